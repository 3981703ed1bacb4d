"""The calibration scenario: the three deployments on the report-like trace, at the
report's load and at each one's SLA goodput, their BCR, and a table beside the PDD
report's published figures.

Example::

    result = calibrate()                      # 2000 requests, seed 1
    print(format_table(result))
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tqdm import tqdm

from .capacity import max_goodput, run_trace
from .economics import Prices, bcr, mean_benefit
from .scenarios import CALIBRATION_PARAMETERS, CALIBRATION_WORKLOAD, REPORT, REPORT_TOLERANCE, calibration_configs
from .workload import agentic

__all__ = ["calibrate", "format_table", "comparison_rows", "CACHED_FRACTIONS"]

# Cached input billed at the two ends of the 10-25 % range of public price lists.
CACHED_FRACTIONS = (0.10, 0.25)


def calibrate(num_requests: int = CALIBRATION_WORKLOAD.num_requests, seed: int = 1, goodput_iterations: int = 5, progress: bool = True,
              workload_changes: dict[str, Any] | None = None, **overrides: Any) -> dict[str, Any]:
    """Runs every deployment at the calibration load, then searches its SLA goodput.
    ``overrides`` go to every :class:`ClusterConfig` (e.g. ``wan_gbps=40``),
    ``workload_changes`` to the :class:`AgenticConfig` (e.g. ``output_median=350``)."""
    configs = calibration_configs(**overrides)
    workload = replace(CALIBRATION_WORKLOAD, num_requests=num_requests, **(workload_changes or {}))
    trace = agentic(workload, seed=seed)
    scenarios: dict[str, Any] = {}
    with tqdm(total=2 * len(configs), desc="calibration", disable=not progress) as bar:
        for name, cfg in configs.items():
            scenarios[name] = {"at_offered_load": run_trace(cfg, trace)}
            bar.update()
        for name, cfg in configs.items():
            rate, summary = max_goodput(cfg, workload, iterations=goodput_iterations, seed=seed)
            scenarios[name]["goodput_rps"] = rate
            scenarios[name]["goodput_capped"] = summary.get("goodput_capped", False)
            scenarios[name]["at_goodput"] = summary
            bar.update()
    for name, cfg in configs.items():
        scenarios[name]["price_per_hour"] = cfg.price_per_hour
        scenarios[name]["bcr"] = {str(f): bcr(scenarios[name]["goodput_rps"],
                                              mean_benefit(Prices(cached_fraction=f), trace), cfg.price_per_hour)
                                  for f in CACHED_FRACTIONS}
    return {"requests": len(trace), "seed": seed, "parameters": {k: p._asdict() for k, p in
                                                                 CALIBRATION_PARAMETERS.items()},
            "report": REPORT, "overrides": overrides, "workload_changes": workload_changes or {},
            "scenarios": scenarios, "comparison": comparison_rows(scenarios)}


def _change(new: float, old: float) -> float | None:
    return None if not old else new / old - 1


def _within(sim: float, report: float) -> bool:
    return abs(sim / report - 1) <= REPORT_TOLERANCE


def comparison_rows(scenarios: dict[str, Any]) -> list[dict[str, Any]]:
    """(metric, report, simulated) rows; changes are fractions (-0.46 = -46 %). Rows
    the calibration is judged on carry ``check`` (what passing means) and ``ok``."""
    cross, pdd, same = (scenarios[k]["at_offered_load"] for k in ("cross-DC PD", "PDD", "same-DC PD"))
    g = {k: scenarios[k]["goodput_rps"] for k in scenarios}
    bcr_vs_same = tuple(_change(scenarios["PDD"]["bcr"][f], scenarios["same-DC PD"]["bcr"][f])
                        for f in scenarios["PDD"]["bcr"])
    bcr_vs_cross = tuple(_change(scenarios["PDD"]["bcr"][f], scenarios["cross-DC PD"]["bcr"][f])
                         for f in scenarios["PDD"]["bcr"])
    tol = f"+-{REPORT_TOLERANCE:.0%}"

    def judged(metric: str, report: float, sim: float) -> dict[str, Any]:
        return {"metric": metric, "report": report, "sim": sim, "check": tol, "ok": _within(sim, report)}

    return [
        judged("cross-DC PD TTFT p90 (s)", REPORT["cross_ttft_p90_s"], cross["ttft_p90_s"]),
        judged("cross-DC PD TTFT p99 (s)", REPORT["cross_ttft_p99_s"], cross["ttft_p99_s"]),
        judged("PDD TTFT p90 (s)", REPORT["pdd_ttft_p90_s"], pdd["ttft_p90_s"]),
        judged("PDD TTFT p99 (s)", REPORT["pdd_ttft_p99_s"], pdd["ttft_p99_s"]),
        {"metric": "TTFT p90 change, PDD vs cross-DC", "report": REPORT["ttft_p90_change"],
         "sim": _change(pdd["ttft_p90_s"], cross["ttft_p90_s"]), "fraction": True},
        {"metric": "RLD share of output tokens", "report": REPORT["rld_token_share"],
         "sim": pdd["rld_token_share"], "fraction": True},
        {"metric": "same-DC PD TTFT p90 (s)", "report": None, "sim": same["ttft_p90_s"]},
        judged("goodput, 88 H100 same-DC PD (req/s)", REPORT["baseline_goodput_rps"], g["same-DC PD"]),
        {"metric": "goodput, cross-DC PD (req/s)", "report": None, "sim": g["cross-DC PD"]},
        judged("goodput, PDD (req/s)", REPORT["pdd_goodput_rps"], g["PDD"]),
        {"metric": "goodput change, PDD vs same-DC PD", "report": REPORT["goodput_change"],
         "sim": _change(g["PDD"], g["same-DC PD"]), "fraction": True},
        {"metric": "BCR change, PDD vs same-DC PD (cached 10% / 25%)",
         "report": (REPORT["bcr_change_low"], REPORT["bcr_change_high"]), "sim": bcr_vs_same, "fraction": True,
         "check": "> 0", "ok": all(v is not None and v > 0 for v in bcr_vs_same)},
        {"metric": "BCR change, PDD vs cross-DC PD (cached 10% / 25%)", "report": None, "sim": bcr_vs_cross,
         "fraction": True},
    ]


def _fmt(value: Any, fraction: bool) -> str:
    if value is None:
        return "-"
    if isinstance(value, tuple):
        return " / ".join(_fmt(v, fraction) for v in value)
    return f"{value * 100:+.1f} %" if fraction else f"{value:.2f}"


# (label, summary key, format); TPOTs are shown in ms.
_RUN_ROWS = [("TTFT p50 (s)", "ttft_p50_s", "{:.2f}"), ("TTFT p90 (s)", "ttft_p90_s", "{:.2f}"),
             ("TTFT p99 (s)", "ttft_p99_s", "{:.2f}"), ("TPOT p50 (ms)", "tpot_p50_s", "{:.1f}"),
             ("TPOT p99 (ms)", "tpot_p99_s", "{:.1f}"), ("SLA attainment", "sla_attainment", "{:.1%}"),
             ("RLD token share", "rld_token_share", "{:.1%}"), ("WAN used (Gbit/s)", "wan_gbps_mean", "{:.1f}"),
             ("WAN link busy", "wan_busy_fraction", "{:.0%}"), ("P prefix hit", "p_hit_rate", "{:.1%}"),
             ("MD prefix hit", "md_hit_rate", "{:.1%}")]


def _run_block(scen: dict[str, Any], where: str, rate_label: str, rate_key: str) -> list[str]:
    names = list(scen)
    lines = [f"{rate_label:28}" + "".join(f"{scen[n][where][rate_key]:>14.2f}" for n in names)]
    for label, key, fmt in _RUN_ROWS:
        cells = []
        for n in names:
            v = scen[n][where][key]
            text = "-" if v is None or (key.startswith("wan") and not scen[n][where]["wan_gb"]) else \
                fmt.format(v * 1000 if "tpot" in key else v)
            cells.append(f"{text:>14}")
        lines.append(f"{label:28}" + "".join(cells))
    return lines


def format_table(result: dict[str, Any]) -> str:
    scen = result["scenarios"]
    names = list(scen)
    head = f"{'':28}" + "".join(f"{n:>14}" for n in names)
    changed = "".join(f", {k}={v}" for k, v in {**result["workload_changes"], **result["overrides"]}.items())
    lines = [f"Calibration: {result['requests']} requests, seed {result['seed']}{changed}", "",
             "At the report's load (one trace for all three):", head]
    lines += _run_block(scen, "at_offered_load", "offered load (req/s)", "offered_rps")
    lines += ["", "At each deployment's SLA goodput:", head]
    lines += _run_block(scen, "at_goodput", "sent load (req/s)", "sent_rps")
    lines.append(f"{'max SLA goodput (req/s)':28}"
                 + "".join(f"{('>= ' if scen[n]['goodput_capped'] else '') + format(scen[n]['goodput_rps'], '.2f'):>14}"
                           for n in names))
    lines.append(f"{'hardware cost ($/h)':28}" + "".join(f"{scen[n]['price_per_hour']:>14.1f}" for n in names))
    lines.append(f"{'BCR (cached 10 % / 25 %)':28}"
                 + "".join(f"{' / '.join(f'{v:.2f}' for v in scen[n]['bcr'].values()):>14}" for n in names))
    lines += ["", f"{'beside the PDD report':52}{'report':>16}{'simulated':>20}{'check':>8}  verdict"]
    for row in result["comparison"]:
        frac = row.get("fraction", False)
        verdict = "" if "ok" not in row else ("ok" if row["ok"] else "MISSED")
        lines.append(f"{row['metric']:52}{_fmt(row['report'], frac):>16}{_fmt(row['sim'], frac):>20}"
                     f"{row.get('check', ''):>8}  {verdict}")
    lines += ["", "Parameters and their sources:"]
    for key, p in result["parameters"].items():
        lines.append(f"  {key}: {p['value']}  [{p['source']}]")
    return "\n".join(lines)
