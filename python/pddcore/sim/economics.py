"""Economics: hardware cost, billed benefit and the benefit-cost ratio (BCR).

Providers bill agentic traffic per token, and input tokens that hit the prefix cache
at a fraction of the uncached price (10-25 % in public price lists). The benefit of a
deployment is what its SLA-compliant requests bill per hour; its cost is the rental
price of its accelerators; BCR = benefit / cost.

As the mean prefix hit rate rises, each request bills less (cached input is cheap)
but costs less to serve (less prefill, less KV to ship): BCR is high at both ends and
lower in the middle -- the "bathtub" -- with dips where a hit rate routes load the
wrong way.

Example::

    prices = Prices(cached_fraction=0.2)
    prices.request_benefit(prompt_tokens=40000, cached_tokens=38000, output_tokens=400)
    bcr(goodput_rps=11.5, benefit_per_request=0.02, cost_per_hour=209.9)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .workload import Request

__all__ = ["Prices", "bcr", "mean_benefit"]


@dataclass(frozen=True)
class Prices:
    """Dollars per million tokens: uncached input, output; cached input is billed at
    ``cached_fraction`` of the uncached input price."""

    input_per_mtok: float = 1.00
    output_per_mtok: float = 4.00
    cached_fraction: float = 0.20

    def __post_init__(self):
        if not self.input_per_mtok > 0 or not self.output_per_mtok > 0:
            raise ValueError("token prices must be > 0")
        if not 0 <= self.cached_fraction <= 1:
            raise ValueError(f"cached_fraction must be in [0, 1], got {self.cached_fraction!r}")

    def request_benefit(self, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> float:
        uncached = prompt_tokens - cached_tokens
        return (self.input_per_mtok * (uncached + self.cached_fraction * cached_tokens)
                + self.output_per_mtok * output_tokens) / 1e6


def mean_benefit(prices: Prices, requests: Iterable[Request]) -> float:
    """Average billed dollars per request."""
    total = count = 0
    for r in requests:
        total += prices.request_benefit(r.prompt_tokens, r.cached_tokens, r.output_tokens)
        count += 1
    if not count:
        raise ValueError("no requests")
    return total / count


def bcr(goodput_rps: float, benefit_per_request: float, cost_per_hour: float) -> float:
    """Billed dollars per hardware dollar."""
    if not cost_per_hour > 0:
        raise ValueError(f"cost_per_hour must be > 0, got {cost_per_hour!r}")
    return goodput_rps * 3600.0 * benefit_per_request / cost_per_hour
