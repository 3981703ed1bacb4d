"""The SGLang-mooncake-shaped adapter moves bytes between pointer-addressed regions."""

from __future__ import annotations

import pytest
import torch

from pddcore.integrations.mooncake_compat import MooncakeCompatEngine

TOKEN = b"mooncake-adapter-9d2c5f8a1e4b7036"


@pytest.fixture
def pair():
    a = MooncakeCompatEngine("127.0.0.1", auth_token=TOKEN, timeout_s=10.0)
    b = MooncakeCompatEngine("127.0.0.1", auth_token=TOKEN, timeout_s=10.0)
    yield a, b
    a.close()
    b.close()


def test_batch_transfer_sync_lands_at_peer_addresses(pair):
    a, b = pair
    g = torch.Generator().manual_seed(0)
    src = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (4096, 1 << 20)]
    dst = [torch.zeros(n, dtype=torch.uint8) for n in (8192, 1 << 20)]
    assert a.batch_register([t.data_ptr() for t in src], [t.numel() for t in src]) == 0
    assert b.batch_register([t.data_ptr() for t in dst], [t.numel() for t in dst]) == 0
    # Page-like pieces, scattered into both destination regions.
    pieces = [(src[0].data_ptr() + 100, dst[0].data_ptr() + 5000, 3000),
              (src[1].data_ptr(), dst[1].data_ptr() + 4096, 65536),
              (src[1].data_ptr() + 65536, dst[1].data_ptr(), 4096)]
    ret = a.batch_transfer_sync(b.get_session_id(), *map(list, zip(*pieces)))
    assert ret == 0
    assert torch.equal(dst[0][5000:8000], src[0][100:3100])
    assert torch.equal(dst[1][4096:4096 + 65536], src[1][:65536])
    assert torch.equal(dst[1][:4096], src[1][65536:65536 + 4096])
    assert a.transfer_sync(b.get_session_id(), src[0].data_ptr(), dst[0].data_ptr(), 16) == 0
    assert torch.equal(dst[0][:16], src[0][:16])
    assert a.get_localhost() == "127.0.0.1"


def test_addresses_outside_regions_are_refused(pair):
    a, b = pair
    src = torch.ones(4096, dtype=torch.uint8)
    dst = torch.zeros(4096, dtype=torch.uint8)
    a.register(src.data_ptr(), 4096)
    b.register(dst.data_ptr(), 4096)
    with pytest.raises(ValueError, match="peer range"):
        a.batch_transfer_sync(b.get_session_id(), [src.data_ptr()], [dst.data_ptr() + 4000], [200])
    with pytest.raises(ValueError, match="local range"):
        a.batch_transfer_sync(b.get_session_id(), [src.data_ptr() + 4095], [dst.data_ptr()], [2])
    assert int(dst.sum()) == 0
    # Memory the peer registers later is found by refreshing its region list.
    late = torch.zeros(64, dtype=torch.uint8)
    b.register(late.data_ptr(), 64)
    assert a.transfer_sync(b.get_session_id(), src.data_ptr(), late.data_ptr(), 64) == 0
    assert int(late.sum()) == 64
    b.deregister(late.data_ptr())


def test_refused_session_returns_minus_one(pair):
    a, _ = pair
    src = torch.ones(64, dtype=torch.uint8)
    a.register(src.data_ptr(), 64)
    stranger = MooncakeCompatEngine("127.0.0.1", auth_token=b"another-mooncake-token-1a2b3c4d5e6f")
    try:
        assert a.transfer_sync(stranger.get_session_id(), src.data_ptr(), 0x1000, 64) == -1
    finally:
        stranger.close()
