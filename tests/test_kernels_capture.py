"""Kernels ready for CUDA graphs and torch.compile, checked on CPU.

A plan reads the batch's index tensors back to the host once; its runs read nothing back
(so nothing in them synchronises with the GPU), and under torch.compile every launch is a
``torch.ops.pddcore`` custom op with a fake implementation, so ``torch.compile`` keeps a
whole decode step in one graph. The compile uses the ``aot_eager`` backend: it traces the
ops through their fake implementations and functionalizes their writes as inductor does,
without inductor's minute of C++ compilation on this machine.
"""

from __future__ import annotations

import pytest
import torch

import pddcore
import pddcore.kernels as K
from pddcore.pack import PackPlan

LAYERS, PAGE, HKV, HEADS, DIM = 2, 4, 2, 4, 16
KV_LENS = [5, 9, 3]


class Step:
    """A decode step of a toy model over a paged pool: per layer store the new token and
    attend, then ship three pages to a second pool (pack, unpack)."""

    def __init__(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.k_pool = [torch.randn(16, PAGE, HKV, DIM, generator=gen) for _ in range(LAYERS)]
        self.v_pool = [torch.randn(16, PAGE, HKV, DIM, generator=gen) for _ in range(LAYERS)]
        self.dst_k = [torch.zeros_like(t) for t in self.k_pool]
        self.dst_v = [torch.zeros_like(t) for t in self.v_pool]
        kv_indptr = torch.tensor([0] + KV_LENS).cumsum(0)
        kv_indices = torch.randperm(16 * PAGE, generator=gen)[:int(kv_indptr[-1])]
        self.store = K.StorePlan(kv_indices[kv_indptr[1:] - 1], self.k_pool[0])
        self.decode = K.DecodePlan(kv_indptr, kv_indices, self.k_pool[0], num_heads=HEADS, sliding_window=6)
        self.pack = PackPlan(pddcore.KVLayout.from_tensors(self.k_pool, self.v_pool), torch.tensor([3, 0, 7]))
        self.unpack = PackPlan(pddcore.KVLayout.from_tensors(self.dst_k, self.dst_v), torch.tensor([1, 2, 3]))
        self.buf = torch.empty(self.pack.nbytes, dtype=torch.uint8)

    def __call__(self, q, k, v):
        outs = []
        for layer in range(LAYERS):
            self.store.run(k[layer], v[layer], self.k_pool[layer], self.v_pool[layer])
            o = torch.empty_like(q[layer])
            self.decode.run(q[layer], self.k_pool[layer], self.v_pool[layer], o)
            outs.append(o)
        self.unpack.unpack(self.pack.pack(out=self.buf))
        return torch.stack(outs) * 2


def step_inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    batch = len(KV_LENS)
    return (torch.randn(LAYERS, batch, HEADS, DIM, generator=gen), torch.randn(LAYERS, batch, HKV, DIM, generator=gen),
            torch.randn(LAYERS, batch, HKV, DIM, generator=gen))


def test_decode_step_compiles_to_one_graph_with_the_custom_ops():
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.compilers import nop
        return aot_autograd(fw_compiler=nop)(gm, example_inputs)

    eager, compiled = Step(seed=1), Step(seed=1)
    inputs = step_inputs(2)
    want = eager(*inputs)
    got = torch.compile(compiled, fullgraph=True, backend=recording_backend)(*inputs)

    assert len(graphs) == 1
    called = {str(node.target).removesuffix(".default") for node in graphs[0].graph.nodes
              if node.op == "call_function"}
    assert {"pddcore.store_kv", "pddcore.decode_attention", "pddcore.pack", "pddcore.unpack"} <= called
    assert torch.equal(got, want)
    for a, b in zip(compiled.k_pool + compiled.v_pool + compiled.dst_k + compiled.dst_v,
                    eager.k_pool + eager.v_pool + eager.dst_k + eager.dst_v):
        assert torch.equal(a, b)
    assert torch.equal(compiled.dst_k[0][1:4], compiled.k_pool[0][[3, 0, 7]])


def test_extend_compiles_to_one_graph():
    gen = torch.Generator().manual_seed(3)
    k_pool, v_pool = torch.randn(32, HKV, DIM, generator=gen), torch.randn(32, HKV, DIM, generator=gen)
    plan = K.ExtendPlan(torch.tensor([0, 2, 5]), torch.tensor([0, 4, 10]), torch.randperm(32, generator=gen)[:10],
                        k_pool, num_heads=HEADS, logit_cap=3.0)
    q, k, v = (torch.randn(5, h, DIM, generator=gen) for h in (HEADS, HKV, HKV))

    def extend(q, k, v):
        o = torch.empty_like(q)
        plan.run(q, k, v, o, k_pool, v_pool)
        return o

    want = extend(q, k, v)
    got = torch.compile(extend, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(got, want)
    expected = torch.empty_like(q)
    K.extend_attention(q, k, v, expected, k_pool, v_pool, plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                       logit_cap=3.0)
    assert torch.equal(want, expected)


READ_BACK = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


@pytest.fixture
def no_read_back(monkeypatch):
    """Makes every way a tensor's value reaches Python raise, so a sync cannot hide."""

    def forbid(name):
        def read_back(*args, **kwargs):
            raise AssertionError(f"Tensor.{name} read a value back to the host")
        return read_back

    def arm():
        for name in READ_BACK:
            monkeypatch.setattr(torch.Tensor, name, forbid(name))

    return arm


def test_plans_read_back_and_their_runs_do_not(no_read_back):
    step = Step(seed=4)
    inputs = step_inputs(5)
    want = Step(seed=4)(*inputs)
    no_read_back()
    with pytest.raises(AssertionError, match="read a value back"):  # the plans do read indptrs back...
        K.DecodePlan(step.decode.kv_indptr, step.decode.kv_indices, step.k_pool[0], num_heads=HEADS)
    assert torch.equal(step(*inputs), want)  # ...their runs never do


def test_run_rejects_a_pool_or_batch_other_than_planned():
    step = Step(seed=6)
    q, k, v = step_inputs(7)
    o = torch.zeros_like(q[0])
    with pytest.raises(ValueError, match="not the one planned"):
        step.decode.run(q[0], step.k_pool[0][:8], step.v_pool[0][:8], o)
    with pytest.raises(ValueError, match="B\\+1 = 3"):
        step.decode.run(q[0][:2], step.k_pool[0], step.v_pool[0], o[:2])
    with pytest.raises(ValueError, match="planned for|query heads"):
        step.decode.run(q[0][:, :2], step.k_pool[0], step.v_pool[0], o[:, :2])
    with pytest.raises(ValueError, match="2 entries for|3 entries for 2"):
        step.store.run(k[0][:2], v[0][:2], step.k_pool[0], step.v_pool[0])
    assert not o.any()
    with pytest.raises(ValueError, match="buffer too small"):
        step.pack.pack(out=torch.zeros(step.pack.nbytes - 1, dtype=torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_decode_step_runs_without_sync_and_replays_in_a_cuda_graph():
    pytest.importorskip("triton")
    cpu_step, gpu_step = Step(seed=8), Step(seed=8)
    cuda = torch.device("cuda")
    gpu_step.k_pool = [t.to(cuda) for t in gpu_step.k_pool]
    gpu_step.v_pool = [t.to(cuda) for t in gpu_step.v_pool]
    gpu_step.dst_k = [t.to(cuda) for t in gpu_step.dst_k]
    gpu_step.dst_v = [t.to(cuda) for t in gpu_step.dst_v]
    slots = cpu_step.store.slot_mapping.to(cuda)
    gpu_step.store = K.StorePlan(slots, gpu_step.k_pool[0])
    gpu_step.decode = K.DecodePlan(cpu_step.decode.kv_indptr.to(cuda), cpu_step.decode.kv_indices.to(cuda),
                                   gpu_step.k_pool[0], num_heads=HEADS, sliding_window=6)
    gpu_step.pack = PackPlan(pddcore.KVLayout.from_tensors(gpu_step.k_pool, gpu_step.v_pool), torch.tensor([3, 0, 7]))
    gpu_step.unpack = PackPlan(pddcore.KVLayout.from_tensors(gpu_step.dst_k, gpu_step.dst_v), torch.tensor([1, 2, 3]))
    gpu_step.buf = torch.empty(gpu_step.pack.nbytes, dtype=torch.uint8, device=cuda)
    inputs = step_inputs(9)
    want = cpu_step(*inputs)
    static = [t.to(cuda) for t in inputs]

    gpu_step(*static)  # warm-up: Triton compiles its kernels here
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation in a run raises
    try:
        gpu_step(*static)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gpu_step(*static)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), want, atol=2e-5, rtol=1e-5)
    assert torch.equal(gpu_step.dst_k[0][1:4].cpu(), gpu_step.k_pool[0][[3, 0, 7]].cpu())
