"""One connection per peer engine, by address: made on first use and made again once it
dropped. Every role that talks to other engines by address (the reference engine's KV link,
the demo's RLD and MD, the engine adapters) keeps its peers here instead of its own
reconnect logic.

Example::

    peers = PeerCache(engine)
    engine.send(peers.get("10.0.0.2:7000"), b"hello")    # connects, or reuses the live connection
    peers.send("10.0.0.2:7000", b"again")                # the same, in one call
    peers.engine_id("10.0.0.2:7000")    # the id that connection reached; never connects nor waits

A connect to one address (up to the engine's ``timeout_s`` when the peer there is gone or
frozen) holds up only other connects to that same address: never connects to other
addresses, nor :meth:`PeerCache.engine_id`.
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
        self._engine_ids: dict[str, int] = {}
        self._connecting: dict[str, threading.Lock] = {}   # per address, held across its connect
        self._lock = threading.Lock()   # guards the dicts only: never held across a connect

    def _live(self, address: str) -> Peer | None:
        with self._lock:
            peer = self._peers.get(address)
        return peer if peer is not None and peer.connected else None

    def get(self, address: str) -> Peer:
        peer = self._live(address)
        if peer is not None:
            return peer
        with self._lock:
            connecting = self._connecting.setdefault(address, threading.Lock())
        with connecting:
            peer = self._live(address)  # another thread may have connected while this one waited
            if peer is None:
                peer = self.engine.connect(address)
                with self._lock:
                    self._peers[address] = peer
                    self._engine_ids[address] = peer.engine_id
            return peer

    def send(self, address: str, message: bytes) -> None:
        """A priority-lane message to the engine at ``address``."""
        self.engine.send(self.get(address), message)

    def engine_id(self, address: str) -> int | None:
        """The id of the engine the last successful connection to ``address`` reached, live or
        dropped since; None before the first. Never connects, nor waits for a connect."""
        with self._lock:
            return self._engine_ids.get(address)

    def connected(self, address: str) -> bool:
        """Whether the connection to ``address`` is up; never connects, nor waits for a connect."""
        return self._live(address) is not None
