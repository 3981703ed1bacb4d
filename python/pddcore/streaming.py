"""Layer-wise KV streaming: send a request's KV while prefill is still producing it.

An engine computes KV one layer at a time. A :class:`LayerStreamSender` posts each layer
(or each part of a layer: a chunk of its pages) as soon as it is written, as its own
:meth:`~pddcore.TransferEngine.write_batch`, so the WAN transfer overlaps prefill instead
of starting after it. Each post carries a small notification naming the request, the
layer and the part; the engine delivers it only after every byte of that post was
verified and applied. A :class:`LayerStreamReceiver` turns those notifications into one
progress record per request: which layers landed (a bitmap), how many leading layers are
complete (``applied_layers``: an extend may start over them) and, once every part of every
layer landed, one completion. Parts may land in any order; a part posted twice counts once.

Example (sender: P, during prefill; receiver: MD)::

    stream = LayerStreamSender(p_engine, md_peer, key=b"req-42", num_layers=model_layers)
    model.prefill([seq], [ids], on_layer=lambda layer: stream.post(layer, writes_of(layer)))
    stream.wait()                                  # raises TransferError if a post failed

    receiver = LayerStreamReceiver()
    for msg in md_engine.poll_messages(timeout=0.1):
        progress = receiver.feed(msg)              # None: not a layer-stream notification
        if progress is not None and progress.complete:
            ...                                    # every layer of progress.key landed

Wire format of a notification (little endian): magic ``b"PDLS"``, version u8, then
``num_layers`` u32, ``parts_per_layer`` u32, ``layer`` u32, ``part`` u32, the key's
length u16 and the key bytes (at most 1024).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field
from typing import Iterable

from .transfer import Message, Peer, Transfer, TransferEngine, TransferError, WriteSpec

__all__ = ["LayerStreamSender", "LayerStreamReceiver", "StreamProgress", "StreamError"]

_MAGIC = b"PDLS"
_VERSION = 1
_HEADER = struct.Struct("<4sBIIIIH")
MAX_KEY_BYTES = 1024


class StreamError(ValueError):
    """A layer-stream notification that contradicts the stream it names, or bad arguments."""


def _check_shape(num_layers: int, parts_per_layer: int) -> None:
    for name, value in (("num_layers", num_layers), ("parts_per_layer", parts_per_layer)):
        if not isinstance(value, int) or not 1 <= value <= 0xFFFF_FFFF:
            raise StreamError(f"{name} must be an int in [1, 2**32), got {value!r}")


def encode_notification(key: bytes, num_layers: int, parts_per_layer: int, layer: int, part: int) -> bytes:
    return _HEADER.pack(_MAGIC, _VERSION, num_layers, parts_per_layer, layer, part, len(key)) + key


def decode_notification(payload: bytes) -> tuple[bytes, int, int, int, int] | None:
    """``(key, num_layers, parts_per_layer, layer, part)``, or None when the payload is not
    a layer-stream notification. Raises StreamError for one that is but is malformed."""
    if len(payload) < _HEADER.size or payload[:4] != _MAGIC:
        return None
    magic, version, num_layers, parts, layer, part, key_len = _HEADER.unpack_from(payload)
    if version != _VERSION:
        raise StreamError(f"layer-stream notification of version {version}; this side speaks {_VERSION}")
    if len(payload) != _HEADER.size + key_len:
        raise StreamError(f"layer-stream notification of {len(payload)} bytes; its key needs "
                          f"{_HEADER.size + key_len}")
    if num_layers == 0 or parts == 0 or layer >= num_layers or part >= parts:
        raise StreamError(f"layer-stream notification for layer {layer} part {part} of a stream of "
                          f"{num_layers} layers x {parts} parts")
    return payload[_HEADER.size:], num_layers, parts, layer, part


class LayerStreamSender:
    """Posts one request's KV to one peer, layer by layer (or part by part).

    ``key`` names the request at the receiver (bytes, at most 1024); ``num_layers`` x
    ``parts_per_layer`` posts complete it. Each :meth:`post` is one transfer; :meth:`wait`
    waits for all of them and raises the first failure.
    """

    def __init__(self, engine: TransferEngine, peer: Peer, key: bytes, num_layers: int, *, parts_per_layer: int = 1):
        if not isinstance(key, (bytes, bytearray)) or not 0 < len(key) <= MAX_KEY_BYTES:
            raise StreamError(f"key must be 1 to {MAX_KEY_BYTES} bytes")
        _check_shape(num_layers, parts_per_layer)
        self.engine, self.peer, self.key = engine, peer, bytes(key)
        self.num_layers, self.parts_per_layer = num_layers, parts_per_layer
        self._posted: dict[tuple[int, int], Transfer] = {}

    def post(self, layer: int, writes: Iterable[WriteSpec], *, part: int = 0) -> Transfer:
        """Sends ``writes`` (as :meth:`TransferEngine.write_batch` takes them) as ``layer``'s
        ``part``. Raises StreamError for a layer or part outside the stream or posted before."""
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise StreamError(f"layer {layer!r} is outside [0, {self.num_layers})")
        if not isinstance(part, int) or not 0 <= part < self.parts_per_layer:
            raise StreamError(f"part {part!r} is outside [0, {self.parts_per_layer})")
        if (layer, part) in self._posted:
            raise StreamError(f"layer {layer} part {part} of {self.key!r} was already posted")
        notify = encode_notification(self.key, self.num_layers, self.parts_per_layer, layer, part)
        try:
            transfer = self.engine.write_batch(self.peer, writes, notify=notify)
        except TransferError as e:
            raise TransferError(f"layer {layer} part {part} of {self.key!r}: {e}") from e
        self._posted[(layer, part)] = transfer
        return transfer

    @property
    def complete(self) -> bool:
        """Every part of every layer was posted (not necessarily landed)."""
        return len(self._posted) == self.num_layers * self.parts_per_layer

    def wait(self, timeout: float | None = None) -> None:
        """Waits until every posted part landed; raises TransferError for the first that failed,
        and StreamError when the stream was not posted completely."""
        for (layer, part), transfer in sorted(self._posted.items()):
            try:
                transfer.wait(timeout)
            except TransferError as e:
                raise TransferError(f"layer {layer} part {part} of {self.key!r}: {e}") from e
        if not self.complete:
            raise StreamError(f"{len(self._posted)} of {self.num_layers * self.parts_per_layer} parts of "
                              f"{self.key!r} were posted")

    def cancel(self) -> None:
        """Cancels every posted part that is still in flight (each cancel fences the receiver)."""
        for transfer in self._posted.values():
            transfer.cancel()


@dataclass
class StreamProgress:
    """What landed of one request's stream at the receiver."""

    key: bytes
    sender_engine_id: int
    num_layers: int
    parts_per_layer: int
    parts_landed: list[int] = field(default_factory=list)  # per layer

    @property
    def layers_landed(self) -> list[bool]:
        """One flag per layer: every part of it landed."""
        return [n == self.parts_per_layer for n in self.parts_landed]

    @property
    def applied_layers(self) -> int:
        """How many leading layers (0, 1, ...) landed completely."""
        for i, landed in enumerate(self.layers_landed):
            if not landed:
                return i
        return self.num_layers

    @property
    def complete(self) -> bool:
        return self.applied_layers == self.num_layers


