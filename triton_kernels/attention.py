"""Extend and decode attention over a token or paged KV pool (Triton).

One kernel serves both: a program takes one block of a request's query tokens times all
query heads of one KV head (GQA rows are packed, so each K/V tile is loaded once per
group), and one range of that request's keys. Keys ``0 .. prefix_len-1`` come from the
pool through ``kv_indices``; in extend mode keys ``prefix_len ..`` are the new tokens in
``k_extend`` / ``v_extend``. Softmax is online, in float32, in base 2.

When a batch has too few (request, block, KV head) programs to fill the GPU - a short
extend or a decode over a long prefix - the keys are split into ranges
(flash-decoding): each range writes a normalized partial output and its log-sum-exp,
and `_merge_splits` combines them.

Arguments arrive checked by `pddcore.kernels`; the launchers only add the limits of
this implementation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pddcore.kernels._checks import as_paged_pool

from ._runtime import is_interpreted, require_runnable

__all__ = ["extend_attention", "decode_attention"]

_MAX_HEAD_DIM = 256
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 64


@triton.jit
def _attention_fwd(
    Q, K_new, V_new, K_pool, V_pool, O, Part_out, Part_lse,
    qo_indptr, kv_indptr, kv_indices,
    sm_scale, logit_cap, sliding_window, keys_per_split, num_m_blocks,
    stride_qt, stride_qh, stride_qd,
    stride_knt, stride_knh, stride_knd,
    stride_vnt, stride_vnh, stride_vnd,
    stride_kpp, stride_kps, stride_kph, stride_kpd,
    stride_vpp, stride_vps, stride_vph, stride_vpd,
    stride_ot, stride_oh, stride_od,
    stride_pos, stride_pot, stride_poh,
    stride_pls, stride_plt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EXTEND: tl.constexpr, CAUSAL: tl.constexpr, USE_WINDOW: tl.constexpr, USE_CAP: tl.constexpr,
    SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
):
    LOG2E: tl.constexpr = 1.4426950408889634
    TOKENS: tl.constexpr = BLOCK_M // BLOCK_G
    req = tl.program_id(0) // num_m_blocks
    m_block = tl.program_id(0) % num_m_blocks
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)

    q_start = tl.load(qo_indptr + req).to(tl.int64)
    q_len = tl.load(qo_indptr + req + 1).to(tl.int64) - q_start
    m_start = m_block * TOKENS
    if m_start >= q_len:
        return
    kv_start = tl.load(kv_indptr + req).to(tl.int64)
    prefix_len = tl.load(kv_indptr + req + 1).to(tl.int64) - kv_start
    # Extend: queries follow the prefix. Decode: the query is the last pooled token.
    if EXTEND:
        first_q_pos = prefix_len
        num_keys = prefix_len + q_len
    else:
        first_q_pos = prefix_len - q_len
        num_keys = prefix_len

    rows = tl.arange(0, BLOCK_M)
    tok = m_start + rows // BLOCK_G
    grp = rows % BLOCK_G
    row_ok = (tok < q_len) & (grp < GROUP)
    head = kv_head * GROUP + grp
    q_pos = first_q_pos + tok
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM

    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, num_keys)
    if CAUSAL:
        hi = tl.minimum(hi, first_q_pos + tl.minimum(m_start + TOKENS, q_len))
    if USE_WINDOW:
        lo = tl.maximum(lo, first_q_pos + m_start - sliding_window)

    q = tl.load(Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    for n in range(lo, hi, BLOCK_N):
        k_pos = n + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        pooled = k_ok & (k_pos < prefix_len)
        slot = tl.load(kv_indices + kv_start + k_pos, mask=pooled, other=0).to(tl.int64)
        page = slot // PAGE_SIZE
        within = slot % PAGE_SIZE
        kp = K_pool + page[:, None] * stride_kpp + within[:, None] * stride_kps + kv_head * stride_kph
        vp = V_pool + page[:, None] * stride_vpp + within[:, None] * stride_vps + kv_head * stride_vph
        pool_mask = pooled[:, None] & dim_ok[None, :]
        k = tl.load(kp + dims[None, :] * stride_kpd, mask=pool_mask, other=0.0)
        v = tl.load(vp + dims[None, :] * stride_vpd, mask=pool_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if EXTEND:
            # Each key is either pooled or new: the other load is masked off and adds 0.
            fresh = k_ok & (k_pos >= prefix_len)
            new_row = q_start + k_pos - prefix_len
            new_mask = fresh[:, None] & dim_ok[None, :]
            k_fresh = tl.load(K_new + new_row[:, None] * stride_knt + kv_head * stride_knh
                              + dims[None, :] * stride_knd, mask=new_mask, other=0.0)
            v_fresh = tl.load(V_new + new_row[:, None] * stride_vnt + kv_head * stride_vnh
                              + dims[None, :] * stride_vnd, mask=new_mask, other=0.0)
            k += k_fresh.to(k.dtype)
            v += v_fresh.to(v.dtype)
        if DOT_FP32:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        if USE_CAP:
            # cap * tanh(x / cap), with tanh(y) = 2 sigmoid(2y) - 1 (no tanh in core Triton)
            qk = logit_cap * (2.0 * tl.sigmoid(2.0 * qk * (sm_scale / logit_cap)) - 1.0) * LOG2E
        else:
            qk = qk * (sm_scale * LOG2E)
        visible = row_ok[:, None] & k_ok[None, :]
        if CAUSAL:
            visible = visible & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (q_pos[:, None] - k_pos[None, :] <= sliding_window)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        tok_g = q_start + tok
        tl.store(Part_out + split * stride_pos + tok_g[:, None] * stride_pot + head[:, None] * stride_poh
                 + dims[None, :], out, mask=store_mask)
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(Part_lse + split * stride_pls + tok_g * stride_plt + head, lse, mask=row_ok)
    else:
        tl.store(O + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
                 out.to(O.dtype.element_ty), mask=store_mask)


@triton.jit
def _merge_splits(
    Part_out, Part_lse, O, num_splits, num_heads,
    stride_pos, stride_pot, stride_poh, stride_pls, stride_plt,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per token: combine the key ranges' partial outputs by their log-sum-exp."""
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < num_heads
    mask = head_ok[:, None] & (dims < HEAD_DIM)[None, :]
    m = tl.full([BLOCK_H], -1.0e30, tl.float32)
    weight = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    # Walk the splits by pointer increments: 64-bit, unlike split * stride in int32.
    lse_ptr = Part_lse + tok * stride_plt + heads
    part_ptr = Part_out + tok * stride_pot + heads[:, None] * stride_poh + dims[None, :]
    for _ in range(num_splits):
        lse = tl.load(lse_ptr, mask=head_ok, other=float("-inf"))
        part = tl.load(part_ptr, mask=mask, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + part * beta[:, None]
        weight = weight * alpha + beta
        m = m_new
        lse_ptr += stride_pls
        part_ptr += stride_pos
    out = acc / tl.where(weight > 0, weight, 1.0)[:, None]
    tl.store(O + tok * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od,
             out.to(O.dtype.element_ty), mask=mask)


def _num_splits(device: torch.device, programs: int, max_keys: int) -> int:
    """Enough key ranges for about two programs per SM, each at least a few blocks long."""
    if device.type != "cuda" or max_keys == 0:
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(target, max(1, programs)), triton.cdiv(max_keys, _MIN_KEYS_PER_SPLIT),
                      _MAX_SPLITS))


