"""A drop-in for SGLang's mooncake engine wrapper, backed by :class:`TransferEngine`.

SGLang's disaggregation code talks to ``MooncakeTransferEngine`` through a handful of
pointer-addressed calls; :class:`MooncakeCompatEngine` has the same names and return
conventions, so an SGLang deployment can swap it in::

    engine = MooncakeCompatEngine("10.0.0.5", gpu_id=0)
    engine.batch_register(kv_data_ptrs, kv_data_lens)
    session = engine.get_session_id()                  # "10.0.0.5:<port>", sent to peers
    ret = engine.batch_transfer_sync(peer_session, src_ptrs, dst_ptrs, lengths)   # 0 or -1

Addresses are virtual addresses: local ones must fall inside regions registered here,
remote ones inside regions the peer registered (their list is fetched from the peer over
the authenticated control connection). An address outside every region raises
ValueError before anything is sent; a failed transfer returns -1 (as mooncake does) and
logs the engine's reason.
"""

from __future__ import annotations

import bisect
import logging
import threading
from typing import Any, Sequence

from ..peer_cache import PeerCache
from ..transfer import Peer, Region, RegionDescriptor, TransferEngine, TransferError

__all__ = ["MooncakeCompatEngine"]

log = logging.getLogger(__name__)


class _RangeIndex:
    """Sorted, non-overlapping [base, base + size) ranges -> value."""

    def __init__(self, ranges: Sequence[tuple[int, int, Any]] = ()):
        self._items = sorted(ranges, key=lambda r: r[0])
        self._bases = [r[0] for r in self._items]

    def find(self, addr: int, length: int) -> tuple[int, Any] | None:
        """(offset within the range, value) of the range holding [addr, addr + length)."""
        i = bisect.bisect_right(self._bases, addr) - 1
        if i < 0:
            return None
        base, size, value = self._items[i]
        return (addr - base, value) if addr + length <= base + size else None


class MooncakeCompatEngine:
    """SGLang ``MooncakeTransferEngine``-shaped wrapper around a :class:`TransferEngine`.

    Args:
        hostname: address to listen on; the session id is ``"hostname:port"``.
        gpu_id, ib_device: accepted for signature compatibility (the TCP backend ignores them).
        **engine_kwargs: passed to :class:`TransferEngine` (streams, auth_token, timeout_s, ...).
    """

    def __init__(self, hostname: str = "127.0.0.1", gpu_id: int = 0, ib_device: str | None = None, **engine_kwargs):
        self.engine = TransferEngine(listen=f"{hostname}:0", **engine_kwargs)
        self.gpu_id = gpu_id
        self.ib_device = ib_device
        self._lock = threading.Lock()
        self._local: dict[int, Region] = {}
        self._peers = PeerCache(self.engine)
        self._connections: dict[str, Peer] = {}  # the connection each session's region index was read over
        self._remote: dict[str, _RangeIndex] = {}

    def get_session_id(self) -> str:
        return self.engine.address

    def get_localhost(self) -> str:
        return self.engine.address.rsplit(":", 1)[0]

    def close(self) -> None:
        self.engine.close()

    # -- registration ----------------------------------------------------------------

    def register(self, ptr: int, length: int) -> int:
        # Mooncake's API: peers write registered memory, addressed by its virtual address.
        region = self.engine.register_pointer(ptr, length, target=True, listed_address=True)
        with self._lock:
            self._local[ptr] = region
        return 0

    def deregister(self, ptr: int) -> int:
        with self._lock:
            region = self._local.pop(ptr, None)
        if region is None:
            raise ValueError(f"no region registered at {ptr:#x}")
        self.engine.unregister(region)
        return 0

    def batch_register(self, ptrs: Sequence[int], lengths: Sequence[int]) -> int:
        if len(ptrs) != len(lengths):
            raise ValueError(f"{len(ptrs)} pointers but {len(lengths)} lengths")
        for ptr, length in zip(ptrs, lengths):
            self.register(ptr, length)
        return 0

    def batch_deregister(self, ptrs: Sequence[int]) -> int:
        for ptr in ptrs:
            self.deregister(ptr)
        return 0

    # -- transfers -------------------------------------------------------------------

    def transfer_sync(self, session_id: str, buffer: int, peer_buffer_address: int, length: int) -> int:
        return self.batch_transfer_sync(session_id, [buffer], [peer_buffer_address], [length])

    def batch_transfer_sync(self, session_id: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
                            lengths: Sequence[int]) -> int:
        """Writes each local range to the peer's address; 0 once every byte was verified
        and applied at the peer, -1 if the transfer failed."""
        if not (len(buffers) == len(peer_buffer_addresses) == len(lengths)):
            raise ValueError("buffers, peer_buffer_addresses and lengths differ in length")
        try:
            peer = self._peer(session_id)
        except TransferError as e:
            log.error("cannot reach %s: %s", session_id, e)
            return -1
        with self._lock:
            local = _RangeIndex([(r.base, r.nbytes, r) for r in self._local.values()])
        writes = []
        for i, (src, dst, n) in enumerate(zip(buffers, peer_buffer_addresses, lengths)):
            if n <= 0:
                continue
            found = local.find(src, n)
            if found is None:
                raise ValueError(f"transfer {i}: local range [{src:#x}, +{n}) is not inside a registered region")
            src_off, region = found
            dst_off, desc = self._remote_range(session_id, peer, dst, n, i)
            writes.append((region, src_off, desc, dst_off, n))
        if not writes:
            return 0
        try:
            self.engine.write_batch(peer, writes).wait()
        except TransferError as e:
            log.error("transfer to %s failed: %s", session_id, e)
            return -1
        return 0

    def _peer(self, session_id: str) -> Peer:
        peer = self._peers.get(session_id)
        with self._lock:
            if self._connections.get(session_id) is not peer:  # a new connection: its regions may differ
                self._connections[session_id] = peer
                self._remote.pop(session_id, None)
        return peer

    def _remote_range(self, session_id: str, peer: Peer, addr: int, n: int, i: int) -> tuple[int, RegionDescriptor]:
        for refresh in (False, True):  # the peer may have registered more memory since
            with self._lock:
                index = None if refresh else self._remote.get(session_id)
            if index is None:
                index = _RangeIndex([(base, size, RegionDescriptor(peer.address, peer.engine_id, rid, size))
                                     for rid, base, size in self.engine.remote_regions(peer)])
                with self._lock:
                    self._remote[session_id] = index
            found = index.find(addr, n)
            if found is not None:
                return found
        raise ValueError(f"transfer {i}: peer range [{addr:#x}, +{n}) is not inside a region registered at {session_id}")
