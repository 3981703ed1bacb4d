"""The demo's receivers join P's streamed layers with the KV-ready note: a streamed note is
handed on only once every layer of its request from the same sender landed, whatever
the order; an unstreamed note and other messages pass at once."""

from __future__ import annotations

import itertools

import pytest

from pddcore.deploy import wire
from pddcore.deploy.kv_arrivals import KvArrivals
from pddcore.streaming import encode_notification
from pddcore.transfer import Message

LAYERS = 3


def note(rid: str, streamed: bool = True) -> Message:
    kv = wire.KvReady(rid, 40, 0, 0, 1024, 5, 0, "P_RLD_MD", 8, 1, streamed=streamed)
    return Message("p:1", 11, wire.encode_kv(kv), True)


def layer(rid: str, i: int, sender: int = 11) -> Message:
    return Message("p:1", sender, encode_notification(rid.encode(), LAYERS, 1, i, 0), True)


@pytest.mark.parametrize("order", list(itertools.permutations(["n", 0, 1, 2])))
def test_streamed_note_passes_exactly_when_the_last_layer_landed(order):
    arrivals = KvArrivals()
    handed = []
    for step, item in enumerate(order):
        out = arrivals.feed(note("r1") if item == "n" else layer("r1", item))
        handed.append(out)
        if step < len(order) - 1:
            assert out == []
    assert [wire.parse(m)[1].rid for m in handed[-1]] == ["r1"]


def test_other_messages_and_unstreamed_notes_pass_at_once():
    arrivals = KvArrivals()
    plain = Message("p:1", 11, b"PRDYr7", False)
    assert arrivals.feed(plain) == [plain]
    unstreamed = note("r2", streamed=False)
    assert arrivals.feed(unstreamed) == [unstreamed]


def test_layers_from_another_sender_do_not_complete_a_note():
    arrivals = KvArrivals()
    assert arrivals.feed(note("r3")) == []
    for i in range(LAYERS):
        assert arrivals.feed(layer("r3", i, sender=99)) == []  # same request id, another engine
    out = []
    for i in range(LAYERS):
        out += arrivals.feed(layer("r3", i))
    assert [wire.parse(m)[1].rid for m in out] == ["r3"]


def test_a_note_sent_as_a_plain_message_is_no_proof():
    arrivals = KvArrivals()
    forged = Message("p:1", 11, note("r4").payload, False)
    assert arrivals.feed(forged) == [forged]  # handed on as is: the role's parse() rejects it
    assert wire.parse(forged)[0] == "forged"


def test_an_incomplete_stream_is_forgotten_after_expiry(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("pddcore.deploy.kv_arrivals.time.monotonic", lambda: clock[0])
    arrivals = KvArrivals(expire_s=5.0)
    assert arrivals.feed(note("r5")) == []
    clock[0] += 6.0
    for i in range(LAYERS):
        assert arrivals.feed(layer("r5", i)) == []  # the parked note expired: nothing is handed on
