"""Extend-Decode Handoff: the token-ID message RLD sends MD, the one-shot / catch-up
policy that decides when to send it, and the MD-side assembler.

When MD holds the prompt's KV, RLD does not ship the KV of the tokens it decoded in the
meantime; it sends their **token ids** and MD recomputes their KV with one extend pass.
Everything here is pure Python, free of I/O and deterministic, so the reference
deployment and the simulator run the very same code.

Wire format (version 1, little-endian)::

    offset  size  field
    0       4     magic b"PDDH"
    4       1     version (1)
    5       1     flags: bit 0 FINAL, bit 1 sampler state present; others reserved (0)
    6       4     body length in bytes (u32)
    10      n     body
    10+n    4     CRC32C of bytes [0, 10+n)

    body = varint len(request_id) | request_id (UTF-8) | varint seq | varint start_pos
           | varint count | count x varint token id
           | [varint seed | varint rng_offset | varint num_generated]   (if bit 1)

Varints are unsigned LEB128 (canonical: no overlong forms). Token ids are sent as plain
varints, not deltas: generated text is not sorted, so zig-zag deltas of neighbouring ids
are about twice as large as the ids themselves, while BPE vocabularies give the frequent
tokens small ids (1-2 bytes). Any id below 2**21 takes at most 3 bytes, so 100 tokens of
any vocabulary up to 2M entries, a request id of up to 64 bytes and a sampler state fit
in 512 bytes (the PDD report's payload was 1.5 KB).

Example::

    msg = Handoff("req-7", seq=0, start_pos=4096, token_ids=[11, 42, 7], flags=FINAL)
    data = msg.encode()                     # 27 bytes on the priority lane
    asm = HandoffAssembler("req-7", start_pos=4096)
    for r in asm.accept(data):              # contiguous ranges, ready for an extend pass
        extend(r.start_pos, r.token_ids)
    assert asm.done
"""

from __future__ import annotations

import enum
import operator
import struct
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from . import _C

__all__ = [
    "FINAL", "HandoffFlag", "HandoffError", "SamplerState", "Handoff",
    "HandoffMode", "HandoffState", "HandoffDecision", "HandoffPolicy",
    "TokenRange", "HandoffAssembler", "split_into_messages",
]

MAGIC = b"PDDH"
VERSION = 1
_HEADER = struct.Struct("<4sBBI")
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size
TRAILER_BYTES = _CRC.size

MAX_REQUEST_ID_BYTES = 256
MAX_TOKENS = 1 << 20  # far above any handoff; bounds what a corrupt count can make us allocate
_TOKEN_LIMIT = 1 << 32
_U63 = 1 << 63
_U64 = 1 << 64
_SAMPLER_BIT = 0x02


class HandoffError(ValueError):
    """A handoff message or sequence is malformed, inconsistent or not for this request."""


class HandoffFlag(enum.IntFlag):
    """Public flags of a :class:`Handoff`."""

    FINAL = 0x01  # RLD stops after this batch; MD owns the output from here on


FINAL = HandoffFlag.FINAL


@dataclass(frozen=True)
class SamplerState:
    """What MD needs to continue sampling exactly where RLD stopped.

    ``seed``: the request's sampling seed (u64). ``rng_offset``: random draws already
    consumed (e.g. the Philox offset), so MD's next draw is RLD's next draw.
    ``num_generated``: output tokens counted toward stop conditions (``max_tokens``,
    ``min_tokens``), including the ones carried by this handoff.
    """

    seed: int
    rng_offset: int
    num_generated: int

    def __post_init__(self):
        _check_uint("seed", self.seed, _U64)
        _check_uint("rng_offset", self.rng_offset, _U63)
        _check_uint("num_generated", self.num_generated, _U63)


