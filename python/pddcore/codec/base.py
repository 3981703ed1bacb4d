"""`Codec`: what every KV codec offers (a name, a wire id, encode and decode)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from .frame import CodecError, FrameHeader, check_out

__all__ = ["Codec"]


class Codec(ABC):
    """Turns a tensor (or bytes) into one self-describing frame and back.

    ``encode(x)`` takes a torch tensor (any shape; float16 / bfloat16 / float32 / float64,
    integer or bool, as the codec allows) or a bytes-like object (a 1-D uint8 tensor) and
    returns the frame as ``bytes``. ``decode(frame, out=None, max_bytes=None)`` returns the
    tensor: written into ``out`` (which must have the frame's dtype and shape), or newly
    allocated, which needs ``max_bytes``: the most decoded bytes the caller expects. A frame
    claiming more is refused before anything is allocated, so a small frame from a peer
    cannot make the receiver allocate whatever its header says. On a bad frame or ``out``
    it raises :class:`CodecError` and leaves ``out`` untouched.
    """

    name: str
    codec_id: int
    lossless: bool

    @abstractmethod
    def encode(self, data: Any) -> bytes:
        """The frame of ``data``."""

    def decode(self, frame: bytes | bytearray | memoryview, out: torch.Tensor | None = None, *,
               max_bytes: int | None = None) -> torch.Tensor:
        """The tensor held by ``frame``, in ``out`` when given; else newly allocated, at most
        ``max_bytes`` (required then) decoded bytes."""
        frame = memoryview(frame).cast("B")
        header = FrameHeader.parse(frame)
        if header.codec_id != self.codec_id:
            raise CodecError(f"frame was written by codec id {header.codec_id}, not by {self.name!r} "
                             f"(id {self.codec_id}); pddcore.codec.decode() picks the codec from the frame")
        check_out(header, out, max_bytes)
        return self._decode(header, frame[header.header_len:], out)

    @abstractmethod
    def _decode(self, header: FrameHeader, body: memoryview, out: torch.Tensor | None) -> torch.Tensor:
        """Decodes a checked header's ``body``; writes ``out`` only once the result is verified."""

    def __repr__(self) -> str:
        return f"<pddcore codec {self.name!r}>"
