"""`pddcore demo`: PDD end to end, as an operator deploys it: the ``pddcore serve`` gateway
in front of ``pddcore engine`` servers (P and RLD in one datacenter, MD in the other).

The default scenario is sized so the effect PDD targets shows on one small box: an
emulated WAN of 100 Mbit/s with 25 ms one-way delay, and the embedded model in float64
(8 KiB of KV per token, 4 layers x 2 KV heads x 64 dims x K,V x 8 bytes), so a fresh
document's KV takes long on the WAN next to its prefill. Before the run the demo prints
the scenario and the router settings it changes, with their reasons; after it, the
comparison table and :func:`pddcore.deploy.report.explain`: the prefill, KV transfer,
cache-hit and decode-step figures that run measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform

from .. import __version__
from ..router import RouterConfig
from .cluster import RunConfig
from .demo import kv_bytes_per_token, run_demo, vocab_size
from .network import Network
from .report import explain, format_table, plot_ttft_cdf
from .trace import Scenario, agentic_trace

LABELS = {"pd": "cross-DC PD", "pdd": "PDD"}
# The router's TTFT budget for the default scenario, between what the default link needs for
# a fresh context's KV (528 to 1424 tokens x 8 KiB at 100 Mbit/s: 0.35 to 0.93 s before
# any RTT) and for a follow-up's last pages, all MD lacks of it (3 pages of 16 tokens:
# 0.03 s, plus an RTT).
TTFT_SLO_S = 0.2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=24, help="requests in the agentic trace (default 24)")
    parser.add_argument("--bandwidth", type=float, default=100.0, help="WAN bandwidth in Mbit/s (default 100)")
    parser.add_argument("--delay-ms", type=float, default=25.0, help="one-way WAN delay in ms (default 25)")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="one-way delay jitter in ms (default 0)")
    parser.add_argument("--model", metavar="PATH", help="Hugging Face Llama/Qwen2 folder (default: embedded model)")
    parser.add_argument("--kill-md-after", type=float, metavar="S", help="fault: kill MD S seconds into the PDD run")
    parser.add_argument("--relay", action="store_true", help="use the userspace relay even where the kernel "
                                                             "WAN emulator could run")
    parser.add_argument("--json", metavar="PATH", help="write all results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of the TTFT CDFs")


def _setup(scenario: Scenario, bpt: float) -> str:
    """The scenario and the router settings the demo changes, before the run: sizes and
    settings only (what they lead to is measured and printed after the run)."""
    sessions = scenario.sessions
    slash = lambda values: "/".join(str(v) for v in values)  # noqa: E731
    followups = [o for s in sessions for o in s.outputs[1:]]
    parts = [f"{len(sessions)} sessions opening with a fresh context ({slash(len(s.first_context) for s in sessions)} "
             f"tokens, answered in {slash(s.outputs[0] for s in sessions)} tokens)"]
    if followups:
        parts.append(f"{len(followups)} follow-up turns (answered in {slash(sorted(set(followups)))} tokens)")
    run = RunConfig("pdd", ttft_slo_s=TTFT_SLO_S)
    router = {f.name: f.default for f in dataclasses.fields(RouterConfig)}
    return (f"scenario: {', then '.join(parts)}; KV is {bpt / 1024:g} KiB per token. "
            f"Router (pddcore.router.Router): ttft_slo_s {run.ttft_slo_s:g} s instead of the default "
            f"{router['ttft_slo_s']:g} s, scaled with the small emulated link (a fresh context's KV needs "
            f"longer on it, a follow-up's missing pages far less); rld_tpot_s {run.rld_tpot_s:g} s (default "
            f"{router['rld_tpot_s']:g} s: what an RLD token costs on a production RLD slot, not this machine's "
            f"decode step, which is printed after the run); min_md_tokens {router['min_md_tokens']} and "
            f"wan_value_ratio {router['wan_value_ratio']:g} (defaults); a catch-up handoff once RLD's backlog exceeds "
            f"{run.catch_up_threshold} tokens (the HandoffPolicy default).")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.requests < 1 or args.bandwidth <= 0 or args.delay_ms < 0:
        raise SystemExit("--requests must be >= 1, --bandwidth > 0 and --delay-ms >= 0")
    model = {"path": args.model} if args.model else {"seed": 0}
    scenario = agentic_trace(args.requests, vocab_size=vocab_size(model))
    overrides = {mode: {"ttft_slo_s": TTFT_SLO_S} for mode in LABELS}
    if args.kill_md_after is not None:
        overrides["pdd"]["kill_md_after_s"] = args.kill_md_after
    bars: dict[str, tqdm] = {}

    def progress(mode: str, done: int) -> None:
        if mode not in bars:
            bars[mode] = tqdm(total=scenario.num_requests, desc=f"{LABELS[mode]:>12}", unit="req")
        bars[mode].update(done - bars[mode].n)
        if done == scenario.num_requests:
            bars[mode].close()

    with Network(args.bandwidth * 1e6, args.delay_ms, args.jitter_ms, force_relay=args.relay) as network:
        print(f"pddcore {__version__} demo: {scenario.num_requests} requests of an agentic trace "
              f"({len(scenario.sessions)} sessions), WAN {network.describe()}")
        print(_setup(scenario, kv_bytes_per_token(model)))
        result = run_demo(scenario, network, model=model, overrides=overrides, progress=progress)
    for bar in bars.values():
        bar.close()
    modes = list(result["metrics"])
    print()
    print(format_table([result["metrics"][m] for m in modes], [LABELS[m] for m in modes]))
    print()
    print(explain(result["metrics"]["pdd"]))
    print()
    ok = True
    for mode in modes:
        c = result["correctness"][mode]
        verdict = "PASS" if c["pass"] else "FAIL"
        ok &= c["pass"]
        detail = f"{c['identical']}/{c['requests']} requests identical to the single-process greedy decode"
        if not c["pass"]:
            detail += f" (agreement {100 * c['agreement']:.2f}%, first divergences {c['divergent'][:3]})"
        print(f"correctness {LABELS[mode]:>12}: {verdict}  {detail}")
    result["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result["machine"] = f"{platform.node()} {platform.machine()} {platform.processor() or ''}".strip()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot_ttft_cdf([result["metrics"][m] for m in modes], [LABELS[m] for m in modes], args.plot,
                      f"TTFT, {scenario.num_requests} agentic requests, WAN {args.bandwidth:g} Mbit/s "
                      f"{args.delay_ms:g} ms")
    return 0 if ok else 1
