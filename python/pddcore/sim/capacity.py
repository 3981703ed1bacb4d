"""Running a config on a trace, and finding its SLA goodput: the highest arrival rate
at which at least ``attainment`` of the requests meet the SLA (the trace's arrivals
are compressed or stretched; the requests themselves stay the same).

Example::

    summary = run_trace(config, trace)                  # one run, accounting checked
    rate, summary = max_goodput(config, trace)          # req/s and the run at that rate
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from .cluster import ClusterConfig, ClusterSim
from .metrics import check_accounting, summarize
from .workload import Request, scale_rate

__all__ = ["run_trace", "max_goodput"]


def run_trace(config: ClusterConfig, requests: Sequence[Request]) -> dict[str, Any]:
    run = ClusterSim(config).run(requests)
    check_accounting(run)
    return summarize(run)


def max_goodput(config: ClusterConfig, requests: Sequence[Request], attainment: float = 0.9,
                iterations: int = 6, low: float = 0.125, high: float = 16.0,
                min_span_slos: float = 3.0) -> tuple[float, dict[str, Any]]:
    """Geometric bisection over the rate factor in [``low``, ``high``] x the trace's
    rate. Returns the highest passing rate (req/s) and its summary; 0 and the run at
    ``low`` when even that fails. When the top rate passes, the rate is a lower bound
    and the summary says ``"goodput_capped": True``.

    A rate is only tried while the compressed trace still spans at least
    ``min_span_slos`` x the TTFT SLO: a burst that ends before queues can build would
    otherwise pass as goodput a rate the cluster cannot sustain."""
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment must be in (0, 1], got {attainment!r}")
    requests = list(requests)
    span = requests[-1].arrival_s - requests[0].arrival_s
    if len(requests) < 2 or span <= 0:
        raise ValueError("a goodput search needs at least two requests at different times")
    base_rate = (len(requests) - 1) / span
    high = min(high, span / (min_span_slos * config.ttft_slo_s))
    if high <= low:
        raise ValueError(f"the trace spans {span:.0f} s; a goodput search from {low} x its rate needs "
                         f"{low * min_span_slos * config.ttft_slo_s:.0f} s or more (use more requests)")

    def attempt(factor: float) -> dict[str, Any]:
        return run_trace(config, scale_rate(requests, factor))

    best = attempt(low)
    if best["sla_attainment"] < attainment:
        return 0.0, best
    top = attempt(high)
    if top["sla_attainment"] >= attainment:
        return base_rate * high, {**top, "goodput_capped": True}
    lo, hi = low, high
    for _ in range(iterations):
        mid = math.sqrt(lo * hi)
        s = attempt(mid)
        if s["sla_attainment"] >= attainment:
            lo, best = mid, s
        else:
            hi = mid
    return base_rate * lo, best
