"""`KVLayout`: a zero-copy description of an engine's paged KV pool.

A pool is a list of layers; each layer has either two planes (K and V, for MHA and
GQA) or one plane (the MLA latent). A plane is a tensor (or raw memory) whose dim 0
is the page index; a page is a grid of ``tokens_per_page x num_kv_heads`` cells, each
one head of one token (``head_bytes`` contiguous bytes)::

    cell(page, t, h) = base + page * page_stride + t * token_stride + h * head_stride

Dense token-major pages are the common case, but any strides whose cells do not
overlap work: FlashInfer's ``[num_pages, 2, page_size, heads, dim]`` through its
``[:, 0]`` and ``[:, 1]`` views, head-major ``[pages, heads, page_size, dim]`` pages
permuted to ``[pages, page_size, heads, dim]``, and vLLM 0.33's per-layer
``[blocks, heads, block_size, head_size + head_size_v]`` caches whose K and V halves
alternate within every row (``t[..., :head_size]`` and ``t[..., head_size:]``,
permuted). :func:`pddcore.pack` always produces the same canonical byte order, so
pools of different layouts exchange pages. The copy is bytewise, so any dtype works
(fp32, fp16, bf16, fp8, int8).

Example::

    k = [torch.zeros(64, 16, 8, 128, dtype=torch.bfloat16) for _ in range(4)]  # [pages, tokens, heads, dim]
    v = [torch.zeros_like(t) for t in k]
    layout = KVLayout.from_tensors(k, v)
    layout.packed_nbytes(10)          # 4 layers * 2 planes * 10 pages * 32 KiB
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from . import _C

__all__ = ["KVLayout", "PlaneInfo"]


@dataclass(frozen=True)
class PlaneInfo:
    """Geometry of one plane, in bytes. Addresses are host or device pointers;
    ``token_stride`` / ``head_stride`` default to a dense token-major page."""

    base: int
    num_pages: int
    page_stride: int
    tokens_per_page: int
    num_heads: int
    head_bytes: int
    token_stride: int = 0
    head_stride: int = 0

    def __post_init__(self) -> None:
        if not self.head_stride:
            object.__setattr__(self, "head_stride", self.head_bytes)
        if not self.token_stride:
            object.__setattr__(self, "token_stride", self.num_heads * self.head_stride)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page's cells (what a page packs to)."""
        return self.tokens_per_page * self.num_heads * self.head_bytes


def _normalize_heads(heads: tuple[int, int] | None) -> tuple[int, int]:
    if heads is None:
        return 0, 0
    h0, h1 = heads
    if not (0 <= h0 < h1):
        raise ValueError(f"heads=({h0}, {h1}) must satisfy 0 <= h0 < h1")
    return int(h0), int(h1)


def _resolve_device(device: torch.device) -> torch.device:
    """``cuda`` becomes ``cuda:<current device>``: the pack launchers run on one named device."""
    if device.type != "cuda" or device.index is not None:
        return device
    reason = _C.cuda_unusable_reason()
    if reason:
        raise RuntimeError(f"a KVLayout on {device} needs a usable CUDA device: {reason}")
    return torch.device("cuda", torch.cuda.current_device())


