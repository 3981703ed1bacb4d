"""MD's side of the handoff: reassembling one request's messages into contiguous token
ranges (:class:`HandoffAssembler`), and RLD's cutting of its tokens into those messages
(:func:`split_into_messages`).

Example::

    msgs = split_into_messages("req-7", 4096, [11, 42, 7, 9], batch_ends=[3, 4])
    asm = HandoffAssembler("req-7", start_pos=4096)
    asm.accept(msgs[1].encode())     # [] : positions 4099.. wait for 4096..4098
    asm.accept(msgs[0])              # [TokenRange(4096, (11, 42, 7, 9), final=True)]
    assert asm.done and asm.tokens == (11, 42, 7, 9)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .message import FINAL, Handoff, HandoffError, SamplerState

__all__ = ["TokenRange", "HandoffAssembler", "split_into_messages"]


@dataclass(frozen=True)
class TokenRange:
    """Tokens at positions ``[start_pos, start_pos + len(token_ids))``, contiguous with
    everything yielded before; ``final`` when this range completes the handoff."""

    start_pos: int
    token_ids: tuple[int, ...]
    final: bool

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass
class HandoffAssembler:
    """Reassembles one request's handoff messages on MD.

    ``start_pos`` is the first position MD lacks (the prompt length, plus any tokens MD
    already holds). Messages may arrive out of order, duplicated, or re-sent after a
    drop, even split differently: :meth:`accept` is idempotent and returns only the
    newly contiguous ranges. A message that contradicts tokens already seen, goes past
    the FINAL end, or belongs to another request raises :class:`HandoffError` and
    changes nothing.

    ``max_window`` bounds how far ahead of :attr:`next_pos` tokens are held while earlier
    ones are missing: a message reaching past ``next_pos + max_window`` is refused, so a peer
    cannot make MD buffer more than that many tokens. Each message costs time in its own
    length only, never in how many tokens are held.
    """

    request_id: str
    start_pos: int
    max_window: int = 1 << 16
    _delivered: list[int] = field(default_factory=list, init=False, repr=False)
    _pending: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _pending_end: int = field(default=0, init=False, repr=False)  # past the highest pending position; 0: none
    _end_pos: int | None = field(default=None, init=False, repr=False)
    _sampler: SamplerState | None = field(default=None, init=False, repr=False)
    _sampler_seq: int = field(default=-1, init=False, repr=False)

    def __post_init__(self):
        if type(self.start_pos) is not int or self.start_pos < 0:
            raise ValueError(f"start_pos must be an integer >= 0, got {self.start_pos!r}")
        if type(self.max_window) is not int or self.max_window < 1:
            raise ValueError(f"max_window must be an integer >= 1, got {self.max_window!r}")

    @property
    def next_pos(self) -> int:
        """First position not yet yielded."""
        return self.start_pos + len(self._delivered)

    @property
    def end_pos(self) -> int | None:
        """End of the handoff, known once the FINAL message arrived."""
        return self._end_pos

    @property
    def done(self) -> bool:
        return self._end_pos is not None and self.next_pos == self._end_pos

    @property
    def tokens(self) -> tuple[int, ...]:
        """All tokens yielded so far, in order."""
        return tuple(self._delivered)

    @property
    def sampler_state(self) -> SamplerState | None:
        """Sampler state of the highest-``seq`` message that carried one."""
        return self._sampler

    def accept(self, message: Handoff | bytes | bytearray | memoryview) -> list[TokenRange]:
        msg = message if isinstance(message, Handoff) else Handoff.decode(message)
        if msg.request_id != self.request_id:
            raise HandoffError(f"message for request {msg.request_id!r} reached the assembler of {self.request_id!r}")
        if msg.start_pos < self.start_pos:
            raise HandoffError(f"message starts at position {msg.start_pos}, before this handoff's start "
                               f"{self.start_pos}")
        if msg.end_pos > self.next_pos + self.max_window:
            raise HandoffError(f"message reaches position {msg.end_pos}, more than max_window={self.max_window} "
                               f"tokens past the first missing position {self.next_pos}")
        end = self._end_pos
        if msg.final:
            if end is not None and end != msg.end_pos:
                raise HandoffError(f"FINAL message ends at {msg.end_pos} but an earlier FINAL ended at {end}")
            end = msg.end_pos
        if end is not None:
            highest = max(msg.end_pos, self._pending_end)
            if highest > end:
                raise HandoffError(f"tokens up to position {highest} but the FINAL message ends at {end}")
        self._check_consistent(msg)

        was_done = self.done
        self._end_pos = end
        if msg.sampler_state is not None and msg.seq > self._sampler_seq:
            self._sampler, self._sampler_seq = msg.sampler_state, msg.seq
        first_new = self.next_pos
        skip = max(0, first_new - msg.start_pos)
        for pos, tok in enumerate(msg.token_ids[skip:], msg.start_pos + skip):
            self._pending[pos] = tok
        self._pending_end = max(self._pending_end, msg.end_pos)
        run = []
        pos = first_new
        while pos in self._pending:
            run.append(self._pending.pop(pos))
            pos += 1
        if not self._pending:
            self._pending_end = 0
        self._delivered.extend(run)
        if run or (self.done and msg.final and not was_done):
            # An empty range still signals the end when the FINAL message carried nothing new.
            return [TokenRange(first_new, tuple(run), self.done)]
        return []

    def _check_consistent(self, msg: Handoff) -> None:
        delivered_end = self.next_pos
        for pos, tok in enumerate(msg.token_ids, msg.start_pos):
            known = self._delivered[pos - self.start_pos] if pos < delivered_end else self._pending.get(pos)
            if known is not None and known != tok:
                raise HandoffError(f"message seq {msg.seq} says token {tok} at position {pos}, "
                                   f"an earlier message said {known}")


def split_into_messages(request_id: str, start_pos: int, token_ids: Sequence[int], batch_ends: Iterable[int], *,
                        sampler_state: SamplerState | None = None) -> list[Handoff]:
    """RLD side: the messages of one request whose batches end at ``batch_ends`` (token
    counts, non-decreasing, the last one ``len(token_ids)``; that batch is sent FINAL with
    ``sampler_state``). Each decision of :class:`HandoffPolicy` is one batch."""
    tokens = list(token_ids)
    ends = list(batch_ends)
    if not ends or ends[-1] != len(tokens) or any(b < a for a, b in zip([0] + ends, ends)):
        raise ValueError(f"batch_ends {ends} must be non-decreasing from 0 and end at {len(tokens)}")
    messages, begin = [], 0
    for seq, end in enumerate(ends):
        last = seq == len(ends) - 1
        messages.append(Handoff(request_id, seq, start_pos + begin, tokens[begin:end], FINAL if last else 0,
                                sampler_state if last else None))
        begin = end
    return messages
