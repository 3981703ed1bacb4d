"""Connections to peer engines by address (pddcore.peer_cache.PeerCache) and the adapters'
control messages over them (pddcore.integrations._peers.Peers), with a peer that is frozen:
a real engine in a child process stopped with SIGSTOP, whose connection was dropped, so that
a connect to it waits (up to the engine's timeout_s) for a hello it cannot send.

Nothing waiting on the frozen peer may hold up a connect to another address, the question
who sent a message (``is_from``, which never waits: it raises NotKnownYet while it learns,
and the adapters' HeldMessages handle such a message again later, in its sender's order),
or a control message to another peer: each is checked to
have returned while the connect to the frozen peer still waits (an event set when that
connect returns), never against a clock."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

import pytest

from pddcore.integrations._messages import MessageSchema, is_int, is_str
from pddcore.integrations._peers import HeldMessages, NotKnownYet, Peers
from pddcore.peer_cache import PeerCache
from pddcore.transfer import Message, TransferEngine

from transfer_peer import Connects, RemoteEngine

DEADLINE_S = 60  # only so that a regression fails instead of hanging; no speed is measured
SCHEMA = MessageSchema(b"PDDT1", "peers test", key="req", key_check=is_str, kinds={"note": {"n": is_int}})
log = logging.getLogger(__name__)


@pytest.fixture
def engine():
    with TransferEngine(listen="127.0.0.1:0") as e:
        yield e


@pytest.fixture
def remote():
    """An engine in a child process (:class:`RemoteEngine`), running again at teardown
    whatever a test did to it."""
    peer = RemoteEngine(listen="127.0.0.1:0")
    yield peer
    os.kill(peer.process.pid, signal.SIGCONT)
    peer.close()


def _wait_for_data_streams(engine: TransferEngine, address: str) -> None:
    """Waits until every data stream to ``address`` is dialed: closing a connection waits for
    a data stream still dialing, which a frozen peer would hold up to the engine's timeout_s."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        peer = engine.stats()["peers"][address]
        if sum(peer["congestion_control"].values()) == peer["streams"]:
            return
        assert time.monotonic() < deadline, f"the data streams to {address} were never dialed"
        time.sleep(0.005)


class Frozen:
    """``remote`` stopped (SIGSTOP) with ``get``'s connection to it dropped, and ``get`` called
    again on a thread of its own: that reconnect waits on the frozen peer until :meth:`resume`."""

    def __init__(self, monkeypatch, engine: TransferEngine, remote: RemoteEngine, get):
        self.remote, self.pid = remote, remote.process.pid
        self.engine_id = get(remote.address).engine_id
        _wait_for_data_streams(engine, remote.address)
        self.connects = Connects(monkeypatch, engine, remote.address)
        os.kill(self.pid, signal.SIGSTOP)
        get(remote.address).close()
        self.result: list = []
        self.reconnect = threading.Thread(target=lambda: self.result.append(get(remote.address)), daemon=True)
        self.reconnect.start()
        assert self.connects.started.wait(DEADLINE_S)

    def resume(self):
        """Lets the peer run and returns the reconnected peer."""
        os.kill(self.pid, signal.SIGCONT)
        self.reconnect.join(DEADLINE_S)
        assert not self.reconnect.is_alive()
        return self.result[0]


