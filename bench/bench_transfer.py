"""TransferEngine throughput against a raw-socket baseline on loopback, and through the
WAN emulator against the line rate, with priority-lane latency under load.

    flock /tmp/pddcore-bench.lock python -m pytest bench/bench_transfer.py --benchmark-only -s
"""

import pytest

from pddcore.benchmarks import transfer_cases
from pddcore.testing.wan import unavailable_reason


def test_loopback_vs_raw_socket(benchmark):
    results = benchmark.pedantic(transfer_cases.loopback_matrix, rounds=1, iterations=1)
    benchmark.extra_info["cases"] = [r.as_dict() for r in results]
    print("\n" + transfer_cases.format_loopback(results))
    assert all(r.engine_gbps > 0 and r.raw_gbps > 0 for r in results)


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"WAN emulator: {unavailable_reason()}")
@pytest.mark.parametrize("delay_ms", [0, 25], ids=["rtt0ms", "rtt50ms"])
def test_wan_64k_pieces_vs_line_rate(benchmark, delay_ms):
    result = benchmark.pedantic(transfer_cases.wan_case, kwargs={"rate": "1gbit", "delay_ms": delay_ms},
                                rounds=1, iterations=1)
    benchmark.extra_info.update(result.as_dict())
    print("\n" + transfer_cases.format_wan(result))
    assert result.goodput_gbps > 0