@dataclass(frozen=True)
class Handoff:
    """One handoff message: the tokens RLD generated at positions
    ``[start_pos, start_pos + len(token_ids))`` of request ``request_id``.

    ``seq`` numbers the messages of one request (0, 1, ...); ``flags`` is 0 for a
    catch-up batch (RLD keeps decoding) or :data:`FINAL` (RLD has stopped; this is the
    last batch). ``sampler_state`` travels at least with the final message.
    """

    request_id: str
    seq: int
    start_pos: int
    token_ids: tuple[int, ...]
    flags: int = 0
    sampler_state: SamplerState | None = None

    def __post_init__(self):
        if not isinstance(self.request_id, str):
            raise HandoffError(f"request_id must be a str, got {type(self.request_id).__name__}")
        rid_bytes = len(self.request_id.encode("utf-8", "surrogatepass"))
        if not 0 < rid_bytes <= MAX_REQUEST_ID_BYTES:
            raise HandoffError(f"request_id must be 1..{MAX_REQUEST_ID_BYTES} UTF-8 bytes, got {rid_bytes}")
        _check_uint("seq", self.seq, _U63)
        _check_uint("start_pos", self.start_pos, _U63)
        try:
            tokens = tuple(map(operator.index, self.token_ids))
        except TypeError as e:
            raise HandoffError(f"token_ids must be a sequence of integers: {e}") from None
        if len(tokens) > MAX_TOKENS:
            raise HandoffError(f"{len(tokens)} tokens exceed the limit of {MAX_TOKENS} per message")
        if tokens and not (0 <= min(tokens) and max(tokens) < _TOKEN_LIMIT):
            bad = next(i for i, t in enumerate(tokens) if not 0 <= t < _TOKEN_LIMIT)
            raise HandoffError(f"token_ids[{bad}] = {tokens[bad]} is outside [0, 2**32)")
        object.__setattr__(self, "token_ids", tokens)
        if type(self.flags) is not int and not isinstance(self.flags, HandoffFlag):
            raise HandoffError(f"flags must be an int, got {type(self.flags).__name__}")
        if self.flags & ~int(HandoffFlag.FINAL):
            raise HandoffError(f"flags={self.flags:#x} has bits other than FINAL set")
        object.__setattr__(self, "flags", HandoffFlag(self.flags))
        if self.sampler_state is not None and not isinstance(self.sampler_state, SamplerState):
            raise HandoffError(f"sampler_state must be a SamplerState or None, got {type(self.sampler_state).__name__}")

    @property
    def final(self) -> bool:
        return bool(self.flags & HandoffFlag.FINAL)

    @property
    def end_pos(self) -> int:
        """Position just past the last carried token."""
        return self.start_pos + len(self.token_ids)

    def encode(self) -> bytes:
        """The message in wire format version 1 (see the module docstring)."""
        body = bytearray()
        rid = self.request_id.encode("utf-8")
        _put_varints(body, (len(rid),))
        body += rid
        _put_varints(body, (self.seq, self.start_pos, len(self.token_ids)))
        _put_varints(body, self.token_ids)
        wire_flags = int(self.flags)
        if self.sampler_state is not None:
            wire_flags |= _SAMPLER_BIT
            s = self.sampler_state
            _put_varints(body, (s.seed, s.rng_offset, s.num_generated))
        msg = bytearray(_HEADER.pack(MAGIC, VERSION, wire_flags, len(body)))
        msg += body
        msg += _CRC.pack(_C.crc32c(bytes(msg)))
        return bytes(msg)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> "Handoff":
        """Parses one whole message; raises :class:`HandoffError` naming the first problem."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise HandoffError(f"expected bytes, got {type(data).__name__}")
        buf = bytes(data)
        if len(buf) < HEADER_BYTES + TRAILER_BYTES:
            raise HandoffError(f"message is {len(buf)} bytes, shorter than the "
                               f"{HEADER_BYTES + TRAILER_BYTES}-byte header and checksum")
        magic, version, wire_flags, body_len = _HEADER.unpack_from(buf)
        if magic != MAGIC:
            raise HandoffError(f"bad magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise HandoffError(f"unsupported handoff version {version}, this build reads {VERSION}")
        if wire_flags & ~(int(HandoffFlag.FINAL) | _SAMPLER_BIT):
            raise HandoffError(f"reserved flag bits set: {wire_flags:#04x}")
        expected = HEADER_BYTES + body_len + TRAILER_BYTES
        if len(buf) != expected:
            raise HandoffError(f"length field says {expected} bytes in all, got {len(buf)} "
                               f"({'truncated' if len(buf) < expected else 'trailing bytes'})")
        (crc,) = _CRC.unpack_from(buf, HEADER_BYTES + body_len)
        actual = _C.crc32c(buf[: HEADER_BYTES + body_len])
        if crc != actual:
            raise HandoffError(f"CRC32C mismatch: message says {crc:#010x}, content gives {actual:#010x}")

        reader = _Reader(buf, HEADER_BYTES, HEADER_BYTES + body_len)
        rid_len = reader.varint("request_id length")
        if not 0 < rid_len <= MAX_REQUEST_ID_BYTES:
            raise HandoffError(f"request_id length {rid_len} is outside 1..{MAX_REQUEST_ID_BYTES}")
        try:
            request_id = reader.take(rid_len, "request_id").decode("utf-8")
        except UnicodeDecodeError as e:
            raise HandoffError(f"request_id is not valid UTF-8: {e}") from None
        seq = reader.varint("seq", _U63)
        start_pos = reader.varint("start_pos", _U63)
        count = reader.varint("token count", MAX_TOKENS + 1)
        if count > reader.remaining:  # each token takes at least one byte
            raise HandoffError(f"token count {count} exceeds the {reader.remaining} body bytes left")
        tokens = reader.varints(count, "token id", _TOKEN_LIMIT)
        sampler = None
        if wire_flags & _SAMPLER_BIT:
            sampler = SamplerState(reader.varint("seed", _U64), reader.varint("rng_offset", _U63),
                                   reader.varint("num_generated", _U63))
        if reader.remaining:
            raise HandoffError(f"{reader.remaining} unexpected bytes after the last field")
        return cls(request_id, seq, start_pos, tokens, wire_flags & int(HandoffFlag.FINAL), sampler)


def _check_uint(name: str, value: int, limit: int) -> None:
    if type(value) is not int or not 0 <= value < limit:
        raise HandoffError(f"{name} must be an integer in [0, 2**{limit.bit_length() - 1}), got {value!r}")


def _put_varints(out: bytearray, values: Iterable[int]) -> None:
    append = out.append
    for value in values:
        while value >= 0x80:
            append((value & 0x7F) | 0x80)
            value >>= 7
        append(value)


class _Reader:
    """Bounds-checked cursor over a message body."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: bytes, pos: int, end: int):
        self.buf, self.pos, self.end = buf, pos, end

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.remaining:
            raise HandoffError(f"{what} needs {n} bytes, only {self.remaining} left in the body")
        out = self.buf[self.pos: self.pos + n]
        self.pos += n
        return out

    def varint(self, what: str, limit: int = _U64) -> int:
        return self.varints(1, what, limit)[0]

    def varints(self, count: int, what: str, limit: int = _U64) -> list[int]:
        """``count`` canonical LEB128 values below ``limit``; one tight loop, since the
        token ids are most of a message."""
        buf, pos, end = self.buf, self.pos, self.end
        out: list[int] = []
        value = shift = 0
        while len(out) < count:
            if pos >= end:
                raise HandoffError(f"{what}: varint runs past the end of the body")
            byte = buf[pos]
            pos += 1
            if byte & 0x80:
                value |= (byte & 0x7F) << shift
                shift += 7
                if shift >= 70:
                    raise HandoffError(f"{what}: varint longer than 10 bytes")
                continue
            if byte == 0 and shift:
                raise HandoffError(f"{what}: overlong varint encoding")
            value |= byte << shift
            if value >= limit:
                raise HandoffError(f"{what} = {value} is out of range (limit {limit})")
            out.append(value)
            value = shift = 0
        self.pos = pos
        return out


