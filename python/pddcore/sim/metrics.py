"""Metrics of one simulation run: latency percentiles, SLA goodput, token shares, WAN use,
and the accounting check that every request and token is there.

Example::

    run = ClusterSim(config).run(requests)
    check_accounting(run)               # raises AccountingError on a lost request or token
    summary = summarize(run)            # a flat dict, JSON-ready
    summary["ttft_p90_s"], summary["rld_token_share"]
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from .._stats import percentiles
from .cluster import SimRun

__all__ = ["AccountingError", "check_accounting", "summarize", "sla_met"]

PERCENTILES = (50, 90, 99)


class AccountingError(AssertionError):
    """A request or token went missing or was counted twice."""


def check_accounting(run: SimRun) -> None:
    """Every request finished once, after its arrival and first token, and its output
    tokens were produced exactly once, split between RLD and MD."""
    seen = set()
    for job in run.jobs:
        rid = job.req.id
        if rid in seen:
            raise AccountingError(f"request id {rid!r} appears twice")
        seen.add(rid)
        if job.t_first is None or job.t_done is None:
            raise AccountingError(f"request {rid!r} never {'started' if job.t_first is None else 'finished'}")
        if not job.req.arrival_s <= job.t_arrive <= job.t_first <= job.t_done:
            raise AccountingError(f"request {rid!r}: times out of order (arrival {job.req.arrival_s}, release "
                                  f"{job.t_arrive}, first token {job.t_first}, done {job.t_done})")
        if job.tokens_rld < 0 or job.tokens_md < 0 or job.tokens_rld + job.tokens_md != job.req.output_tokens:
            raise AccountingError(f"request {rid!r}: RLD {job.tokens_rld} + MD {job.tokens_md} tokens != output "
                                  f"{job.req.output_tokens}")


def sla_met(run: SimRun) -> np.ndarray:
    """Per request: TTFT and TPOT within the config's SLA."""
    cfg = run.config
    ttft = np.fromiter((j.ttft for j in run.jobs), float, len(run.jobs))
    tpot = np.fromiter((j.tpot for j in run.jobs), float, len(run.jobs))
    return (ttft <= cfg.ttft_slo_s) & (tpot <= cfg.tpot_slo_s)


def summarize(run: SimRun) -> dict[str, Any]:
    """``offered_rps``: the trace's arrival rate. ``sent_rps``: the rate requests were
    released at while the trace arrived (a session holds its next turn until the
    previous one finished). ``sla_goodput_rps``: ``sla_attainment`` x ``sent_rps``.
    ``wan_gbps_mean`` / ``wan_busy_fraction``: over the time the WAN was in use (first
    arrival to its last transfer), so decoding that goes on after it does not dilute them."""
    cfg, jobs = run.config, run.jobs
    n = len(jobs)
    ttft = np.fromiter((j.ttft for j in jobs), float, n)
    tpot = np.fromiter((j.tpot for j in jobs if j.req.output_tokens > 1), float)
    met = sla_met(run)
    out_tokens = sum(j.req.output_tokens for j in jobs)
    prompt = sum(j.req.prompt_tokens for j in jobs)
    wan_window = max(run.wan_last_busy_s, 1e-9)
    arrival_span = max(jobs[-1].req.arrival_s - jobs[0].req.arrival_s, 1e-9)
    # Requests released while the trace was still arriving, per second of it: turns
    # a slow cluster holds back past the window lower it; the drain after it does not.
    window_end = jobs[-1].req.arrival_s
    sent_rps = (sum(1 for j in jobs if j.t_arrive <= window_end) - 1) / arrival_span if n > 1 else 0.0
    summary: dict[str, Any] = {
        "name": cfg.name,
        "scenario": cfg.scenario,
        "requests": n,
        "offered_rps": (n - 1) / arrival_span if n > 1 else 0.0,
        "sent_rps": sent_rps,
        "output_tokens": out_tokens,
    }
    summary.update({f"ttft_p{p}_s": v for p, v in percentiles(ttft, PERCENTILES).items()})
    summary.update({f"tpot_p{p}_s": v for p, v in percentiles(tpot, PERCENTILES, empty=0.0).items()})
    summary.update({
        "sla_attainment": float(met.mean()),
        "sla_goodput_rps": float(met.mean() * sent_rps),
        "rld_token_share": sum(j.tokens_rld for j in jobs) / out_tokens,
        "wan_gbps_mean": run.wan_bytes * 8 / wan_window / 1e9,
        "wan_busy_fraction": run.wan_busy_s / wan_window,
        "wan_gb": run.wan_bytes / 1e9,
        "p_hit_rate": sum(j.p_hit_tokens for j in jobs) / prompt,
        "trace_hit_rate": sum(j.req.cached_tokens for j in jobs) / prompt,
        "md_hit_rate": run.md_hit_pages / run.md_lookup_pages if run.md_lookup_pages else None,
        "routes": dict(Counter(j.pipeline.value for j in jobs)),
        "handoffs": dict(Counter(h for j in jobs for h in j.handoffs)),
        "price_per_hour": cfg.price_per_hour,
        "duration_s": run.duration_s,
        "events": run.events,
    })
    return summary
