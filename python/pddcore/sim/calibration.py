"""The calibration scenario: the three deployments on the report-like trace, their
goodput and BCR, and a table beside the PDD report's published figures.

Example::

    result = calibrate(num_requests=3000)
    print(format_table(result))
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tqdm import tqdm

from .capacity import max_goodput, run_trace
from .economics import Prices, bcr, mean_benefit
from .scenarios import CALIBRATION_CHOICES, CALIBRATION_WAN_GBPS, CALIBRATION_WORKLOAD, REPORT, calibration_configs
from .workload import agentic

__all__ = ["calibrate", "format_table", "comparison_rows"]

# Cached input billed at the two ends of the 10-25 % range.
_CACHED_FRACTIONS = (0.10, 0.25)
# WAN bandwidths (Gbit/s) of the sensitivity rows, beside the calibration's own.
SENSITIVITY_GBPS = (16.0, 25.0, 50.0)


def calibrate(num_requests: int = 3000, seed: int = 1, goodput_iterations: int = 5, progress: bool = True,
              workload_changes: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """Runs every deployment at the calibration load, then searches its SLA goodput.
    ``overrides`` go to every :class:`ClusterConfig` (e.g. ``wan_gbps=40``),
    ``workload_changes`` to the :class:`AgenticConfig` (e.g. ``output_median=2500``)."""
    configs = calibration_configs(**overrides)
    workload = replace(CALIBRATION_WORKLOAD, num_requests=num_requests, **(workload_changes or {}))
    trace = agentic(workload, seed=seed)
    scenarios: dict[str, Any] = {}
    wan_gbps = overrides.get("wan_gbps", CALIBRATION_WAN_GBPS)
    sensitivity_gbps = [g for g in SENSITIVITY_GBPS if g != wan_gbps]
    sensitivity = []
    with tqdm(total=2 * len(configs) + 2 * len(sensitivity_gbps), desc="calibration", disable=not progress) as bar:
        for name, cfg in configs.items():
            scenarios[name] = {"at_offered_load": run_trace(cfg, trace)}
            bar.update()
        for name, cfg in configs.items():
            rate, summary = max_goodput(cfg, workload, iterations=goodput_iterations, seed=seed)
            scenarios[name]["goodput_rps"] = rate
            scenarios[name]["goodput_capped"] = summary.get("goodput_capped", False)
            scenarios[name]["at_goodput"] = summary
            bar.update()
        for gbps in sensitivity_gbps:
            row = {"wan_gbps": gbps}
            for name in ("cross-DC PD", "PDD"):
                s = run_trace(configs[name].with_(wan_gbps=gbps), trace)
                row[name] = {k: s[k] for k in ("ttft_p90_s", "ttft_p99_s", "rld_token_share", "wan_busy_fraction")}
                bar.update()
            sensitivity.append(row)
    for name, cfg in configs.items():
        scenarios[name]["price_per_hour"] = cfg.price_per_hour
        scenarios[name]["bcr"] = {str(f): bcr(scenarios[name]["goodput_rps"],
                                              mean_benefit(Prices(cached_fraction=f), trace), cfg.price_per_hour)
                                  for f in _CACHED_FRACTIONS}
    return {"requests": len(trace), "seed": seed, "choices": CALIBRATION_CHOICES, "report": REPORT,
            "overrides": overrides, "workload_changes": workload_changes or {}, "wan_gbps": wan_gbps, "scenarios": scenarios,
            "comparison": comparison_rows(scenarios), "wan_sensitivity": sensitivity}


def _change(new: float, old: float) -> float | None:
    return None if not old else new / old - 1


def comparison_rows(scenarios: dict[str, Any]) -> list[dict[str, Any]]:
    """(metric, report, simulated) rows; changes are fractions (-0.46 = -46 %)."""
    cross, pdd, same = (scenarios[k]["at_offered_load"] for k in ("cross-DC PD", "PDD", "same-DC PD"))
    g = {k: scenarios[k]["goodput_rps"] for k in scenarios}
    bcr_vs_same = [_change(scenarios["PDD"]["bcr"][f], scenarios["same-DC PD"]["bcr"][f])
                   for f in scenarios["PDD"]["bcr"]]
    bcr_vs_cross = [_change(scenarios["PDD"]["bcr"][f], scenarios["cross-DC PD"]["bcr"][f])
                    for f in scenarios["PDD"]["bcr"]]
    return [
        {"metric": "cross-DC PD TTFT p90 (s)", "report": REPORT["cross_ttft_p90_s"], "sim": cross["ttft_p90_s"]},
        {"metric": "cross-DC PD TTFT p99 (s)", "report": REPORT["cross_ttft_p99_s"], "sim": cross["ttft_p99_s"]},
        {"metric": "PDD TTFT p90 (s)", "report": REPORT["pdd_ttft_p90_s"], "sim": pdd["ttft_p90_s"]},
        {"metric": "PDD TTFT p99 (s)", "report": REPORT["pdd_ttft_p99_s"], "sim": pdd["ttft_p99_s"]},
        {"metric": "TTFT p90 change, PDD vs cross-DC", "report": REPORT["ttft_p90_change"],
         "sim": _change(pdd["ttft_p90_s"], cross["ttft_p90_s"]), "fraction": True},
        {"metric": "RLD share of output tokens", "report": REPORT["rld_token_share"],
         "sim": pdd["rld_token_share"], "fraction": True},
        {"metric": "same-DC PD TTFT p90 (s)", "report": None, "sim": same["ttft_p90_s"]},
        {"metric": "goodput, 88 H100 same-DC PD (req/s)", "report": REPORT["baseline_goodput_rps"],
         "sim": g["same-DC PD"]},
        {"metric": "goodput, cross-DC PD (req/s)", "report": None, "sim": g["cross-DC PD"]},
        {"metric": "goodput, PDD (req/s)", "report": REPORT["pdd_goodput_rps"], "sim": g["PDD"]},
        {"metric": "goodput change, PDD vs same-DC PD", "report": REPORT["goodput_change"],
         "sim": _change(g["PDD"], g["same-DC PD"]), "fraction": True},
        {"metric": "BCR change, PDD vs same-DC PD (cached 10% / 25%)",
         "report": (REPORT["bcr_change_low"], REPORT["bcr_change_high"]), "sim": tuple(bcr_vs_same),
         "fraction": True},
        {"metric": "BCR change, PDD vs cross-DC PD (cached 10% / 25%)", "report": None, "sim": tuple(bcr_vs_cross),
         "fraction": True},
    ]


def _fmt(value: Any, fraction: bool) -> str:
    if value is None:
        return "-"
    if isinstance(value, tuple):
        return " / ".join(_fmt(v, fraction) for v in value)
    return f"{value * 100:+.1f} %" if fraction else f"{value:.2f}"


def format_table(result: dict[str, Any]) -> str:
    lines = []
    scen = result["scenarios"]
    names = list(scen)
    head = f"{'':28}" + "".join(f"{n:>14}" for n in names)
    changed = "".join(f", {k}={v}" for k, v in result["workload_changes"].items())
    lines.append(f"Calibration: {result['requests']} requests, seed {result['seed']}{changed}, at the offered load")
    lines.append(head)
    rows = [("offered load (req/s)", "offered_rps", "{:.2f}"), ("TTFT p50 (s)", "ttft_p50_s", "{:.2f}"),
            ("TTFT p90 (s)", "ttft_p90_s", "{:.2f}"), ("TTFT p99 (s)", "ttft_p99_s", "{:.2f}"),
            ("TPOT p50 (ms)", "tpot_p50_s", "{:.1f}"), ("TPOT p90 (ms)", "tpot_p90_s", "{:.1f}"),
            ("TPOT p99 (ms)", "tpot_p99_s", "{:.1f}"), ("SLA attainment", "sla_attainment", "{:.1%}"),
            ("SLA goodput (req/s)", "sla_goodput_rps", "{:.2f}"), ("RLD token share", "rld_token_share", "{:.1%}"),
            ("WAN used (Gbit/s)", "wan_gbps_mean", "{:.1f}"), ("MD prefix hit", "md_hit_rate", "{:.1%}")]
    for label, key, fmt in rows:
        cells = []
        for n in names:
            v = scen[n]["at_offered_load"][key]
            if v is None:
                cells.append(f"{'-':>14}")
            else:
                cells.append(f"{fmt.format(v * 1000 if 'tpot' in key else v):>14}")
        lines.append(f"{label:28}" + "".join(cells))
    lines.append(f"{'max SLA goodput (req/s)':28}"
                 + "".join(f"{('>= ' if scen[n]['goodput_capped'] else '') + format(scen[n]['goodput_rps'], '.2f'):>14}"
                           for n in names))
    lines.append(f"{'hardware cost ($/h)':28}" + "".join(f"{scen[n]['price_per_hour']:>14.1f}" for n in names))
    lines.append(f"{'BCR (cached 10 % / 25 %)':28}"
                 + "".join(f"{' / '.join(f'{v:.2f}' for v in scen[n]['bcr'].values()):>14}" for n in names))
    lines.append("")
    lines.append(f"{'beside the PDD report':52}{'report':>18}{'simulated':>20}")
    for row in result["comparison"]:
        frac = row.get("fraction", False)
        lines.append(f"{row['metric']:52}{_fmt(row['report'], frac):>18}{_fmt(row['sim'], frac):>20}")
    lines.append("")
    lines.append(f"WAN sensitivity at the same load (calibration: {result['wan_gbps']:g} Gbit/s)")
    lines.append(f"{'WAN Gbit/s':>12}{'cross p90/p99 (s)':>22}{'link busy':>11}{'PDD p90/p99 (s)':>20}{'RLD share':>11}")
    for row in result["wan_sensitivity"]:
        c, p = row["cross-DC PD"], row["PDD"]
        lines.append(f"{row['wan_gbps']:>12g}{c['ttft_p90_s']:>12.2f} / {c['ttft_p99_s']:<7.2f}"
                     f"{c['wan_busy_fraction']:>11.0%}{p['ttft_p90_s']:>10.2f} / {p['ttft_p99_s']:<7.2f}"
                     f"{p['rld_token_share']:>11.1%}")
    lines.append("")
    lines.append("Parameters (datasheet or physical choices; only the WAN bandwidth is matched to the report):")
    for key, text in result["choices"].items():
        lines.append(f"  {key}: {text}")
    return "\n".join(lines)