# ---- policy ---------------------------------------------------------------------------------

class HandoffMode(enum.Enum):
    WAIT = "wait"          # MD does not hold the prompt's KV yet: keep decoding on RLD
    ONE_SHOT = "one_shot"  # hand over everything now; RLD stops at once
    CATCH_UP = "catch_up"  # hand over what exists while RLD keeps decoding (until final)


@dataclass(frozen=True)
class HandoffState:
    """RLD's view of one request when it considers a handoff.

    ``backlog_tokens``: tokens RLD generated that MD does not hold yet (not yet handed
    over). ``md_ready``: MD holds the KV of the prompt (the transfer is done).
    ``rld_load``: RLD's busy fraction (running / capacity, 0..1, may exceed 1 when
    queueing). ``rounds_done``: catch-up batches already sent for this request.
    """

    backlog_tokens: int
    md_ready: bool
    rld_load: float
    rounds_done: int = 0

    def __post_init__(self):
        if type(self.backlog_tokens) is not int or self.backlog_tokens < 0:
            raise ValueError(f"backlog_tokens must be an integer >= 0, got {self.backlog_tokens!r}")
        if not self.rld_load >= 0:
            raise ValueError(f"rld_load must be >= 0, got {self.rld_load!r}")
        if type(self.rounds_done) is not int or self.rounds_done < 0:
            raise ValueError(f"rounds_done must be an integer >= 0, got {self.rounds_done!r}")


@dataclass(frozen=True)
class HandoffDecision:
    """What RLD does now: send ``num_tokens`` (the oldest of the backlog) with the FINAL
    flag when ``final``; ``reason`` says why, in words."""

    mode: HandoffMode
    num_tokens: int
    final: bool
    reason: str


