"""The lossy ``"fp8"`` codec: FP8 E4M3 values with one float32 scale per page.

Opt-in only (it changes the KV the receiver decodes from). Rows along dim 0 are pages:
each row ``x[i]`` is sent as ``round_e4m3(x[i] / s_i)`` with ``s_i = amax(|x[i]|) / 448``
(448 is E4M3's largest finite value), and decoded as ``code * s_i`` in the frame's dtype.
A 1-D tensor is one page. Hand it a packed KV buffer viewed as
``[layers * planes * pages, page_elements]`` and every page of every layer's K or V plane
gets its own scale (``pddcore.pack``'s order is layer, plane, page).

Error: E4M3 keeps 3 mantissa bits, so its relative step is 2^-3 and rounding to nearest
is off by at most half a step, 2^-4 of the value (2^-10 of the scale below E4M3's
smallest normal 2^-6). Per element, ``|x - x'| <= 2^-4 |x| + 2^-10 s``, hence at most
2^-4 of the page's amax, plus the rounding of float32 arithmetic and of the output dtype.

Frame: meta = the float32 scales (one per page); body = the E4M3 codes (one byte per
element); content CRC over the body. Input must be floating point and finite.

Example::

    import torch
    import pddcore
    from pddcore import codec

    buf = pddcore.pack(layout, ids)                     # uint8, layer-major
    pages = buf.view(torch.bfloat16).view(layout.num_layers * 2 * len(ids), -1)
    frame = codec.get("fp8").encode(pages)              # ~1 byte per element + 4 per page
    codec.decode(frame, out=torch.empty_like(pages))    # within 2^-4 of each page's amax
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .base import Codec
from .frame import CodecError, FrameHeader, crc32c_of, write_out

__all__ = ["Fp8Codec", "E4M3_MAX", "page_count"]

E4M3_MAX = 448.0
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Scales stay float32 normals: a page of float64 values below float32's range still gets
# a usable scale (its values then round to zero, an error below 2^-126).
_SMALLEST_SCALE = torch.finfo(torch.float32).tiny
_LARGEST_AMAX = torch.finfo(torch.float32).max
_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()  # code -> value


def page_count(shape: tuple[int, ...]) -> int:
    """Pages (scales) of a tensor of ``shape``: dim 0 when 2-D or more, else one; none when empty."""
    if math.prod(shape) == 0:
        return 0
    return shape[0] if len(shape) >= 2 else 1


def _as_pages(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t.reshape(rows, t.numel() // rows if rows else 0)


class Fp8Codec(Codec):
    name = "fp8"
    codec_id = 4
    lossless = False

    def encode(self, data: Any) -> bytes:
        if not isinstance(data, torch.Tensor) or data.dtype not in _FLOAT_DTYPES:
            kind = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
            raise CodecError(f"fp8 encodes float16 / bfloat16 / float32 / float64 tensors, got {kind}")
        x = data.detach().to("cpu").contiguous()
        pages = _as_pages(x, page_count(tuple(x.shape)))
        amax = pages.abs().amax(dim=1).double() if pages.numel() else torch.zeros(0, dtype=torch.float64)
        bad = (~torch.isfinite(amax)) | (amax > _LARGEST_AMAX)
        if bad.any():
            raise CodecError(f"fp8 needs finite values within float32's range; page {int(bad.nonzero()[0])} "
                             f"has amax {amax[bad][0].item()}")
        scales = (amax / E4M3_MAX).float().clamp_min(_SMALLEST_SCALE)
        scales[amax == 0] = 1.0
        codes = (pages.float() / scales[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        body = codes.view(torch.uint8).numpy().tobytes()
        header = FrameHeader(self.codec_id, x.dtype, tuple(x.shape), scales.numpy().astype("<f4").tobytes(),
                             len(body), crc32c_of(body))
        return header.to_bytes() + body

    def _decode(self, header: FrameHeader, body: memoryview, out: torch.Tensor | None) -> torch.Tensor:
        if header.dtype not in _FLOAT_DTYPES:
            raise CodecError(f"corrupted frame: fp8 frame of dtype {header.dtype}")
        rows = page_count(header.shape)
        if len(header.meta) != 4 * rows or header.body_len != header.numel:
            raise CodecError(f"corrupted frame: {len(header.meta)} bytes of scales and {header.body_len} of codes "
                             f"for {rows} pages of shape {header.shape}")
        codes = np.frombuffer(body, dtype=np.uint8)
        if crc32c_of(codes) != header.content_crc:
            raise CodecError("corrupted frame: the fp8 codes fail their CRC32C")
        scales = torch.from_numpy(np.frombuffer(header.meta, dtype="<f4").astype(np.float32))
        values = _as_pages(torch.from_numpy(np.take(_E4M3_VALUES, codes)), rows)  # a table look-up: 4x torch's cast
        values *= scales[:, None]
        return write_out(values.to(header.dtype).view(header.shape), out)
