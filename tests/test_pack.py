"""pack/unpack against an independent torch reference (index_select + cat)."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

import pddcore
from pddcore import KVLayout, pack, unpack

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float16]


def make_pool(num_layers, num_pages, page_size, heads, dim, dtype, mla=False, seed=0):
    g = torch.Generator().manual_seed(seed)

    def plane():
        shape = (num_pages, page_size, heads, dim) if page_size > 1 else (num_pages, heads, dim)
        if dtype.is_floating_point:
            return torch.randn(shape, generator=g).to(dtype)
        return torch.randint(-128, 127, shape, generator=g, dtype=torch.int8).to(dtype)

    k = [plane() for _ in range(num_layers)]
    v = None if mla else [plane() for _ in range(num_layers)]
    return k, v


def planes_in_order(k, v, layers):
    for layer in layers:
        yield k[layer]
        if v is not None:
            yield v[layer]


def reference_pack(k, v, ids, layers=None, heads=None):
    layers = range(len(k)) if layers is None else layers
    parts = []
    for t in planes_in_order(k, v, layers):
        sel = t.index_select(0, ids)
        if heads is not None:
            sel = sel[..., heads[0]:heads[1], :]
        parts.append(sel.contiguous().reshape(-1).view(torch.uint8))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mla", [False, True])
def test_pack_matches_reference_and_round_trips(dtype, page_size, mla):
    k, v = make_pool(3, 37, page_size, 4, 8, dtype, mla=mla)
    layout = KVLayout.from_tensors(k, v)
    ids = torch.tensor([5, 6, 7, 0, 36, 36, 2, 3, 1], dtype=torch.int64)
    buf = pack(layout, ids)
    assert buf.numel() == layout.packed_nbytes(len(ids))
    assert torch.equal(buf, reference_pack(k, v, ids))

    k2, v2 = make_pool(3, 37, page_size, 4, 8, dtype, mla=mla, seed=1)
    layout2 = KVLayout.from_tensors(k2, v2)
    dst_ids = torch.tensor([9, 10, 11, 12, 13, 14, 15, 16, 17], dtype=torch.int32)
    unique = torch.tensor([5, 6, 7, 0, 2, 3, 1])  # skip the repeated 36 so each dst holds one page
    unique_dst = torch.tensor([9, 10, 11, 12, 15, 16, 17])
    unpack(layout2, dst_ids, buf)
    for a, b in zip(planes_in_order(k, v, range(3)), planes_in_order(k2, v2, range(3))):
        assert torch.equal(a[unique].view(torch.uint8), b[unique_dst].view(torch.uint8))
        assert torch.equal(a[36].view(torch.uint8), b[13].view(torch.uint8))
        assert torch.equal(a[36].view(torch.uint8), b[14].view(torch.uint8))


@pytest.mark.parametrize("page_size", [1, 4])
def test_layer_subset_and_head_slice(page_size):
    k, v = make_pool(4, 11, page_size, 8, 6, torch.float16)
    layout = KVLayout.from_tensors(k, v)
    ids = torch.tensor([10, 3, 4, 4, 0])
    for layers in ([2], [3, 0], [1, 2, 3]):
        for heads in (None, (0, 8), (2, 5), (7, 8)):
            got = pack(layout, ids, layers=layers, heads=heads)
            assert torch.equal(got, reference_pack(k, v, ids, layers, heads)), (layers, heads)
            assert got.numel() == layout.packed_nbytes(len(ids), layers, heads)


def test_head_slice_round_trip_between_tp_degrees():
    # A TP-8 style pool (8 KV heads) feeding two TP-4 style pools (4 heads each).
    k, v = make_pool(2, 9, 16, 8, 16, torch.bfloat16)
    src = KVLayout.from_tensors(k, v)
    ids = torch.tensor([1, 2, 3, 7])
    for h0 in (0, 4):
        dk, dv = make_pool(2, 5, 16, 4, 16, torch.bfloat16, seed=3)
        dst = KVLayout.from_tensors(dk, dv)
        unpack(dst, torch.arange(4), pack(src, ids, heads=(h0, h0 + 4)))
        for a, b in zip(planes_in_order(k, v, [0, 1]), planes_in_order(dk, dv, [0, 1])):
            assert torch.equal(a[ids][:, :, h0:h0 + 4].view(torch.uint8), b[:4].view(torch.uint8))


def test_empty_page_list():
    k, v = make_pool(2, 5, 1, 2, 4, torch.float32)
    layout = KVLayout.from_tensors(k, v)
    buf = pack(layout, torch.empty(0, dtype=torch.int64))
    assert buf.numel() == 0
    unpack(layout, torch.empty(0, dtype=torch.int64), buf)


def test_strided_pages_flashinfer_style():
    # [pages, 2, page_size, heads, dim]: K and V interleaved per page, so each plane's
    # pages are contiguous but not adjacent.
    g = torch.Generator().manual_seed(5)
    pools = [torch.randn(13, 2, 4, 3, 8, generator=g) for _ in range(2)]
    layout = KVLayout.from_tensors([p[:, 0] for p in pools], [p[:, 1] for p in pools])
    ids = torch.tensor([12, 0, 1, 2, 6])
    want = reference_pack([p[:, 0] for p in pools], [p[:, 1] for p in pools], ids)
    assert torch.equal(pack(layout, ids), want)
    assert torch.equal(pack(layout, ids, heads=(1, 2)),
                       reference_pack([p[:, 0] for p in pools], [p[:, 1] for p in pools], ids, heads=(1, 2)))


def strided_pool(kind, num_layers, num_pages, page_size, heads, dim, dtype, seed, device="cpu"):
    """K and V planes as [pages, tokens, heads, dim] views of the memory layout ``kind``:
    token-major or head-major pages, separate or with K and V halves alternating in each
    row (vLLM 0.33's per-layer [blocks, heads, block_size, head_size + head_size_v])."""
    g = torch.Generator().manual_seed(seed)
    k, v = [], []
    for _ in range(num_layers):
        if kind.startswith("kv_rows"):
            inner = (heads, page_size, 2 * dim) if kind.endswith("hnd") else (page_size, heads, 2 * dim)
            t = torch.randn((num_pages,) + inner, generator=g).to(dtype).to(device)
            t = t.permute(0, 2, 1, 3) if kind.endswith("hnd") else t
            k.append(t[..., :dim]), v.append(t[..., dim:])
        else:
            for planes in (k, v):
                t = torch.randn(num_pages, heads, page_size, dim, generator=g).to(dtype).to(device)
                planes.append(t.permute(0, 2, 1, 3) if kind == "hnd" else t.transpose(1, 2).contiguous())
    return k, v


KINDS = ["nhd", "hnd", "kv_rows_nhd", "kv_rows_hnd"]


@settings(max_examples=60, deadline=None)
@given(src_kind=st.sampled_from(KINDS), dst_kind=st.sampled_from(KINDS), num_pages=st.integers(1, 9),
       page_size=st.sampled_from([1, 2, 5, 16]), heads=st.integers(1, 5), dim=st.sampled_from([1, 3, 8]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), data=st.data())
def test_strided_cells_match_reference_across_layouts(src_kind, dst_kind, num_pages, page_size, heads, dim, dtype,
                                                      data):
    k, v = strided_pool(src_kind, 2, num_pages, page_size, heads, dim, dtype, seed=1)
    layout = KVLayout.from_tensors(k, v)
    ids = torch.tensor(data.draw(st.lists(st.integers(0, num_pages - 1), max_size=7)), dtype=torch.int64)
    h0 = data.draw(st.integers(0, heads - 1))
    sel = data.draw(st.sampled_from([None, (h0, data.draw(st.integers(h0 + 1, heads)))]))
    buf = pack(layout, ids, heads=sel)
    assert torch.equal(buf, reference_pack(k, v, ids, heads=sel))

    # Canonical bytes: a pool of another layout takes them and packs them back the same.
    dk, dv = strided_pool(dst_kind, 2, len(ids) + 1, page_size, heads if sel is None else sel[1] - sel[0], dim,
                          dtype, seed=2)
    dst = KVLayout.from_tensors(dk, dv)
    before = [t.clone() for t in dk + dv]
    dst_ids = torch.arange(1, len(ids) + 1)
    unpack(dst, dst_ids, buf)
    assert torch.equal(pack(dst, dst_ids), buf)
    for a, b in zip(dk + dv, before):
        assert torch.equal(a[0], b[0])  # page 0 was not a destination: untouched


def test_kv_rows_keep_the_other_half_untouched():
    # K and V share each row: writing the K plane must not touch a byte of V.
    k, v = strided_pool("kv_rows_nhd", 1, 4, 3, 2, 8, torch.float16, seed=3)
    k_before, v_before = k[0].clone(), v[0].clone()
    unpack(KVLayout.from_tensors(k), torch.tensor([2, 0]), torch.zeros(2 * 3 * 2 * 8 * 2, dtype=torch.uint8))
    assert torch.equal(v[0], v_before)
    assert not k[0][[0, 2]].any() and torch.equal(k[0][[1, 3]], k_before[[1, 3]])


def test_overlapping_cells_rejected():
    t = torch.zeros(4, 8, 16)
    overlapping = t.as_strided((4, 2, 3, 8), (128, 16, 4, 1))  # heads 4 elements apart, 8 wide
    with pytest.raises(ValueError, match="cells overlap"):
        KVLayout.from_tensors([overlapping])


def test_token_pool_grouped_into_pages():
    # SGLang: token-granular pool [slots, heads, dim] with page_size 4.
    k, v = make_pool(2, 24, 1, 2, 8, torch.float32)
    layout = KVLayout.from_tensors(k, v, tokens_per_page=4)
    assert layout.num_pages == 6 and layout.tokens_per_page == 4
    ids = torch.tensor([5, 1])
    slots = torch.cat([torch.arange(20, 24), torch.arange(4, 8)])
    assert torch.equal(pack(layout, ids), reference_pack(k, v, slots))


def test_from_pointers_and_sglang_kv_args_match_from_tensors():
    k, v = make_pool(3, 10, 1, 2, 8, torch.float16)
    by_tensor = KVLayout.from_tensors(k, v, tokens_per_page=2)
    page_bytes = 2 * 2 * 8 * 2
    by_ptr = KVLayout.from_pointers([t.data_ptr() for t in k], page_bytes, 5, v_ptrs=[t.data_ptr() for t in v],
                                    tokens_per_page=2, num_kv_heads=2, device="cpu")
    by_args = KVLayout.from_sglang_kv_args([t.data_ptr() for t in k + v], [t.numel() * 2 for t in k + v],
                                           [page_bytes] * 6, page_size=2, num_kv_heads=2, device="cpu")
    ids = torch.tensor([4, 0, 2])
    want = pack(by_tensor, ids, heads=(1, 2))
    assert torch.equal(pack(by_ptr, ids, heads=(1, 2)), want)
    assert torch.equal(pack(by_args, ids, heads=(1, 2)), want)


def test_bytes_per_token():
    k, v = make_pool(3, 4, 16, 2, 64, torch.bfloat16)
    layout = KVLayout.from_tensors(k, v)
    assert layout.bytes_per_token() == 3 * 2 * 2 * 64 * 2
    assert layout.bytes_per_token(heads=(0, 1)) == 3 * 2 * 1 * 64 * 2


@settings(max_examples=40, deadline=None)
@given(
    num_pages=st.integers(1, 9),
    page_size=st.sampled_from([1, 2, 3, 16]),
    heads=st.integers(1, 5),
    dim=st.integers(1, 9),
    mla=st.booleans(),
    data=st.data(),
)
def test_random_layouts(num_pages, page_size, heads, dim, mla, data):
    k, v = make_pool(2, num_pages, page_size, heads, dim, torch.float32, mla=mla)
    layout = KVLayout.from_tensors(k, v)
    ids = torch.tensor(data.draw(st.lists(st.integers(0, num_pages - 1), max_size=12)), dtype=torch.int64)
    h = None
    if not mla and data.draw(st.booleans()):
        h0 = data.draw(st.integers(0, heads - 1))
        h = (h0, data.draw(st.integers(h0 + 1, heads)))
    layers = data.draw(st.one_of(st.none(), st.lists(st.integers(0, 1), min_size=1, max_size=3)))
    assert torch.equal(pack(layout, ids, layers=layers, heads=h), reference_pack(k, v, ids, layers, h))


@pytest.mark.parametrize("threads", [1, 2])
def test_large_pack_uses_threads_correctly(threads):
    # Big enough to take the multi-threaded, sliced path.
    k, v = make_pool(2, 64, 16, 8, 128, torch.float16)
    layout = KVLayout.from_tensors(k, v)
    ids = torch.randperm(64)[:50]
    old = pddcore.get_num_threads()
    try:
        pddcore.set_num_threads(threads)
        assert torch.equal(pack(layout, ids), reference_pack(k, v, ids))
        assert torch.equal(pack(layout, ids, heads=(3, 7)), reference_pack(k, v, ids, heads=(3, 7)))
    finally:
        pddcore.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind,page_size,dim,heads", [("kv_rows_nhd", 16, 128, None), ("kv_rows_hnd", 64, 37, (1, 6))])
def test_packs_past_the_streaming_threshold_match_the_reference(threads, kind, page_size, dim, heads):
    """More than 8 MiB: stores bypass the cache and the pool is read in address order.
    37-byte int8 cells put every row off 16-byte alignment."""
    k, v = strided_pool(kind, 2, 300, page_size, 8, dim, torch.int8 if dim == 37 else torch.float16, seed=11)
    layout = KVLayout.from_tensors(k, v)
    ids = torch.randperm(300, generator=torch.Generator().manual_seed(1))[:260]
    assert layout.packed_nbytes(len(ids), heads=heads) > 8 << 20
    old = pddcore.get_num_threads()
    try:
        pddcore.set_num_threads(threads)
        buf = pack(layout, ids, heads=heads)
        assert torch.equal(buf, reference_pack(k, v, ids, heads=heads))
        dk, dv = strided_pool(kind, 2, 300, page_size, 8, dim, k[0].dtype, seed=12)
        unpack(KVLayout.from_tensors(dk, dv), ids, buf, heads=heads)
        h = slice(*heads) if heads else slice(None)
        for a, b in zip(k + v, dk + dv):
            assert torch.equal(a[ids][:, :, h], b[ids][:, :, h])
    finally:
        pddcore.set_num_threads(old)


# ---- validation: every failure leaves the destination untouched ---------------------------

@pytest.fixture
def pool():
    k, v = make_pool(2, 6, 4, 2, 4, torch.float32)
    return k, v, KVLayout.from_tensors(k, v)


def snapshot(k, v):
    return [t.clone() for t in k + v]


@pytest.mark.parametrize("ids, match", [
    (torch.tensor([0, 6]), "page id 6 at position 1"),
    (torch.tensor([-1]), "page id -1"),
    (torch.tensor([[0, 1]]), "1-D"),
    (torch.tensor([0.0, 1.0]), "int32 or int64"),
])
def test_bad_page_ids_rejected_nothing_written(pool, ids, match):
    k, v, layout = pool
    before = snapshot(k, v)
    buf = torch.full((layout.packed_nbytes(2),), 7, dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        unpack(layout, ids, buf)
    assert all(torch.equal(a, b) for a, b in zip(before, k + v))
    out = torch.full((layout.packed_nbytes(2),), 7, dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        pack(layout, ids, out=out)
    assert bool((out == 7).all())


def test_short_or_wrong_buffer_rejected(pool):
    k, v, layout = pool
    before = snapshot(k, v)
    ids = torch.tensor([0, 1, 2])
    need = layout.packed_nbytes(3)
    with pytest.raises(ValueError, match="buffer too small"):
        unpack(layout, ids, torch.zeros(need - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        unpack(layout, ids, torch.zeros(need, dtype=torch.int8))
    with pytest.raises(ValueError, match="contiguous"):
        unpack(layout, ids, torch.zeros(2 * need, dtype=torch.uint8)[::2])
    assert all(torch.equal(a, b) for a, b in zip(before, k + v))
    out = torch.zeros(need - 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="buffer too small"):
        pack(layout, ids, out=out)
    assert bool((out == 0).all())


def test_bad_heads_and_layers_rejected(pool):
    _, _, layout = pool
    ids = torch.tensor([0])
    with pytest.raises(ValueError, match="out of bounds"):
        pack(layout, ids, heads=(1, 3))
    with pytest.raises(ValueError, match="h0 < h1"):
        pack(layout, ids, heads=(1, 1))
    with pytest.raises(ValueError, match="layer 2 is out of range"):
        pack(layout, ids, layers=[0, 2])


def test_mla_rejects_head_slice():
    k, _ = make_pool(2, 4, 1, 1, 16, torch.float32, mla=True)
    with pytest.raises(ValueError, match="MLA"):
        pack(KVLayout.from_tensors(k), torch.tensor([0]), heads=(0, 1))


def test_layout_constructor_errors():
    t = torch.zeros(4, 3, 8)
    with pytest.raises(ValueError, match="not contiguous"):
        KVLayout.from_tensors([t.transpose(1, 2)], [t.transpose(1, 2)])
    with pytest.raises(ValueError, match="layers"):
        KVLayout.from_tensors([t, t], [t])
    with pytest.raises(ValueError, match="plane 1"):
        KVLayout.from_tensors([t], [torch.zeros(4, 3, 8, device="meta")])
    with pytest.raises(ValueError, match="multiple of tokens_per_page"):
        KVLayout.from_tensors([t], [t], tokens_per_page=3)
    with pytest.raises(ValueError, match="page_bytes"):
        KVLayout.from_pointers([t.data_ptr()], 10, 4, tokens_per_page=3, device="cpu")
    with pytest.raises(TypeError, match="device"):  # where raw pointers point is never guessed
        KVLayout.from_pointers([t.data_ptr()], 12, 4, tokens_per_page=3)


def test_cuda_path_reports_clearly_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; tests/test_pack_cuda.py covers it")
    from pddcore import _C

    reason = _C.cuda_unusable_reason()
    assert reason, "no GPU here, so CUDA must report why it is unusable"
    # A layout that names a CUDA device is refused with that same reason.
    t = torch.zeros(4, 3, 8)
    with pytest.raises(RuntimeError, match=re.escape(reason)):
        KVLayout.from_pointers([t.data_ptr()], t[0].nbytes, 4, tokens_per_page=3, device="cuda:0")
