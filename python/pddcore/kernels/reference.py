"""Plain torch implementations of the recompute kernels.

They are the CPU execution path and the test oracle of the Triton kernels. Arguments are
those of `pddcore.kernels` and are assumed checked (see `_checks`). Math runs in float32
for fp16 / bf16 / fp32 inputs and in float64 for float64 inputs, so a float64 model is
reproducible bit for bit. Work is vectorized per request; a long extend is cut into
query chunks only to bound the size of the score matrix.
"""

from __future__ import annotations

import torch

from ._checks import Batch, as_paged_pool

__all__ = ["extend_attention", "decode_attention", "store_kv"]

# Upper bound on elements of one [Hkv, G, queries, keys] score tensor (128 MiB in float64).
_MAX_SCORE_ELEMENTS = 1 << 24


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _gather(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``[len(slots), Hkv, D]`` of a pool; slot s lives at page s // P, offset s % P."""
    pages = as_paged_pool(pool)
    page_size = pages.shape[1]
    slots = slots.long()
    return pages[slots // page_size, slots % page_size]


def _attend(q, k, v, first_q_pos: int, *, causal: bool, sliding_window: int, logit_cap: float,
            sm_scale: float) -> torch.Tensor:
    """Attention of queries ``q [E, H, D]`` at positions first_q_pos.. over keys ``k, v [S, Hkv, D]``
    at positions 0..S-1. Returns ``[E, H, D]`` in the compute dtype.

    Key j is visible to the query at position p when (not causal or j <= p) and
    (sliding_window < 0 or p - j <= sliding_window): the window holds the query's own
    token and `sliding_window` tokens before it (SGLang's convention).
    """
    num_q, heads, dim = q.shape
    num_k, kv_heads, _ = k.shape
    group = heads // kv_heads
    # One plain batched matmul per KV head, its G query heads stacked as rows (a
    # broadcast 4-D matmul is an order of magnitude slower on CPU).
    q = q.reshape(num_q, kv_heads, group, dim).permute(1, 2, 0, 3)      # [Hkv, G, E, D]
    k = k.permute(1, 2, 0)                                               # [Hkv, D, S]
    v = v.permute(1, 0, 2)                                               # [Hkv, S, D]
    k_pos = torch.arange(num_k, device=q.device)
    out = torch.empty_like(q)
    chunk = max(1, _MAX_SCORE_ELEMENTS // max(1, heads * num_k))
    for start in range(0, num_q, chunk):
        stop = min(num_q, start + chunk)
        rows = q[:, :, start:stop].reshape(kv_heads, group * (stop - start), dim)
        scores = torch.bmm(rows, k).view(kv_heads, group, stop - start, num_k) * sm_scale
        if logit_cap > 0:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        q_pos = first_q_pos + torch.arange(start, stop, device=q.device).unsqueeze(1)
        visible = torch.ones(stop - start, num_k, dtype=torch.bool, device=q.device)
        if causal:
            visible &= k_pos <= q_pos
        if sliding_window >= 0:
            visible &= q_pos - k_pos <= sliding_window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[:, :, start:stop] = torch.bmm(probs.view(kv_heads, -1, num_k), v).view(kv_heads, group, -1, dim)
    return out.permute(2, 0, 1, 3).reshape(num_q, heads, dim)


def extend_attention(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, kv_indices,
                     batch: Batch, *, causal: bool, sliding_window: int, logit_cap: float) -> None:
    ct = _compute_dtype(q_extend.dtype)
    qo, kv = batch.qo_indptr, batch.kv_indptr
    for i in range(batch.num_requests):
        q0, q1 = qo[i], qo[i + 1]
        if q0 == q1:
            continue
        prefix = kv_indices[kv[i]:kv[i + 1]]
        k = torch.cat([_gather(k_buffer, prefix), k_extend[q0:q1]]).to(ct)
        v = torch.cat([_gather(v_buffer, prefix), v_extend[q0:q1]]).to(ct)
        out = _attend(q_extend[q0:q1].to(ct), k, v, len(prefix), causal=causal,
                      sliding_window=sliding_window, logit_cap=logit_cap, sm_scale=batch.sm_scale)
        o_extend[q0:q1] = out.to(o_extend.dtype)


def decode_attention(q, k_buffer, v_buffer, o, kv_indices, batch: Batch, *, sliding_window: int,
                     logit_cap: float) -> None:
    ct = _compute_dtype(q.dtype)
    kv = batch.kv_indptr
    for i in range(batch.num_requests):
        slots = kv_indices[kv[i]:kv[i + 1]]
        k = _gather(k_buffer, slots).to(ct)
        v = _gather(v_buffer, slots).to(ct)
        out = _attend(q[i:i + 1].to(ct), k, v, len(slots) - 1, causal=True,
                      sliding_window=sliding_window, logit_cap=logit_cap, sm_scale=batch.sm_scale)
        o[i] = out[0].to(o.dtype)


def store_kv(k, v, k_buffer, v_buffer, slot_mapping) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_pages, v_pages = as_paged_pool(k_buffer), as_paged_pool(v_buffer)
    page_size = k_pages.shape[1]
    page, offset = slots // page_size, slots % page_size
    k_pages[page, offset] = k[keep]
    v_pages[page, offset] = v[keep]
