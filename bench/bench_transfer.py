"""TransferEngine throughput against a raw-socket baseline on loopback, and through the
WAN emulator against the line rate, with priority-lane latency under load; the chunk
checksum (CRC32C) against a memcpy.

    flock /tmp/pddcore-bench.lock python -m pytest bench/bench_transfer.py --benchmark-only -s

``--backend rdma`` runs the loopback matrix over RDMA (a NIC, or ``PDDCORE_VERBS=emulator``
for the verbs emulator, whose numbers measure the emulator, not hardware) and, where a NIC
exists, goodput against its line rate; the WAN cases are tcp-only.
"""

import pytest

from pddcore.benchmarks import crc_cases, rdma_cases, transfer_cases, transfer_wan_cases
from pddcore.testing.wan import unavailable_reason


@pytest.fixture
def backend(request) -> str:
    return request.config.getoption("--backend")


def test_loopback_vs_raw_socket(benchmark, backend):
    results = benchmark.pedantic(transfer_cases.loopback_matrix, kwargs={"backend": backend}, rounds=1, iterations=1)
    benchmark.extra_info["cases"] = [r.as_dict() for r in results]
    print("\n" + transfer_cases.format_loopback(results))
    assert all(r.engine_gbps > 0 and r.raw_gbps > 0 for r in results)


def test_crc32c_vs_memcpy(benchmark):
    results = benchmark.pedantic(crc_cases.crc32c_rates, rounds=1, iterations=1)
    benchmark.extra_info["cases"] = [r.as_dict() for r in results]
    print("\n" + crc_cases.format_table(results))
    assert all(r.crc_gbps > 0 and r.memcpy_gbps > 0 for r in results)


def test_rdma_vs_line_rate(benchmark, backend):
    if backend != "rdma":
        pytest.skip("run with --backend rdma")
    if rdma_cases.nic_line_rate() is None:
        pytest.skip("no RDMA NIC on this machine: no line rate to compare with")
    result = benchmark.pedantic(rdma_cases.rdma_vs_line_rate, rounds=1, iterations=1)
    benchmark.extra_info.update(result.as_dict())
    print(f"\nRDMA {result.device}: {result.goodput_gbit:.1f} Gbit/s = {result.ratio:.2f}x line rate "
          f"({result.line_gbit:.0f} Gbit/s)")
    assert result.goodput_gbit > 0


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"WAN emulator: {unavailable_reason()}")
@pytest.mark.parametrize("delay_ms", [0, 25], ids=["rtt0ms", "rtt50ms"])
def test_wan_64k_pieces_vs_line_rate(benchmark, delay_ms, backend):
    if backend != "tcp":
        pytest.skip("the WAN path is tcp")
    result = benchmark.pedantic(transfer_wan_cases.wan_case, kwargs={"rate": "1gbit", "delay_ms": delay_ms},
                                rounds=1, iterations=1)
    benchmark.extra_info.update(result.as_dict())
    print("\n" + transfer_wan_cases.format_wan(result))
    assert result.goodput_gbps > 0
