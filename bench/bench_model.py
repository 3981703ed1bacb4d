"""The reference model's handoff recompute: one extend pass over N tokens against the
N decode steps that produced them (the baseline, measured in the same run), on the
embedded float64 CPU model.

    flock /tmp/pddcore-bench.lock python -m pytest bench/bench_model.py --benchmark-only -s
"""

from __future__ import annotations

import pytest
import torch

from pddcore.benchmarks.extend_cases import extend_vs_decode_steps
from pddcore.model import Model


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: extra OpenMP threads only contend on a small CPU
    yield Model.default(seed=0)
    torch.set_num_threads(threads)


def run_case(model: Model, prefix_len: int, new_tokens: int) -> dict:
    return extend_vs_decode_steps(model, prefix_len, new_tokens).as_dict()


@pytest.mark.parametrize("new_tokens", [16, 100])
@pytest.mark.parametrize("prefix_len", [512, 2048])
def test_extend_vs_decode_steps(benchmark, model, prefix_len, new_tokens):
    result = benchmark.pedantic(run_case, args=(model, prefix_len, new_tokens), rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print(f"\nprefix {prefix_len:5d}, {new_tokens:3d} tokens: {new_tokens} decode steps {result['decode_steps_s'] * 1e3:8.1f} ms,"
          f" one extend {result['extend_s'] * 1e3:7.1f} ms  -> x{result['speedup']:.1f}")
    assert result["speedup"] > 0
