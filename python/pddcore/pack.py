"""Gather pages of a paged KV pool into one contiguous byte buffer, and back.

Packed byte order is layer-major, exactly::

    for layer in layers:                 # all layers, or the `layers` given, in that order
        for plane in planes(layer):      # K then V (one latent plane for MLA)
            for page in page_ids:        # in the order given; repeats allowed
                for token in page:       # only matters with a head slice
                    bytes of heads [h0, h1) of that token

so layer i's bytes can be sent as soon as that layer is ready. Consecutive page ids are
coalesced into one copy.

Between pools that share a page format (equal :attr:`KVLayout.pool_page_format`, e.g.
two vLLM 0.33 engines), ``order="pool"`` moves each page as it lies in the pool instead::

    for layer in layers:
        for span in spans(layer):        # K and V together where they alternate within a
            for page in page_ids:        # page (vLLM's rows); else each plane on its own
                the span's bytes, as in the pool

one copy per run of consecutive page ids rather than one per 256-byte cell; same size as
the canonical bytes, no head slice. ``unpack(..., order="pool", page_format=...)`` takes
the packing layout's ``pool_page_format`` and refuses a buffer from a pool of another
format (ValueError, nothing written). On CPU the copy runs on a pool of C++ threads with the GIL
released; on CUDA it is one kernel launch, on the layout's device and that device's
current stream, that may write straight into pinned host memory. Every check runs
before the first byte moves: on a bad argument nothing is written.

`pack` and `unpack` plan and run in one call. A `PackPlan` splits them as FlashInfer
does: the plan reads the page ids on the host and checks them once per batch; running it
does no host work but the copy (on CUDA: one launch, so it can be captured in a CUDA
graph). Under ``torch.compile`` both run through the ``torch.ops.pddcore.pack`` /
``unpack`` custom ops, which it keeps whole (no graph break).

Example::

    layout = KVLayout.from_tensors(k_layers, v_layers)
    ids = torch.tensor([7, 8, 9, 2], dtype=torch.int64)
    buf = pack(layout, ids)                       # uint8 tensor, layout.packed_nbytes(4) bytes
    unpack(other_layout, torch.arange(4), buf)    # lands them in pages 0..3 elsewhere

    plan = PackPlan(layout, ids)                  # once per batch
    plan.pack(out=buf)                            # any number of times, e.g. inside a CUDA graph
"""

from __future__ import annotations

import itertools
import weakref
from typing import Sequence

import torch

from . import _C
from .layout import KVLayout, _normalize_heads

__all__ = ["pack", "unpack", "PackPlan", "set_num_threads", "get_num_threads"]

# Plans by id: the custom ops take a plan's id (an int torch.compile can bake into a graph).
_PLANS: "weakref.WeakValueDictionary[int, PackPlan]" = weakref.WeakValueDictionary()
_PLAN_IDS = itertools.count(1)


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
        if buf.device.type == "cuda" and buf.device != layout.device:
            raise ValueError(f"{name} is on {buf.device} but the layout is on {layout.device}")
    elif buf.device.type != "cpu":
        raise ValueError(f"{name} is on {buf.device} but the layout is on {layout.device}")


