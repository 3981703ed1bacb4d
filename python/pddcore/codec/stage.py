"""The per-transfer codec stage: a codec frame crosses between :class:`pddcore.TransferEngine`
peers through registered staging regions, with no change to the engine.

Sender: :func:`send_compressed` encodes a tensor into its :class:`Staging` source, then one
verified write copies the frame into the receiver's staging target; the write's
notification is a :class:`FrameNotice` ``(key, offset, frame length)``. Receiver: the
notification arrives (``engine.poll_messages()``) only once every byte of the frame was
verified and applied, and :func:`decode_notified` decodes the frame from its staging
region into the destination tensor.

A staging range is the caller's to manage: the sender's holds the frame until the
returned :class:`~pddcore.transfer.Transfer` is done, the receiver's until
:func:`decode_notified` returns (the decoded tensor never aliases it).

Example (one process, loopback)::

    import torch
    from pddcore import TransferEngine, codec
    from pddcore.transfer import new_auth_token

    token = new_auth_token()
    with TransferEngine(auth_token=token) as md, TransferEngine(auth_token=token) as p:
        inbox = codec.Staging(md, 1 << 20, target=True)
        outbox = codec.Staging(p, 1 << 20)
        kv = torch.randn(9, 16, 2, 64).to(torch.bfloat16)
        send = codec.send_compressed(p, p.connect(md.address), kv, "zstd", inbox.descriptor(),
                                     key=b"req-7", staging=outbox)
        send.wait()
        [note] = md.poll_messages(timeout=5)
        key, got = codec.decode_notified(note, inbox, out=torch.empty_like(kv))
        assert key == b"req-7" and torch.equal(got, kv)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .frame import CodecError
from .registry import decode, get

if TYPE_CHECKING:
    from ..transfer import Message, Peer, RegionDescriptor, Transfer, TransferEngine
    from .base import Codec

__all__ = ["Staging", "FrameNotice", "send_compressed", "decode_notified"]

_NOTICE = struct.Struct("<4sBQQH")
_NOTICE_MAGIC = b"PDKN"
_NOTICE_VERSION = 1


class Staging:
    """A host byte buffer registered with ``engine`` for codec frames: a source
    (``target=False``, the sender's) or a write target (the receiver's; pass
    :meth:`descriptor` to the sender). ``buffer``: a 1-D contiguous CPU uint8 tensor to
    register, or a size in bytes to allocate one."""

    def __init__(self, engine: TransferEngine, buffer: torch.Tensor | int, *, target: bool = False):
        if isinstance(buffer, int):
            buffer = torch.empty(buffer, dtype=torch.uint8)
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.dim() != 1 \
                or buffer.device.type != "cpu":
            raise ValueError("staging needs a size or a 1-D CPU torch.uint8 tensor")
        self.engine = engine
        self.buffer = buffer
        self.region = engine.register(buffer, target=target)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def descriptor(self) -> bytes:
        return self.region.descriptor()

    def view(self, offset: int, length: int) -> np.ndarray:
        """Bytes ``[offset, offset + length)`` of the buffer (no copy); ValueError outside it."""
        if offset < 0 or length < 0 or offset + length > self.nbytes:
            raise ValueError(f"range [{offset}, {offset + length}) is outside the {self.nbytes}-byte staging buffer")
        return self.buffer.numpy()[offset:offset + length]


@dataclass(frozen=True)
class FrameNotice:
    """A write notification's payload: which request's frame landed where in the receiver's staging."""

    key: bytes
    offset: int
    length: int

    def to_bytes(self) -> bytes:
        return _NOTICE.pack(_NOTICE_MAGIC, _NOTICE_VERSION, self.offset, self.length, len(self.key)) + self.key

    @classmethod
    def parse(cls, payload: bytes) -> FrameNotice:
        if len(payload) < _NOTICE.size:
            raise CodecError(f"not a codec frame notice ({len(payload)} bytes)")
        magic, version, offset, length, key_len = _NOTICE.unpack_from(payload)
        if magic != _NOTICE_MAGIC or version != _NOTICE_VERSION:
            raise CodecError("not a codec frame notice (bad magic or version)")
        if len(payload) != _NOTICE.size + key_len:
            raise CodecError("codec frame notice has a bad length")
        return cls(bytes(payload[_NOTICE.size:]), offset, length)


def send_compressed(engine: TransferEngine, peer: Peer, tensor: Any, codec: str | Codec,
                    dst_descriptor: bytes | RegionDescriptor, *, key: bytes, staging: Staging, src_offset: int = 0,
                    dst_offset: int = 0) -> Transfer:
    """Encodes ``tensor`` with ``codec`` into ``staging`` at ``src_offset`` and writes the
    frame to the peer's staging target (``dst_descriptor``) at ``dst_offset``, notifying
    ``FrameNotice(key, dst_offset, frame length)``. Returns the write's Transfer (its
    ``nbytes`` is the frame length). ValueError when the frame does not fit either side."""
    codec = get(codec) if isinstance(codec, str) else codec
    if not isinstance(key, (bytes, bytearray)) or len(key) > 0xFFFF:
        raise ValueError("key must be bytes of at most 65535 bytes")
    frame = codec.encode(tensor)
    staging.view(src_offset, len(frame))[:] = np.frombuffer(frame, dtype=np.uint8)
    notice = FrameNotice(bytes(key), dst_offset, len(frame))
    return engine.write(peer, staging.region, src_offset, dst_descriptor, dst_offset, len(frame),
                        notify=notice.to_bytes())


def decode_notified(message: Message, staging: Staging, out: torch.Tensor | None = None, *,
                    max_bytes: int | None = None) -> tuple[bytes, torch.Tensor]:
    """``(key, tensor)`` of the frame a :func:`send_compressed` notification announces,
    decoded from ``staging`` into ``out`` (or a new tensor of at most ``max_bytes``, required
    then). Raises :class:`CodecError` for a message that is not such a notification or a bad
    frame (``out`` untouched)."""
    if not getattr(message, "notification", False):
        raise CodecError("a codec frame is announced by a write notification; this message is not one")
    notice = FrameNotice.parse(message.payload)
    try:
        frame = staging.view(notice.offset, notice.length)
    except ValueError as e:
        raise CodecError(f"frame notice points outside the staging buffer: {e}") from None
    return notice.key, decode(memoryview(frame), out, max_bytes=max_bytes)
