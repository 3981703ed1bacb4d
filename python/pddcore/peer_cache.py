"""One connection per peer engine, by address: made on first use and made again once it
dropped. Every role that talks to other engines by address (the reference engine's KV link,
the demo's RLD and MD, the engine adapters) keeps its peers here instead of its own
reconnect logic.

Example::

    peers = PeerCache(engine)
    engine.send(peers.get("10.0.0.2:7000"), b"hello")    # connects, or reuses the live connection
    peers.send("10.0.0.2:7000", b"again")                # the same, in one call
"""

from __future__ import annotations

import threading

from .transfer import Peer, TransferEngine

__all__ = ["PeerCache"]


class PeerCache:
    """Thread-safe; :class:`pddcore.TransferError` from connecting or sending reaches the caller."""

    def __init__(self, engine: TransferEngine):
        self.engine = engine
        self._peers: dict[str, Peer] = {}
        self._lock = threading.Lock()

    def get(self, address: str) -> Peer:
        with self._lock:
            peer = self._peers.get(address)
            if peer is None or not peer.connected:
                peer = self._peers[address] = self.engine.connect(address)
            return peer

    def send(self, address: str, message: bytes) -> None:
        """A priority-lane message to the engine at ``address``."""
        self.engine.send(self.get(address), message)
