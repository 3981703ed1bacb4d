"""Registered staging buffers for the engine adapters, carved out of one arena that is
allocated (and, for GPU KV, pinned) once, when the adapter starts.

An adapter packs a request's KV pages into a staging buffer and writes it to the peer, or
receives into one and unpacks from it. A pinned allocation costs milliseconds and a
registration a system call, so neither belongs on the hot path (vLLM's ``save_kv_layer``
runs inside the forward): the pool allocates its arena of ``capacity_bytes`` up front, hands
out spans of it, and keeps released buffers registered for the next request of the same size
class. A request that needs more than is left gets :class:`StagingExhausted`, which names
the setting that sizes the arena; nothing is allocated to make room.

Where the arena lives follows the KV pool and the transfer backend:

* KV on the CPU: plain host memory;
* KV on a GPU, tcp backend (or rdma without GPUDirect): pinned host memory, which the CUDA
  pack kernel writes and the unpack kernel reads directly (pageable memory is refused);
* KV on a GPU, rdma backend with ``gpudirect=True``: device memory on the KV's GPU,
  registered by address so the NIC reads and writes it without a host copy.

A buffer takes its size rounded up to a size class (64 KiB at least, then at most 1/8 above
the size asked), so requests of 64 KiB and more use at least 8/9 of the bytes they hold.

Example::

    pool = StagingPool(engine, layout.device, 1 << 30)          # 1 GiB, allocated here
    buf = pool.acquire(layout.packed_nbytes(len(ids)))          # a source: only we read it
    pack(layout, ids, out=buf.tensor)
    engine.write(peer, buf.region, 0, dst_descriptor, 0, buf.nbytes)
    ...
    pool.release(buf)          # stays registered for the next request
    pool.discard(rx)           # a receive buffer a peer may still write into: never handed out
                               # again until the engine withdrew its registration
"""

from __future__ import annotations

import bisect
import logging
import threading
from dataclasses import dataclass

import torch

from ..transfer import Region, TransferEngine, TransferError

__all__ = ["StagingBuffer", "StagingPool", "StagingExhausted"]

log = logging.getLogger(__name__)

_MIN_CLASS_BYTES = 64 << 10


class StagingExhausted(RuntimeError):
    """The staging arena has no span left for a request."""


@dataclass(eq=False)
class StagingBuffer:
    """``tensor`` (uint8, exactly ``nbytes`` long) is the start of registered ``region``,
    which covers the arena's span ``[offset, offset + size)``."""

    tensor: torch.Tensor
    region: Region
    nbytes: int
    offset: int
    size: int


