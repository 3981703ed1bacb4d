"""RadixCache insert and match throughput on agentic traffic, as a ratio to a hash-chain
prefix cache (vLLM-style: one dict entry per page keyed by the hash of all tokens up to
it, per-page LRU) measured on the same requests in the same run.

Workload: requests of 8K-64K tokens; 90 % of each request is a prefix of one of a few
long shared contexts (agent sessions, system prompts), the last 10 % is new. Each
request does what MD does: match, lock, evict what the new pages need, insert, unlock.

    flock /tmp/pddcore-bench.lock python -m pytest bench/bench_radix.py --benchmark-only -s
    PDDCORE_BENCH_RADIX_REQUESTS=10000 flock /tmp/pddcore-bench.lock \\
        python -m pytest bench/bench_radix.py --benchmark-only -s        # the full size
    python bench/bench_radix.py --requests 10000 --page-size 16          # without pytest
"""

from __future__ import annotations

import argparse
import os

import pytest

from pddcore.benchmarks.radix_cases import run_case

DEFAULT_REQUESTS = int(os.environ.get("PDDCORE_BENCH_RADIX_REQUESTS", "2000"))


@pytest.mark.parametrize("page_size", [16, 64])
def test_radix_vs_hash_chain(benchmark, page_size):
    result = benchmark.pedantic(run_case, args=(DEFAULT_REQUESTS, page_size), rounds=1, iterations=1)
    benchmark.extra_info.update(result.as_dict())
    print("\n" + result.table())
    # Both caches see the same requests with the same capacity; any real prefix cache must
    # reuse most of a 90 %-shared workload.
    assert result.radix_hit_rate > 0.5 and result.radix_match_ops_s > 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--capacity-tokens", type=int, default=2_000_000)
    args = parser.parse_args()
    print(run_case(args.requests, args.page_size, args.capacity_tokens).table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
