"""`pddcore bench` case ``demo``: how soon PDD answers against cross-DC PD, on the reference
deployment (``pddcore demo``'s scenario, link and router budget; ``quick``: its first 8
requests), both modes back to back on the same link in one run.

The figures are TTFT p50 / p90 / p99 of PDD beside cross-DC PD's as the baseline (below
1x: PDD's first tokens come sooner). Real processes share the machine's cores, so these
are performance figures, measured here and in ``pddcore demo``; the tests check only what
a run must do on any machine (docs/demo.md). Every run also checks that both modes'
outputs equal the single-process greedy decode.

Example::

    r = demo_case(quick=True)
    r.ttft_s["pdd"]["p90"] / r.ttft_s["pd"]["p90"]   # PDD's TTFT p90 over cross-DC PD's
"""

from __future__ import annotations

from dataclasses import dataclass

from ..deploy import Network, agentic_trace, run_demo
from ..deploy.cli import LABELS, TTFT_SLO_S
from .results import Result

PERCENTILES = ("p50", "p90", "p99")
_BANDWIDTH_BPS, _DELAY_MS = 100e6, 25.0  # pddcore demo's defaults


@dataclass
class DemoResult(Result):
    requests: int
    network: str  # the link and what emulated it
    ttft_s: dict[str, dict[str, float]]  # mode ("pd", "pdd") -> percentile -> seconds
    outputs_exact: dict[str, bool]  # mode -> every output equals the single-process greedy decode


def demo_case(quick: bool, *, requests: int | None = None) -> DemoResult:
    """Both modes on a fresh emulated link; ``requests`` (default 24, ``quick`` 8) of the trace."""
    scenario = agentic_trace(requests or (8 if quick else 24))
    overrides = {mode: {"ttft_slo_s": TTFT_SLO_S} for mode in LABELS}
    with Network(_BANDWIDTH_BPS, _DELAY_MS) as network:
        described = network.describe()
        result = run_demo(scenario, network, overrides=overrides)
    ttft = {mode: {p: result["metrics"][mode]["ttft_s"][p] for p in PERCENTILES} for mode in LABELS}
    exact = {mode: bool(result["correctness"][mode]["pass"]) for mode in LABELS}
    return DemoResult(scenario.num_requests, described, ttft, exact)


def format_result(r: DemoResult) -> str:
    lines = [f"{r.requests} requests of pddcore demo's trace, WAN {r.network}",
             f"{'TTFT':<6}{LABELS['pd']:>14}{LABELS['pdd']:>10}{'PDD / PD':>10}"]
    for p in PERCENTILES:
        pd, pdd = r.ttft_s["pd"][p], r.ttft_s["pdd"][p]
        lines.append(f"{p:<6}{pd * 1e3:>11.0f} ms{pdd * 1e3:>7.0f} ms{pdd / pd:>9.2f}x")
    lines += [f"outputs of {LABELS[mode]}: {'exact' if ok else 'DIFFER from the greedy decode'}"
              for mode, ok in r.outputs_exact.items()]
    return "\n".join(lines)
