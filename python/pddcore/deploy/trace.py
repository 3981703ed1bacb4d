"""The default scenario: a short agentic trace.

Agentic sessions share a system prompt; each opens with a long document nobody has seen
(a low-hit request: P and MD lack most of it) and a long answer (a plan, a summary), so
RLD starts it at once and MD, once the document's KV has crossed the WAN, takes it over
by the token-id handoff. The session then goes on for several turns whose context is
the previous context plus the previous answer plus a short new user message (high-hit:
MD's radix cache holds the previous turn, answer included, so nearly all of the context
is cached there; ``pddcore demo`` prints the hit rate it measured); these go to MD directly. Opening documents cycle through
``document_tokens``: the longer one takes long enough on the WAN that RLD's backlog
exceeds the handoff's catch-up threshold. Between the agentic sessions come singular
requests: one turn with a fresh document and an ultra-short answer (a classification,
a tool choice) that RLD finishes alone. Token ids are drawn from a seeded generator, so
both deployments see the same trace.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

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


def agentic_trace(num_requests: int = 24, *, vocab_size: int = 4096, turns: int = 5, system_tokens: int = 128,
                  document_tokens: int | Sequence[int] = (1280, 384, 512, 384), user_tokens: int = 16,
                  output_tokens: int = 64, first_output_tokens: int = 384, singular_every: int = 2,
                  singular_output_tokens: int = 4, stagger_s: float = 1.5, think_s: float = 0.3,
                  seed: int = 0) -> Scenario:
    """``num_requests`` requests in sessions started ``stagger_s`` apart. Every
    ``singular_every``-th session (0: none) is one singular request with a
    ``singular_output_tokens`` answer and a document of ``min(document_tokens)``; the
    others are agentic: ``turns`` turns, the first answering ``first_output_tokens``
    about a document whose length cycles through ``document_tokens``, the next ones
    ``output_tokens`` each."""
    documents = (document_tokens,) if isinstance(document_tokens, int) else tuple(document_tokens)
    if num_requests < 1 or turns < 1 or not documents or min(documents) < 0 or singular_every < 0:
        raise ValueError(f"need at least one request, one turn, one document length >= 0 and singular_every >= 0; "
                         f"got {num_requests}, {turns}, {document_tokens!r}, {singular_every}")
    rng = random.Random(seed)
    draw = lambda n: tuple(rng.randrange(1, vocab_size) for _ in range(n))  # noqa: E731
    system = draw(system_tokens)
    sessions: list[Session] = []
    left, agentic = num_requests, 0
    while left > 0:
        sid = len(sessions)
        if singular_every and sid % singular_every == singular_every - 1:
            n, document, outputs = 1, min(documents), (singular_output_tokens,)
        else:
            n, document = min(turns, left), documents[agentic % len(documents)]
            outputs = (first_output_tokens,) + (output_tokens,) * (n - 1)
            agentic += 1
        left -= n
        sessions.append(Session(sid, sid * stagger_s, system + draw(document) + draw(user_tokens),
                                tuple(draw(user_tokens) for _ in range(n - 1)), outputs))
    return Scenario(tuple(sessions), think_s)
