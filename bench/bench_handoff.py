"""The PDD report's handoff microbenchmark: 100 tokens handed from RLD to MD across an
emulated WAN under background bulk traffic, (a) as their KV (pack + TransferEngine write +
unpack) against (b) as token ids plus one extend pass, beside the report's figures.
Needs root (the WAN emulator); see pddcore.benchmarks.handoff_cases.

    flock /tmp/pddcore-bench.lock python -m pytest bench/bench_handoff.py --benchmark-only -s
"""

import pytest

from pddcore.benchmarks import handoff_cases
from pddcore.testing.wan import unavailable_reason

_REASON = unavailable_reason()


@pytest.mark.skipif(_REASON is not None, reason=f"WAN emulator: {_REASON}")
@pytest.mark.parametrize("model", list(handoff_cases.MODELS))
def test_handoff_kv_vs_token_ids(benchmark, model):
    result = benchmark.pedantic(handoff_cases.handoff_case, args=(model,), kwargs={"trials": 100},
                                rounds=1, iterations=1)
    benchmark.extra_info.update(result.as_dict())
    print("\n" + handoff_cases.format_handoff(result))
    assert len(result.kv.samples_ms) == len(result.ids.samples_ms) == 100
    assert result.ids.payload_bytes < result.kv.payload_bytes
