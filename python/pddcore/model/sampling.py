"""Greedy and seeded sampling whose random state fits in a handoff.

Draw ``n`` of a request uses the uniform number ``u(seed, n)`` taken from a hash of
``(seed, n)`` (BLAKE2b), not from a stateful generator. The complete random state is
therefore :class:`SamplerState` ``(seed, draws)``: RelayDecode sends those two integers
with its handoff and MainDecode continues with exactly the draws RelayDecode would have
made, on any device and with any torch version. Every sampled token, greedy or not,
counts as one draw, so ``draws`` is the number of tokens sampled so far.

Sampling itself runs in float64 on the CPU: temperature, then top-k, then top-p
(nucleus) filtering, then the inverse CDF at ``u`` over the surviving tokens in
token-id order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["SamplingParams", "SamplerState", "sample", "uniform"]

_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` means greedy (the first maximal logit wins ties);
    ``top_k == 0`` and ``top_p == 1`` switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class SamplerState:
    """A request's random state: its seed and how many tokens it has sampled."""

    seed: int = 0
    draws: int = 0

    def __post_init__(self) -> None:
        if self.draws < 0:
            raise ValueError(f"draws must be >= 0, got {self.draws}")


def uniform(seed: int, draw: int) -> float:
    """The ``draw``-th uniform number in [0, 1) of stream ``seed`` (53 random bits)."""
    message = (int(seed) & _U64).to_bytes(8, "little") + (int(draw) & _U64).to_bytes(8, "little")
    bits = int.from_bytes(hashlib.blake2b(message, digest_size=8).digest(), "little")
    return (bits >> 11) * 2.0 ** -53


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], states: Sequence[SamplerState]) -> list[int]:
    """One token per row of ``logits[B, vocab]``; advances each ``states[i].draws`` by one.

    Raises ValueError (and advances nothing) on a shape mismatch or non-finite logits.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if not len(params) == len(states) == logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows but {len(params)} params and {len(states)} states")
    rows = logits.detach().to(device="cpu", dtype=torch.float64)
    if not torch.isfinite(rows).all():
        raise ValueError("logits contain NaN or infinity")
    tokens = [_sample_row(row, p, uniform(s.seed, s.draws)) for row, p, s in zip(rows, params, states)]
    for s in states:
        s.draws += 1
    return tokens


def _sample_row(row: torch.Tensor, params: SamplingParams, u: float) -> int:
    if params.greedy:
        return int(torch.argmax(row))
    scaled = row / params.temperature
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1:
        order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(order.values, dim=-1) - order.values
        dropped = order.indices[before >= params.top_p]
        probs = probs.index_fill(0, dropped, 0.0)
    cdf = torch.cumsum(probs, dim=-1)
    target = torch.tensor([u * float(cdf[-1])], dtype=torch.float64)
    # Rounding can put the target at the very top of the CDF: fall back to the last live token.
    last_live = int(torch.nonzero(probs)[-1])
    return min(int(torch.searchsorted(cdf, target, right=True)), last_live)
