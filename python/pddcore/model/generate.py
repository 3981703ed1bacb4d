"""The single-process reference decode (the demo's correctness oracle) and the token
agreement report used where outputs cannot be bit-identical (fp16 / bf16 on GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from .decoder import Model, TokenIds
from .sampling import SamplerState, SamplingParams, sample

__all__ = ["generate", "TokenAgreement", "token_agreement"]


def generate(model: Model, prompt: TokenIds, max_new_tokens: int, *,
             sampling: SamplingParams = SamplingParams(), seed: int = 0,
             stop_token_ids: Iterable[int] | None = None, page_size: int = 16) -> list[int]:
    """Prefill ``prompt`` then decode one token at a time in a private KV pool.

    Returns up to ``max_new_tokens`` tokens; stops after the first token in
    ``stop_token_ids`` (default: the config's EOS ids), which is included.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if len(prompt) == 0:
        raise ValueError("the prompt must hold at least one token")
    if max_new_tokens == 0:
        return []
    stops = set(model.config.eos_token_ids if stop_token_ids is None else stop_token_ids)
    pool = model.new_pool(-(-(len(prompt) + max_new_tokens) // page_size), page_size)
    seq = pool.new_sequence()
    state = SamplerState(seed)
    logits = model.prefill([seq], [prompt])
    out: list[int] = []
    while True:
        token = sample(logits, [sampling], [state])[0]
        out.append(token)
        if token in stops or len(out) == max_new_tokens:
            return out
        logits = model.decode([seq], [token])


@dataclass(frozen=True)
class TokenAgreement:
    """How far two token streams agree, position by position."""

    matched: int
    compared: int
    first_divergence: int | None

    @property
    def rate(self) -> float:
        return self.matched / self.compared if self.compared else 1.0

    @property
    def identical(self) -> bool:
        return self.first_divergence is None


def token_agreement(reference: Sequence[int], candidate: Sequence[int]) -> TokenAgreement:
    """Positions are compared up to the longer stream; a missing token counts as a
    mismatch. ``first_divergence`` is the first differing position, None if identical."""
    reference, candidate = list(reference), list(candidate)
    common = min(len(reference), len(candidate))
    mismatches = [i for i in range(common) if reference[i] != candidate[i]]
    if len(reference) != len(candidate):
        mismatches.append(common)
    return TokenAgreement(
        matched=common - sum(1 for i in mismatches if i < common),
        compared=max(len(reference), len(candidate)),
        first_divergence=mismatches[0] if mismatches else None,
    )
