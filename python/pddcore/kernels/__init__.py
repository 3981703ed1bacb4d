"""Extend-decode recompute kernels: extend attention, decode attention, KV store.

After a handoff, MD recomputes the KV of the tokens RLD generated with one *extend* pass:
each request's new tokens attend to that request's cached prefix in the KV pool and
causally to each other. The argument convention is SGLang's ``extend_attention_fwd``.

Shapes (T new tokens in total, B requests, H query heads, Hkv KV heads, D head dim):

* ``q_extend``, ``o_extend`` ``[T, H, D]``; ``k_extend``, ``v_extend`` ``[T, Hkv, D]``.
* ``k_buffer``, ``v_buffer``: the KV pool, either token-granular ``[slots, Hkv, D]`` or
  paged ``[pages, page_size, Hkv, D]`` (any strides, e.g. the ``[:, 0]`` view of a
  FlashInfer ``[pages, 2, page_size, Hkv, D]`` tensor). A **slot id** ``s`` always names
  one token: ``pool[s]`` for a token pool, ``pool[s // page_size, s % page_size]`` for a
  paged one (vLLM's ``slot_mapping`` convention). `slots_from_page_table` turns a page
  table into slot ids.
* ``qo_indptr`` ``[B+1]``: request i's new tokens are ``q_extend[qo_indptr[i]:qo_indptr[i+1]]``.
* ``kv_indptr`` ``[B+1]`` over ``kv_indices``: the slot ids of request i's *prefix*
  (extend) or of all its tokens including the new one (decode).
* H must be a multiple of Hkv (GQA: query head h reads KV head h // (H // Hkv)).
* dtypes: float16, bfloat16, float32 (and float64 on the torch path); all tensors share
  one dtype and device; index tensors are int32 or int64. Accumulation is float32
  (float64 for float64 inputs) with an online softmax in the Triton kernels.
* ``sm_scale`` defaults to ``1/sqrt(D)``; ``logit_cap > 0`` applies
  ``cap * tanh(score / cap)`` to the scaled scores; ``sliding_window = W >= 0`` lets the
  query at position p see keys at positions p - W .. p (SGLang's convention), -1 disables it.

Dispatch: CUDA tensors run the Triton kernels (``pddcore.triton_kernels``), CPU tensors the
torch reference (`pddcore.kernels.reference`). ``PDDCORE_FORCE_TRITON=1`` runs the Triton
kernels for CPU tensors too, in Triton's interpreter, which needs ``TRITON_INTERPRET=1``
set before triton is imported (this is how CI tests them). float64 always takes the torch
path (forcing Triton with float64 is an error). Inconsistent arguments raise
``ValueError`` before anything is launched or written.

Plan and run, as FlashInfer splits them: checking reads the indptrs (and the range of
the used kv_indices, or the slot mapping) back to the host. The one-shot functions do
that on every call, one small sync on CUDA. `ExtendPlan`, `DecodePlan` and `StorePlan`
do it once per batch; their ``run`` (for every layer) checks only shapes, dtypes and
devices and launches with no host synchronisation, so it can be captured in a CUDA graph.
Under torch.compile every launch is a ``torch.ops.pddcore`` custom op with a fake
implementation, so ``torch.compile(fullgraph=True)`` keeps a step that runs plans in one graph.

Example::

    import torch, pddcore.kernels as K
    pool_k = torch.zeros(64, 2, 128); pool_v = torch.zeros_like(pool_k)   # 64 slots, Hkv=2, D=128
    prefix = torch.arange(10)                                            # one request, 10 cached tokens
    K.store_kv(torch.randn(10, 2, 128), torch.randn(10, 2, 128), pool_k, pool_v, prefix)
    q, k, v = torch.randn(3, 8, 128), torch.randn(3, 2, 128), torch.randn(3, 2, 128)
    o = torch.empty_like(q)
    K.extend_attention(q, k, v, o, pool_k, pool_v, torch.tensor([0, 3]), torch.tensor([0, 10]), prefix)
    K.store_kv(k, v, pool_k, pool_v, torch.arange(10, 13))            # now the 3 tokens are cached

    # a decode step: plan once per batch, run per layer
    slots = torch.arange(14)                                         # the 13 cached tokens + the new one
    store = K.StorePlan(slots[-1:], pool_k)
    decode = K.DecodePlan(torch.tensor([0, 14]), slots, pool_k, num_heads=8)
    store.run(torch.randn(1, 2, 128), torch.randn(1, 2, 128), pool_k, pool_v)
    decode.run(q[:1], pool_k, pool_v, o[:1])
"""

