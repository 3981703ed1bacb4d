"""An adapter's connections to the peer engines it talks to, by address, and the control
messages it sends over them.

Example::

    peers = Peers(engine, MESSAGES, log)             # the adapter's MessageSchema
    peers.send("10.0.0.2:7000", "fail", req="r-1", reason="aborted")   # logged, not raised, on error
    engine.write(peers.connect("10.0.0.2:7000"), ...)                   # the same connection
    peers.is_from(message, "10.0.0.2:7000")   # whether a received message came from that engine
"""

from __future__ import annotations

import logging
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

    def connect(self, address: str) -> Peer:
        return self._peers.get(address)

    def send(self, address: str, kind: str, **fields: Any) -> None:
        """Sends one control message; a failure is logged only, since the peer's own
        timeout covers a message that never arrives."""
        try:
            self.engine.send(self.connect(address), self.messages.encode(kind, **fields))
        except Exception as exc:
            self.log.warning("%s: could not send %s to %s: %s", self.messages.name, kind, address, exc)

    def is_from(self, message: Message, address: str) -> bool:
        """Whether ``message`` comes from the engine listening at ``address``."""
        return message.sender_engine_id == self.connect(address).engine_id
