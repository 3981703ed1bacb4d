"""What a :class:`~pddcore.transfer.TransferEngine` hands out and takes: region descriptors,
received messages, and the handles of its regions, peers and transfers.

A :class:`RegionDescriptor` is plain data that crosses the wire (``to_bytes`` /
``from_bytes``); :class:`Region`, :class:`Peer` and :class:`Transfer` are created only by
their engine (``register``, ``connect``, ``write``) and act through its core.

Example::

    from pddcore.transfer import RegionDescriptor

    d = RegionDescriptor("10.0.0.2:7000", engine_id=7, region_id=3, size=1 << 20)
    assert RegionDescriptor.from_bytes(d.to_bytes()) == d   # 32 bytes + the address
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from . import _C

__all__ = ["RegionDescriptor", "Message", "Region", "Peer", "Transfer", "TransferError", "WriteSpec"]

TransferError = _C.TransferError
TransferError.__doc__ = "A transfer, connection or handshake failed; the message names the cause."


class _Engine(Protocol):
    """What a region and a peer know of the engine that made them (a TransferEngine; this
    module does not import it, so that the dependency runs one way)."""

    @property
    def address(self) -> str: ...

    @property
    def engine_id(self) -> int: ...


_DESCRIPTOR = struct.Struct("<4sHQQQH")
_DESCRIPTOR_MAGIC = b"PDDR"
_DESCRIPTOR_VERSION = 1
_STATUS = {0: "pending", 1: "done", 2: "failed", 3: "cancelled"}


@dataclass(frozen=True)
class RegionDescriptor:
    """What a peer needs to write into a region: its engine, id and size."""

    address: str
    engine_id: int
    region_id: int
    size: int

    def to_bytes(self) -> bytes:
        addr = self.address.encode()
        return _DESCRIPTOR.pack(_DESCRIPTOR_MAGIC, _DESCRIPTOR_VERSION, self.engine_id, self.region_id, self.size,
                                len(addr)) + addr

    @classmethod
    def from_bytes(cls, data: bytes | RegionDescriptor) -> RegionDescriptor:
        if isinstance(data, RegionDescriptor):
            return data
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"a region descriptor must be bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) < _DESCRIPTOR.size:
            raise ValueError(f"region descriptor too short ({len(data)} bytes)")
        magic, version, engine_id, region_id, size, addr_len = _DESCRIPTOR.unpack_from(data)
        if magic != _DESCRIPTOR_MAGIC or version != _DESCRIPTOR_VERSION:
            raise ValueError("not a pddcore region descriptor (bad magic or version)")
        if len(data) != _DESCRIPTOR.size + addr_len:
            raise ValueError("region descriptor has a bad length")
        return cls(data[_DESCRIPTOR.size:].decode(), engine_id, region_id, size)


class Message(NamedTuple):
    """A priority-lane message or a write notification (see :meth:`TransferEngine.poll_messages`)."""

    sender: str
    """The sender engine's listen address; ``connect()`` to it to answer."""
    sender_engine_id: int
    """The sender engine's id, from its hello (which the auth token's HMAC covers): compare
    it with :attr:`Peer.engine_id` to know who sent this, whatever address it names."""
    payload: bytes
    notification: bool
    """True for the ``notify`` of a write whose every byte was verified and applied here;
    False for a message sent with :meth:`TransferEngine.send`."""


class Region:
    """A registered memory range of a :class:`TransferEngine`: a write ``target`` (peers may
    write into it) or a source (only this engine reads it)."""

    def __init__(self, engine: _Engine, region_id: int, base: int, nbytes: int, target: bool,
                 keep_alive: Any):
        self.engine = engine
        self.id = region_id
        self.base = base
        self.nbytes = nbytes
        self.target = target
        self._keep_alive = keep_alive

    def descriptor(self) -> bytes:
        """Bytes a peer passes as ``dst_descriptor``: engine address, engine id, region id, size."""
        return RegionDescriptor(self.engine.address, self.engine.engine_id, self.id, self.nbytes).to_bytes()

    def __repr__(self) -> str:
        kind = "target" if self.target else "source"
        return f"Region(id={self.id}, {kind}, nbytes={self.nbytes}, engine={self.engine.address})"


class Peer:
    """A connected peer engine (see :meth:`TransferEngine.connect`)."""

    def __init__(self, engine: _Engine, core: Any, handle: Any):
        self.engine = engine
        self._core = core
        self._handle = handle

    @property
    def address(self) -> str:
        """The peer engine's listen address; also the peer id in its messages to us."""
        return self._handle.address

    @property
    def engine_id(self) -> int:
        return self._handle.engine_id

    @property
    def connected(self) -> bool:
        """False once the control connection is lost."""
        return self._handle.connected

    def close(self) -> None:
        """Closes this peer's connections; its transfers in flight fail."""
        self._core.disconnect(self._handle)

    def __repr__(self) -> str:
        return f"Peer({self.address}, connected={self.connected})"


class Transfer:
    """An asynchronous write batch. Done means every byte was verified and applied remotely."""

    def __init__(self, core: Any, handle: Any):
        self._core = core
        self._handle = handle

    @property
    def status(self) -> str:
        """"pending", "done", "failed" or "cancelled"."""
        return _STATUS[self._handle.status]

    @property
    def nbytes(self) -> int:
        return self._handle.total_bytes

    @property
    def bytes_acked(self) -> int:
        """Bytes the peer has verified and applied so far."""
        return self._handle.bytes_acked

    @property
    def error(self) -> str | None:
        """Why the transfer failed or was cancelled; None while pending or when done."""
        return self._handle.error or None

    def done(self) -> bool:
        """True once finished successfully; raises TransferError if it failed or was cancelled."""
        status = self._handle.status
        if status >= 2:
            raise TransferError(f"transfer {_STATUS[status]}: {self._handle.error}")
        return status == 1

    def wait(self, timeout: float | None = None) -> None:
        """Blocks (GIL released) until done. Raises TransferError on failure or cancel, and
        TimeoutError if ``timeout`` seconds pass first (the transfer keeps going)."""
        if not self._handle.wait(-1.0 if timeout is None else float(timeout)):
            raise TimeoutError(f"transfer still pending after {timeout} s ({self.bytes_acked}/{self.nbytes} bytes)")
        self.done()

    def cancel(self) -> None:
        """Stops sending, then returns once the peer confirmed that no chunk of this transfer
        will be written any more (chunks it applied before stay): the destination range can be
        reused at once. The peer confirms only once no chunk of it is being written; while one
        is (a slow chunk outlasting the peer's own ``timeout_s``) it answers busy and is asked
        again. On a failed transfer it only waits for that fence; no-op once done.

        Raises TransferError if the peer does not confirm within this engine's ``timeout_s``
        (it is gone, frozen, or a chunk is still arriving): bytes already sent may still land,
        so the transfer's destination ranges stay quarantined: a write through the same
        :class:`Peer` into any of them raises TransferError until a later ``cancel()`` of this
        transfer is confirmed."""
        self._core.cancel(self._handle)

    def __repr__(self) -> str:
        return f"Transfer({self.status}, {self.bytes_acked}/{self.nbytes} bytes)"


WriteSpec = tuple[Region, int, "bytes | RegionDescriptor", int, int]
