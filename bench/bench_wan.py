"""WAN emulator: delay-line packet rate per core, and bulk TCP through a 1 Gbit/s link.

    flock /tmp/pddcore-bench.lock python -m pytest bench/bench_wan.py --benchmark-only -s

Needs root and /dev/net/tun (skipped otherwise).
"""

import pytest

from pddcore.benchmarks import wan_cases
from pddcore.testing.wan import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


@pytest.mark.parametrize("mtu", [1500, 9000])
def test_delay_line_packets_per_core(benchmark, mtu):
    result = benchmark.pedantic(wan_cases.delay_line_capacity, args=(mtu,), rounds=1, iterations=1)
    benchmark.extra_info.update(result.as_dict())
    print(f"\ndelay line, MTU {mtu}: {result.pps_per_core / 1e3:.0f} kpps per core "
          f"({result.forwarded_packets} packets in {result.cpu_seconds:.2f} CPU-s, {result.wall_seconds:.1f} s wall) "
          f"= {result.ratio_1g:.2f}x the rate of 1 Gbit/s, {result.ratio_10g:.2f}x of 10 Gbit/s")
    assert result.forwarded_packets > 0


@pytest.mark.parametrize("offload", [True, False], ids=["offload", "per-packet"])
def test_bulk_tcp_uncapped_ceiling(benchmark, offload):
    result = benchmark.pedantic(wan_cases.bulk_tcp, args=(None, 0.0, 4.0, offload), rounds=1, iterations=1)
    benchmark.extra_info.update(result.as_dict())
    print(f"\nTCP, uncapped link, no delay, {'offload' if offload else 'per-packet'} "
          f"(this machine's ceiling): {result.steady_gbps:.2f} Gbit/s")
    assert result.steady_gbps > 0


@pytest.mark.parametrize("rtt_ms", [0, 50])
def test_bulk_tcp_vs_line_rate(benchmark, rtt_ms):
    result = benchmark.pedantic(wan_cases.bulk_tcp, args=("1gbit", rtt_ms / 2, 8.0), rounds=1, iterations=1)
    benchmark.extra_info.update(result.as_dict())
    print(f"\nTCP through 1 Gbit/s, RTT {rtt_ms} ms: steady {result.steady_gbps:.3f} Gbit/s = "
          f"{result.ratio:.3f}x line rate (whole run incl. slow start {result.avg_gbps:.3f} Gbit/s)")
    assert result.steady_gbps > 0
