"""A request's KV packed layer-major into one buffer (``pddcore.pack``'s order): the byte
range of each layer, and a :class:`KVLayout` over the buffer that reads pages of it back.

The producer stages each request this way, and a push buffer on the consumer mirrors that
copy byte for byte. For ``n`` pages::

    [layer 0: K pages 0..n | V pages 0..n][layer 1: ...] ...     offsets[l], offsets[l + 1]

Example::

    offsets = layer_offsets(pool_layout, n)                       # [0, bytes of layer 0, ...]
    view = layer_major_layout(pool_layout, n, buffer.tensor, "cpu")
    pack(view, torch.arange(2, n), out=part)                      # pages 2.. of every layer
"""

from __future__ import annotations

import torch

from ...layout import KVLayout

__all__ = ["layer_offsets", "layer_major_layout"]


def layer_offsets(src: KVLayout, num_pages: int) -> list[int]:
    """Where each layer of ``num_pages`` pages of ``src`` starts, plus the total at the end."""
    offsets = [0]
    for layer in range(src.num_layers):
        offsets.append(offsets[-1] + src.packed_nbytes(num_pages, layers=[layer]))
    return offsets


def layer_major_layout(src: KVLayout, num_pages: int, buffer: torch.Tensor, device: torch.device | str) -> KVLayout:
    """A layout with ``src``'s cells over ``buffer`` (uint8, on ``device``) holding ``num_pages``
    pages packed layer-major; page ``i`` is the ``i``-th page packed."""
    offsets = layer_offsets(src, num_pages)
    if buffer.numel() < offsets[-1]:
        raise ValueError(f"buffer of {buffer.numel()} bytes is smaller than {num_pages} pages ({offsets[-1]})")
    ppl, planes = src.planes_per_layer, src.planes
    ptrs = [buffer.data_ptr() + offsets[layer] + p * num_pages * planes[layer * ppl + p].page_bytes
            for layer in range(src.num_layers) for p in range(ppl)]
    first = planes[0]
    return KVLayout.from_pointers(ptrs[::ppl], [planes[i * ppl].page_bytes for i in range(src.num_layers)], num_pages,
                                  v_ptrs=ptrs[1::ppl] if ppl == 2 else None, device=device,
                                  tokens_per_page=first.tokens_per_page, num_kv_heads=first.num_heads)
