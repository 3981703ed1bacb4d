"""Registered staging buffers for the engine adapters, allocated once and reused.

An adapter packs a request's KV pages into a staging buffer and writes it to the peer, or
receives into one and unpacks from it. Registering a buffer per request costs a
registration (and, for CUDA layouts, a pinned allocation) on the hot path, so the pool keeps
released buffers registered and hands them out again.

Where the buffer lives follows the KV pool and the transfer backend:

* KV on the CPU: plain host memory;
* KV on a GPU, tcp backend (or rdma without GPUDirect): pinned host memory, which the CUDA
  pack kernel writes and the unpack kernel reads directly (pageable memory is refused);
* KV on a GPU, rdma backend with ``gpudirect=True``: device memory on the KV's GPU,
  registered by address so the NIC reads and writes it without a host copy.

Example::

    pool = StagingPool(engine, layout.device)
    buf = pool.acquire(layout.packed_nbytes(len(ids)))            # a source: only we read it
    pack(layout, ids, out=buf.tensor)
    engine.write(peer, buf.region, 0, dst_descriptor, 0, buf.nbytes)
    ...
    pool.release(buf)          # stays registered for the next request
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ..transfer import Region, TransferEngine

__all__ = ["StagingBuffer", "StagingPool"]

_MIN_CLASS_BYTES = 64 << 10


@dataclass(eq=False)
class StagingBuffer:
    """``tensor`` (uint8, exactly ``nbytes`` long) is the start of registered ``region``."""

    tensor: torch.Tensor
    region: Region
    nbytes: int
    _storage: torch.Tensor


def _size_class(nbytes: int) -> int:
    return max(_MIN_CLASS_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())


class StagingPool:
    """Hands out registered buffers of at least the asked size; keeps up to
    ``max_idle_bytes`` of released ones registered for reuse. Thread-safe."""

    def __init__(self, engine: TransferEngine, kv_device: torch.device | str, *, gpudirect: bool = False,
                 max_idle_bytes: int = 1 << 30):
        self.engine = engine
        self.kv_device = torch.device(kv_device)
        if gpudirect and (engine.backend != "rdma" or self.kv_device.type != "cuda"):
            raise ValueError(f"gpudirect needs the rdma backend and CUDA KV, got backend {engine.backend!r} "
                             f"and KV on {self.kv_device}")
        self.gpudirect = gpudirect
        self.max_idle_bytes = int(max_idle_bytes)
        self._idle: dict[tuple[int, bool], list[StagingBuffer]] = {}  # (size class, target) -> buffers
        self._idle_bytes = 0
        self._lock = threading.Lock()

    @property
    def buffer_device(self) -> torch.device:
        """Where the buffers live: the KV's GPU with GPUDirect, the host otherwise."""
        return self.kv_device if self.gpudirect else torch.device("cpu")

    def acquire(self, nbytes: int, *, target: bool = False) -> StagingBuffer:
        """A buffer of ``nbytes``; ``target=True`` for one that peers write into (a receive
        buffer), else a source that only this engine reads."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        key = (_size_class(nbytes), target)
        with self._lock:
            free = self._idle.get(key)
            if free:
                buf = free.pop()
                self._idle_bytes -= key[0]
                return StagingBuffer(buf._storage[:nbytes], buf.region, nbytes, buf._storage)
        storage = self._allocate(key[0])
        return StagingBuffer(storage[:nbytes], self._register(storage, target), nbytes, storage)

    def release(self, buf: StagingBuffer) -> None:
        """Returns ``buf``; the caller must not touch its tensor afterwards."""
        size = buf._storage.numel()
        with self._lock:
            if self._idle_bytes + size <= self.max_idle_bytes:
                self._idle.setdefault((size, buf.region.target), []).append(buf)
                self._idle_bytes += size
                return
        self.engine.unregister(buf.region)

    def close(self) -> None:
        """Unregisters every idle buffer (buffers still out are the holders' to release)."""
        with self._lock:
            idle, self._idle, self._idle_bytes = self._idle, {}, 0
        for bufs in idle.values():
            for buf in bufs:
                self.engine.unregister(buf.region)

    def _allocate(self, size: int) -> torch.Tensor:
        if self.gpudirect:
            return torch.empty(size, dtype=torch.uint8, device=self.kv_device)
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.kv_device.type == "cuda")

    def _register(self, storage: torch.Tensor, target: bool) -> Region:
        if self.gpudirect:
            return self.engine.register_pointer(storage.data_ptr(), storage.numel(), target=target, keep_alive=storage)
        return self.engine.register(storage, target=target)