@dataclass(frozen=True)
class HandoffPolicy:
    """Chooses One-Shot or Catch-Up handoff from RLD's backlog, MD readiness and RLD load.

    * ``catch_up_threshold`` (default 64 tokens): a backlog at or under it is handed over
      in one final message. MD recomputes 64 tokens in one extend pass in about the time
      of one or two decode steps, so the user sees at most that hiccup; above it the
      extend pass grows long enough that RLD should keep the stream going meanwhile.
    * ``high_load`` (default 0.8): at or above this RLD busy fraction, always One-Shot.
      RLD must keep room for new eager starts (the reason it exists); at 80 % continuous
      batching begins to queue new requests.
    * ``max_rounds`` (default 4): catch-up batches before forcing the final one. Extend
      runs far faster per token than decode, so the backlog shrinks geometrically and
      2-3 rounds suffice; the cap only guards against a slow MD that never catches up.

    Example::

        policy = HandoffPolicy()
        d = policy.decide(HandoffState(backlog_tokens=300, md_ready=True, rld_load=0.3))
        d.mode, d.num_tokens, d.final   # (CATCH_UP, 300, False): RLD keeps decoding
    """

    catch_up_threshold: int = 64
    high_load: float = 0.8
    max_rounds: int = 4

    def __post_init__(self):
        if type(self.catch_up_threshold) is not int or self.catch_up_threshold < 0:
            raise ValueError(f"catch_up_threshold must be an integer >= 0, got {self.catch_up_threshold!r}")
        if not self.high_load > 0:
            raise ValueError(f"high_load must be > 0, got {self.high_load!r}")
        if type(self.max_rounds) is not int or self.max_rounds < 1:
            raise ValueError(f"max_rounds must be an integer >= 1, got {self.max_rounds!r}")

    def decide(self, state: HandoffState) -> HandoffDecision:
        backlog = state.backlog_tokens
        if not state.md_ready:
            return HandoffDecision(HandoffMode.WAIT, 0, False, "MD does not hold the prompt's KV yet")
        catching_up = state.rounds_done > 0
        if backlog <= self.catch_up_threshold:
            mode = HandoffMode.CATCH_UP if catching_up else HandoffMode.ONE_SHOT
            return HandoffDecision(mode, backlog, True,
                                   f"backlog {backlog} <= threshold {self.catch_up_threshold}: final handoff")
        if state.rld_load >= self.high_load:
            return HandoffDecision(HandoffMode.ONE_SHOT, backlog, True,
                                   f"RLD load {state.rld_load:.2f} >= {self.high_load:.2f}: free RLD at once")
        if state.rounds_done >= self.max_rounds:
            return HandoffDecision(HandoffMode.CATCH_UP, backlog, True,
                                   f"{state.rounds_done} catch-up rounds done (max {self.max_rounds}): final handoff")
        return HandoffDecision(HandoffMode.CATCH_UP, backlog, False,
                               f"backlog {backlog} > threshold {self.catch_up_threshold} and RLD load "
                               f"{state.rld_load:.2f} < {self.high_load:.2f}: hand over, keep decoding")


# ---- MD side --------------------------------------------------------------------------------

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
    """

    request_id: str
    start_pos: int
    _delivered: list[int] = field(default_factory=list, init=False, repr=False)
    _pending: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _end_pos: int | None = field(default=None, init=False, repr=False)
    _sampler: SamplerState | None = field(default=None, init=False, repr=False)
    _sampler_seq: int = field(default=-1, init=False, repr=False)

    def __post_init__(self):
        if type(self.start_pos) is not int or self.start_pos < 0:
            raise ValueError(f"start_pos must be an integer >= 0, got {self.start_pos!r}")

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
        end = self._end_pos
        if msg.final:
            if end is not None and end != msg.end_pos:
                raise HandoffError(f"FINAL message ends at {msg.end_pos} but an earlier FINAL ended at {end}")
            end = msg.end_pos
        if end is not None:
            highest = max([msg.end_pos] + [p + 1 for p in self._pending])
            if highest > end:
                raise HandoffError(f"tokens up to position {highest} but the FINAL message ends at {end}")
        self._check_consistent(msg)

        was_done = self.done
        self._end_pos = end
        if msg.sampler_state is not None and msg.seq > self._sampler_seq:
            self._sampler, self._sampler_seq = msg.sampler_state, msg.seq
        first_new = self.next_pos
        for pos, tok in enumerate(msg.token_ids, msg.start_pos):
            if pos >= first_new:
                self._pending[pos] = tok
        run = []
        pos = first_new
        while pos in self._pending:
            run.append(self._pending.pop(pos))
            pos += 1
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
