"""The gateway's Prometheus series (``/metrics``, text exposition format), on a registry of
its own so that several gateways in one process (tests) never share counters.

==================================  =======================================================
series                              what it counts
==================================  =======================================================
pddcore_requests_total{route}       requests by pipeline: P_MD, P_RLD_MD, RLD_ONLY
pddcore_request_errors_total{kind}  requests answered with an error: bad_request, upstream
pddcore_ttft_seconds                time to the first token the client got
pddcore_tpot_seconds                mean time per output token after the first, per request
pddcore_tokens_total{source}        tokens delivered, by the role that produced them
pddcore_handoffs_total{kind}        final handoffs RLD -> MD: one_shot, catch_up
pddcore_catch_up_rounds_total       extend-only rounds MD ran while RLD kept decoding
pddcore_handoff_gap_seconds         last RLD token to first MD token
pddcore_wan_kv_bytes_total          KV bytes MD pulled across the WAN (tokens x KV bytes per token)
pddcore_resumes_total{reason}       requests continued elsewhere after a failure
pddcore_fallbacks_total{reason}     requests that stayed on RLD: md_prefetch_failed,
                                    md_prefetch_timeout, md_extend_failed
pddcore_upstream_errors_total{role} failed engine calls, by role
==================================  =======================================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

__all__ = ["GatewayMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pddcore_requests", "Requests by PDD pipeline", ["route"], registry=r)
        self.errors = Counter("pddcore_request_errors", "Requests answered with an error", ["kind"], registry=r)
        self.ttft = Histogram("pddcore_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("pddcore_tpot_seconds", "Mean time per output token after the first",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("pddcore_tokens", "Tokens delivered, by producing role", ["source"], registry=r)
        self.handoffs = Counter("pddcore_handoffs", "Final RLD -> MD handoffs", ["kind"], registry=r)
        self.catch_up_rounds = Counter("pddcore_catch_up_rounds", "Extend-only rounds on MD", registry=r)
        self.handoff_gap = Histogram("pddcore_handoff_gap_seconds", "Last RLD token to first MD token",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.wan_bytes = Counter("pddcore_wan_kv_bytes", "KV bytes MD pulled across the WAN", registry=r)
        self.resumes = Counter("pddcore_resumes", "Requests continued elsewhere after a failure", ["reason"],
                               registry=r)
        self.fallbacks = Counter("pddcore_fallbacks", "Requests that stayed on RLD instead of moving to MD",
                                 ["reason"], registry=r)
        self.upstream_errors = Counter("pddcore_upstream_errors", "Failed engine calls", ["role"], registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
