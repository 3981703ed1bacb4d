"""The default scenario: a short agentic trace.

Sessions share a system prompt; each session opens with a long document nobody has
seen (a low-hit request: P and MD lack most of it), then goes on for several turns
whose context is the previous context plus the previous answer plus a short new user
message (high-hit: MD's radix cache holds the previous turn, answer included, so over
95 % of the context is cached there). Outputs are short. One session in four opens with
an ultra-short answer (a classification: singular traffic, RLD finishes it alone).
Token ids are drawn from a seeded generator, so both deployments see the same trace.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Session", "Scenario", "agentic_trace"]


@dataclass(frozen=True)
class Session:
    """``first_context``: system prompt + document + first question; ``followups[i]``:
    the user tokens of turn i + 1; ``outputs[i]``: max new tokens of turn i."""

    sid: int
    start_s: float
    first_context: tuple[int, ...]
    followups: tuple[tuple[int, ...], ...]
    outputs: tuple[int, ...]


@dataclass(frozen=True)
class Scenario:
    sessions: tuple[Session, ...]
    think_s: float

    @property
    def num_requests(self) -> int:
        return sum(len(s.outputs) for s in self.sessions)


def agentic_trace(num_requests: int = 24, *, vocab_size: int = 4096, turns: int = 6, system_tokens: int = 128,
                  document_tokens: int = 640, user_tokens: int = 16, output_tokens: int = 40,
                  first_output_tokens: int = 128, singular_output_tokens: int = 4, stagger_s: float = 3.0,
                  think_s: float = 0.3, seed: int = 0) -> Scenario:
    if num_requests < 1 or turns < 1:
        raise ValueError(f"need at least one request and one turn, got {num_requests}, {turns}")
    rng = random.Random(seed)
    draw = lambda n: tuple(rng.randrange(1, vocab_size) for _ in range(n))  # noqa: E731
    system = draw(system_tokens)
    sessions, left = [], num_requests
    while left > 0:
        sid = len(sessions)
        n = min(turns, left)
        left -= n
        first = singular_output_tokens if sid % 4 == 3 else first_output_tokens
        sessions.append(Session(sid, sid * stagger_s, system + draw(document_tokens) + draw(user_tokens),
                                tuple(draw(user_tokens) for _ in range(n - 1)),
                                (first,) + (output_tokens,) * (n - 1)))
    return Scenario(tuple(sessions), think_s)