from __future__ import annotations

import torch

from . import _ops
from ._checks import (Batch, PoolShape, check_decode, check_decode_tensors, check_extend, check_extend_tensors,
                      check_store, check_store_tensors, plan_decode_batch, plan_extend_batch, plan_store_slots,
                      require_batch, require_slots, require_tokens)
from ._ops import uses_triton

__all__ = ["extend_attention", "decode_attention", "store_kv", "ExtendPlan", "DecodePlan", "StorePlan",
           "slots_from_page_table", "uses_triton"]


def _require_heads(q: torch.Tensor, batch: Batch) -> None:
    if q.shape[1] != batch.num_heads:
        raise ValueError(f"the plan is for {batch.num_heads} query heads, got {q.shape[1]}")


class ExtendPlan:
    """One extend batch, checked once: `run` it for every layer.

    ``k_buffer`` is any layer's pool (its shape, page size and device; every layer's pool
    must match). The other arguments are those of `extend_attention`; ``num_heads`` is H.
    """

    def __init__(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                 k_buffer: torch.Tensor, *, num_heads: int, sm_scale: float | None = None, causal: bool = True,
                 sliding_window: int = -1, logit_cap: float = 0.0):
        self.pool = PoolShape.of(k_buffer)
        self.batch = plan_extend_batch(self.pool, num_heads, qo_indptr, kv_indptr, kv_indices, sm_scale,
                                       sliding_window, logit_cap)
        self.qo_indptr, self.kv_indptr, self.kv_indices = qo_indptr, kv_indptr, kv_indices
        self.causal, self.sliding_window, self.logit_cap = bool(causal), sliding_window, float(logit_cap)

    def run(self, q_extend: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor, o_extend: torch.Tensor,
            k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> None:
        """Writes ``o_extend``; see `extend_attention`."""
        check_extend_tensors(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer)
        self.pool.require(k_buffer, v_buffer)
        _require_heads(q_extend, self.batch)
        require_tokens("qo_indptr[-1]", self.batch.qo_indptr[-1], q_extend.shape[0])
        _ops.extend_attention(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, self.qo_indptr,
                              self.kv_indptr, self.kv_indices, self.batch.qo_indptr, self.batch.kv_indptr,
                              self.batch.sm_scale, self.causal, self.sliding_window, self.logit_cap)


class DecodePlan:
    """One decode batch, checked once: `run` it for every layer (arguments as `ExtendPlan`)."""

    def __init__(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, k_buffer: torch.Tensor, *,
                 num_heads: int, sm_scale: float | None = None, sliding_window: int = -1, logit_cap: float = 0.0):
        self.pool = PoolShape.of(k_buffer)
        self.batch = plan_decode_batch(self.pool, num_heads, kv_indptr, kv_indices, sm_scale, sliding_window,
                                       logit_cap)
        self.kv_indptr, self.kv_indices = kv_indptr, kv_indices
        self.qo_indptr = torch.arange(self.batch.num_requests + 1, dtype=kv_indptr.dtype, device=kv_indptr.device)
        self.sliding_window, self.logit_cap = sliding_window, float(logit_cap)

    def run(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, o: torch.Tensor) -> None:
        """Writes ``o``; see `decode_attention`."""
        check_decode_tensors(q, k_buffer, v_buffer, o)
        self.pool.require(k_buffer, v_buffer)
        _require_heads(q, self.batch)
        require_batch(self.batch, q.shape[0])
        _ops.decode_attention(q, k_buffer, v_buffer, o, self.qo_indptr, self.kv_indptr, self.kv_indices,
                              self.batch.kv_indptr, self.batch.sm_scale, self.sliding_window, self.logit_cap)


class StorePlan:
    """One batch's slot mapping, checked once (in range, no slot twice): `run` it for every layer."""

    def __init__(self, slot_mapping: torch.Tensor, k_buffer: torch.Tensor):
        self.pool = PoolShape.of(k_buffer)
        self.num_tokens = plan_store_slots(self.pool, slot_mapping)
        self.slot_mapping = slot_mapping

    def run(self, k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> None:
        """Writes the tokens into the pool; see `store_kv`."""
        check_store_tensors(k, v, k_buffer, v_buffer)
        self.pool.require(k_buffer, v_buffer)
        require_slots(self.num_tokens, k.shape[0])
        _ops.store_kv(k, v, k_buffer, v_buffer, self.slot_mapping)


def extend_attention(q_extend: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor,
                     o_extend: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                     qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, *,
                     sm_scale: float | None = None, causal: bool = True, sliding_window: int = -1,
                     logit_cap: float = 0.0) -> None:
    """Attention of each request's new tokens over its cached prefix plus the new tokens.

    The new tokens are *not* in the pool yet: their keys and values come from
    ``k_extend`` / ``v_extend`` and sit at positions ``prefix_len ..`` after the prefix.
    With ``causal=False`` the new tokens see each other in both directions. Writes
    ``o_extend`` in place. See the module docstring for shapes.
    """
    batch = check_extend(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
                         qo_indptr, kv_indptr, kv_indices, sm_scale, sliding_window, logit_cap)
    _ops.extend_attention(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                          kv_indices, batch.qo_indptr, batch.kv_indptr, batch.sm_scale, bool(causal), sliding_window,
                          float(logit_cap))


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, o: torch.Tensor,
                     kv_indptr: torch.Tensor, kv_indices: torch.Tensor, *, sm_scale: float | None = None,
                     sliding_window: int = -1, logit_cap: float = 0.0) -> None:
    """One query token per request (``q``, ``o`` ``[B, H, D]``) over that request's slots.

    The request's own new token must already be stored (`store_kv`) and be the last entry
    of its ``kv_indices`` range (SGLang's convention); it sits at position ``len - 1``.
    Writes ``o`` in place.
    """
    batch = check_decode(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, sm_scale, sliding_window, logit_cap)
    qo_indptr = torch.arange(batch.num_requests + 1, dtype=kv_indptr.dtype, device=kv_indptr.device)
    _ops.decode_attention(q, k_buffer, v_buffer, o, qo_indptr, kv_indptr, kv_indices, batch.kv_indptr,
                          batch.sm_scale, sliding_window, float(logit_cap))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write token i's ``k[i]``, ``v[i]`` ``[N, Hkv, D]`` into slot ``slot_mapping[i]`` of the pool.

    A negative slot skips that token (padding). Slots must be distinct and in range.
    """
    check_store(k, v, k_buffer, v_buffer, slot_mapping)
    _ops.store_kv(k, v, k_buffer, v_buffer, slot_mapping)


def slots_from_page_table(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Slot ids of the first ``seq_lens[i]`` tokens of each row of a page table, concatenated.

    ``page_table [B, max_pages]`` lists each request's pages in order (vLLM's block table);
    the result is the ``kv_indices`` for a paged pool, and ``kv_indptr`` is the cumulative
    sum of ``seq_lens`` with a leading 0. Example: page_size 4, pages [7, 2], length 6 ->
    slots [28, 29, 30, 31, 8, 9].
    """
    if page_table.dim() != 2 or seq_lens.dim() != 1 or seq_lens.numel() != page_table.shape[0]:
        raise ValueError(f"page_table must be [B, max_pages] and seq_lens [B], got {tuple(page_table.shape)} "
                         f"and {tuple(seq_lens.shape)}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    lens = seq_lens.long()
    if lens.numel() and (int(lens.min()) < 0 or int(lens.max()) > page_table.shape[1] * page_size):
        raise ValueError(f"seq_lens must lie in [0, {page_table.shape[1] * page_size}] for this page table")
    pos = torch.arange(page_table.shape[1] * page_size, device=page_table.device)
    slots = page_table.long().repeat_interleave(page_size, dim=1) * page_size + pos % page_size
    return slots[pos.unsqueeze(0) < lens.unsqueeze(1)]
