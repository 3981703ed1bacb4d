"""An adapter's connections to the peer engines it talks to, by address, and the control
messages it sends over them.

Example::

    peers = Peers(engine, MESSAGES, log)             # the adapter's MessageSchema
    peers.send("10.0.0.2:7000", "pull", req="r-1", ...)    # returns once sent; logged, not raised, on error
    peers.post("10.0.0.2:7000", "fail", req="r-1", reason="aborted")    # returns at once, sent in order
    engine.write(peers.connect("10.0.0.2:7000"), ...)                   # the same connection
    peers.is_from(message, "10.0.0.2:7000")   # whether a received message came from that engine
    peers.close()                             # before engine.close()
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

from ..peer_cache import PeerCache
from ..transfer import Message, Peer, TransferEngine
from ._messages import MessageSchema

__all__ = ["Peers"]


class Peers:
    """One connection per peer address, reopened once it dropped. Thread-safe."""

    def __init__(self, engine: TransferEngine, messages: MessageSchema, log: logging.Logger):
        self.engine, self.messages, self.log = engine, messages, log
        self._peers = PeerCache(engine)
        self._post_lock = threading.Lock()
        self._outbox: dict[str, collections.deque[tuple[str, bytes]]] = {}
        self._posting: dict[str, threading.Thread] = {}   # the thread draining each address's outbox
        self._closed = False

    def connect(self, address: str) -> Peer:
        return self._peers.get(address)

    def send(self, address: str, kind: str, **fields: Any) -> None:
        """Sends one control message; a failure is logged only, since the peer's own
        timeout covers a message that never arrives."""
        self._send(address, kind, self.messages.encode(kind, **fields))

    def _send(self, address: str, kind: str, payload: bytes) -> None:
        try:
            self.engine.send(self.connect(address), payload)
        except Exception as exc:
            self.log.warning("%s: could not send %s to %s: %s", self.messages.name, kind, address, exc)

    def post(self, address: str, kind: str, **fields: Any) -> None:
        """Sends one control message as :meth:`send` does, but from a thread of its address's
        own, and returns at once: reconnecting to a peer gone or frozen (up to the engine's
        ``timeout_s``) holds up neither the caller (an engine's scheduler thread) nor the
        messages to other peers. Messages posted to one address leave in the order posted; a
        failure, and a message posted after :meth:`close`, is logged as with :meth:`send` (a
        request failing while the adapter shuts down must not raise on the engine's thread)."""
        payload = self.messages.encode(kind, **fields)
        with self._post_lock:
            if self._closed:
                self.log.warning("%s: did not send %s to %s: closed", self.messages.name, kind, address)
                return
            self._outbox.setdefault(address, collections.deque()).append((kind, payload))
            if address not in self._posting:
                thread = threading.Thread(target=self._drain, args=(address,), name=f"pdd-post-{address}",
                                          daemon=True)
                self._posting[address] = thread
                thread.start()

    def _drain(self, address: str) -> None:
        """Sends ``address``'s posted messages in order; ends once its outbox is empty."""
        while True:
            with self._post_lock:
                outbox = self._outbox.get(address)
                if not outbox:
                    self._outbox.pop(address, None)
                    del self._posting[address]
                    return
                kind, payload = outbox.popleft()
            self._send(address, kind, payload)

    def is_from(self, message: Message, address: str) -> bool:
        """Whether ``message`` comes from the engine listening at ``address``.

        Answered from the id the last connection to ``address`` reached, without connecting
        (a connection that dropped does not change who listens there): yes when the sender
        states that id, no when it states another while that connection is up. Only an
        address never connected, or one whose connection dropped and whose sender states
        another id (a peer restarted there, or a sender naming an address not its own),
        connects to learn who listens there now; an id that is not that engine's is refused."""
        known = self._peers.engine_id(address)
        if known == message.sender_engine_id:
            return True
        if known is not None and self._peers.connected(address):
            return False
        return message.sender_engine_id == self.connect(address).engine_id

    def close(self) -> None:
        """Stops posting: messages posted but not yet sent are dropped (logged), and a message
        being sent is waited for (up to the engine's ``timeout_s``); call before the engine closes."""
        with self._post_lock:
            self._closed = True
            dropped = sum(len(outbox) for outbox in self._outbox.values())
            self._outbox.clear()
            sending = list(self._posting.values())
        if dropped:
            self.log.warning("%s: %d posted messages not sent: closing", self.messages.name, dropped)
        for thread in sending:
            thread.join()
