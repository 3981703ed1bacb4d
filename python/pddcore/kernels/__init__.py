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
``ValueError`` before anything is launched or written; checking reads the indptrs (and
the range of the used kv_indices) back to the host, one small sync per call on CUDA.

Example::

    import torch, pddcore.kernels as K
    pool_k = torch.zeros(64, 2, 128); pool_v = torch.zeros_like(pool_k)   # 64 slots, Hkv=2, D=128
    prefix = torch.arange(10)                                            # one request, 10 cached tokens
    K.store_kv(torch.randn(10, 2, 128), torch.randn(10, 2, 128), pool_k, pool_v, prefix)
    q, k, v = torch.randn(3, 8, 128), torch.randn(3, 2, 128), torch.randn(3, 2, 128)
    o = torch.empty_like(q)
    K.extend_attention(q, k, v, o, pool_k, pool_v, torch.tensor([0, 3]), torch.tensor([0, 10]), prefix)
    K.store_kv(k, v, pool_k, pool_v, torch.arange(10, 13))            # now the 3 tokens are cached
"""

from __future__ import annotations

import os

import torch

from . import reference
from ._checks import check_decode, check_extend, check_store

__all__ = ["extend_attention", "decode_attention", "store_kv", "slots_from_page_table", "uses_triton"]


def uses_triton(t: torch.Tensor) -> bool:
    """Whether a call whose tensors look like `t` runs the Triton kernels.

    True for CUDA tensors (fp16/bf16/fp32) and whenever ``PDDCORE_FORCE_TRITON=1``.
    """
    if os.environ.get("PDDCORE_FORCE_TRITON") == "1":
        if t.dtype == torch.float64:
            raise ValueError("PDDCORE_FORCE_TRITON=1: the Triton kernels take float16/bfloat16/float32, got float64")
        return True
    return t.is_cuda and t.dtype != torch.float64


def _triton():
    try:
        from .. import triton_kernels  # imported lazily: triton is optional and slow to import
    except ModuleNotFoundError as exc:
        if exc.name != "triton":
            raise
        raise RuntimeError("CUDA tensors (or PDDCORE_FORCE_TRITON=1) need the triton package: pip install triton") from exc
    return triton_kernels


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
    options = dict(causal=bool(causal), sliding_window=sliding_window, logit_cap=float(logit_cap))
    if uses_triton(q_extend):
        _triton().extend_attention(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
                                   qo_indptr, kv_indptr, kv_indices, batch, **options)
    else:
        reference.extend_attention(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, kv_indices, batch,
                                   **options)


def decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, o: torch.Tensor,
                     kv_indptr: torch.Tensor, kv_indices: torch.Tensor, *, sm_scale: float | None = None,
                     sliding_window: int = -1, logit_cap: float = 0.0) -> None:
    """One query token per request (``q``, ``o`` ``[B, H, D]``) over that request's slots.

    The request's own new token must already be stored (`store_kv`) and be the last entry
    of its ``kv_indices`` range (SGLang's convention); it sits at position ``len - 1``.
    Writes ``o`` in place.
    """
    batch = check_decode(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, sm_scale, sliding_window, logit_cap)
    options = dict(sliding_window=sliding_window, logit_cap=float(logit_cap))
    if uses_triton(q):
        _triton().decode_attention(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, batch, **options)
    else:
        reference.decode_attention(q, k_buffer, v_buffer, o, kv_indices, batch, **options)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write token i's ``k[i]``, ``v[i]`` ``[N, Hkv, D]`` into slot ``slot_mapping[i]`` of the pool.

    A negative slot skips that token (padding). Slots must be distinct and in range.
    """
    check_store(k, v, k_buffer, v_buffer, slot_mapping)
    impl = _triton() if uses_triton(k) else reference
    impl.store_kv(k, v, k_buffer, v_buffer, slot_mapping)


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
