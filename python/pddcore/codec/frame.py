"""The self-describing frame every codec writes, and what all codecs share: reading the
input, checking the caller's ``out`` tensor, checksums.

Frame layout (little-endian)::

    magic "PDKC" | version u8 | codec id u8 | dtype code u8 | ndim u8
    | meta_len u32 | body_len u64 | content_crc u32            (24 bytes)
    | shape: ndim x u64
    | meta: meta_len bytes (codec specific: segment lengths, fp8 scales)
    | header_crc u32  (CRC32C of every header byte before it)
    | body: body_len bytes

``content_crc`` is the CRC32C of the decoded tensor's bytes for lossless codecs (end to
end: it also catches a bad decompression) and of the body for lossy ones. A frame is
exactly header + body long; anything else is rejected.

Example::

    header = FrameHeader(codec_id=1, dtype=torch.bfloat16, shape=(4, 16), meta=b"", body_len=3, content_crc=7)
    frame = header.to_bytes() + b"abc"
    FrameHeader.parse(frame).shape          # (4, 16)
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import _C

__all__ = ["CodecError", "FrameHeader", "Source", "read_source", "check_out", "write_out", "crc32c_of",
           "element_size", "tensor_of"]

MAGIC = b"PDKC"
VERSION = 1
_PREFIX = struct.Struct("<4sBBBBIQI")
_U32 = struct.Struct("<I")
_MAX_NDIM = 16

# Wire codes of the dtypes a frame can carry; never renumber (frames outlive processes).
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.uint8: 1, torch.int8: 2, torch.int16: 3, torch.int32: 4, torch.int64: 5, torch.bool: 6,
    torch.float16: 7, torch.bfloat16: 8, torch.float32: 9, torch.float64: 10,
}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
# Same-size integer views: copying through them moves bits, never values (NaN payloads survive).
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CRC_CHUNK = 4 << 20


class CodecError(ValueError):
    """A frame could not be encoded or decoded: bad input, a truncated or corrupted frame,
    or an ``out`` tensor of the wrong dtype or shape. Nothing was written to ``out``."""


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def crc32c_of(data: np.ndarray | bytes, crc: int = 0) -> int:
    """CRC32C of a uint8 array's bytes, chained over chunks so the copy into ``bytes`` that
    ``_C.crc32c`` needs stays small."""
    if isinstance(data, bytes):
        return _C.crc32c(data, crc)
    for start in range(0, data.size, _CRC_CHUNK):
        crc = _C.crc32c(data[start:start + _CRC_CHUNK].tobytes(), crc)
    return crc


@dataclass(frozen=True)
class FrameHeader:
    codec_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    meta: bytes
    body_len: int
    content_crc: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the decoded tensor."""
        return self.numel * element_size(self.dtype)

    @property
    def header_len(self) -> int:
        return _PREFIX.size + 8 * len(self.shape) + len(self.meta) + _U32.size

    def to_bytes(self) -> bytes:
        head = (_PREFIX.pack(MAGIC, VERSION, self.codec_id, DTYPE_CODES[self.dtype], len(self.shape), len(self.meta),
                             self.body_len, self.content_crc)
                + struct.pack(f"<{len(self.shape)}Q", *self.shape) + self.meta)
        return head + _U32.pack(_C.crc32c(head))

    @classmethod
    def parse(cls, frame: bytes | memoryview) -> FrameHeader:
        """Reads and checks the header of ``frame``; raises :class:`CodecError` on a wrong
        magic or version, an unknown dtype, a corrupted header or a length that does not add up."""
        frame = memoryview(frame)
        if len(frame) < _PREFIX.size:
            raise CodecError(f"truncated frame: {len(frame)} bytes, a header alone takes {_PREFIX.size}")
        magic, version, codec_id, dtype_code, ndim, meta_len, body_len, content_crc = _PREFIX.unpack_from(frame)
        if magic != MAGIC:
            raise CodecError(f"not a pddcore codec frame (magic {bytes(magic)!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise CodecError(f"codec frame version {version} is not supported (this pddcore reads {VERSION})")
        if ndim > _MAX_NDIM:
            raise CodecError(f"corrupted frame header: ndim {ndim}")
        header_len = _PREFIX.size + 8 * ndim + meta_len + _U32.size
        if len(frame) < header_len:
            raise CodecError(f"truncated frame: {len(frame)} bytes, its header alone takes {header_len}")
        (header_crc,) = _U32.unpack_from(frame, header_len - _U32.size)
        if _C.crc32c(bytes(frame[:header_len - _U32.size])) != header_crc:
            raise CodecError("corrupted frame header (CRC32C mismatch)")
        if dtype_code not in _DTYPES:
            raise CodecError(f"frame carries unknown dtype code {dtype_code}")
        if len(frame) != header_len + body_len:
            raise CodecError(f"frame is {len(frame)} bytes, its header says {header_len + body_len}"
                             f"{' (truncated)' if len(frame) < header_len + body_len else ''}")
        shape = struct.unpack_from(f"<{ndim}Q", frame, _PREFIX.size)
        meta = bytes(frame[_PREFIX.size + 8 * ndim:header_len - _U32.size])
        return cls(codec_id, _DTYPES[dtype_code], tuple(shape), meta, body_len, content_crc)


@dataclass(frozen=True)
class Source:
    """An encoder's input: its dtype, shape and bytes, plus the tensor itself (contiguous,
    on the CPU) when it came as one."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    raw: np.ndarray  # [nbytes] uint8, a view of the input's memory
    tensor: torch.Tensor | None


def read_source(data: Any) -> Source:
    """Accepts a torch tensor (any device, any strides: copied to a contiguous CPU tensor
    when needed) or a bytes-like object (read in place as a 1-D uint8 tensor)."""
    if isinstance(data, torch.Tensor):
        if data.dtype not in DTYPE_CODES:
            raise CodecError(f"codecs carry {', '.join(map(str, DTYPE_CODES))}; got {data.dtype}")
        tensor = data.detach().to("cpu").contiguous()
        return Source(tensor.dtype, tuple(tensor.shape), tensor.reshape(-1).view(torch.uint8).numpy(), tensor)
    try:
        view = memoryview(data).cast("B")
    except TypeError:
        raise CodecError(f"cannot encode {type(data).__name__}: need a torch.Tensor or a bytes-like object") from None
    return Source(torch.uint8, (len(view),), np.frombuffer(view, dtype=np.uint8), None)


def tensor_of(raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A writable uint8 array's bytes as a tensor of ``dtype`` and ``shape`` (no copy)."""
    if raw.size == 0:
        return torch.empty(shape, dtype=dtype)  # torch cannot reinterpret an empty numpy array's strides
    return torch.from_numpy(raw).view(dtype).view(shape)


def check_out(header: FrameHeader, out: torch.Tensor | None, max_bytes: int | None) -> None:
    """Raises :class:`CodecError` unless ``out`` has the frame's dtype and shape or, without
    ``out``, the frame decodes to at most ``max_bytes`` (which must then be given)."""
    if out is None:
        if max_bytes is None:
            raise CodecError("decoding without out needs max_bytes: the most decoded bytes this caller accepts "
                             "(a frame's header could claim any size)")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise CodecError(f"max_bytes must be a non-negative int, got {max_bytes!r}")
        if header.nbytes > max_bytes:
            raise CodecError(f"frame decodes to {header.nbytes} bytes ({header.dtype} {header.shape}), "
                             f"more than max_bytes={max_bytes}")
        return
    if not isinstance(out, torch.Tensor):
        raise CodecError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != header.dtype or tuple(out.shape) != header.shape:
        raise CodecError(f"out is {out.dtype} {tuple(out.shape)}; the frame holds {header.dtype} {header.shape}")


def write_out(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``result`` (verified, the frame's dtype and shape) as the caller's tensor: copied bit
    for bit into ``out`` (any strides, any device), or returned itself."""
    if out is None:
        return result
    bits = _BITS_DTYPE[result.element_size()]
    out.view(bits).copy_(result.view(bits))
    return out
