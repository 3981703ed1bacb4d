"""The codec registry: codecs by name (:func:`get`) and frames decoded by the codec id they carry."""

from __future__ import annotations

import torch

from .base import Codec
from .fp8 import Fp8Codec
from .frame import CodecError, FrameHeader
from .lossless import BytePlaneCodec, _Lz4, _Zstd

__all__ = ["get", "available", "decode", "DEFAULT_LOSSLESS"]

DEFAULT_LOSSLESS = "zstd"

_CODECS: dict[str, Codec] = {c.name: c for c in (
    BytePlaneCodec("none", 1, None),
    BytePlaneCodec("zstd", 2, _Zstd(level=1)),
    BytePlaneCodec("lz4", 3, _Lz4()),
    Fp8Codec(),
)}
_BY_ID = {c.codec_id: c for c in _CODECS.values()}


def available() -> list[str]:
    """Names of the registered codecs."""
    return list(_CODECS)


def get(name: str, threads: int = 1) -> Codec:
    """The codec called ``name`` (see :func:`available`); ValueError for an unknown name.
    ``threads``: the lossless codecs code their segments on that many threads (the frame
    does not change); ``fp8`` runs on torch's own threads and takes only 1."""
    try:
        found = _CODECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(_CODECS)}") from None
    if isinstance(found, BytePlaneCodec):
        return found.with_threads(threads)
    if threads != 1:
        raise ValueError(f"codec {name!r} takes threads=1 only (torch parallelizes it), got {threads!r}")
    return found


def decode(frame: bytes | bytearray | memoryview, out: torch.Tensor | None = None, *,
           max_bytes: int | None = None) -> torch.Tensor:
    """Decodes a frame of any codec (named by the frame itself) into ``out``, or into a new
    tensor of at most ``max_bytes`` (required without ``out``; a larger claim raises
    :class:`CodecError` before anything is allocated)."""
    header = FrameHeader.parse(memoryview(frame).cast("B"))
    codec = _BY_ID.get(header.codec_id)
    if codec is None:
        raise CodecError(f"frame names codec id {header.codec_id}, which this pddcore does not have")
    return codec.decode(frame, out, max_bytes=max_bytes)
