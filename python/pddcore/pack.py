"""Gather pages of a paged KV pool into one contiguous byte buffer, and back.

Packed byte order is layer-major, exactly::

    for layer in layers:                 # all layers, or the `layers` given, in that order
        for plane in planes(layer):      # K then V (one latent plane for MLA)
            for page in page_ids:        # in the order given; repeats allowed
                for token in page:       # only matters with a head slice
                    bytes of heads [h0, h1) of that token

so layer i's bytes can be sent as soon as that layer is ready. Consecutive page ids are
coalesced into one copy. On CPU the copy runs on a pool of C++ threads with the GIL
released; on CUDA it is one kernel launch that may write straight into pinned host
memory. Every check runs before the first byte moves: on a bad argument nothing is written.

Example::

    layout = KVLayout.from_tensors(k_layers, v_layers)
    ids = torch.tensor([7, 8, 9, 2], dtype=torch.int64)
    buf = pack(layout, ids)                       # uint8 tensor, layout.packed_nbytes(4) bytes
    unpack(other_layout, torch.arange(4), buf)    # lands them in pages 0..3 elsewhere
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import _C
from .layout import KVLayout, _normalize_heads

__all__ = ["pack", "unpack", "set_num_threads", "get_num_threads"]


def _page_ids_on_host(page_ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(page_ids, torch.Tensor):
        raise ValueError(f"page_ids must be a 1-D int32/int64 torch.Tensor, got {type(page_ids).__name__}")
    if page_ids.dim() != 1:
        raise ValueError(f"page_ids must be 1-D, got shape {tuple(page_ids.shape)}")
    if page_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"page_ids must be int32 or int64, got {page_ids.dtype}")
    return page_ids.detach().to("cpu").contiguous()


def _check_buffer(layout: KVLayout, buf: torch.Tensor, name: str) -> None:
    if not isinstance(buf, torch.Tensor):
        raise ValueError(f"{name} must be a torch.uint8 tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8:
        raise ValueError(f"{name} must be torch.uint8, got {buf.dtype}")
    if buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"{name} must be 1-D and contiguous, got shape {tuple(buf.shape)} strides {buf.stride()}")
    if layout.device.type == "cuda":
        if buf.device.type == "cpu" and not buf.is_pinned():
            raise ValueError(f"{name} is pageable host memory; a CUDA layout needs a CUDA tensor or pinned memory")
    elif buf.device.type != "cpu":
        raise ValueError(f"{name} is on {buf.device} but the layout is on {layout.device}")


def _run(fn, layout: KVLayout, page_ids: torch.Tensor, buf: torch.Tensor, layers, heads) -> None:
    ids = _page_ids_on_host(page_ids)
    h0, h1 = _normalize_heads(heads)
    if heads is not None and layout.is_mla:
        raise ValueError("heads= does not apply to an MLA layout: its latent plane is not split by head")
    on_cuda = layout.device.type == "cuda"
    stream = torch.cuda.current_stream(layout.device).cuda_stream if on_cuda else 0
    fn(layout._desc, ids, buf, list(layers or []), h0, h1, on_cuda, stream)


def pack(layout: KVLayout, page_ids: torch.Tensor, *, layers: Sequence[int] | None = None,
         heads: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copies the pages ``page_ids`` of ``layout`` into one uint8 buffer and returns it.

    Args:
        layout: the pool to read.
        page_ids: 1-D int32/int64 tensor of page indices (any order, repeats allowed).
        layers: layer indices to include (default: all).
        heads: ``(h0, h1)`` KV-head range taken from every token (default: all heads).
        out: optional destination, 1-D contiguous uint8 of at least
            ``layout.packed_nbytes(len(page_ids), layers, heads)`` bytes; on a CUDA layout
            it may be pinned host memory.
    Returns:
        ``out`` (or a new tensor on the layout's device), exactly the packed bytes long.
    """
    nbytes = layout.packed_nbytes(int(page_ids.numel()) if isinstance(page_ids, torch.Tensor) else 0, layers, heads)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=layout.device)
    _check_buffer(layout, out, "out")
    _run(_C.pack, layout, page_ids, out, layers, heads)
    return out[:nbytes]


def unpack(layout: KVLayout, page_ids: torch.Tensor, buf: torch.Tensor, *, layers: Sequence[int] | None = None,
           heads: tuple[int, int] | None = None) -> None:
    """Writes a buffer produced by :func:`pack` (same layers and heads) into the pages
    ``page_ids`` of ``layout``. Raises ``ValueError`` and writes nothing if ``buf`` is
    shorter than ``layout.packed_nbytes(len(page_ids), layers, heads)``."""
    _check_buffer(layout, buf, "buf")
    _run(_C.unpack, layout, page_ids, buf, layers, heads)


def set_num_threads(n: int) -> None:
    """Sets how many CPU threads pack/unpack use (default: all cores)."""
    _C.set_num_threads(int(n))


def get_num_threads() -> int:
    return int(_C.get_num_threads())
