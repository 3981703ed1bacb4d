"""Recompute kernels: tokens/s as ratios to baselines measured in the same run.

    flock /tmp/pddcore-bench.lock python -m pytest bench/bench_kernels.py --benchmark-only -s

GPU cases (skip without CUDA): a 100-token extend over 8K and 64K prefixes, and a decode
step over the same contexts, each with the Triton kernel, the torch reference on the GPU,
and torch's scaled_dot_product_attention over KV gathered from the pool (gather included,
as an engine without a paged kernel would have to). CPU case: the torch reference (the
CPU execution path) against the same SDPA baseline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import pytest
import torch
import torch.nn.functional as F

import pddcore.kernels as K
from pddcore.benchmarks.timing import best_seconds
from pddcore.kernels import reference
from pddcore.kernels._checks import check_decode, check_extend

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Triton kernels)")


@dataclass
class Workload:
    """Pool, prefix slots and new tokens of a batch of requests with equal lengths."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor

    @staticmethod
    def build(requests, prefix, new, heads, kv_heads, dim, dtype, device) -> "Workload":
        slots = requests * prefix
        pool_shape = (slots + 1, kv_heads, dim)
        gen = dict(dtype=dtype, device=device)
        return Workload(
            q=torch.randn(requests * new, heads, dim, **gen), k=torch.randn(requests * new, kv_heads, dim, **gen),
            v=torch.randn(requests * new, kv_heads, dim, **gen),
            k_pool=torch.randn(pool_shape, **gen), v_pool=torch.randn(pool_shape, **gen),
            qo_indptr=torch.arange(0, requests * new + 1, new, device=device),
            kv_indptr=torch.arange(0, slots + 1, prefix, device=device),
            kv_indices=torch.randperm(slots, device=device))  # scattered slots, as in a long-lived pool

    def extend_args(self, o):
        return (self.q, self.k, self.v, o, self.k_pool, self.v_pool, self.qo_indptr, self.kv_indptr, self.kv_indices)


def sdpa_extend(w: Workload, o: torch.Tensor) -> None:
    """Baseline: gather each request's prefix, append the new tokens, masked SDPA."""
    qo, kv = w.qo_indptr.tolist(), w.kv_indptr.tolist()
    for i in range(len(qo) - 1):
        new = slice(qo[i], qo[i + 1])
        prefix = w.kv_indices[kv[i]:kv[i + 1]]
        k = torch.cat([w.k_pool[prefix], w.k[new]]).transpose(0, 1)
        v = torch.cat([w.v_pool[prefix], w.v[new]]).transpose(0, 1)
        num_q, num_k = qo[i + 1] - qo[i], k.shape[1]
        visible = torch.ones(num_q, num_k, dtype=torch.bool, device=o.device).tril(num_k - num_q)
        o[new] = F.scaled_dot_product_attention(w.q[new].transpose(0, 1), k, v, attn_mask=visible,
                                                enable_gqa=True).transpose(0, 1)


def sdpa_decode(w: Workload, o: torch.Tensor) -> None:
    kv = w.kv_indptr.tolist()
    for i in range(len(kv) - 1):
        slots = w.kv_indices[kv[i]:kv[i + 1]]
        o[i] = F.scaled_dot_product_attention(w.q[i:i + 1].transpose(0, 1), w.k_pool[slots].transpose(0, 1),
                                              w.v_pool[slots].transpose(0, 1), enable_gqa=True)[:, 0]


@dataclass
class KernelResult:
    case: str
    new_tokens: int
    seconds: dict

    def as_dict(self) -> dict:
        base = self.seconds["sdpa_gathered"]
        return {**asdict(self), "tokens_per_s": {name: self.new_tokens / s for name, s in self.seconds.items()},
                "speedup_vs_sdpa_gathered": {name: base / s for name, s in self.seconds.items()}}

    def table(self) -> str:
        base = self.seconds["sdpa_gathered"]
        rows = [f"  {name:16s} {self.new_tokens / s:14.0f} tok/s   x{base / s:6.2f} vs SDPA(gathered)"
                for name, s in self.seconds.items()]
        return "\n".join([f"{self.case}:", *rows])


