"""Running a config on a trace, and finding its SLA goodput: the highest arrival rate
at which at least ``attainment`` of the requests meet the SLA (the trace's arrivals
are compressed or stretched; the requests themselves stay the same).

Example::

    summary = run_trace(config, trace)                  # one run, accounting checked
    rate, summary = max_goodput(config, workload)       # SLA goodput (req/s) and its run
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Sequence

from .cluster import ClusterSim
from .deployment import ClusterConfig
from .metrics import check_accounting, summarize
from .workload import AgenticConfig, Request, agentic, scale_rate

__all__ = ["run_trace", "max_goodput"]


def run_trace(config: ClusterConfig, requests: Sequence[Request]) -> dict[str, Any]:
    run = ClusterSim(config).run(requests)
    check_accounting(run)
    return summarize(run)


def max_goodput(config: ClusterConfig, trace: Sequence[Request] | AgenticConfig, attainment: float = 0.9,
                iterations: int = 6, low: float = 0.125, high: float = 16.0, min_span_slos: float = 3.0,
                seed: int = 0) -> tuple[float, dict[str, Any]]:
    """Geometric bisection over a rate factor in [``low``, ``high``], starting at 1
    (the trace as given): the highest factor at which at least ``attainment`` of the
    requests meet the SLA. Returns the
    SLA goodput there (attainment x the rate requests were actually sent at, which
    causal sessions may hold below the offered rate) and that run's summary; 0 and the
    run at ``low`` when even that fails. When the top factor passes, the goodput is a
    lower bound and the summary says ``"goodput_capped": True``.

    ``trace`` is an :class:`AgenticConfig` (regenerated at each rate with ``seed``, so
    the number of agent sessions grows with the rate, as it does when more users come)
    or a list of requests (arrivals compressed or stretched; its sessions then pace
    themselves and hold the achieved rate down, which the goodput shows).

    A factor is only tried while the trace still spans at least ``min_span_slos`` x
    the TTFT SLO: a burst that ends before queues can build would otherwise pass a
    rate the cluster cannot sustain."""
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment must be in (0, 1], got {attainment!r}")
    if isinstance(trace, AgenticConfig):
        workload = trace
        span = workload.num_requests / workload.rate

        def at(factor: float) -> list[Request]:
            return agentic(replace(workload, rate=workload.rate * factor), seed=seed)
    else:
        requests = list(trace)
        span = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
        if len(requests) < 2 or span <= 0:
            raise ValueError("a goodput search needs at least two requests at different times")

        def at(factor: float) -> list[Request]:
            return scale_rate(requests, factor)
    high = min(high, span / (min_span_slos * config.ttft_slo_s))
    if high <= low:
        raise ValueError(f"the trace spans {span:.0f} s; a goodput search from {low} x its rate needs "
                         f"{low * min_span_slos * config.ttft_slo_s:.0f} s or more (use more requests)")

    def attempt(factor: float) -> dict[str, Any]:
        return run_trace(config, at(factor))

    # Start at the trace's own rate (the run the caller compares against), then bisect
    # upward or downward from it.
    start = min(1.0, high)
    best = attempt(start)
    if best["sla_attainment"] >= attainment:
        lo, hi = start, high
        if high > start:
            top = attempt(high)
            if top["sla_attainment"] >= attainment:
                return top["sla_goodput_rps"], {**top, "goodput_capped": True}
        else:
            return best["sla_goodput_rps"], {**best, "goodput_capped": True}
    else:
        lo, hi = low, start
        best = attempt(low)
        if best["sla_attainment"] < attainment:
            return 0.0, best
    for _ in range(iterations):
        mid = math.sqrt(lo * hi)
        s = attempt(mid)
        if s["sla_attainment"] >= attainment:
            lo = mid
            if s["sla_goodput_rps"] >= best["sla_goodput_rps"]:
                best = s
        else:
            hi = mid
    return best["sla_goodput_rps"], best
