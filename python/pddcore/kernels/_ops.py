"""The kernels as ``torch.library`` custom ops (``torch.ops.pddcore.*``).

torch.compile and CUDA graphs see each op whole: its fake (meta) implementation says it
only writes its output argument, and its real one dispatches to the Triton kernels or the
torch reference. The ops take the host copy of the ragged offsets (from a plan) as int
lists, so nothing in them reads a tensor back to the host. Arguments arrive checked by
`pddcore.kernels`; call the public functions and plans, not these.

`extend_attention`, `decode_attention` and `store_kv` here go through the ops only while
torch.compile traces; eagerly they call the implementation directly, since the
dispatcher costs tens of microseconds per call (per layer, in a forward pass).
"""

from __future__ import annotations

import contextlib
import os

import torch

from . import reference
from ._checks import Batch, as_paged_pool

__all__ = ["uses_triton"]


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


def _on_device(device: torch.device):
    """Triton launches on the current CUDA device's stream: make it the tensors' device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _batch(qo_offsets: list[int], kv_offsets: list[int], q: torch.Tensor, k_buffer: torch.Tensor,
           sm_scale: float) -> Batch:
    _, page_size, kv_heads, head_dim = as_paged_pool(k_buffer).shape
    return Batch(list(qo_offsets), list(kv_offsets), q.shape[1], kv_heads, head_dim, page_size, sm_scale)


def _extend_attention(q_extend: torch.Tensor, k_extend: torch.Tensor, v_extend: torch.Tensor, o_extend: torch.Tensor,
                     k_buffer: torch.Tensor, v_buffer: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor, qo_offsets: list[int], kv_offsets: list[int], sm_scale: float,
                     causal: bool, sliding_window: int, logit_cap: float) -> None:
    batch = _batch(qo_offsets, kv_offsets, q_extend, k_buffer, sm_scale)
    options = dict(causal=causal, sliding_window=sliding_window, logit_cap=logit_cap)
    if uses_triton(q_extend):
        with _on_device(q_extend.device):
            _triton().extend_attention(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr,
                                       kv_indptr, kv_indices, batch, **options)
    else:
        reference.extend_attention(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, kv_indices, batch,
                                   **options)


def _decode_attention(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, o: torch.Tensor,
                     qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     kv_offsets: list[int], sm_scale: float, sliding_window: int, logit_cap: float) -> None:
    batch = _batch(list(range(len(kv_offsets))), kv_offsets, q, k_buffer, sm_scale)
    options = dict(sliding_window=sliding_window, logit_cap=logit_cap)
    if uses_triton(q):
        with _on_device(q.device):
            _triton().decode_attention(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, batch, qo_indptr=qo_indptr,
                                       **options)
    else:
        reference.decode_attention(q, k_buffer, v_buffer, o, kv_indices, batch, **options)


def _store_kv(k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    if uses_triton(k):
        with _on_device(k.device):
            _triton().store_kv(k, v, k_buffer, v_buffer, slot_mapping)
    else:
        reference.store_kv(k, v, k_buffer, v_buffer, slot_mapping)


_extend_op = torch.library.custom_op("pddcore::extend_attention", _extend_attention, mutates_args=("o_extend",))
_decode_op = torch.library.custom_op("pddcore::decode_attention", _decode_attention, mutates_args=("o",))
_store_op = torch.library.custom_op("pddcore::store_kv", _store_kv, mutates_args=("k_buffer", "v_buffer"))


def extend_attention(*args) -> None:
    (_extend_op if torch.compiler.is_compiling() else _extend_attention)(*args)


def decode_attention(*args) -> None:
    (_decode_op if torch.compiler.is_compiling() else _decode_attention)(*args)


def store_kv(*args) -> None:
    (_store_op if torch.compiler.is_compiling() else _store_kv)(*args)


@_extend_op.register_fake
def _(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, qo_offsets,
      kv_offsets, sm_scale, causal, sliding_window, logit_cap) -> None:
    return None


@_decode_op.register_fake
def _(q, k_buffer, v_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_offsets, sm_scale, sliding_window,
      logit_cap) -> None:
    return None


@_store_op.register_fake
def _(k, v, k_buffer, v_buffer, slot_mapping) -> None:
    return None
