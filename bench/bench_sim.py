"""Simulator throughput: 100k agentic requests through PDD (router, handoff policy, MD
radix cache all in the loop), events per second, as a ratio to the bare event loop
(heapq push + pop of no-op callbacks) measured in the same run.

    flock /tmp/pddcore-bench.lock python -m pytest bench/bench_sim.py --benchmark-only -s
    PDDCORE_BENCH_SIM_REQUESTS=20000 flock /tmp/pddcore-bench.lock \\
        python -m pytest bench/bench_sim.py --benchmark-only -s      # a quicker size
    python bench/bench_sim.py --requests 100000                      # without pytest
"""

from __future__ import annotations

import argparse
import os
import time

from pddcore.sim import ClusterSim, check_accounting, summarize
from pddcore.sim.engine import EventLoop
from pddcore.sim.scenarios import calibration_configs, calibration_trace

DEFAULT_REQUESTS = int(os.environ.get("PDDCORE_BENCH_SIM_REQUESTS", "100000"))


def _noop() -> None:
    pass


def bare_loop_events_per_s(events: int = 1_000_000) -> float:
    """Baseline: the same heap of timed callbacks with nothing to simulate."""
    loop = EventLoop()
    start = time.perf_counter()
    for i in range(events):
        loop.at(i * 1e-3, _noop)
    loop.run()
    return events / (time.perf_counter() - start)


def run_case(num_requests: int, scenario: str = "PDD") -> dict:
    trace = calibration_trace(num_requests)
    sim = ClusterSim(calibration_configs()[scenario])
    start = time.perf_counter()
    run = sim.run(trace)
    elapsed = time.perf_counter() - start
    check_accounting(run)
    summary = summarize(run)
    baseline = bare_loop_events_per_s()
    eps = run.events / elapsed
    return {"scenario": scenario, "requests": num_requests, "events": run.events, "seconds": elapsed,
            "events_per_s": eps, "requests_per_s": num_requests / elapsed, "bare_loop_events_per_s": baseline,
            "ratio_to_bare_loop": eps / baseline, "simulated_s": run.duration_s,
            "ttft_p90_s": summary["ttft_p90_s"], "rld_token_share": summary["rld_token_share"]}


def _table(r: dict) -> str:
    return (f"{r['scenario']}: {r['requests']} requests, {r['events']} events in {r['seconds']:.1f} s -> "
            f"{r['events_per_s']:.0f} events/s, {r['requests_per_s']:.0f} requests/s "
            f"({r['ratio_to_bare_loop']:.3f} x the bare event loop's {r['bare_loop_events_per_s']:.0f} events/s); "
            f"{r['simulated_s']:.0f} s simulated, TTFT p90 {r['ttft_p90_s']:.2f} s, "
            f"RLD share {r['rld_token_share']:.1%}")


def test_sim_100k_requests(benchmark):
    result = benchmark.pedantic(run_case, args=(DEFAULT_REQUESTS,), rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print("\n" + _table(result))
    assert result["events"] > DEFAULT_REQUESTS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    parser.add_argument("--scenario", default="PDD", choices=list(calibration_configs()))
    args = parser.parse_args()
    print(_table(run_case(args.requests, args.scenario)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
