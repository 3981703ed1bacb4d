"""pack / unpack with order="pool": whole pages as they lie in the pool, between pools of one
page format. Checked against torch's view of the same pools: vLLM 0.33's rows (K and V
halves alternating, token-major and head-major) move as one span per page, separate K and
V planes (dense or head-major) plane by plane; a pool of another format is refused with
nothing written."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pddcore import KVLayout, pack, unpack
from test_pack import KINDS, strided_pool


def pool_order_reference(kind: str, k: list[torch.Tensor], v: list[torch.Tensor], ids: torch.Tensor,
                         layers=None) -> torch.Tensor:
    """The pages' bytes as the pool holds them, from the tensors' own memory layout:
    token-major pages are [tokens, heads, dim] per plane, head-major [heads, tokens, dim];
    vLLM rows put each K cell right before its V cell."""
    out = []
    for l in (range(len(k)) if layers is None else layers):
        if kind.startswith("kv_rows"):
            rows = torch.cat([k[l], v[l]], dim=-1)  # [pages, tokens, heads, 2 dim]
            pages = rows.permute(0, 2, 1, 3) if kind.endswith("hnd") else rows
            out.append(pages[ids].contiguous().reshape(-1).view(torch.uint8))
        else:
            for plane in (k[l], v[l]):
                pages = plane.permute(0, 2, 1, 3) if kind == "hnd" else plane
                out.append(pages[ids].contiguous().reshape(-1).view(torch.uint8))
    return torch.cat(out) if out else torch.empty(0, dtype=torch.uint8)


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(KINDS), num_pages=st.integers(1, 9), page_size=st.sampled_from([1, 2, 5, 16]),
       heads=st.integers(1, 5), dim=st.sampled_from([1, 3, 8]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       data=st.data())
def test_pool_order_moves_pages_as_they_lie(kind, num_pages, page_size, heads, dim, dtype, data):
    k, v = strided_pool(kind, 3, num_pages, page_size, heads, dim, dtype, seed=1)
    src = KVLayout.from_tensors(k, v)
    ids = torch.tensor(data.draw(st.lists(st.integers(0, num_pages - 1), max_size=7)), dtype=torch.int64)
    layers = data.draw(st.sampled_from([None, [2, 0], [1]]))
    buf = pack(src, ids, layers=layers, order="pool")
    assert torch.equal(buf, pool_order_reference(kind, k, v, ids, layers))
    assert buf.numel() == src.packed_nbytes(len(ids), layers)

    # A pool of the same format, other contents and size, takes them page for page.
    dk, dv = strided_pool(kind, 3, len(ids) + 2, page_size, heads, dim, dtype, seed=2)
    dst = KVLayout.from_tensors(dk, dv)
    assert dst.pool_page_format == src.pool_page_format
    before = [t.clone() for t in dk + dv]
    dst_ids = torch.arange(1, len(ids) + 1)
    unpack(dst, dst_ids, buf, layers=layers, order="pool", page_format=src.pool_page_format)
    for l in range(3):
        for got, was, orig in ((dk[l], before[l], k[l]), (dv[l], before[3 + l], v[l])):
            if layers is None or l in layers:
                # Pages in id order; a repeated id lands its (equal) bytes on each of its slots.
                assert torch.equal(got[dst_ids], orig[ids])
            else:
                assert torch.equal(got[dst_ids], was[dst_ids])
            assert torch.equal(got[0], was[0]) and torch.equal(got[len(ids) + 1:], was[len(ids) + 1:])


def test_vllm_rows_move_as_one_span_per_page():
    # One layer of vLLM 0.33 rows: K and V together tile each page.
    k, v = strided_pool("kv_rows_nhd", 1, 4, 16, 8, 128, torch.float16, seed=3)
    fmt = KVLayout.from_tensors(k, v).pool_page_format
    assert len(fmt) == 1 and [p[:3] for p in fmt[0]] == [(0, 0, 0), (0, 1, 256)]
    # Separate dense planes: one span each.
    k, v = strided_pool("nhd", 1, 4, 16, 8, 128, torch.float16, seed=3)
    assert [[p[:3] for p in span] for span in KVLayout.from_tensors(k, v).pool_page_format] == [[(0, 0, 0)],
                                                                                              [(0, 1, 0)]]


def test_a_pool_of_another_format_is_refused_and_untouched():
    k, v = strided_pool("kv_rows_nhd", 2, 4, 2, 3, 8, torch.float32, seed=4)
    src = KVLayout.from_tensors(k, v)
    buf = pack(src, torch.tensor([3, 1]), order="pool")
    for kind in ("nhd", "hnd", "kv_rows_hnd"):
        dk, dv = strided_pool(kind, 2, 4, 2, 3, 8, torch.float32, seed=5)
        dst = KVLayout.from_tensors(dk, dv)
        before = [t.clone() for t in dk + dv]
        with pytest.raises(ValueError, match="page_format differs"):
            unpack(dst, torch.tensor([0, 1]), buf, order="pool", page_format=src.pool_page_format)
        assert all(torch.equal(a, b) for a, b in zip(dk + dv, before))


def test_bad_pool_order_arguments():
    k, v = strided_pool("kv_rows_nhd", 1, 4, 2, 3, 8, torch.float32, seed=6)
    layout = KVLayout.from_tensors(k, v)
    ids = torch.tensor([0, 1])
    buf = pack(layout, ids, order="pool")
    with pytest.raises(ValueError, match="heads= does not apply"):
        pack(layout, ids, heads=(0, 1), order="pool")
    with pytest.raises(ValueError, match="needs page_format"):
        unpack(layout, ids, buf, order="pool")
    with pytest.raises(ValueError, match="order must be"):
        pack(layout, ids, order="native")
    with pytest.raises(ValueError, match="applies to order='pool' only"):
        unpack(layout, ids, buf, page_format=layout.pool_page_format)
    with pytest.raises(ValueError, match="buffer too small"):
        unpack(layout, ids, buf[:-1], order="pool", page_format=layout.pool_page_format)


def test_planes_with_gaps_have_no_pool_order():
    # K and V take two thirds of each row; the last third belongs to neither.
    rows = torch.randn(4, 2, 3, 24)
    k, v = [rows[..., :8]], [rows[..., 8:16]]
    layout = KVLayout.from_tensors(k, v)
    with pytest.raises(ValueError, match="leave gaps"):
        layout.pool_page_format
    with pytest.raises(ValueError, match="leave gaps"):
        pack(layout, torch.tensor([0]), order="pool")