def _size_class(nbytes: int) -> int:
    n = max(nbytes, _MIN_CLASS_BYTES)
    step = 1 << max(13, (n - 1).bit_length() - 4)  # at most n / 8: 2^(b-4) < n / 8 for 2^(b-1) < n
    return -(-n // step) * step


class StagingPool:
    """Hands out registered spans of one arena of ``capacity_bytes`` allocated here;
    ``name`` says, in :class:`StagingExhausted`, what sizes it. Thread-safe."""

    def __init__(self, engine: TransferEngine, kv_device: torch.device | str, capacity_bytes: int, *,
                 gpudirect: bool = False, name: str = "staging"):
        self.engine = engine
        self.kv_device = torch.device(kv_device)
        if gpudirect and (engine.backend != "rdma" or self.kv_device.type != "cuda"):
            raise ValueError(f"gpudirect needs the rdma backend and CUDA KV, got backend {engine.backend!r} "
                             f"and KV on {self.kv_device}")
        if capacity_bytes < _MIN_CLASS_BYTES:
            raise ValueError(f"{name}: capacity of {capacity_bytes} bytes is below one buffer ({_MIN_CLASS_BYTES})")
        self.gpudirect = gpudirect
        self.name = name
        self.capacity_bytes = int(capacity_bytes)
        self._arena = self._allocate(self.capacity_bytes)
        self._free: list[tuple[int, int]] = [(0, self.capacity_bytes)]   # (offset, size), by offset
        self._idle: dict[tuple[int, bool], list[StagingBuffer]] = {}      # (size class, target) -> buffers
        self._idle_bytes = 0
        self._withdrawing: list[StagingBuffer] = []   # discarded while a chunk still touched them
        self._lock = threading.Lock()

    @property
    def buffer_device(self) -> torch.device:
        """Where the buffers live: the KV's GPU with GPUDirect, the host otherwise."""
        return self.kv_device if self.gpudirect else torch.device("cpu")

    @property
    def free_bytes(self) -> int:
        """Bytes of the arena no buffer holds (idle buffers count as held: they are reused first)."""
        with self._lock:
            return sum(size for _, size in self._free)

    def acquire(self, nbytes: int, *, target: bool = False) -> StagingBuffer:
        """A buffer of ``nbytes``; ``target=True`` for one that peers write into (a receive
        buffer), else a source that only this engine reads. Raises :class:`StagingExhausted`
        when the arena has no room for it, even with every idle buffer given back."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        key = (_size_class(nbytes), target)
        with self._lock:
            free = self._idle.get(key)
            if free:
                buf = free.pop()
                self._idle_bytes -= buf.size
            else:
                buf = self._carve(key[0], target)
        return StagingBuffer(self._span(buf.offset, nbytes), buf.region, nbytes, buf.offset, buf.size)

    def release(self, buf: StagingBuffer) -> None:
        """Returns ``buf``, still registered, for reuse; the caller must not touch its tensor
        afterwards."""
        with self._lock:
            self._idle.setdefault((buf.size, buf.region.target), []).append(buf)
            self._idle_bytes += buf.size

    def discard(self, buf: StagingBuffer) -> None:
        """Returns a buffer a peer may still write into: its registration is withdrawn first
        (the engine then rejects every later write into it), so a late write never lands in
        another request's buffer. While a chunk is still being applied the span stays out, and
        goes back once the engine let go of it."""
        with self._lock:
            self._withdrawing.append(buf)
            self._withdraw()

    def close(self) -> None:
        """Unregisters every idle buffer (buffers still out are the holders' to release)."""
        with self._lock:
            idle, self._idle, self._idle_bytes = self._idle, {}, 0
            for bufs in idle.values():
                for buf in bufs:
                    self.engine.unregister(buf.region)
                    self._give_back(buf.offset, buf.size)

    # -- the arena (callers hold the lock) --------------------------------------------------------
    def _span(self, offset: int, nbytes: int) -> torch.Tensor:
        return self._arena[offset:offset + nbytes]

    def _carve(self, size: int, target: bool) -> StagingBuffer:
        offset = self._take(size)
        if offset is None:
            self._withdraw()
            for bufs in self._idle.values():  # idle buffers of other sizes make room
                while bufs:
                    buf = bufs.pop()
                    self.engine.unregister(buf.region)
                    self._give_back(buf.offset, buf.size)
            self._idle_bytes = 0
            offset = self._take(size)
        if offset is None:
            free = sum(s for _, s in self._free)
            raise StagingExhausted(
                f"{self.name}: no room for a buffer of {size} bytes: {free} of {self.capacity_bytes} bytes are free "
                f"(largest span {max((s for _, s in self._free), default=0)}), the rest held by requests in flight")
        span = self._span(offset, size)
        if self.gpudirect:
            region = self.engine.register_pointer(span.data_ptr(), size, target=target, keep_alive=self._arena)
        else:
            region = self.engine.register(span, target=target)
        return StagingBuffer(span, region, size, offset, size)

    def _take(self, size: int) -> int | None:
        for i, (offset, span) in enumerate(self._free):
            if span >= size:
                if span == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, span - size)
                return offset
        return None

    def _give_back(self, offset: int, size: int) -> None:
        i = bisect.bisect(self._free, (offset, size))
        if i < len(self._free) and offset + size == self._free[i][0]:  # merge with the next span
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and with the previous
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            self._free[i - 1] = (offset, size)
            return
        self._free.insert(i, (offset, size))

    def _withdraw(self) -> None:
        waiting = []
        for buf in self._withdrawing:
            try:
                self.engine.unregister(buf.region)
            except TransferError as exc:  # a chunk is still applied to it: try again later
                log.info("%s: a discarded buffer is still in use (%s); it stays out for now", self.name, exc)
                waiting.append(buf)
                continue
            self._give_back(buf.offset, buf.size)
        self._withdrawing = waiting

    def _allocate(self, size: int) -> torch.Tensor:
        if self.gpudirect:
            return torch.empty(size, dtype=torch.uint8, device=self.kv_device)
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.kv_device.type == "cuda")
