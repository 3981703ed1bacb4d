"""Argument checks shared by the torch reference and the Triton launchers.

Split as the kernels are: the ``plan_*`` checks read the index tensors back to the host
(once per batch) and return the host-side batch description both execution paths need;
the ``check_*_tensors`` checks look at shapes, dtypes and devices only, so a plan's run
does them with no host sync. ``check_extend`` / ``check_decode`` / ``check_store`` do
both for a one-shot call. All raise ``ValueError`` naming the problem before anything
is launched or written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Batch", "PoolShape", "as_paged_pool", "check_extend", "check_decode", "check_store", "FLOAT_DTYPES"]

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


def _read_indptr(name: str, indptr, bound: int | None) -> list[int]:
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


@dataclass(frozen=True)
class PoolShape:
    """What a plan knows of the pool it will run on: every layer's pool has this shape."""

    num_slots: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    device: torch.device

    @staticmethod
    def of(k_buffer: torch.Tensor) -> "PoolShape":
        num_slots, page_size, hkv, dim = _check_pool(k_buffer, k_buffer)
        return PoolShape(num_slots, page_size, hkv, dim, k_buffer.device)

    def require(self, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> None:
        """Rejects a pool other than the planned one's shape (metadata only: no host sync)."""
        got = PoolShape(*_check_pool(k_buffer, v_buffer), k_buffer.device)
        if got != self:
            raise ValueError(f"the pool {tuple(k_buffer.shape)} on {k_buffer.device} is not the one planned for "
                             f"({self.num_slots} slots, page size {self.page_size}, {self.num_kv_heads} KV heads, "
                             f"head_dim {self.head_dim}, on {self.device})")


# ---- tensor checks: shapes, dtypes and devices only, so a run can call them with no host sync

def check_extend_tensors(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer) -> None:
    for name, t in (("q_extend", q_extend), ("k_extend", k_extend), ("v_extend", v_extend), ("o_extend", o_extend)):
        _check_tensor(name, t, 3)
    _, _, hkv, dim = _check_pool(k_buffer, v_buffer)
    tensors = dict(q_extend=q_extend, k_extend=k_extend, v_extend=v_extend, o_extend=o_extend,
                   k_buffer=k_buffer, v_buffer=v_buffer)
    _check_same("dtype", tensors, "dtype")
    _check_same("device", tensors, "device")
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


def check_decode_tensors(q, k_buffer, v_buffer, o) -> None:
    _check_tensor("q", q, 3)
    _check_tensor("o", o, 3)
    _, _, hkv, dim = _check_pool(k_buffer, v_buffer)
    tensors = dict(q=q, o=o, k_buffer=k_buffer, v_buffer=v_buffer)
    _check_same("dtype", tensors, "dtype")
    _check_same("device", tensors, "device")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {q.dtype}")
    _, heads, qdim = q.shape
    if o.shape != q.shape:
        raise ValueError(f"o {tuple(o.shape)} must match q {tuple(q.shape)}")
    _check_heads("q", heads, qdim, hkv, dim)


def check_store_tensors(k, v, k_buffer, v_buffer) -> None:
    _check_tensor("k", k, 3)
    _check_tensor("v", v, 3)
    _, _, hkv, dim = _check_pool(k_buffer, v_buffer)
    tensors = dict(k=k, v=v, k_buffer=k_buffer, v_buffer=v_buffer)
    _check_same("dtype", tensors, "dtype")
    _check_same("device", tensors, "device")
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape[1:]) != (hkv, dim):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected (N, Hkv, D) with (Hkv, D) = {(hkv, dim)}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k ({k.shape[0]} tokens) and v ({v.shape[0]} tokens) differ in length")


# ---- plan checks: read the index tensors back to the host, once per batch

def _check_index_device(pool: PoolShape, named: dict[str, torch.Tensor]) -> None:
    for name, t in named.items():
        _check_tensor(name, t, 1)
    devices = {"the pool": pool.device, **{name: t.device for name, t in named.items()}}
    if len(set(devices.values())) > 1:
        raise ValueError("all tensors must share one device: " + ", ".join(f"{n}={d}" for n, d in devices.items()))


