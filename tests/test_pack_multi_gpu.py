"""CUDA pack/unpack on a machine with two GPUs: the launch runs on the layout's device.

Marked `gpu` only where there are two devices, so tests/gpu/run.sh (which fails any `gpu`
test that skips) runs it on a two-GPU machine and leaves it out on a one-GPU one.
"""

from __future__ import annotations

import pytest
import torch

from pddcore import KVLayout, _C, pack, unpack

from test_pack import make_pool, reference_pack

TWO_GPUS = torch.cuda.device_count() >= 2
pytestmark = [
    *([pytest.mark.gpu] if TWO_GPUS else []),
    pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices"),
    pytest.mark.skipif(not _C.cuda_compiled(), reason="pddcore was built without CUDA"),
]


def test_cuda_pack_runs_on_the_layout_device_not_the_current_one():
    """A decode rank on GPU 1 whose thread's current device is GPU 0 (issue 24 item 2)."""
    k, v = make_pool(2, 20, 16, 4, 64, torch.float16, seed=5)
    dk, dv = [t.to("cuda:1") for t in k], [t.to("cuda:1") for t in v]
    torch.cuda.set_device(0)
    layout = KVLayout.from_tensors(dk, dv)
    ids = torch.tensor([3, 4, 5, 11])
    host = torch.empty(layout.packed_nbytes(len(ids)), dtype=torch.uint8, pin_memory=True)
    pack(layout, ids, out=host)  # the legacy default stream of GPU 1, through the device guard
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert torch.equal(host, reference_pack(k, v, ids))
    zk, zv = [torch.zeros_like(t) for t in dk], [torch.zeros_like(t) for t in dv]
    unpack(KVLayout.from_tensors(zk, zv), ids, host)
    torch.cuda.synchronize(1)
    for a, b in zip(dk + dv, zk + zv):
        assert torch.equal(a[ids].cpu(), b[ids].cpu())
    with pytest.raises(ValueError, match="is on cuda:0 but the layout is on cuda:1"):
        pack(layout, ids, out=torch.empty(host.numel(), dtype=torch.uint8, device="cuda:0"))