class PackPlan:
    """The checked copy plan of ``page_ids`` (with ``layers`` and ``heads``) of ``layout``.

    Built once per batch: the page ids are read on the host and checked, and on CUDA the
    copy items are uploaded to the layout's device (the constructor waits for that upload,
    so the plan runs on any stream). Then `pack` / `unpack` copy with no host work but
    the launch. The plan holds the layout; keep the plan alive as long as a CUDA graph
    that ran it.
    """

    def __init__(self, layout: KVLayout, page_ids: torch.Tensor, *, layers: Sequence[int] | None = None,
                 heads: tuple[int, int] | None = None, order: str = "canonical", page_format: tuple | None = None,
                 _wait_for_upload: bool = True):
        if not isinstance(layout, KVLayout):
            raise ValueError(f"layout must be a KVLayout, got {type(layout).__name__}")
        ids = _page_ids_on_host(page_ids)
        h0, h1 = _normalize_heads(heads)
        if heads is not None and layout.is_mla:
            raise ValueError("heads= does not apply to an MLA layout: its latent plane is not split by head")
        if order not in ("canonical", "pool"):
            raise ValueError(f"order must be 'canonical' or 'pool', got {order!r}")
        if order == "pool" and heads is not None:
            raise ValueError("order='pool' moves whole pages: heads= does not apply")
        if order == "canonical" and page_format is not None:
            raise ValueError("page_format= applies to order='pool' only")
        if page_format is not None and page_format != layout.pool_page_format:
            raise ValueError("page_format differs from this layout's pool_page_format: pages in pool order from a "
                             "pool of another format would land scrambled; use order='canonical'")
        self.layout = layout
        self.order = order
        self._page_format = page_format
        self._selection = (ids, layers, heads, order, page_format)
        on_cuda = layout.device.type == "cuda"
        self._plan = _C.CopyPlan(layout._desc, ids, list(layers or []), h0, h1, on_cuda, order == "pool")
        self.nbytes = int(self._plan.nbytes)  # bytes the selection packs to
        self._table = None
        if on_cuda:
            stream = torch.cuda.current_stream(layout.device)
            self._table = torch.empty(self._plan.device_table_nbytes, dtype=torch.uint8, device=layout.device)
            _C.upload_copy_plan(self._plan, self._table, layout.device.index, stream.cuda_stream)
            self._table_stream = stream
            if _wait_for_upload:
                stream.synchronize()
        self._id = next(_PLAN_IDS)
        _PLANS[self._id] = self

    def pack(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copies the planned pages into ``out`` (a new tensor on the layout's device by
        default; on a CUDA layout ``out`` may be pinned host memory) and returns the
        ``nbytes`` long packed view of it."""
        if out is None:
            out = torch.empty(self.nbytes, dtype=torch.uint8, device=self.layout.device)
        _check_buffer(self.layout, out, "out")
        self._check_size(out, "out")
        if torch.compiler.is_compiling():
            torch.ops.pddcore.pack(self._id, out, self.layout.tensors)
        else:  # eagerly, skip the dispatcher's tens of microseconds
            self._run(out, True, self.layout.tensors)
        return out[:self.nbytes]

    def unpack(self, buf: torch.Tensor) -> None:
        """Writes ``buf`` (what `pack` produced for the same layers and heads) into the
        planned pages. In pool order the plan must have been given the packing layout's
        ``page_format``."""
        if self.order == "pool" and self._page_format is None:
            raise ValueError("unpacking in pool order needs page_format= (the packing layout's pool_page_format)")
        _check_buffer(self.layout, buf, "buf")
        self._check_size(buf, "buf")
        if torch.compiler.is_compiling():
            torch.ops.pddcore.unpack(self._id, buf, self.layout.tensors)
        else:
            self._run(buf, False, self.layout.tensors)

    def _check_size(self, buf: torch.Tensor, name: str) -> None:
        if buf.numel() < self.nbytes:
            raise ValueError(f"buffer too small: {name} holds {buf.numel()} bytes, need {self.nbytes}")

    def _run(self, buf: torch.Tensor, pack: bool, planes: list[torch.Tensor]) -> None:
        """Copies between ``buf`` and ``planes``: the layout's own tensors, or copies of
        them that torch.compile's functionalization made (then planned again over those)."""
        own = self.layout.tensors
        if any(a.data_ptr() != b.data_ptr() for a, b in zip(planes, own)):
            ids, layers, heads, order, page_format = self._selection
            PackPlan(self.layout.over(planes), ids, layers=layers, heads=heads, order=order, page_format=page_format,
                     _wait_for_upload=False)._run(buf, pack, planes)
            return
        if self._table is None:
            _C.run_copy_plan_cpu(self._plan, buf, pack)
            return
        device = self.layout.device
        stream = torch.cuda.current_stream(device)
        if stream != self._table_stream:
            self._table.record_stream(stream)  # the caching allocator must not reuse it before this copy ends
        _C.run_copy_plan_cuda(self._plan, self._table, buf, pack, device.index, stream.cuda_stream)


def _plan_of(plan_id: int) -> PackPlan:
    plan = _PLANS.get(plan_id)
    if plan is None:
        raise ValueError(f"no live PackPlan with id {plan_id}")
    return plan


@torch.library.custom_op("pddcore::pack", mutates_args=("out",))
def _pack_op(plan_id: int, out: torch.Tensor, planes: list[torch.Tensor]) -> None:
    """Runs `PackPlan` ``plan_id`` from ``planes`` (the layout's tensors, so torch.compile
    sees what the copy reads) into ``out``."""
    _plan_of(plan_id)._run(out, True, planes)


@torch.library.custom_op("pddcore::unpack", mutates_args=("planes",))
def _unpack_op(plan_id: int, buf: torch.Tensor, planes: list[torch.Tensor]) -> None:
    """Runs `PackPlan` ``plan_id`` from ``buf`` into ``planes`` (the layout's tensors, so
    torch.compile sees what the copy writes)."""
    _plan_of(plan_id)._run(buf, False, planes)


@_pack_op.register_fake
def _(plan_id, out, planes) -> None:
    return None


@_unpack_op.register_fake
def _(plan_id, buf, planes) -> None:
    return None


def pack(layout: KVLayout, page_ids: torch.Tensor, *, layers: Sequence[int] | None = None,
         heads: tuple[int, int] | None = None, out: torch.Tensor | None = None,
         order: str = "canonical") -> torch.Tensor:
    """Copies the pages ``page_ids`` of ``layout`` into one uint8 buffer and returns it.

    Args:
        layout: the pool to read.
        page_ids: 1-D int32/int64 tensor of page indices (any order, repeats allowed).
        layers: layer indices to include (default: all).
        heads: ``(h0, h1)`` KV-head range taken from every token (default: all heads).
        out: optional destination, 1-D contiguous uint8 of at least
            ``layout.packed_nbytes(len(page_ids), layers, heads)`` bytes; on a CUDA layout
            it may be pinned host memory.
        order: ``"canonical"`` (any pool unpacks it) or ``"pool"`` (whole pages as they lie
            in the pool, for a pool of the same ``pool_page_format``; no ``heads``).
    Returns:
        ``out`` (or a new tensor on the layout's device), exactly the packed bytes long.
    """
    return PackPlan(layout, page_ids, layers=layers, heads=heads, order=order, _wait_for_upload=False).pack(out)


def unpack(layout: KVLayout, page_ids: torch.Tensor, buf: torch.Tensor, *, layers: Sequence[int] | None = None,
           heads: tuple[int, int] | None = None, order: str = "canonical", page_format: tuple | None = None) -> None:
    """Writes a buffer produced by :func:`pack` (same layers, heads and order) into the
    pages ``page_ids`` of ``layout``. Raises ``ValueError`` and writes nothing if ``buf``
    is shorter than ``layout.packed_nbytes(len(page_ids), layers, heads)``, or, in pool
    order, unless ``page_format`` (the packing layout's ``pool_page_format``) equals this
    layout's."""
    if order == "pool" and page_format is None:
        raise ValueError("unpacking in pool order needs page_format= (the packing layout's pool_page_format)")
    PackPlan(layout, page_ids, layers=layers, heads=heads, order=order, page_format=page_format,
             _wait_for_upload=False).unpack(buf)


def set_num_threads(n: int) -> None:
    """Sets how many CPU threads pack/unpack use (default: all cores)."""
    _C.set_num_threads(int(n))


def get_num_threads() -> int:
    return int(_C.get_num_threads())
