"""pack/unpack throughput as a ratio to a contiguous copy of the same bytes.

    python -m pytest bench/bench_pack.py --benchmark-only -s
"""

import pytest

from pddcore.benchmarks import pack_cases


@pytest.mark.parametrize("threads", pack_cases.THREADS)
@pytest.mark.parametrize("page_bytes", pack_cases.PAGE_BYTES, ids=lambda b: f"{b // 1024}KiB")
def test_pack_vs_copy(benchmark, page_bytes, threads):
    result = benchmark.pedantic(pack_cases.run_case, args=(page_bytes, threads), rounds=1, iterations=1)
    benchmark.extra_info.update(result.as_dict())
    print("\n" + pack_cases.format_table([result]))
    assert result.pack_gbps > 0 and result.copy_gbps > 0


@pytest.mark.parametrize("threads", pack_cases.THREADS)
def test_pack_vllm_rows_vs_copy(benchmark, threads):
    """vLLM 0.33's pages: K and V halves of every (token, head) row, 256-byte cells."""
    result = benchmark.pedantic(pack_cases.run_case, args=(0, threads), kwargs={"vllm_rows": True}, rounds=1,
                                iterations=1)
    benchmark.extra_info.update(result.as_dict())
    print("\n" + pack_cases.format_table([result]))
    assert result.pack_gbps > 0 and result.copy_gbps > 0