def _answer(peers: Peers, message: Message, address: str) -> bool:
    """``is_from``'s answer once it learned who listens at ``address``."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            return peers.is_from(message, address)
        except NotKnownYet:
            assert time.monotonic() < deadline, f"never learned who listens at {address}"
            time.sleep(0.005)


def _message_from(engine_id: int, address: str) -> Message:
    """What ``poll_messages`` returns for a message from engine ``engine_id``: ``is_from`` reads
    its ``sender_engine_id``, which the hello (covered by the auth token's HMAC) fixed."""
    return Message(address, engine_id, SCHEMA.encode("note", req="r", n=0), False)


# ---- PeerCache ------------------------------------------------------------------------------

def test_a_connect_to_a_frozen_peer_holds_up_no_other_address(monkeypatch, engine, remote):
    cache = PeerCache(engine)
    frozen = Frozen(monkeypatch, engine, remote, cache.get)
    with TransferEngine(listen="127.0.0.1:0") as live:
        peer = cache.get(live.address)
        assert peer.connected and peer.engine_id == live.engine_id == cache.engine_id(live.address)
        assert cache.engine_id(remote.address) == frozen.engine_id and not cache.connected(remote.address)
        assert not frozen.connects.ended.is_set()  # all this while the reconnect still waits
        again = frozen.resume()
    assert again.connected and again.engine_id == frozen.engine_id and cache.connected(remote.address)
    assert cache.get(remote.address) is again and frozen.connects.count == 1  # the live connection, reused


def test_two_threads_reconnecting_to_one_address_make_one_connection(monkeypatch, engine, remote):
    cache = PeerCache(engine)
    frozen = Frozen(monkeypatch, engine, remote, cache.get)
    second: list = []
    waiting = threading.Thread(target=lambda: second.append(cache.get(remote.address)), daemon=True)
    waiting.start()
    first = frozen.resume()
    waiting.join(DEADLINE_S)
    assert second == [first] and frozen.connects.count == 1


def test_the_engine_id_of_an_address_follows_a_restart_there(engine):
    cache = PeerCache(engine)
    assert cache.engine_id("127.0.0.1:1") is None and not cache.connected("127.0.0.1:1")  # never connected
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with TransferEngine(listen=f"127.0.0.1:{port}") as first:
        address, first_id = first.address, first.engine_id
        assert cache.get(address).engine_id == first_id
    # The first engine's connection is gone: the id stays that of the engine last reached.
    with TransferEngine(listen=f"127.0.0.1:{port}") as second:
        assert second.address == address and second.engine_id != first_id
        assert cache.engine_id(address) == first_id
        assert cache.get(address).engine_id == second.engine_id == cache.engine_id(address)


# ---- Peers.is_from --------------------------------------------------------------------------

def test_is_from_answers_for_a_frozen_peer_without_waiting_on_its_reconnect(monkeypatch, engine, remote):
    peers = Peers(engine, SCHEMA, log)
    try:
        frozen = Frozen(monkeypatch, engine, remote, peers.connect)
        assert peers.is_from(_message_from(frozen.engine_id, remote.address), remote.address)
        assert not frozen.connects.ended.is_set()  # answered while the reconnect still waits
        with TransferEngine(listen="127.0.0.1:0") as other:
            # Another engine naming the frozen peer's address, whose connection dropped: the id
            # it states is not the one last reached there, so the answer waits for a reconnect
            # that learns who listens there now, and never attributes the message meanwhile.
            claim = _message_from(other.engine_id, remote.address)
            with pytest.raises(NotKnownYet):
                peers.is_from(claim, remote.address)
            with pytest.raises(NotKnownYet):
                peers.is_from(claim, remote.address)  # asked again: still learning, one connect
            assert not frozen.connects.ended.is_set()  # raised at once, while the reconnect waits
            frozen.resume()
            assert _answer(peers, claim, remote.address) is False
        assert frozen.connects.count == 1  # the learning connect found the reconnected peer
    finally:
        peers.close()


def test_is_from_answers_no_once_when_the_connect_to_learn_fails(engine):
    """Nothing listens at the address: the connect to learn who does fails, the answer is no,
    and the next question connects again (a peer may have started there since)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    peers = Peers(engine, SCHEMA, log)
    try:
        claim = _message_from(12345, address)
        assert _answer(peers, claim, address) is False
        with pytest.raises(NotKnownYet):
            peers.is_from(claim, address)
    finally:
        peers.close()


def test_is_from_refuses_another_engine_while_the_connection_is_up_without_connecting(monkeypatch, engine):
    peers = Peers(engine, SCHEMA, log)
    with TransferEngine(listen="127.0.0.1:0") as listening, TransferEngine(listen="127.0.0.1:0") as other:
        peers.connect(listening.address)  # nothing posted: no close() needed
        connects = Connects(monkeypatch, engine, listening.address)
        assert not peers.is_from(_message_from(other.engine_id, listening.address), listening.address)
        assert peers.is_from(_message_from(listening.engine_id, listening.address), listening.address)
        assert connects.count == 0


def test_is_from_learns_the_engine_restarted_at_an_address(engine):
    """Never connected: is_from connects to learn who listens there. After a restart at the same
    address the old connection is gone and the sender states a new id: is_from connects again
    and from then on refuses the old engine's id."""
    peers = Peers(engine, SCHEMA, log)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with TransferEngine(listen=f"127.0.0.1:{port}") as first:
        address, first_id = first.address, first.engine_id
        assert _answer(peers, _message_from(first_id, address), address)
    with TransferEngine(listen=f"127.0.0.1:{port}") as second:
        assert _answer(peers, _message_from(second.engine_id, address), address)
        assert not peers.is_from(_message_from(first_id, address), address)
    peers.close()


# ---- HeldMessages -----------------------------------------------------------------------------

class Handler:
    """Records what it handled; raises NotKnownYet for messages of a sender in ``unknown``."""

    def __init__(self):
        self.unknown: set[int] = set()
        self.handled: list[tuple[int, int]] = []

    def __call__(self, message: Message) -> None:
        if message.sender_engine_id in self.unknown:
            raise NotKnownYet("learning")
        self.handled.append((message.sender_engine_id, SCHEMA.decode(message.payload)["n"]))


def _note(sender: int, n: int) -> Message:
    return Message(f"127.0.0.1:{sender}", sender, SCHEMA.encode("note", req="r", n=n), False)


def test_held_messages_keep_each_senders_order_and_hold_up_no_other_sender():
    held, handle = HeldMessages(log), Handler()
    handle.unknown = {1}
    held.handle([_note(1, 0), _note(2, 0), _note(1, 1), _note(2, 1)], handle)
    assert handle.handled == [(2, 0), (2, 1)] and len(held) == 2
    held.handle([_note(1, 2)], handle)  # still unknown: held behind the first two
    assert handle.handled == [(2, 0), (2, 1)] and len(held) == 3
    handle.unknown = set()
    held.handle([_note(1, 3), _note(2, 2)], handle)
    assert handle.handled[2:] == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 2)] and len(held) == 0