def _tile(interpreted: bool, dot_fp32: bool, block_d: int) -> tuple[int, int]:
    """(query rows, keys) per tile. The interpreter pays per program and per loop step, so
    it gets the biggest tiles; on GPU, float32 (IEEE) dots take about twice the shared
    memory of 16-bit ones, and these sizes fit sm_80's 163 KiB (checked with triton.compile)."""
    if interpreted:
        return 128, 128
    if dot_fp32:
        return 32, (32 if block_d <= 128 else 16)
    return 64, (64 if block_d <= 128 else 32)


def _launch(q, k_new, v_new, o, k_pool, v_pool, qo_indptr, kv_indptr, kv_indices, batch, *,
            extend: bool, causal: bool, sliding_window: int, logit_cap: float, num_kv_splits: int | None):
    head_dim = batch.head_dim
    if head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"the Triton attention kernels take head_dim <= {_MAX_HEAD_DIM}, got {head_dim}")
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    device = q.device
    require_runnable(device)
    tokens = q.shape[0]
    if tokens == 0:
        return
    interpreted = is_interpreted()
    group = batch.num_heads // batch.num_kv_heads
    block_g = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    dot_fp32 = interpreted or q.dtype == torch.float32
    rows, block_n = _tile(interpreted, dot_fp32, block_d)
    tokens_per_block = max(1, rows // block_g) if extend else 1
    block_m = max(16, block_g * tokens_per_block)
    tokens_per_block = block_m // block_g
    num_m_blocks = max(1, triton.cdiv(batch.max_q_len, tokens_per_block))
    max_keys = max((kb - ka + (qb - qa if extend else 0)
                    for qa, qb, ka, kb in zip(batch.qo_indptr, batch.qo_indptr[1:], batch.kv_indptr, batch.kv_indptr[1:])),
                   default=0)
    programs = batch.num_requests * num_m_blocks * batch.num_kv_heads
    splits = num_kv_splits or _num_splits(device, programs, max_keys)
    keys_per_split = max(block_n, triton.cdiv(triton.cdiv(max(1, max_keys), splits), block_n) * block_n)
    splits = max(1, triton.cdiv(max_keys, keys_per_split))

    if splits > 1:
        part_out = torch.empty(splits, tokens, batch.num_heads, head_dim, dtype=torch.float32, device=device)
        part_lse = torch.empty(splits, tokens, batch.num_heads, dtype=torch.float32, device=device)
    else:  # unused by the kernel; any float32 tensor stands in
        part_out = part_lse = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=device)
    k_pages, v_pages = as_paged_pool(k_pool), as_paged_pool(v_pool)
    grid = (batch.num_requests * num_m_blocks, batch.num_kv_heads, splits)
    _attention_fwd[grid](
        q, k_new, v_new, k_pages, v_pages, o, part_out, part_lse,
        qo_indptr, kv_indptr, kv_indices,
        batch.sm_scale, logit_cap, sliding_window, keys_per_split, num_m_blocks,
        *q.stride(), *k_new.stride(), *v_new.stride(), *k_pages.stride(), *v_pages.stride(), *o.stride(),
        *part_out.stride()[:3], *part_lse.stride()[:2],
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=k_pages.shape[1],
        BLOCK_M=block_m, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        EXTEND=extend, CAUSAL=causal, USE_WINDOW=sliding_window >= 0, USE_CAP=logit_cap > 0,
        SPLIT=splits > 1, DOT_FP32=dot_fp32,
    )
    if splits > 1:
        _merge_splits[(tokens,)](
            part_out, part_lse, o, splits, batch.num_heads,
            *part_out.stride()[:3], *part_lse.stride()[:2], *o.stride(),
            HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(batch.num_heads), BLOCK_D=block_d,
        )


def extend_attention(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                     batch, *, causal: bool, sliding_window: int, logit_cap: float,
                     num_kv_splits: int | None = None) -> None:
    """Triton form of `pddcore.kernels.extend_attention`; ``num_kv_splits`` overrides the split heuristic."""
    _launch(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, batch,
            extend=True, causal=causal, sliding_window=sliding_window, logit_cap=logit_cap,
            num_kv_splits=num_kv_splits)


def decode_attention(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, batch, *, sliding_window: int,
                     logit_cap: float, num_kv_splits: int | None = None, qo_indptr=None) -> None:
    """Triton form of `pddcore.kernels.decode_attention`; ``num_kv_splits`` overrides the split heuristic.
    ``qo_indptr``: ``arange(B + 1)`` on q's device (a plan makes it once; made here when not given)."""
    if qo_indptr is None:
        qo_indptr = torch.arange(q.shape[0] + 1, dtype=kv_indptr.dtype, device=q.device)
    _launch(q, q, q, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, batch,
            extend=False, causal=True, sliding_window=sliding_window, logit_cap=logit_cap,
            num_kv_splits=num_kv_splits)
