"""Numbers of a run (TTFT percentiles, TPOT, WAN bytes, token shares, handoffs, routes)
and the comparison table the demo prints."""

from __future__ import annotations

import numpy as np

from .cluster import RunResult

__all__ = ["run_metrics", "format_table", "plot_ttft_cdf"]


def run_metrics(run: RunResult) -> dict:
    ttft = np.array([r["times"][0] - r["submitted"] for r in run.requests if r["times"]])
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in run.requests if len(r["times"]) > 1]
    roles = [role for r in run.requests for role in r["roles"]]
    counts = run.summary["counts"]
    pct = (lambda q: float(np.percentile(ttft, q))) if len(ttft) else (lambda q: float("nan"))
    return {
        "mode": run.mode, "requests": len(run.requests), "wall_s": run.wall_s,
        "ttft_s": {"p50": pct(50), "p90": pct(90), "p99": pct(99), "mean": float(ttft.mean()) if len(ttft) else None},
        "ttft_all_s": sorted(ttft.tolist()),
        "tpot_s": float(np.mean(tpot)) if tpot else None,
        "wan_bytes": run.summary["wan_bytes"],
        "tokens": {"RLD": roles.count("RLD"), "MD": roles.count("MD")},
        "handoffs": {"one_shot": counts.get("handoff_one_shot", 0), "catch_up": counts.get("handoff_catch_up", 0),
                     "rejected": counts.get("handoff_rejected", 0)},
        "routes": {p: counts.get(f"route_{p}", 0) for p in ("P_MD", "P_RLD_MD", "RLD_ONLY")},
        "faults": {k: v for k, v in counts.items() if k.startswith(("md_lost", "md_failed", "stayed_on_rld",
                                                                       "md_transfer_timeout", "md_cache_only"))},
        "ownership_violations": run.summary["violations"] + run.client_errors,
        "md_killed": run.md_killed,
    }


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def format_table(metrics: list[dict], labels: list[str]) -> str:
    def share(m: dict) -> str:
        total = m["tokens"]["RLD"] + m["tokens"]["MD"]
        return f"{100 * m['tokens']['RLD'] / total:.0f}% / {100 * m['tokens']['MD'] / total:.0f}%" if total else "-"

    rows = [
        ("TTFT p50", lambda m: f"{m['ttft_s']['p50'] * 1e3:.0f} ms"),
        ("TTFT p90", lambda m: f"{m['ttft_s']['p90'] * 1e3:.0f} ms"),
        ("TTFT p99", lambda m: f"{m['ttft_s']['p99'] * 1e3:.0f} ms"),
        ("TPOT (mean)", lambda m: f"{m['tpot_s'] * 1e3:.1f} ms" if m["tpot_s"] is not None else "-"),
        ("WAN bytes (P->MD KV)", lambda m: _mb(m["wan_bytes"])),
        ("tokens RLD / MD", share),
        ("handoffs one-shot / catch-up", lambda m: f"{m['handoffs']['one_shot']} / {m['handoffs']['catch_up']}"),
        ("handoffs rejected (malformed)", lambda m: str(m["handoffs"]["rejected"])),
        ("routes P_MD / P_RLD_MD / RLD_ONLY",
         lambda m: f"{m['routes']['P_MD']} / {m['routes']['P_RLD_MD']} / {m['routes']['RLD_ONLY']}"),
        ("faults and fallbacks", lambda m: ", ".join(f"{k}={v}" for k, v in sorted(m["faults"].items())) or "-"),
        ("requests / wall time", lambda m: f"{m['requests']} / {m['wall_s']:.1f} s"),
    ]
    width = max(len(r[0]) for r in rows) + 2
    cols = [max(len(lbl), *(len(fmt(m)) for _, fmt in rows)) + 2 for lbl, m in zip(labels, metrics)]
    lines = ["".ljust(width) + "".join(lbl.rjust(c) for lbl, c in zip(labels, cols))]
    lines.append("-" * len(lines[0]))
    for name, fmt in rows:
        lines.append(name.ljust(width) + "".join(fmt(m).rjust(c) for m, c in zip(metrics, cols)))
    return "\n".join(lines)


def plot_ttft_cdf(metrics: list[dict], labels: list[str], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, label in zip(metrics, labels):
        xs = np.array(m["ttft_all_s"]) * 1e3
        ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