def _timed(fn, device) -> float:
    if device.type == "cuda":
        return best_seconds(lambda: (fn(), torch.cuda.synchronize()), repeats=10, warmup=3)
    return best_seconds(fn, repeats=3)


def run_extend_case(prefix: int, device: torch.device, *, requests=1, new=100, heads=32, kv_heads=8, dim=128,
                    dtype=torch.bfloat16) -> KernelResult:
    w = Workload.build(requests, prefix, new, heads, kv_heads, dim, dtype, device)
    o = torch.empty_like(w.q)
    batch = check_extend(*w.extend_args(o), None, -1, 0.0)
    seconds = {"sdpa_gathered": _timed(lambda: sdpa_extend(w, o), device)}
    expected = o.clone()
    seconds["torch_reference"] = _timed(lambda: reference.extend_attention(
        w.q, w.k, w.v, o, w.k_pool, w.v_pool, w.kv_indices, batch, causal=True, sliding_window=-1, logit_cap=0.0),
        device)
    if device.type == "cuda":  # on CPU pddcore dispatches to the reference timed above
        seconds["pddcore"] = _timed(lambda: K.extend_attention(*w.extend_args(o)), device)
    tolerance = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
    torch.testing.assert_close(o, expected, atol=tolerance, rtol=tolerance)
    return KernelResult(f"extend {requests}x{new} tokens over {prefix} prefix, {dtype}, {device.type}",
                        requests * new, seconds)


def run_decode_case(context: int, device: torch.device, *, requests=8, heads=32, kv_heads=8, dim=128,
                    dtype=torch.bfloat16) -> KernelResult:
    w = Workload.build(requests, context, 1, heads, kv_heads, dim, dtype, device)
    o = torch.empty_like(w.q)
    batch = check_decode(w.q, w.k_pool, w.v_pool, o, w.kv_indptr, w.kv_indices, None, -1, 0.0)
    seconds = {"sdpa_gathered": _timed(lambda: sdpa_decode(w, o), device)}
    expected = o.clone()
    seconds["torch_reference"] = _timed(lambda: reference.decode_attention(
        w.q, w.k_pool, w.v_pool, o, w.kv_indices, batch, sliding_window=-1, logit_cap=0.0), device)
    if device.type == "cuda":
        seconds["pddcore"] = _timed(lambda: K.decode_attention(w.q, w.k_pool, w.v_pool, o, w.kv_indptr,
                                                               w.kv_indices), device)
    torch.testing.assert_close(o, expected, atol=2e-2, rtol=2e-2)
    return KernelResult(f"decode {requests} requests x {context} context, {dtype}, {device.type}", requests, seconds)


def _record(benchmark, result: KernelResult) -> None:
    benchmark.extra_info.update(result.as_dict())
    print("\n" + result.table())


@needs_cuda
@pytest.mark.parametrize("prefix", [8192, 65536], ids=["8K", "64K"])
def test_extend_gpu(benchmark, prefix):
    result = benchmark.pedantic(run_extend_case, args=(prefix, torch.device("cuda")), rounds=1, iterations=1)
    _record(benchmark, result)
    assert all(s > 0 for s in result.seconds.values())


@needs_cuda
@pytest.mark.parametrize("context", [8192, 65536], ids=["8K", "64K"])
def test_decode_gpu(benchmark, context):
    result = benchmark.pedantic(run_decode_case, args=(context, torch.device("cuda")), rounds=1, iterations=1)
    _record(benchmark, result)
    assert all(s > 0 for s in result.seconds.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_extend_reference_cpu(benchmark, dtype):
    """The CPU execution path: the torch reference (the Triton kernel does not run on CPU)."""
    result = benchmark.pedantic(
        run_extend_case, args=(2048, torch.device("cpu")),
        kwargs=dict(requests=2, new=100, heads=8, kv_heads=2, dim=64, dtype=dtype),
        rounds=1, iterations=1)
    _record(benchmark, result)
    assert all(s > 0 for s in result.seconds.values())


def test_decode_reference_cpu(benchmark):
    result = benchmark.pedantic(
        run_decode_case, args=(2048, torch.device("cpu")),
        kwargs=dict(requests=4, heads=8, kv_heads=2, dim=64, dtype=torch.float64), rounds=1, iterations=1)
    _record(benchmark, result)
    assert all(s > 0 for s in result.seconds.values())
