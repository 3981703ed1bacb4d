"""Parameter sweeps over the calibration deployment, with PNG plots.

* :func:`bathtub`: BCR of the three deployments against the mean prefix hit rate.
* :func:`wan_demand`: WAN bandwidth PDD needs (mean, on an uncongested link) against
  context length, one line per mean hit rate.
* :func:`rld_count`: PDD's TTFT percentiles against the number of RLD instances
  (0 RLD is cross-DC PD).

Each returns a list of JSON-ready rows; :func:`plot` draws any of them.

Example::

    rows = rld_count(counts=(0, 1, 3), num_requests=1000)
    plot("rld", rows, "figures/")          # figures/ttft_vs_rld.png
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Iterable, Sequence

from tqdm import tqdm

from .capacity import max_goodput, run_trace
from .deployment import Pool
from .economics import Prices, bcr, mean_benefit
from .scenarios import CALIBRATION_WORKLOAD, calibration_configs
from .specs import HARDWARE
from .workload import AgenticConfig, agentic

__all__ = ["bathtub", "wan_demand", "rld_count", "plot", "pyplot", "SWEEPS"]


def _workload(**changes: Any) -> AgenticConfig:
    return replace(CALIBRATION_WORKLOAD, **changes)


def _hit_mix(mean_hit: float) -> dict[str, float]:
    """The report's skew where the mean allows it: up to 75 % of requests above 95 %."""
    return {"mean_hit": mean_hit, "high_hit_fraction": min(0.75, mean_hit / 0.975)}


def bathtub(hits: Sequence[float] = (0.05, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.95), num_requests: int = 1500,
            seed: int = 1, prices: Prices = Prices(), progress: bool = True, **overrides: Any) -> list[dict]:
    configs = calibration_configs(**overrides)
    rows = []
    with tqdm(total=len(hits) * len(configs), desc="bathtub", disable=not progress) as bar:
        for hit in hits:
            workload = _workload(num_requests=num_requests, **_hit_mix(hit))
            trace = agentic(workload, seed=seed)
            measured = sum(r.hit_rate for r in trace) / len(trace)
            benefit = mean_benefit(prices, trace)
            for name, cfg in configs.items():
                rate, summary = max_goodput(cfg, workload, iterations=5, high=64.0, seed=seed)
                rows.append({"target_hit": hit, "mean_hit": measured, "scenario": name, "goodput_rps": rate,
                             "goodput_capped": summary.get("goodput_capped", False),
                             "bcr": bcr(rate, benefit, cfg.price_per_hour), "benefit_per_request": benefit,
                             "ttft_p90_s": summary["ttft_p90_s"], "rld_token_share": summary["rld_token_share"]})
                bar.update()
    return rows


def wan_demand(contexts: Sequence[int] = (8192, 16384, 32768, 65536), hits: Sequence[float] = (0.5, 0.8, 0.9, 0.95),
               num_requests: int = 1500, seed: int = 1, progress: bool = True, **overrides: Any) -> list[dict]:
    """Mean and busiest-second WAN demand of PDD at the calibration rate on a link
    fast enough (1.6 Tbit/s) that it never queues: the bandwidth to buy to keep up."""
    cfg = calibration_configs(wan_gbps=1600.0, **overrides)["PDD"]
    rows = []
    with tqdm(total=len(contexts) * len(hits), desc="wan demand", disable=not progress) as bar:
        for hit in hits:
            for ctx in contexts:
                trace = agentic(_workload(num_requests=num_requests, max_context=ctx,
                                          prompt_median=max(256, int(ctx * 0.37)), **_hit_mix(hit)), seed=seed)
                s = run_trace(cfg, trace)
                rows.append({"context": ctx, "target_hit": hit, "wan_gbps_mean": s["wan_gbps_mean"],
                             "md_hit_rate": s["md_hit_rate"], "p_hit_rate": s["p_hit_rate"]})
                bar.update()
    return rows


def rld_count(counts: Iterable[int] = (0, 1, 2, 3, 4, 6, 8), num_requests: int = 3000, seed: int = 1,
              progress: bool = True, **overrides: Any) -> list[dict]:
    configs = calibration_configs(**overrides)
    trace = agentic(_workload(num_requests=num_requests), seed=seed)
    rows = []
    for n in tqdm(list(counts), desc="RLD count", disable=not progress):
        cfg = configs["cross-DC PD"] if n == 0 else configs["PDD"].with_(rld=Pool(HARDWARE["H100"], n))
        s = run_trace(cfg, trace)
        rows.append({"rld_instances": n, **{k: s[k] for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
                                                               "sla_attainment", "rld_token_share")}})
    return rows


SWEEPS = {"bathtub": bathtub, "wan": wan_demand, "rld": rld_count}


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or a clear error without it."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'pddcore[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(kind: str, rows: list[dict], directory: str | os.PathLike) -> str:
    """Draws one sweep's rows as a PNG in ``directory``; returns the file's path."""
    plt = pyplot()

    os.makedirs(directory, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    if kind == "bathtub":
        for name in dict.fromkeys(r["scenario"] for r in rows):
            pts = sorted((r["mean_hit"], r["bcr"], r["goodput_capped"]) for r in rows if r["scenario"] == name)
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            capped = [p for p in pts if p[2]]
            if capped:  # goodput above the search range: the BCR is a lower bound
                ax.plot([p[0] for p in capped], [p[1] for p in capped], "o", markersize=10, mfc="none",
                        color=line.get_color())
        ax.set_xlabel("mean prefix hit rate (ringed: lower bound, goodput above the search range)")
        ax.set_ylabel(r"BCR (billed \$ per hardware \$)")
        ax.set_title("Benefit-cost ratio vs prefix hit rate")
        path = os.path.join(directory, "bcr_vs_hit_rate.png")
    elif kind == "wan":
        for hit in dict.fromkeys(r["target_hit"] for r in rows):
            pts = sorted((r["context"], r["wan_gbps_mean"]) for r in rows if r["target_hit"] == hit)
            ax.plot(*zip(*pts), marker="o", label=f"mean hit {hit:.2f}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("WAN bandwidth needed (Gbit/s, mean)")
        ax.set_title("PDD WAN demand at the calibration load")
        path = os.path.join(directory, "wan_vs_context.png")
    elif kind == "rld":
        xs = [r["rld_instances"] for r in rows]
        for p in (50, 90, 99):
            ax.plot(xs, [r[f"ttft_p{p}_s"] for r in rows], marker="o", label=f"TTFT p{p}")
        ax.set_yscale("log")
        ax.set_xlabel("RLD instances (0 = cross-DC PD)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title("PDD TTFT vs RLD count")
        path = os.path.join(directory, "ttft_vs_rld.png")
    else:
        plt.close(fig)
        raise ValueError(f"unknown sweep {kind!r}; known: {', '.join(SWEEPS)}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
