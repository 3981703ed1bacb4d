"""When RLD hands a request over to MD: wait, one-shot, or catch-up.

RLD asks :class:`HandoffPolicy` each decode step, given its backlog of tokens MD does not
hold, whether MD holds the prompt's KV, and its own load. Pure and deterministic, so the
reference deployment and the simulator decide identically.

Example::

    policy = HandoffPolicy()
    d = policy.decide(HandoffState(backlog_tokens=300, md_ready=True, rld_load=0.3))
    d.mode, d.num_tokens, d.final   # (HandoffMode.CATCH_UP, 300, False): RLD keeps decoding
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["HandoffMode", "HandoffState", "HandoffDecision", "HandoffPolicy"]


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

