"""Recompute kernels: tokens/s as ratios to baselines measured in the same run.

    flock /tmp/pddcore-bench.lock python -m pytest bench/bench_kernels.py --benchmark-only -s

GPU cases (skip without CUDA): a 100-token extend over 8K and 64K prefixes, and a decode
step over the same contexts, each with the Triton kernel, the torch reference on the GPU,
and torch's scaled_dot_product_attention over KV gathered from the pool (gather included,
as an engine without a paged kernel would have to). CPU case: the torch reference (the
CPU execution path) against the same SDPA baseline.

``test_memory_bandwidth_gpu``: pack, unpack, extend and decode as memory-bound kernels,
their bytes moved per second as a fraction of a device-to-device ``copy_`` in the same
run and of the GPU's peak memory bandwidth (from its memory clock and bus width; SGLang's
KV scatter reaches 0.87 of H200 HBM). Each runs from its plan, as in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import pytest
import torch
import torch.nn.functional as F

import pddcore
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


def _peak_bandwidth(device: torch.device) -> float | None:
    """Bytes/s the GPU's memory moves at most (double data rate x bus width), if torch says."""
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None


def run_bandwidth_case(device: torch.device, *, total_bytes=1 << 30, requests=8, context=65536, new=100,
                       heads=32, kv_heads=8, dim=128) -> dict:
    """Bytes/s of each kernel (bytes read + written) against copy_ of the same bytes."""
    tokens, heads_dim = 16, (8, 128)  # vLLM-style 32 KiB bf16 pages
    page_bytes = tokens * heads_dim[0] * heads_dim[1] * 2
    pages = total_bytes // (2 * page_bytes)  # pack moves half the pool's pages, K and V of one layer
    k_pool = torch.randn(2 * pages, tokens, *heads_dim, dtype=torch.bfloat16, device=device)
    v_pool = torch.randn_like(k_pool)
    layout = pddcore.KVLayout.from_tensors([k_pool], [v_pool])
    plan = pddcore.PackPlan(layout, torch.randperm(2 * pages, device=device)[:pages])
    buf = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
    src = torch.empty_like(buf)
    moved = 2 * plan.nbytes  # read once, written once
    seconds = {"copy_": _timed(lambda: buf.copy_(src), device), "pack": _timed(lambda: plan.pack(out=buf), device),
               "unpack": _timed(lambda: plan.unpack(buf), device)}
    nbytes = dict.fromkeys(seconds, moved)
    del k_pool, v_pool, layout, plan, buf, src

    w = Workload.build(requests, context, 1, heads, kv_heads, dim, torch.bfloat16, device)
    o = torch.empty_like(w.q)
    decode = K.DecodePlan(w.kv_indptr, w.kv_indices, w.k_pool, num_heads=heads)
    seconds["decode"] = _timed(lambda: decode.run(w.q, w.k_pool, w.v_pool, o), device)
    kv_bytes = 2 * requests * context * kv_heads * dim * 2
    nbytes["decode"] = kv_bytes
    del w, o, decode
    w = Workload.build(1, context, new, heads, kv_heads, dim, torch.bfloat16, device)
    o = torch.empty_like(w.q)
    extend = K.ExtendPlan(w.qo_indptr, w.kv_indptr, w.kv_indices, w.k_pool, num_heads=heads)
    seconds["extend"] = _timed(lambda: extend.run(w.q, w.k, w.v, o, w.k_pool, w.v_pool), device)
    nbytes["extend"] = kv_bytes // requests
    gbps = {name: nbytes[name] / s / 1e9 for name, s in seconds.items()}
    peak = _peak_bandwidth(device)
    return {"gbps": gbps, "of_copy": {name: g / gbps["copy_"] for name, g in gbps.items()},
            "of_peak": {name: g * 1e9 / peak for name, g in gbps.items()} if peak else None,
            "peak_gbps": peak / 1e9 if peak else None, "device": torch.cuda.get_device_name(device)}


@needs_cuda
def test_memory_bandwidth_gpu(benchmark):
    result = benchmark.pedantic(run_bandwidth_case, args=(torch.device("cuda"),), rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    peak = result["peak_gbps"]
    print(f"\n{result['device']}, peak memory bandwidth {f'{peak:.0f} GB/s' if peak else 'unknown'}")
    for name, g in result["gbps"].items():
        of_peak = f"{result['of_peak'][name]:6.2f} of peak" if peak else ""
        print(f"  {name:8s} {g:8.0f} GB/s  {result['of_copy'][name]:6.2f} of copy_  {of_peak}")
    assert all(g > 0 for g in result["gbps"].values())