class KVLayout:
    """Describes a paged KV pool without copying it; see the module docstring.

    Build one with :meth:`from_tensors`, :meth:`from_pointers` or
    :meth:`from_sglang_kv_args`. The layout keeps the tensors it was built from alive.
    """

    def __init__(self, planes: Sequence[PlaneInfo], planes_per_layer: int, device: torch.device | str,
                 *, tensors: Sequence[torch.Tensor] = ()):
        if planes_per_layer not in (1, 2):
            raise ValueError(f"planes_per_layer must be 1 (MLA) or 2 (K and V), got {planes_per_layer}")
        self.planes: tuple[PlaneInfo, ...] = tuple(planes)
        self.planes_per_layer = planes_per_layer
        self.device = _resolve_device(torch.device(device))
        self._tensors = list(tensors)
        self._tokens_per_page_arg: int | None = None
        self._pool_page_format: tuple | None = None
        self._desc = _C.KVLayoutDesc(
            [(p.base, p.num_pages, p.page_stride, p.tokens_per_page, p.num_heads, p.head_bytes, p.token_stride,
              p.head_stride) for p in self.planes],
            planes_per_layer,
        )
        if self.device.type == "cuda":
            _C.check_cuda_layout(self._desc, self.device.index)

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def from_tensors(cls, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor] | None = None, *,
                     tokens_per_page: int | None = None) -> "KVLayout":
        """Layout over per-layer tensors; ``v=None`` means one (MLA latent) plane per layer.

        Accepted plane shapes (dim 0 is always the page):

        * ``[pages, page_size, kv_heads, head_dim]``, any strides as long as ``head_dim``
          is contiguous (vLLM blocks, FlashInfer's K/V views, permuted head-major pages,
          vLLM 0.33's K and V halves of one cache);
        * ``[pages, page_size, kv_heads, d0, d1, ...]`` with dense pages;
        * ``[slots, kv_heads, head_dim]`` (SGLang token pool, page size 1; pass
          ``tokens_per_page=16`` to view 16 consecutive slots as one page);
        * ``[pages, bytes_or_elements]`` (one opaque row per page).
        """
        if not k:
            raise ValueError("k must hold at least one layer")
        if v is not None and len(v) != len(k):
            raise ValueError(f"k has {len(k)} layers but v has {len(v)}")
        tensors = [t for pair in zip(k, v) for t in pair] if v is not None else list(k)
        device = tensors[0].device
        planes = []
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"plane {i} is a {type(t).__name__}, not a torch.Tensor")
            if t.device != device:
                raise ValueError(f"plane {i} is on {t.device} but plane 0 is on {device}")
            planes.append(cls._plane_of(t, i, tokens_per_page))
        layout = cls(planes, 2 if v is not None else 1, device, tensors=tensors)
        layout._tokens_per_page_arg = tokens_per_page
        return layout

    def over(self, tensors: Sequence[torch.Tensor]) -> "KVLayout":
        """The same kind of layout over other tensors of the same shapes (in `tensors`' order),
        e.g. copies torch.compile made of this layout's tensors. Their strides may differ:
        packed bytes are the same for any strides."""
        if len(tensors) != len(self._tensors) or not self._tensors:
            raise ValueError(f"a layout over {len(self._tensors)} tensors cannot move to {len(tensors)}")
        for i, (a, b) in enumerate(zip(tensors, self._tensors)):
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(f"plane {i}: {tuple(a.shape)} {a.dtype} does not match {tuple(b.shape)} {b.dtype}")
        if self.is_mla:
            return KVLayout.from_tensors(list(tensors), tokens_per_page=self._tokens_per_page_arg)
        return KVLayout.from_tensors(list(tensors[0::2]), list(tensors[1::2]), tokens_per_page=self._tokens_per_page_arg)

    @staticmethod
    def _plane_of(t: torch.Tensor, index: int, tokens_per_page: int | None) -> PlaneInfo:
        if t.dim() < 2:
            raise ValueError(f"plane {index} has shape {tuple(t.shape)}; need dim 0 = pages and at least one more dim")
        es = t.element_size()
        if t.dim() == 4 and t.stride(3) == 1:  # [pages, tokens, heads, dim], any cell strides
            pages, tokens, heads, dim = t.shape
            return PlaneInfo(t.data_ptr(), pages, t.stride(0) * es, tokens, heads, dim * es, t.stride(1) * es,
                             t.stride(2) * es)
        inner = t[0] if t.shape[0] > 0 else t.new_empty(t.shape[1:])
        if not inner.is_contiguous():
            raise ValueError(f"plane {index}: pages are not contiguous (strides {t.stride()} for shape {tuple(t.shape)})")
        shape = list(t.shape)
        if tokens_per_page is not None and t.dim() == 3:
            if shape[0] % tokens_per_page:
                raise ValueError(f"plane {index}: {shape[0]} slots is not a multiple of tokens_per_page={tokens_per_page}")
            if t.stride(0) != math.prod(shape[1:]):
                raise ValueError(f"plane {index}: a token pool viewed as pages needs densely packed slots")
            shape = [shape[0] // tokens_per_page, tokens_per_page] + shape[1:]
            page_stride = tokens_per_page * t.stride(0) * es
        else:
            page_stride = t.stride(0) * es
        if len(shape) >= 4:
            tokens, heads, head_bytes = shape[1], shape[2], math.prod(shape[3:]) * es
        elif len(shape) == 3:
            tokens, heads, head_bytes = 1, shape[1], shape[2] * es
        else:
            tokens, heads, head_bytes = 1, 1, shape[1] * es
        page_bytes = tokens * heads * head_bytes
        return PlaneInfo(t.data_ptr(), shape[0], max(page_stride, page_bytes) if shape[0] <= 1 else page_stride,
                         tokens, heads, head_bytes)

    @classmethod
    def from_pointers(cls, k_ptrs: Sequence[int], page_bytes: int | Sequence[int], num_pages: int | Sequence[int], *,
                      device: torch.device | str, v_ptrs: Sequence[int] | None = None,
                      tokens_per_page: int = 1, num_kv_heads: int = 1,
                      page_stride: int | None = None) -> "KVLayout":
        """Layout over raw memory: one pointer per layer for K (and V), pages densely packed
        unless ``page_stride`` says otherwise. The caller keeps that memory alive.

        ``device`` is where the pointers point (``"cpu"``, ``"cuda:1"``): it has no default,
        because reading device memory from CPU threads (or the reverse) crashes."""
        n = len(k_ptrs)
        if n == 0:
            raise ValueError("k_ptrs must hold at least one layer")
        if v_ptrs is not None and len(v_ptrs) != n:
            raise ValueError(f"k_ptrs has {n} layers but v_ptrs has {len(v_ptrs)}")
        page_bytes_l = [page_bytes] * n if isinstance(page_bytes, int) else list(page_bytes)
        num_pages_l = [num_pages] * n if isinstance(num_pages, int) else list(num_pages)
        if len(page_bytes_l) != n or len(num_pages_l) != n:
            raise ValueError("page_bytes and num_pages need one entry per layer")
        planes = []
        for layer in range(n):
            pb = page_bytes_l[layer]
            row = tokens_per_page * num_kv_heads
            if pb <= 0 or pb % row:
                raise ValueError(f"layer {layer}: page_bytes={pb} is not a positive multiple of "
                                 f"tokens_per_page*num_kv_heads={row}")
            ptrs = [k_ptrs[layer]] + ([v_ptrs[layer]] if v_ptrs is not None else [])
            for ptr in ptrs:
                planes.append(PlaneInfo(int(ptr), int(num_pages_l[layer]), int(page_stride or pb), tokens_per_page,
                                        num_kv_heads, pb // row))
        return cls(planes, 2 if v_ptrs is not None else 1, device)

    @classmethod
    def from_sglang_kv_args(cls, kv_data_ptrs: Sequence[int], kv_data_lens: Sequence[int],
                            kv_item_lens: Sequence[int], page_size: int, *, device: torch.device | str,
                            num_kv_heads: int = 1, is_mla: bool = False) -> "KVLayout":
        """Layout from SGLang's ``KVArgs`` tables: ``kv_data_ptrs`` lists all K layers then
        all V layers (MLA: just the latent layers); ``kv_item_lens`` is bytes per page.
        ``device``: where the pool lives (SGLang: ``cuda:{kv_args.gpu_id}``, or ``cpu``)."""
        ptrs, lens, items = list(kv_data_ptrs), list(kv_data_lens), list(kv_item_lens)
        if not (len(ptrs) == len(lens) == len(items)):
            raise ValueError("kv_data_ptrs, kv_data_lens and kv_item_lens must have equal lengths")
        n = len(ptrs) if is_mla else len(ptrs) // 2
        if not is_mla and len(ptrs) % 2:
            raise ValueError(f"{len(ptrs)} pointers cannot split into K and V halves")
        num_pages = [lens[i] // items[i] for i in range(n)]
        return cls.from_pointers(ptrs[:n], items[:n], num_pages, v_ptrs=None if is_mla else ptrs[n:],
                                 device=device, tokens_per_page=page_size, num_kv_heads=num_kv_heads)

    # ---- queries ---------------------------------------------------------------------------
    @property
    def tensors(self) -> list[torch.Tensor]:
        """The tensors the layout was built from (none for raw pointers)."""
        return list(self._tensors)

    @property
    def num_layers(self) -> int:
        return len(self.planes) // self.planes_per_layer

    @property
    def is_mla(self) -> bool:
        return self.planes_per_layer == 1

    @property
    def num_pages(self) -> int:
        """Pages addressable in every plane (the smallest plane bounds page ids)."""
        return min(p.num_pages for p in self.planes)

    @property
    def tokens_per_page(self) -> int:
        return self.planes[0].tokens_per_page

    @property
    def pool_page_format(self) -> tuple:
        """What :func:`pddcore.pack` with ``order="pool"`` depends on: per layer, the spans
        its pages are copied as (K and V in one where their cells tile it, as vLLM 0.33's
        rows do; else one per plane), each a tuple of its planes' ``(layer, plane, offset in
        the span, tokens_per_page, num_heads, head_bytes, token_stride, head_stride)``. Two
        pools with equal formats exchange pages in pool order. Raises ``ValueError`` for a
        layout whose planes leave gaps within a page (no pool order)."""
        if self._pool_page_format is None:
            self._pool_page_format = tuple(tuple(span) for span in self._desc.pool_page_format())
        return self._pool_page_format

    def packed_nbytes(self, num_pages: int, layers: Sequence[int] | None = None,
                      heads: tuple[int, int] | None = None) -> int:
        """Bytes that :func:`pddcore.pack` produces for ``num_pages`` page ids."""
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        h0, h1 = _normalize_heads(heads)
        return self._desc.packed_nbytes(num_pages, list(layers or []), h0, h1)

    def bytes_per_token(self, layers: Sequence[int] | None = None, heads: tuple[int, int] | None = None) -> float:
        """KV bytes one token occupies across the selected layers (what the router prices)."""
        return self.packed_nbytes(1, layers, heads) / self.tokens_per_page

    def __repr__(self) -> str:
        p = self.planes[0]
        kind = "MLA" if self.is_mla else "K/V"
        return (f"KVLayout({self.num_layers} layers, {kind}, {self.num_pages} pages x {p.tokens_per_page} tokens x "
                f"{p.num_heads} heads x {p.head_bytes} B, device={self.device})")
