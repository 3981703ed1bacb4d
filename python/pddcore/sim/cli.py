"""`pddcore sim`: the cluster simulator from the command line.

    pddcore sim                          # calibration: the three deployments beside the PDD report
    pddcore sim --sensitivity            # the same, plus one parameter changed at a time
    pddcore sim --sweep rld --plot figs  # a sweep (bathtub, wan, rld or all), with PNGs
    pddcore sim --trace trace.jsonl      # the three deployments on your own trace
    pddcore sim --write-trace t.jsonl    # the synthetic calibration trace, as JSONL
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from typing import Any

from .calibration import calibrate, format_table
from .scenarios import CALIBRATION_WAN_GBPS, CALIBRATION_WORKLOAD, calibration_configs, calibration_trace
from .sensitivity import format_sensitivity, sensitivity
from .sweeps import SWEEPS, plot, pyplot
from .workload import TraceError, agentic, read_jsonl, write_jsonl

_TRACE_KEYS = ("offered_rps", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "tpot_p90_s", "tpot_p99_s",
               "sla_attainment", "sla_goodput_rps", "rld_token_share", "wan_gbps_mean", "md_hit_rate")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sweep", choices=[*SWEEPS, "all"], help="run a parameter sweep instead of the calibration")
    mode.add_argument("--trace", metavar="PATH",
                      help="simulate a JSONL trace on the calibration deployments (format: pddcore.sim.workload)")
    mode.add_argument("--write-trace", metavar="PATH", help="write the synthetic calibration trace and exit")
    mode.add_argument("--sensitivity", action="store_true",
                      help="after the calibration, re-run it with one parameter changed at a time (minutes)")
    parser.add_argument("--requests", type=int, default=None,
                        help=f"requests in the synthetic trace (default {CALIBRATION_WORKLOAD.num_requests})")
    parser.add_argument("--seed", type=int, default=1, help="seed of the synthetic trace (default 1)")
    parser.add_argument("--wan-gbps", type=float, default=None, help=f"WAN bandwidth (default {CALIBRATION_WAN_GBPS:g} Gbit/s)")
    parser.add_argument("--wan-rtt-ms", type=float, default=None, help="WAN round trip (default 20 ms)")
    parser.add_argument("--output-median", type=int, default=None,
                        help=f"median output tokens of the calibration workload "
                             f"(default {CALIBRATION_WORKLOAD.output_median})")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="DIR", help="write PNG figures into DIR")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.wan_gbps is not None:
        out["wan_gbps"] = args.wan_gbps
    if args.wan_rtt_ms is not None:
        out["wan_rtt_s"] = args.wan_rtt_ms / 1e3
    return out


def _plot_ttft_cdf(runs: dict[str, Any], directory: str) -> str:
    plt = pyplot()
    os.makedirs(directory, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for name, ttfts in runs.items():
        xs = sorted(ttfts)
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF on the same trace")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(directory, "ttft_cdf.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def _run_trace_mode(args, overrides) -> dict[str, Any]:
    from .cluster import ClusterSim
    from .metrics import check_accounting, summarize

    trace = read_jsonl(args.trace)
    results, ttfts = {}, {}
    for name, cfg in calibration_configs(**overrides).items():
        run = ClusterSim(cfg).run(trace)
        check_accounting(run)
        results[name] = summarize(run)
        ttfts[name] = [j.ttft for j in run.jobs]
    print(f"{'':22}" + "".join(f"{n:>14}" for n in results))
    for key in _TRACE_KEYS:
        cells = "".join(f"{'-' if results[n][key] is None else format(results[n][key], '.3f'):>14}" for n in results)
        print(f"{key:22}{cells}")
    if args.plot:
        print(f"wrote {_plot_ttft_cdf(ttfts, args.plot)}")
    return {"trace": args.trace, "scenarios": results}


def run(args: argparse.Namespace) -> int:
    overrides = _overrides(args)
    progress = not args.no_progress
    if args.requests is not None and args.requests < 2:
        print("pddcore sim: --requests must be at least 2", file=sys.stderr)
        return 2
    try:
        if args.write_trace:
            trace = calibration_trace(args.requests, args.seed)
            write_jsonl(trace, args.write_trace)
            print(f"wrote {len(trace)} requests to {args.write_trace}")
            return 0
        if args.trace:
            result = _run_trace_mode(args, overrides)
        elif args.sweep:
            result = {}
            for kind in (SWEEPS if args.sweep == "all" else [args.sweep]):
                kwargs = {"seed": args.seed, "progress": progress, **overrides}
                if args.requests is not None:
                    kwargs["num_requests"] = args.requests
                rows = SWEEPS[kind](**kwargs)
                result[kind] = rows
                print(f"sweep {kind}:")
                for row in rows:
                    print("  " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in row.items()))
                if args.plot:
                    print(f"wrote {plot(kind, rows, args.plot)}")
        else:
            changes = {} if args.output_median is None else {"output_median": args.output_median}
            requests = args.requests or CALIBRATION_WORKLOAD.num_requests
            result = calibrate(num_requests=requests, seed=args.seed, progress=progress, workload_changes=changes,
                               **overrides)
            print(format_table(result))
            if args.sensitivity:
                rows = sensitivity(num_requests=requests, seed=args.seed, progress=progress, baseline=result,
                                   workload_changes=changes, **overrides)
                print(f"\nSensitivity ({requests} requests, seed {args.seed}; gp = max SLA goodput in req/s, "
                      f"BCR at cached 10 %, TTFTs in s at the report's load; one change per row):")
                print(format_sensitivity(rows))
                result["sensitivity"] = rows
            if args.plot:
                print(f"wrote {_plot_calibration(result, overrides, args.plot)}")
    except (TraceError, ValueError, OSError) as e:
        print(f"pddcore sim: {e}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, default=str)
        print(f"wrote {args.json}")
    return 0


def _plot_calibration(result, overrides, directory) -> str:
    from .cluster import ClusterSim

    workload = replace(CALIBRATION_WORKLOAD, num_requests=result["requests"], **result["workload_changes"])
    trace = agentic(workload, seed=result["seed"])
    ttfts = {name: [j.ttft for j in ClusterSim(cfg).run(trace).jobs]
             for name, cfg in calibration_configs(**overrides).items()}
    return _plot_ttft_cdf(ttfts, directory)
