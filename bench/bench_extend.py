"""Extend recompute time against the number of handed-off tokens (1 to 512), each point
as a ratio to the decode steps that produced the same tokens, on the embedded model.

    flock /tmp/pddcore-bench.lock python -m pytest bench/bench_extend.py --benchmark-only -s
"""

from pddcore.benchmarks import extend_cases


def test_extend_time_vs_tokens(benchmark):
    results = benchmark.pedantic(extend_cases.extend_sweep, rounds=1, iterations=1)
    benchmark.extra_info["points"] = [r.as_dict() for r in results]
    print("\n" + extend_cases.format_extend(results))
    assert [r.new_tokens for r in results] == list(extend_cases.TOKENS)
    assert all(r.extend_s > 0 and r.decode_steps_s > 0 for r in results)
