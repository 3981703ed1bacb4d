"""Argument checks shared by the torch reference and the Triton launchers.

Every public kernel entry calls one of the ``check_*`` functions before it touches
memory; they raise ``ValueError`` naming the problem and return the host-side batch
description both execution paths need (so the ragged offsets are read back once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Batch", "as_paged_pool", "check_extend", "check_decode", "check_store", "FLOAT_DTYPES"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Batch:
    """Host copy of the ragged batch: per-request query and prefix offsets."""

    qo_indptr: list[int]
    kv_indptr: list[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    sm_scale: float

    @property
    def num_requests(self) -> int:
        return len(self.qo_indptr) - 1

    @property
    def max_q_len(self) -> int:
        return max((b - a for a, b in zip(self.qo_indptr, self.qo_indptr[1:])), default=0)

    @property
    def max_kv_len(self) -> int:
        return max((b - a for a, b in zip(self.kv_indptr, self.kv_indptr[1:])), default=0)


def as_paged_pool(buffer: torch.Tensor) -> torch.Tensor:
    """View a token pool ``[slots, Hkv, D]`` as pages of one token ``[slots, 1, Hkv, D]``.

    A slot id ``s`` then always addresses ``pool[s // page_size, s % page_size]``.
    """
    return buffer.unsqueeze(1) if buffer.dim() == 3 else buffer


def _check_tensor(name: str, t, dims: int | tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    allowed = (dims,) if isinstance(dims, int) else dims
    if t.dim() not in allowed:
        raise ValueError(f"{name} must have {' or '.join(map(str, allowed))} dims, got shape {tuple(t.shape)}")


def _check_same(kind: str, named: dict[str, torch.Tensor], attr: str) -> None:
    values = {name: getattr(t, attr) for name, t in named.items()}
    if len(set(values.values())) > 1:
        listing = ", ".join(f"{n}={v}" for n, v in values.items())
        raise ValueError(f"all tensors must share one {kind}: {listing}")


def _check_pool(k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> tuple[int, int, int, int]:
    """Return (num_slots, page_size, Hkv, D) of a token or paged pool."""
    _check_tensor("k_buffer", k_buffer, (3, 4))
    _check_tensor("v_buffer", v_buffer, (3, 4))
    if k_buffer.shape != v_buffer.shape:
        raise ValueError(f"k_buffer {tuple(k_buffer.shape)} and v_buffer {tuple(v_buffer.shape)} differ in shape")
    pages = as_paged_pool(k_buffer)
    num_pages, page_size, hkv, dim = pages.shape
    return num_pages * page_size, page_size, hkv, dim


def _check_scalars(sm_scale, sliding_window, logit_cap, head_dim: int) -> float:
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale!r}")
    if not isinstance(sliding_window, int) or sliding_window < -1:
        raise ValueError(f"sliding_window must be an int >= -1 (-1 disables it), got {sliding_window!r}")
    if not (isinstance(logit_cap, (int, float)) and math.isfinite(logit_cap) and logit_cap >= 0):
        raise ValueError(f"logit_cap must be a finite number >= 0 (0 disables it), got {logit_cap!r}")
    return float(sm_scale)


def _check_heads(qname: str, heads: int, qdim: int, hkv: int, dim: int) -> None:
    if qdim != dim:
        raise ValueError(f"{qname} head_dim {qdim} differs from the pool's {dim}")
    if heads % hkv:
        raise ValueError(f"query heads {heads} must be a multiple of KV heads {hkv}")


def _read_indptr(name: str, indptr, total: int | None, bound: int | None) -> list[int]:
    """Read an indptr back to the host; it must start at 0 and never decrease."""
    _check_tensor(name, indptr, 1)
    if indptr.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {indptr.dtype}")
    if indptr.numel() < 1:
        raise ValueError(f"{name} must hold B+1 >= 1 offsets, got none")
    values = indptr.tolist()
    if values[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {values[0]}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    if total is not None and values[-1] != total:
        raise ValueError(f"{name}[-1] = {values[-1]} must equal the number of tokens {total}")
    if bound is not None and values[-1] > bound:
        raise ValueError(f"{name}[-1] = {values[-1]} exceeds the {bound} entries of kv_indices")
    return values


def _check_indices(name: str, indices, used: int, num_slots: int) -> None:
    _check_tensor(name, indices, 1)
    if indices.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {indices.dtype}")
    if used == 0:
        return
    lo, hi = torch.aminmax(indices[:used])
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= num_slots:
        raise ValueError(f"{name} holds slot ids in [{lo}, {hi}], outside the pool's [0, {num_slots})")


def check_extend(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
                 qo_indptr, kv_indptr, kv_indices, sm_scale, sliding_window, logit_cap) -> Batch:
    for name, t in (("q_extend", q_extend), ("k_extend", k_extend), ("v_extend", v_extend), ("o_extend", o_extend)):
        _check_tensor(name, t, 3)
    num_slots, page_size, hkv, dim = _check_pool(k_buffer, v_buffer)
    tensors = dict(q_extend=q_extend, k_extend=k_extend, v_extend=v_extend, o_extend=o_extend,
                   k_buffer=k_buffer, v_buffer=v_buffer)
    _check_same("dtype", tensors, "dtype")
    _check_same("device", {**tensors, "qo_indptr": qo_indptr, "kv_indptr": kv_indptr, "kv_indices": kv_indices},
                "device")
    if q_extend.dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {q_extend.dtype}")
    tokens, heads, qdim = q_extend.shape
    if o_extend.shape != q_extend.shape:
        raise ValueError(f"o_extend {tuple(o_extend.shape)} must match q_extend {tuple(q_extend.shape)}")
    for name, t in (("k_extend", k_extend), ("v_extend", v_extend)):
        if tuple(t.shape) != (tokens, hkv, dim):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected (T, Hkv, D) = {(tokens, hkv, dim)} "
                             "from q_extend and the pool")
    _check_heads("q_extend", heads, qdim, hkv, dim)
    scale = _check_scalars(sm_scale, sliding_window, logit_cap, dim)
    _check_tensor("kv_indices", kv_indices, 1)
    qo = _read_indptr("qo_indptr", qo_indptr, tokens, None)
    kv = _read_indptr("kv_indptr", kv_indptr, None, kv_indices.numel())
    if len(qo) != len(kv):
        raise ValueError(f"qo_indptr ({len(qo)}) and kv_indptr ({len(kv)}) must both hold B+1 offsets")
    _check_indices("kv_indices", kv_indices, kv[-1], num_slots)
    return Batch(qo, kv, heads, hkv, dim, page_size, scale)


def check_decode(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, sm_scale, sliding_window, logit_cap) -> Batch:
    _check_tensor("q", q, 3)
    _check_tensor("o", o, 3)
    num_slots, page_size, hkv, dim = _check_pool(k_buffer, v_buffer)
    tensors = dict(q=q, o=o, k_buffer=k_buffer, v_buffer=v_buffer)
    _check_same("dtype", tensors, "dtype")
    _check_same("device", {**tensors, "kv_indptr": kv_indptr, "kv_indices": kv_indices}, "device")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {q.dtype}")
    batch, heads, qdim = q.shape
    if o.shape != q.shape:
        raise ValueError(f"o {tuple(o.shape)} must match q {tuple(q.shape)}")
    _check_heads("q", heads, qdim, hkv, dim)
    scale = _check_scalars(sm_scale, sliding_window, logit_cap, dim)
    _check_tensor("kv_indices", kv_indices, 1)
    kv = _read_indptr("kv_indptr", kv_indptr, None, kv_indices.numel())
    if len(kv) != batch + 1:
        raise ValueError(f"kv_indptr must hold B+1 = {batch + 1} offsets for q's batch, got {len(kv)}")
    empty = [i for i, (a, b) in enumerate(zip(kv, kv[1:])) if a == b]
    if empty:
        raise ValueError(f"requests {empty} have no KV slots; a decode request must include its own new token")
    _check_indices("kv_indices", kv_indices, kv[-1], num_slots)
    return Batch(list(range(batch + 1)), kv, heads, hkv, dim, page_size, scale)


def check_store(k, v, k_buffer, v_buffer, slot_mapping) -> tuple[int, int]:
    """Return (num_slots, page_size); reject out-of-range and repeated slots."""
    _check_tensor("k", k, 3)
    _check_tensor("v", v, 3)
    num_slots, page_size, hkv, dim = _check_pool(k_buffer, v_buffer)
    tensors = dict(k=k, v=v, k_buffer=k_buffer, v_buffer=v_buffer)
    _check_same("dtype", tensors, "dtype")
    _check_same("device", {**tensors, "slot_mapping": slot_mapping}, "device")
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape[1:]) != (hkv, dim):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected (N, Hkv, D) with (Hkv, D) = {(hkv, dim)}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k ({k.shape[0]} tokens) and v ({v.shape[0]} tokens) differ in length")
    _check_tensor("slot_mapping", slot_mapping, 1)
    if slot_mapping.dtype not in _INDEX_DTYPES:
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.numel() != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.numel()} entries for {k.shape[0]} tokens")
    kept = slot_mapping[slot_mapping >= 0]
    if kept.numel():
        hi = int(kept.max())
        if hi >= num_slots:
            raise ValueError(f"slot_mapping holds slot {hi}, outside the pool's [0, {num_slots})")
        if torch.unique(kept).numel() != kept.numel():
            raise ValueError("slot_mapping writes one slot twice; the result would depend on write order")
    return num_slots, page_size
