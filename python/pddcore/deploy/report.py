"""Numbers of a run (TTFT percentiles, TPOT, WAN bytes, token shares, handoffs, routes,
and what the gateway and the engines measured: prefill time, when the KV was usable at RLD
and MD, MD's cache hits, decode steps), the comparison table the demo prints, and
:func:`explain`, the scenario's rationale in this run's measured figures.

Example::

    m = run_metrics(run)                  # one RunResult -> a JSON-ready dict
    m["ttft_s"]["p90"], m["prefill"]["s_per_token"], m["decode_step_s"]["RLD"]["p50"]
    print(explain(m))
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from .._stats import percentiles
from .cluster import RunResult

__all__ = ["run_metrics", "format_table", "plot_ttft_cdf", "explain", "gateway_counters"]


def gateway_counters(metrics_text: str) -> dict[str, float]:
    """The gateway's counters from its Prometheus text: ``"name{label}"`` (or ``"name"``) -> value."""
    out = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name.endswith("_total"):
                label = ",".join(sample.labels.values())
                out[f"{sample.name}{{{label}}}" if label else sample.name] = sample.value
    return out


def run_metrics(run: RunResult) -> dict:
    requests = run.requests
    traces = [r["trace"] for r in requests]
    ttft = np.array([r["times"][0] - r["submitted"] for r in requests if r["times"]])
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in requests if len(r["times"]) > 1]
    roles = [role for t in traces for role in t["sources"]]
    handoffs = Counter(kind for t in traces for kind, _ in t["handoffs"])
    routes = Counter(t["pipeline"] for t in traces)
    counters = gateway_counters(run.metrics)
    faults = {name.removeprefix("pddcore_").replace("_total{", ":").rstrip("}"): int(value)
              for name, value in counters.items()
              if name.startswith(("pddcore_resumes_total", "pddcore_fallbacks_total")) and value}
    pct = percentiles(ttft, (50, 90, 99), empty=float("nan"))
    return {
        "mode": run.mode, "requests": len(requests), "wall_s": run.wall_s,
        "ttft_s": {"p50": pct[50], "p90": pct[90], "p99": pct[99], "mean": float(ttft.mean()) if len(ttft) else None},
        "ttft_all_s": sorted(ttft.tolist()),
        "tpot_s": float(np.mean(tpot)) if tpot else None,
        "wan_bytes": counters.get("pddcore_wan_kv_bytes_total", 0.0),
        "tokens": {"RLD": roles.count("RLD"), "MD": roles.count("MD")},
        "handoffs": {"one_shot": handoffs["one_shot"], "catch_up": handoffs["catch_up"]},
        "routes": {p: routes[p] for p in ("P_MD", "P_RLD_MD", "RLD_ONLY")},
        "faults": faults,
        "md_killed": run.md_killed,
        **_measured(run),
    }


def _spread(samples: Sequence[float]) -> dict:
    """Count, min, median and max of ``samples`` (None each when there are none)."""
    if not samples:
        return {"count": 0, "min": None, "p50": None, "max": None}
    q = percentiles(samples, (0, 50, 100))
    return {"count": len(samples), "min": q[0], "p50": q[50], "max": q[100]}


def _measured(run: RunResult) -> dict:
    """What the gateway timed per request (the first prefill; how long after it the KV was
    usable at RLD, its first token there, and at MD, its prefetch done or its first token),
    MD's share of each follow-up turn's context as the gateway's estimate routed it, and the
    engines' own timings of their model passes."""
    requests = run.requests
    passes = (run.timings.get("P") or {}).get("extend_passes", [])
    tokens, seconds = sum(n for _, n in passes), sum(s for s, _ in passes)
    usable = {target: [r["trace"]["kv_usable_s"][target] for r in requests if target in r["trace"]["kv_usable_s"]]
              for target in ("rld", "md")}
    steps = {role: (run.timings.get(role) or {}).get("decode_steps", []) for role in ("RLD", "MD")}
    return {
        "prefill": {"tokens": tokens, "seconds": seconds, "s_per_token": seconds / tokens if tokens else None},
        "fresh_contexts": [{"rid": r["rid"], "context_tokens": len(r["context"]),
                            "prefilled_tokens": r["trace"]["prefill_tokens"], "prefill_s": r["trace"]["prefill_s"],
                            "kv_to_rld_s": r["trace"]["kv_usable_s"].get("rld"),
                            "kv_to_md_s": r["trace"]["kv_usable_s"].get("md")}
                           for r in requests if r["turn"] == 0 and r["trace"]["prefill_s"] is not None],
        "kv_usable_s": {target: _spread(samples) for target, samples in usable.items()},
        "md_hit_followups": _spread([r["trace"]["md_cached_tokens"] / len(r["context"])
                                     for r in requests if r["turn"] > 0]),
        "decode_step_s": {role: {**_spread([s for s, _ in steps[role]]),
                                 "mean_batch": float(np.mean([b for _, b in steps[role]])) if steps[role] else None}
                          for role in steps},
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


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def explain(m: dict) -> str:
    """Why the scenario shows what PDD is for, told in the figures this run measured;
    ``m`` is one mode's :func:`run_metrics` (as ``pddcore demo --json`` writes it)."""
    lines = [f"why this scenario, in this run's measurements ({m['mode']}):"]
    p = m["prefill"]
    if p["tokens"]:
        lines.append(f"  prefill at P: {p['s_per_token'] * 1e3:.2f} ms per token ({p['tokens']} tokens in "
                     f"{p['seconds']:.2f} s of extend passes)")
    for f in m["fresh_contexts"]:
        lines.append(f"  fresh context of {f['context_tokens']} tokens ({f['prefilled_tokens']} not cached at P): "
                     f"prefill call {f['prefill_s']:.2f} s, then its KV usable at RLD after {_ms(f['kv_to_rld_s'])}, "
                     f"at MD after {_ms(f['kv_to_md_s'])}")
    usable = [f"at {target.upper()} {_ms(k['p50'])} ({_ms(k['min'])} to {_ms(k['max'])}, {k['count']} requests)"
              for target, k in m["kv_usable_s"].items() if k["count"]]
    if usable:
        lines.append("  KV usable after the prefill, median (min to max): " + ", ".join(usable))
    hit = m["md_hit_followups"]
    if hit["count"]:
        lines.append(f"  follow-up turns: {100 * hit['min']:.1f} to {100 * hit['max']:.1f} % of the context in MD's "
                     f"prefix cache, as the gateway's radix tree tracks it (median {100 * hit['p50']:.1f} %, "
                     f"{hit['count']} turns), so only their last pages cross the WAN")
    steps = [f"{role} {_ms(d['p50'])} ({d['count']} steps, {d['mean_batch']:.2f} requests per step on average)"
             for role, d in m["decode_step_s"].items() if d["count"]]
    if steps:
        lines.append("  decode step, median: " + ", ".join(steps))
    if m["decode_step_s"]["RLD"]["count"]:
        lines.append("  While a fresh context's KV crosses the WAN to MD, RLD (next to P) already streams its answer; "
                     "MD takes the request over by a token-id handoff once the KV is usable there, and serves "
                     "follow-ups from its radix cache (routes and handoffs: the table above).")
    return "\n".join(lines)
