"""An adapter's connections to the peer engines it talks to, by address, and the control
messages it sends over them.

Example::

    peers = Peers(engine, MESSAGES, log)             # the adapter's MessageSchema
    peers.send("10.0.0.2:7000", "pull", req="r-1", ...)    # returns once sent; logged, not raised, on error
    peers.post("10.0.0.2:7000", "fail", req="r-1", reason="aborted")    # returns at once, sent in order
    engine.write(peers.connect("10.0.0.2:7000"), ...)                   # the same connection
    peers.is_from(message, "10.0.0.2:7000")   # whether a received message came from that engine (or NotKnownYet)
    peers.close()                             # before engine.close()

    held = HeldMessages(log)                  # in the adapter's message loop:
    held.handle(engine.poll_messages(), handle_one)   # a NotKnownYet from handle_one: tried again next round
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable

from ..peer_cache import PeerCache
from ..transfer import Message, Peer, TransferEngine
from ._messages import MessageSchema

__all__ = ["HeldMessages", "NotKnownYet", "Peers"]


class NotKnownYet(Exception):
    """Who listens at an address is being learned, by a connect on that address's own thread
    (:meth:`Peers.is_from`): handle the message again later (:class:`HeldMessages`)."""


class Peers:
    """One connection per peer address, reopened once it dropped. Thread-safe."""

    def __init__(self, engine: TransferEngine, messages: MessageSchema, log: logging.Logger):
        self.engine, self.messages, self.log = engine, messages, log
        self._peers = PeerCache(engine)
        self._post_lock = threading.Lock()
        self._outbox: dict[str, collections.deque[Callable[[], None]]] = {}   # per address, run in order
        self._posting: dict[str, threading.Thread] = {}   # the thread draining each address's outbox
        self._learning: set[str] = set()      # addresses whose connect, to learn who listens there, is queued
        self._unreachable: set[str] = set()   # addresses whose learning connect failed, not yet reported
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
            if not self._queue(address, lambda: self._send(address, kind, payload)):
                self.log.warning("%s: did not send %s to %s: closed", self.messages.name, kind, address)

    def _queue(self, address: str, action: Callable[[], None]) -> bool:
        """Runs ``action`` on ``address``'s own thread after what was queued before; False once
        closed. Called with ``_post_lock`` held."""
        if self._closed:
            return False
        self._outbox.setdefault(address, collections.deque()).append(action)
        if address not in self._posting:
            thread = threading.Thread(target=self._drain, args=(address,), name=f"pdd-post-{address}", daemon=True)
            self._posting[address] = thread
            thread.start()
        return True

    def _drain(self, address: str) -> None:
        """Runs ``address``'s queued actions in order; ends once its outbox is empty."""
        while True:
            with self._post_lock:
                outbox = self._outbox.get(address)
                if not outbox:
                    self._outbox.pop(address, None)
                    del self._posting[address]
                    return
                action = outbox.popleft()
            action()

    def _learn(self, address: str) -> None:
        """Connects to ``address`` to learn the id of the engine there (:meth:`is_from`)."""
        try:
            self.connect(address)
        except Exception as exc:
            self.log.warning("%s: could not connect to %s to learn who sent a message: %s", self.messages.name,
                             address, exc)
            with self._post_lock:
                self._unreachable.add(address)
        finally:
            with self._post_lock:
                self._learning.discard(address)

    def is_from(self, message: Message, address: str) -> bool:
        """Whether ``message`` comes from the engine listening at ``address``; never waits.

        Answered from the id the last connection to ``address`` reached (a connection that
        dropped does not change who listens there): yes when the sender states that id, no
        when it states another while that connection is up. Only an address never connected,
        or one whose connection dropped and whose sender states another id (a peer restarted
        there, or a sender naming an address not its own), needs a connect to learn who
        listens there now: it runs on the address's own thread, and this raises
        :class:`NotKnownYet` until it ended. A connect that failed answers no, once; the next
        question connects again. An id that is not that engine's is refused."""
        known = self._peers.engine_id(address)
        if known == message.sender_engine_id:
            return True
        if known is not None and self._peers.connected(address):
            return False
        with self._post_lock:
            if address in self._unreachable:
                self._unreachable.discard(address)
                return False
            if address not in self._learning:
                if not self._queue(address, lambda: self._learn(address)):
                    return False  # closed: nothing is learned any more
                self._learning.add(address)
        raise NotKnownYet(f"connecting to {address} to learn who listens there")

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


class HeldMessages:
    """An adapter's received messages, each handled once who sent it is known: a message whose
    handler raised :class:`NotKnownYet` is held and handled again in a later round, and so is
    every later message of the same sender, so each sender's messages are handled in the order
    sent. Used by one thread (the adapter's message loop)."""

    MAX_HELD = 65536   # beyond this many, newly held messages are dropped (logged): a sender's flood

    def __init__(self, log: logging.Logger):
        self.log = log
        self._held: list[Message] = []

    def __len__(self) -> int:
        return len(self._held)

    def handle(self, received: list[Message], handle: Callable[[Message], None]) -> None:
        """Calls ``handle`` on the messages held before, then on ``received``, in order."""
        messages, self._held = self._held + received, []
        waiting: set[int] = set()   # senders with a message held in this round
        for message in messages:
            if message.sender_engine_id not in waiting:
                try:
                    handle(message)
                    continue
                except NotKnownYet:
                    waiting.add(message.sender_engine_id)
            if len(self._held) < self.MAX_HELD:
                self._held.append(message)
            else:
                self.log.warning("dropped a message from %s: %d messages wait already to learn who sent them",
                                 message.sender, self.MAX_HELD)
