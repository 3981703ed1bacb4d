"""`pddcore bench`: the microbenchmark suite on this machine, with a progress bar, a
results table (each ratio beside its in-run baseline), ``results.json`` with machine info,
and PNG plots (:mod:`pddcore.benchmarks.plots`). The cases' runners are in
:mod:`pddcore.benchmarks.runners`.

Cases (``--cases``, comma-separated; default all):

- ``pack``: pack / unpack GB/s against a contiguous copy of the same bytes.
- ``transfer``: TransferEngine against raw sockets on loopback, per chunk size and streams;
  congestion control "auto" against the better of cubic and bbr chosen by hand.
- ``wan``: TransferEngine goodput through the WAN emulator against the line rate (a plain
  TCP stream beside it), priority-lane latency under bulk load against the idle link, and
  the delay line's packets/s per core against what 1 Gbit/s needs (root only).
- ``loss``: goodput at 1 Gbit/s, 50 ms RTT with 0 / 0.01 / 0.1 / 1 % packet loss, cubic vs
  bbr, 64 KiB and 1 MiB pieces, against the line rate, beside the bandwidth-delay product;
  every row with per-packet forwarding, so the 0 % row is the same path without loss;
  "auto" beside them, against the better of the two (root only).
- ``peers``: pddcore / peer / line rate on the same emulated WAN and piece sizes, for each
  installed peer engine (Mooncake, NIXL: ``pip install 'pddcore[peers]'``) (root only).
- ``wan10g``: goodput at 10 Gbit/s, 20 and 50 ms RTT, against the line rate and against one
  plain TCP stream through the same link (what the emulator reaches here); "auto" against
  the better of cubic and bbr (root only).
- ``stream``: the end of P's prefill to the KV applied at MD over the emulated WAN, streamed
  per layer against posted after prefill (root only).
- ``handoff``: the PDD report's 100-token handoff, KV against token ids + extend (root only).
- ``extend``: one extend pass over N handed-off tokens against N decode steps, N = 1..512.
- ``radix``: RadixCache match / insert ops/s against a hash-chain prefix cache.
- ``codec``: KV codecs on real KV: ratio, encode / decode GB/s on one core against memcpy,
  FP8 error and greedy-token agreement on FP8 KV; as root, each codec end to end (encode,
  wire, decode into MD's pool) on the emulated WAN at 200 Mbit/s and 1 Gbit/s, 50 ms RTT,
  against ``none``.
- ``serve``: the same trace through ``pddcore serve`` over reference engine servers, MD across
  the emulated WAN: TTFT p50 / p90 / p99 of PDD against cross-DC PD, the handoff gap against
  the median TPOT, and the gateway's TPOT against streaming from the engine directly (root only).
- ``demo``: TTFT p50 / p90 / p99 of PDD against cross-DC PD on ``pddcore demo``'s
  deployment, scenario and link.

Example::

    pddcore bench --quick --out /tmp/bench            # about a minute
    pddcore bench --cases pack,radix --out /tmp/bench
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import traceback

from .plots import write_plots
from .results import machine_info
from .runners import CASES, RUNNERS, Row, Skipped


def format_rows(rows: list[Row]) -> str:
    lines = [f"{'case':<9}{'measurement':<46}{'value':>12} {'unit':<7}{'baseline':>12}  {'(what)':<18}{'ratio':>9}"]
    for r in rows:
        lines.append(f"{r.case:<9}{r.what[:45]:<46}{r.value:>12.4g} {r.unit:<7}{r.baseline:>12.4g}  "
                     f"{r.baseline_name[:17]:<18}{r.ratio:>8.3g}x")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small sizes and fewer points (about a minute)")
    parser.add_argument("--out", default="pddcore-bench", help="folder for results.json and the plots")
    parser.add_argument("--backend", choices=("tcp", "rdma"), default="tcp", help="transfer backend for 'transfer'")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    selected = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in selected if c not in RUNNERS]
    if unknown or not selected:
        raise SystemExit(f"pddcore bench: unknown or no cases {unknown}; choose from {','.join(CASES)}")
    os.makedirs(args.out, exist_ok=True)
    started = dt.datetime.now(dt.timezone.utc)
    load_at_start = os.getloadavg()
    cases: dict[str, dict] = {}
    texts: list[str] = []
    rows: list[Row] = []
    failed = False
    with tqdm(selected, unit="case", desc="pddcore bench") as bar:
        for name in bar:
            bar.set_postfix_str(name)
            try:
                out = RUNNERS[name](args.quick, args.backend)
            except Skipped as e:
                cases[name] = {"skipped": str(e)}
                texts.append(f"[{name}] skipped: {e}")
                continue
            except Exception as e:  # one broken case must not hide the others' results
                failed = True
                cases[name] = {"error": repr(e), "traceback": traceback.format_exc()}
                texts.append(f"[{name}] FAILED: {e!r}")
                continue
            cases[name] = out.data
            texts.append(f"[{name}]\n{out.text}")
            rows.extend(out.rows)
    try:
        plots = write_plots(cases, args.out)
    except ImportError as e:
        plots = []
        texts.append(f"[plots] not written: {e} (pip install 'pddcore[bench]' for matplotlib)")
    result = {
        "date": started.isoformat(timespec="seconds"),
        "seconds": (dt.datetime.now(dt.timezone.utc) - started).total_seconds(),
        "quick": args.quick, "backend": args.backend, "cases_selected": selected,
        "machine": machine_info(),
        "loadavg_at_start": load_at_start,
        "table": [r.as_dict() for r in rows],
        "cases": cases,
        "plots": [os.path.basename(p) for p in plots],
    }
    path = os.path.join(args.out, "results.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    m = result["machine"]
    print(f"\npddcore {m['pddcore']} bench, {result['date']}, {m['cpu_model']} ({m['usable_cpus']} usable CPUs), "
          f"torch {m['torch']}, CUDA {'yes' if m['cuda_usable'] else 'no'}, {result['seconds']:.0f} s, "
          f"load average {load_at_start[0]:.1f} -> {m['loadavg'][0]:.1f}")
    print("\n\n".join(texts))
    if rows:
        print("\nsummary (ratio = value / baseline, both measured in this run)\n" + format_rows(rows))
    print(f"\nwrote {path}" + "".join(f"\nwrote {p}" for p in plots))
    return 1 if failed else 0
