"""Sensitivity of the calibration: the report's figures re-simulated with one parameter
changed at a time, beside the calibrated baseline (same trace seed and length).

Each :class:`Variation` changes a :class:`ClusterConfig` field (``config``) or an
:class:`AgenticConfig` field (``workload``) of every deployment alike. A row is a full
:func:`pddcore.sim.calibration.calibrate` run (three runs at the load, three SLA
goodput searches): about a minute each at 2000 requests.

Example::

    rows = sensitivity()
    print(format_sensitivity(rows))
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from tqdm import tqdm

from .calibration import calibrate
from .scenarios import CALIBRATION_WORKLOAD, REPORT

__all__ = ["Variation", "VARIATIONS", "sensitivity", "format_sensitivity"]


class Variation(NamedTuple):
    label: str
    config: dict[str, Any] = {}
    workload: dict[str, Any] = {}


# The parameters that move the result, each toward both ends of its plausible range.
VARIATIONS = (
    Variation("calibrated"),
    Variation("WAN 10 Gbit/s", config={"wan_gbps": 10.0}),
    Variation("WAN 16 Gbit/s", config={"wan_gbps": 16.0}),
    Variation("outputs median 350", workload={"output_median": 350}),
    Variation("outputs median 2500", workload={"output_median": 2500}),
    Variation("P cache: HBM only", config={"prefill_cache_ratio": 1.0}),
    Variation("P cache: unbounded", config={"prefill_cache_ratio": None}),
    Variation("HBM reserve 5 %", config={"memory_reserve": 0.05}),
    Variation("HBM reserve 15 %", config={"memory_reserve": 0.15}),
    Variation("prefill MFU 0.30", config={"mfu": 0.30}),
    Variation("Poisson arrivals", workload={"burstiness": 1.0}),
    Variation("load 11.5 req/s", workload={"rate": 11.5}),
)

# (column head, report value or None, function of a calibration result)
_COLUMNS = (
    ("same-DC gp", REPORT["baseline_goodput_rps"], lambda r: r["scenarios"]["same-DC PD"]["goodput_rps"]),
    ("PDD gp", REPORT["pdd_goodput_rps"], lambda r: r["scenarios"]["PDD"]["goodput_rps"]),
    ("BCR vs same", REPORT["bcr_change_low"], lambda r: next(row["sim"][0] for row in r["comparison"]
                                                            if row["metric"].startswith("BCR change, PDD vs same"))),
    ("cross p90", REPORT["cross_ttft_p90_s"], lambda r: r["scenarios"]["cross-DC PD"]["at_offered_load"]["ttft_p90_s"]),
    ("cross p99", REPORT["cross_ttft_p99_s"], lambda r: r["scenarios"]["cross-DC PD"]["at_offered_load"]["ttft_p99_s"]),
    ("PDD p90", REPORT["pdd_ttft_p90_s"], lambda r: r["scenarios"]["PDD"]["at_offered_load"]["ttft_p90_s"]),
    ("PDD p99", REPORT["pdd_ttft_p99_s"], lambda r: r["scenarios"]["PDD"]["at_offered_load"]["ttft_p99_s"]),
    ("RLD share", REPORT["rld_token_share"], lambda r: r["scenarios"]["PDD"]["at_offered_load"]["rld_token_share"]),
    ("P hit", None, lambda r: r["scenarios"]["PDD"]["at_offered_load"]["p_hit_rate"]),
)
_FRACTIONS = {"BCR vs same", "RLD share", "P hit"}


def sensitivity(variations: Sequence[Variation] = VARIATIONS, num_requests: int = CALIBRATION_WORKLOAD.num_requests,
                seed: int = 1, progress: bool = True, baseline: dict[str, Any] | None = None,
                workload_changes: dict[str, Any] | None = None, **overrides: Any) -> list[dict[str, Any]]:
    """One row per variation: its label, changes, and the report's figures simulated.
    ``overrides`` / ``workload_changes`` apply to every row before the variation's own
    changes; ``baseline`` (a :func:`calibrate` result with the same requests, seed and
    changes) is reused for a variation that changes nothing."""
    rows = []
    for v in tqdm(variations, desc="sensitivity", disable=not progress):
        if baseline is not None and not v.config and not v.workload:
            result = baseline
        else:
            result = calibrate(num_requests=num_requests, seed=seed, progress=False,
                               workload_changes={**(workload_changes or {}), **v.workload}, **{**overrides, **v.config})
        rows.append({"label": v.label, "config": v.config, "workload": v.workload,
                     **{head: value(result) for head, _, value in _COLUMNS}})
    return rows


def _cell(head: str, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:+.0%}" if head == "BCR vs same" else f"{value:.1%}" if head in _FRACTIONS else f"{value:.2f}"


def format_sensitivity(rows: list[dict[str, Any]]) -> str:
    width = max(len(r["label"]) for r in rows) + 2
    lines = [f"{'':{width}}" + "".join(f"{head:>12}" for head, _, _ in _COLUMNS),
             f"{'the report':{width}}" + "".join(f"{_cell(head, report):>12}" for head, report, _ in _COLUMNS)]
    for row in rows:
        lines.append(f"{row['label']:{width}}" + "".join(f"{_cell(head, row[head]):>12}" for head, _, _ in _COLUMNS))
    return "\n".join(lines)