class LayerStreamReceiver:
    """Tracks layer-stream notifications per (sender engine, key); see the module docstring.

    A completed stream is forgotten by :meth:`feed` after it returned its final progress, so
    the same key may stream again (a later request). With ``expire_s``, a stream that got no
    part for that long (its sender failed or cancelled it) is forgotten too, so a long-lived
    receiver does not keep every broken stream.
    """

    def __init__(self, expire_s: float | None = None) -> None:
        if expire_s is not None and not expire_s > 0:
            raise StreamError(f"expire_s must be positive or None, got {expire_s!r}")
        self._expire_s = expire_s
        self._streams: dict[tuple[int, bytes], StreamProgress] = {}
        self._seen: dict[tuple[int, bytes], set[tuple[int, int]]] = {}
        self._touched: dict[tuple[int, bytes], float] = {}  # monotonic time of each stream's last part

    def feed(self, message: Message) -> StreamProgress | None:
        """Consumes one of :meth:`TransferEngine.poll_messages`'s messages. Returns the stream's
        progress after it, or None when the message is not a layer-stream notification (a
        priority-lane message never is: only a write's notify proves its bytes landed).
        Raises StreamError when it contradicts its stream (another shape)."""
        if not message.notification:
            return None
        decoded = decode_notification(message.payload)
        if decoded is None:
            return None
        key, num_layers, parts, layer, part = decoded
        now = time.monotonic()
        if self._expire_s is not None:
            for stale in [i for i, t in self._touched.items() if now - t > self._expire_s]:
                del self._streams[stale], self._seen[stale], self._touched[stale]
        ident = (message.sender_engine_id, key)
        self._touched[ident] = now
        progress = self._streams.get(ident)
        if progress is None:
            progress = StreamProgress(key, message.sender_engine_id, num_layers, parts, [0] * num_layers)
            self._streams[ident] = progress
            self._seen[ident] = set()
        elif (progress.num_layers, progress.parts_per_layer) != (num_layers, parts):
            raise StreamError(f"stream {key!r} was {progress.num_layers} layers x {progress.parts_per_layer} parts; "
                              f"a notification says {num_layers} x {parts}")
        if (layer, part) not in self._seen[ident]:
            self._seen[ident].add((layer, part))
            progress.parts_landed[layer] += 1
        if progress.complete:
            del self._streams[ident], self._seen[ident], self._touched[ident]
        return progress

    def progress(self, sender_engine_id: int, key: bytes) -> StreamProgress | None:
        """The progress of a stream still in flight (None: nothing landed yet, or completed)."""
        return self._streams.get((sender_engine_id, bytes(key)))