def plan_extend_batch(pool: PoolShape, num_heads: int, qo_indptr, kv_indptr, kv_indices, sm_scale, sliding_window,
                      logit_cap) -> Batch:
    _check_heads("q_extend", num_heads, pool.head_dim, pool.num_kv_heads, pool.head_dim)
    scale = _check_scalars(sm_scale, sliding_window, logit_cap, pool.head_dim)
    _check_index_device(pool, dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices))
    qo = _read_indptr("qo_indptr", qo_indptr, None)
    kv = _read_indptr("kv_indptr", kv_indptr, kv_indices.numel())
    if len(qo) != len(kv):
        raise ValueError(f"qo_indptr ({len(qo)}) and kv_indptr ({len(kv)}) must both hold B+1 offsets")
    _check_indices("kv_indices", kv_indices, kv[-1], pool.num_slots)
    return Batch(qo, kv, num_heads, pool.num_kv_heads, pool.head_dim, pool.page_size, scale)


def plan_decode_batch(pool: PoolShape, num_heads: int, kv_indptr, kv_indices, sm_scale, sliding_window,
                      logit_cap) -> Batch:
    _check_heads("q", num_heads, pool.head_dim, pool.num_kv_heads, pool.head_dim)
    scale = _check_scalars(sm_scale, sliding_window, logit_cap, pool.head_dim)
    _check_index_device(pool, dict(kv_indptr=kv_indptr, kv_indices=kv_indices))
    kv = _read_indptr("kv_indptr", kv_indptr, kv_indices.numel())
    empty = [i for i, (a, b) in enumerate(zip(kv, kv[1:])) if a == b]
    if empty:
        raise ValueError(f"requests {empty} have no KV slots; a decode request must include its own new token")
    _check_indices("kv_indices", kv_indices, kv[-1], pool.num_slots)
    return Batch(list(range(len(kv))), kv, num_heads, pool.num_kv_heads, pool.head_dim, pool.page_size, scale)


def plan_store_slots(pool: PoolShape, slot_mapping) -> int:
    """Rejects out-of-range and repeated slots; returns the number of tokens."""
    _check_index_device(pool, dict(slot_mapping=slot_mapping))
    if slot_mapping.dtype not in _INDEX_DTYPES:
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    kept = slot_mapping[slot_mapping >= 0]
    if kept.numel():
        hi = int(kept.max())
        if hi >= pool.num_slots:
            raise ValueError(f"slot_mapping holds slot {hi}, outside the pool's [0, {pool.num_slots})")
        if torch.unique(kept).numel() != kept.numel():
            raise ValueError("slot_mapping writes one slot twice; the result would depend on write order")
    return slot_mapping.numel()


def require_tokens(name: str, planned: int, tokens: int) -> None:
    if planned != tokens:
        raise ValueError(f"{name} = {planned} must equal the number of tokens {tokens}")


def check_extend(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
                 qo_indptr, kv_indptr, kv_indices, sm_scale, sliding_window, logit_cap) -> Batch:
    """Every check of one extend call (tensors, then the plan's); returns its batch."""
    check_extend_tensors(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer)
    batch = plan_extend_batch(PoolShape.of(k_buffer), q_extend.shape[1], qo_indptr, kv_indptr, kv_indices, sm_scale,
                              sliding_window, logit_cap)
    require_tokens("qo_indptr[-1]", batch.qo_indptr[-1], q_extend.shape[0])
    return batch


def check_decode(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, sm_scale, sliding_window, logit_cap) -> Batch:
    """Every check of one decode call (tensors, then the plan's); returns its batch."""
    check_decode_tensors(q, k_buffer, v_buffer, o)
    batch = plan_decode_batch(PoolShape.of(k_buffer), q.shape[1], kv_indptr, kv_indices, sm_scale, sliding_window,
                              logit_cap)
    require_batch(batch, q.shape[0])
    return batch


def require_batch(batch: Batch, num_queries: int) -> None:
    if batch.num_requests != num_queries:
        raise ValueError(f"kv_indptr must hold B+1 = {num_queries + 1} offsets for q's batch, "
                         f"got {batch.num_requests + 1}")


def check_store(k, v, k_buffer, v_buffer, slot_mapping) -> None:
    """Every check of one store_kv call."""
    check_store_tensors(k, v, k_buffer, v_buffer)
    require_slots(plan_store_slots(PoolShape.of(k_buffer), slot_mapping), k.shape[0])


def require_slots(planned: int, tokens: int) -> None:
    if planned != tokens:
        raise ValueError(f"slot_mapping has {planned} entries for {tokens} tokens")