def test_held_messages_drop_beyond_their_cap_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(HeldMessages, "MAX_HELD", 3)
    held, handle = HeldMessages(log), Handler()
    handle.unknown = {1}
    held.handle([_note(1, n) for n in range(5)], handle)
    assert len(held) == 3 and "dropped a message from 127.0.0.1:1" in caplog.text
    handle.unknown = set()
    held.handle([], handle)
    assert handle.handled == [(1, 0), (1, 1), (1, 2)]


# ---- Peers.post -----------------------------------------------------------------------------

def _received(remote: RemoteEngine, count: int) -> list[int]:
    """The ``n`` of the next ``count`` notes ``remote`` receives, in arrival order."""
    got: list[int] = []
    while len(got) < count:
        batch = remote.call("wait_message", DEADLINE_S, None)
        assert batch, "the peer received nothing"
        got += [SCHEMA.decode(payload)["n"] for _, payload, _, _ in batch]
    return got


def test_post_returns_at_once_keeps_the_order_to_a_frozen_peer_and_holds_up_no_other(monkeypatch, engine, remote):
    peers = Peers(engine, SCHEMA, log)
    try:
        frozen = Frozen(monkeypatch, engine, remote, peers.connect)
        for n in range(5):
            peers.post(remote.address, "note", req="r", n=n)   # the first waits on the reconnect
        with TransferEngine(listen="127.0.0.1:0") as live:
            peers.post(live.address, "note", req="r", n=99)
            assert [SCHEMA.decode(m.payload)["n"] for m in live.poll_messages(timeout=DEADLINE_S)] == [99]
            assert not frozen.connects.ended.is_set()  # delivered while the frozen peer's notes wait
        frozen.resume()
        assert _received(remote, 5) == [0, 1, 2, 3, 4]
    finally:
        peers.close()


def test_close_drops_what_is_not_sent_waits_for_what_is_and_drops_later_posts(monkeypatch, engine, remote, caplog):
    peers = Peers(engine, SCHEMA, log)
    frozen = Frozen(monkeypatch, engine, remote, peers.connect)
    sending, connect = threading.Event(), peers.connect
    monkeypatch.setattr(peers, "connect", lambda address: sending.set() or connect(address))
    peers.post(remote.address, "note", req="r", n=0)
    assert sending.wait(DEADLINE_S)  # note 0 is being sent: it waits for the reconnect under way
    peers.post(remote.address, "note", req="r", n=1)
    closing = threading.Thread(target=peers.close, daemon=True)
    closing.start()
    frozen.resume()
    closing.join(DEADLINE_S)
    assert not closing.is_alive()
    peers.post(remote.address, "note", req="r", n=2)
    assert "did not send note to" in caplog.text
    peers.send(remote.address, "note", req="r", n=3)  # sending in the caller's thread still works
    assert _received(remote, 2) == [0, 3]  # notes 1 and 2 were dropped
