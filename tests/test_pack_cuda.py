"""CUDA pack/unpack: one kernel, device or pinned-host buffers. Skips without a GPU."""

from __future__ import annotations

import pytest
import torch

from pddcore import KVLayout, PackPlan, _C, pack, unpack

from test_pack import make_pool, reference_pack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
    pytest.mark.skipif(not _C.cuda_compiled(), reason="pddcore was built without CUDA"),
]


def to_cuda(k, v):
    return [t.cuda() for t in k], None if v is None else [t.cuda() for t in v]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", [None, (1, 3)])
def test_cuda_pack_matches_cpu_reference(dtype, page_size, heads):
    k, v = make_pool(3, 41, page_size, 4, 24, dtype)
    ck, cv = to_cuda(k, v)
    layout = KVLayout.from_tensors(ck, cv)
    ids = torch.tensor([40, 3, 4, 5, 5, 0, 17], dtype=torch.int64)
    got = pack(layout, ids.cuda(), heads=heads)
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), reference_pack(k, v, ids, heads=heads))


def test_cuda_pack_into_pinned_host_and_unpack_from_it():
    k, v = make_pool(2, 33, 16, 8, 128, torch.float16)
    ck, cv = to_cuda(k, v)
    layout = KVLayout.from_tensors(ck, cv)
    ids = torch.arange(5, 30)
    host = torch.empty(layout.packed_nbytes(len(ids)), dtype=torch.uint8).pin_memory()
    pack(layout, ids, out=host)
    torch.cuda.synchronize()
    assert torch.equal(host, reference_pack(k, v, ids))

    dk, dv = to_cuda(*make_pool(2, 33, 16, 8, 128, torch.float16, seed=9))
    dst = KVLayout.from_tensors(dk, dv)
    unpack(dst, torch.arange(len(ids)), host)
    torch.cuda.synchronize()
    for a, b in zip(ck + cv, dk + dv):
        assert torch.equal(a[ids].cpu(), b[: len(ids)].cpu())


def test_cuda_rejects_pageable_host_buffer():
    k, v = to_cuda(*make_pool(1, 4, 1, 2, 8, torch.float32))
    layout = KVLayout.from_tensors(k, v)
    with pytest.raises(ValueError, match="pageable"):
        pack(layout, torch.tensor([0]), out=torch.empty(layout.packed_nbytes(1), dtype=torch.uint8))


@pytest.mark.parametrize("kind", ["hnd", "kv_rows_nhd", "kv_rows_hnd"])
@pytest.mark.parametrize("heads", [None, (1, 2)])
def test_cuda_pack_of_strided_cells_matches_cpu(kind, heads):
    from test_pack import strided_pool

    k, v = strided_pool(kind, 2, 9, 5, 3, 8, torch.bfloat16, seed=4)
    ids = torch.tensor([8, 0, 1, 2, 6], dtype=torch.int64)
    want = pack(KVLayout.from_tensors(k, v), ids, heads=heads)
    ck, cv = strided_pool(kind, 2, 9, 5, 3, 8, torch.bfloat16, seed=4, device="cuda")
    layout = KVLayout.from_tensors(ck, cv)
    pinned = torch.empty(want.numel(), dtype=torch.uint8, pin_memory=True)
    pack(layout, ids, heads=heads, out=pinned)
    torch.cuda.synchronize()
    assert torch.equal(pinned, want)


def test_tcp_engine_refuses_device_memory():
    from pddcore import TransferEngine

    t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    with TransferEngine() as engine:
        with pytest.raises(ValueError, match="GPU memory"):
            engine.register_pointer(t.data_ptr(), t.numel())
        with pytest.raises(ValueError, match="CPU tensors"):
            engine.register(t)
        assert not engine.regions()
        host = torch.zeros(1 << 20, dtype=torch.uint8, pin_memory=True)
        assert engine.register(host).nbytes == host.numel()  # pinned host memory is fine


def test_cuda_plan_runs_on_a_non_default_stream_and_in_a_cuda_graph():
    k, v = make_pool(2, 40, 16, 4, 64, torch.bfloat16, seed=3)
    ck, cv = to_cuda(k, v)
    plan = PackPlan(KVLayout.from_tensors(ck, cv), torch.tensor([9, 2, 3, 4, 31]))
    out = torch.zeros(plan.nbytes, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan.pack(out=out)
    side.synchronize()
    assert torch.equal(out.cpu(), reference_pack(k, v, torch.tensor([9, 2, 3, 4, 31])))

    graph = torch.cuda.CUDAGraph()
    out.zero_()
    with torch.cuda.graph(graph):
        plan.pack(out=out)
    for t in ck + cv:
        t.add_(1)  # the replay must read the pool as it is then
    graph.replay()
    torch.cuda.synchronize()
    want = reference_pack([t.cpu() for t in ck], [t.cpu() for t in cv], torch.tensor([9, 2, 3, 4, 31]))
    assert torch.equal(out.cpu(), want)
