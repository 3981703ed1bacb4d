"""Scatter new tokens' K and V into their slots of a token or paged pool (Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pddcore.kernels._checks import as_paged_pool

from ._runtime import is_interpreted, require_runnable

__all__ = ["store_kv"]


@triton.jit
def _store_kv(
    K, V, K_pool, V_pool, slot_mapping, num_tokens,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_kpp, stride_kps, stride_kph, stride_kpd,
    stride_vpp, stride_vps, stride_vph, stride_vpd,
    HEAD_DIM: tl.constexpr, ROW: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """A tile is BLOCK_T tokens x one token's (head, dim) row of ROW elements."""
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_mapping + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    keep = slot >= 0
    page = tl.where(keep, slot, 0) // PAGE_SIZE
    within = tl.where(keep, slot, 0) % PAGE_SIZE
    col = tl.arange(0, BLOCK_C)
    head = (col // HEAD_DIM).to(tl.int64)
    dim = (col % HEAD_DIM).to(tl.int64)
    mask = keep[:, None] & (col < ROW)[None, :]
    k = tl.load(K + tok[:, None] * stride_kt + head[None, :] * stride_kh + dim[None, :] * stride_kd, mask=mask)
    v = tl.load(V + tok[:, None] * stride_vt + head[None, :] * stride_vh + dim[None, :] * stride_vd, mask=mask)
    tl.store(K_pool + page[:, None] * stride_kpp + within[:, None] * stride_kps + head[None, :] * stride_kph
             + dim[None, :] * stride_kpd, k, mask=mask)
    tl.store(V_pool + page[:, None] * stride_vpp + within[:, None] * stride_vps + head[None, :] * stride_vph
             + dim[None, :] * stride_vpd, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Triton form of `pddcore.kernels.store_kv` (arguments already checked)."""
    require_runnable(k.device)
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k_pages, v_pages = as_paged_pool(k_buffer), as_paged_pool(v_buffer)
    row = kv_heads * head_dim
    block_c = triton.next_power_of_2(row)
    # About 8K elements per tile on GPU; the interpreter prefers few, large programs.
    budget = 1 << (16 if is_interpreted() else 13)
    block_t = min(triton.next_power_of_2(num_tokens), max(1, budget // block_c))
    _store_kv[(triton.cdiv(num_tokens, block_t),)](
        k, v, k_pages, v_pages, slot_mapping, num_tokens,
        *k.stride(), *v.stride(), *k_pages.stride(), *v_pages.stride(),
        HEAD_DIM=head_dim, ROW=row, PAGE_SIZE=k_pages.shape[1], BLOCK_T=block_t, BLOCK_C=block_c,
    )
