"""Layer-wise KV streaming (pddcore.streaming) between real engines on loopback: parts
posted in any order land byte-identical, the receiver's progress is the contiguous
prefix of landed layers, a prefill's KV streamed from its on_layer hook equals the pool's,
and malformed or contradicting notifications are refused."""

from __future__ import annotations

import random
import struct

import pytest
import torch
from hypothesis import given, settings, strategies as st

from pddcore import KVLayout, pack, unpack
from pddcore.model import Model, ModelConfig
from pddcore.streaming import (LayerStreamReceiver, LayerStreamSender, StreamError, decode_notification,
                               encode_notification)
from pddcore.transfer import Message, TransferEngine, TransferError

TOKEN = b"stream-test-token-4b7e1a9d3c6f2085"


@pytest.fixture(scope="module")
def engines():
    with TransferEngine(auth_token=TOKEN, timeout_s=5.0) as p, TransferEngine(auth_token=TOKEN, timeout_s=5.0) as md:
        yield p, md, p.connect(md.address)


def drain_until_complete(md: TransferEngine, receiver: LayerStreamReceiver, key: bytes) -> list:
    """Every progress record of `key` until it completes (other messages are not expected)."""
    history = []
    for _ in range(1000):
        for msg in md.poll_messages(timeout=0.5):
            progress = receiver.feed(msg)
            assert progress is not None, msg
            assert progress.key == key
            history.append((list(progress.parts_landed), progress.applied_layers, progress.complete))
            if progress.complete:
                return history
    raise AssertionError(f"stream {key!r} did not complete; progress: {history[-1:] or 'none'}")


@settings(max_examples=12, deadline=None)
@given(num_layers=st.integers(1, 7), parts=st.integers(1, 3), part_bytes=st.integers(1, 5000),
       seed=st.integers(0, 2**32 - 1))
def test_parts_posted_out_of_order_land_byte_identical(engines, num_layers, parts, part_bytes, seed):
    p, md, peer = engines
    rng = random.Random(seed)
    total = num_layers * parts * part_bytes
    data = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    dst = torch.zeros(total, dtype=torch.uint8)
    src_region, dst_region = p.register(data), md.register(dst, target=True)
    try:
        key = f"req-{seed}".encode()
        stream = LayerStreamSender(p, peer, key, num_layers, parts_per_layer=parts)
        order = [(layer, part) for layer in range(num_layers) for part in range(parts)]
        rng.shuffle(order)
        for layer, part in order:
            offset = (layer * parts + part) * part_bytes
            stream.post(layer, [(src_region, offset, dst_region.descriptor(), offset, part_bytes)], part=part)
        stream.wait(timeout=30)
        receiver = LayerStreamReceiver()
        history = drain_until_complete(md, receiver, key)
        assert torch.equal(dst, data)
        # Independently of the receiver: the applied prefix is the run of leading layers
        # whose every part was notified so far, and it only grows.
        for landed, applied, complete in history:
            expected = next((i for i, n in enumerate(landed) if n < parts), num_layers)
            assert applied == expected and complete == (expected == num_layers)
        assert [a for _, a, _ in history] == sorted(a for _, a, _ in history)
        assert len(history) == num_layers * parts  # one record per part, the last one complete
        assert receiver.progress(p.engine_id, key) is None  # forgotten once complete
    finally:
        md.unregister(dst_region)
        p.unregister(src_region)


def test_prefill_streams_each_layer_from_its_hook_and_md_rebuilds_the_pool(engines):
    p, md, peer = engines
    config = ModelConfig(num_layers=5, num_kv_heads=2, head_dim=16, num_heads=4, hidden_size=64,
                         intermediate_size=96, vocab_size=300)
    model = Model.default(seed=3, config=config)
    page_size, tokens = 4, 37  # a partial last page
    p_pool = model.new_pool(16, page_size)
    seq = p_pool.new_sequence()
    prompt = torch.randint(0, config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    p_pool.reserve([seq], [tokens])
    layout = p_pool.layout()
    page_ids = torch.tensor(seq.pages)
    per_layer = layout.packed_nbytes(len(seq.pages), [0], None)
    send = torch.zeros(per_layer * config.num_layers, dtype=torch.uint8)
    staging = torch.zeros_like(send)
    send_region, staging_region = p.register(send), md.register(staging, target=True)
    stream = LayerStreamSender(p, peer, b"doc", config.num_layers)
    called = []

    def post_layer(layer: int) -> None:
        called.append(layer)
        chunk = send[layer * per_layer:(layer + 1) * per_layer]
        pack(layout, page_ids, layers=[layer], out=chunk)
        stream.post(layer, [(send_region, layer * per_layer, staging_region.descriptor(), layer * per_layer,
                             per_layer)])

    try:
        model.prefill([seq], [prompt], on_layer=post_layer)
        assert called == list(range(config.num_layers))
        stream.wait(timeout=30)
        drain_until_complete(md, LayerStreamReceiver(), b"doc")
        md_pool = model.new_pool(16, page_size)
        md_seq = md_pool.allocate_sequence(tokens)
        md_layout = md_pool.layout()
        for layer in range(config.num_layers):
            unpack(md_layout, torch.tensor(md_seq.pages), staging[layer * per_layer:(layer + 1) * per_layer],
                   layers=[layer])
        for layer in range(config.num_layers):
            assert torch.equal(md_pool.k_layers[layer][md_seq.slots()], p_pool.k_layers[layer][seq.slots()])
            assert torch.equal(md_pool.v_layers[layer][md_seq.slots()], p_pool.v_layers[layer][seq.slots()])
        # The streamed KV continues the same way as the prefill's own.
        token = int(torch.argmax(model.decode([seq], [prompt[-1]])))
        assert token == int(torch.argmax(model.decode([md_seq], [prompt[-1]])))
    finally:
        md.unregister(staging_region)
        p.unregister(send_region)


def test_sender_refuses_bad_layers_parts_and_repeats(engines):
    p, md, peer = engines
    data = torch.ones(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    src_region, dst_region = p.register(data), md.register(dst, target=True)
    try:
        stream = LayerStreamSender(p, peer, b"k", 2, parts_per_layer=2)
        write = [(src_region, 0, dst_region.descriptor(), 0, 8)]
        with pytest.raises(StreamError, match="layer 2 is outside"):
            stream.post(2, write)
        with pytest.raises(StreamError, match="part 2 is outside"):
            stream.post(0, write, part=2)
        stream.post(0, write)
        with pytest.raises(StreamError, match="already posted"):
            stream.post(0, write)
        with pytest.raises(StreamError, match="1 of 4 parts"):
            stream.wait(timeout=10)
        for bad in (dict(key=b"", num_layers=1), dict(key=b"x" * 1025, num_layers=1), dict(key=b"x", num_layers=0)):
            with pytest.raises(StreamError):
                LayerStreamSender(p, peer, **bad)
        md.poll_messages(timeout=1.0)
    finally:
        md.unregister(dst_region)
        p.unregister(src_region)


def test_a_failed_part_names_its_layer():
    with TransferEngine(auth_token=TOKEN, timeout_s=2.0) as p:
        md = TransferEngine(auth_token=TOKEN, timeout_s=2.0)
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        dst_region = md.register(dst, target=True)
        desc = dst_region.descriptor()
        src_region = p.register(torch.ones(1 << 20, dtype=torch.uint8))
        peer = p.connect(md.address)
        stream = LayerStreamSender(p, peer, b"lost", 2)
        stream.post(0, [(src_region, 0, desc, 0, 1024)]).wait(timeout=30)
        md.close()  # MD dies between the layers
        with pytest.raises(TransferError, match="layer 1 part 0 of b'lost'"):
            stream.post(1, [(src_region, 0, desc, 0, 1 << 20)])
            stream.wait(timeout=30)


def test_receiver_ignores_other_messages_and_refuses_contradictions():
    receiver = LayerStreamReceiver()
    frame = encode_notification(b"r", 3, 1, 0, 0)
    assert receiver.feed(Message("a:1", 7, b"plain notify", True)) is None
    assert receiver.feed(Message("a:1", 7, frame, False)) is None  # a message proves nothing landed
    first = receiver.feed(Message("a:1", 7, frame, True))
    assert first.parts_landed == [1, 0, 0] and first.applied_layers == 1 and not first.complete
    assert receiver.feed(Message("a:1", 7, frame, True)).parts_landed == [1, 0, 0]  # a repeat counts once
    with pytest.raises(StreamError, match="3 layers x 1 parts"):
        receiver.feed(Message("a:1", 7, encode_notification(b"r", 4, 1, 1, 0), True))
    # Another sender's stream of the same key is its own.
    other = receiver.feed(Message("b:2", 8, encode_notification(b"r", 2, 1, 1, 0), True))
    assert other.parts_landed == [0, 1] and other.applied_layers == 0
    assert receiver.progress(7, b"r").parts_landed == [1, 0, 0]


@pytest.mark.parametrize("payload, match", [
    (encode_notification(b"r", 2, 1, 2, 0), "layer 2 part 0"),
    (encode_notification(b"r", 2, 1, 0, 1), "layer 0 part 1"),
    (encode_notification(b"r", 0, 1, 0, 0), "0 layers"),
    (encode_notification(b"rr", 2, 1, 0, 0)[:-1], "its key needs"),
    (b"PDLS" + bytes([9]) + bytes(struct.calcsize("<IIIIH")), "version 9"),
])
def test_malformed_notifications_raise(payload, match):
    with pytest.raises(StreamError, match=match):
        decode_notification(payload)
    assert decode_notification(b"PDL") is None and decode_notification(b"other payload of some length") is None


def test_an_idle_incomplete_stream_is_forgotten_after_expire_s(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("pddcore.streaming.time.monotonic", lambda: clock[0])
    receiver = LayerStreamReceiver(expire_s=5.0)
    receiver.feed(Message("a:1", 7, encode_notification(b"broken", 2, 1, 0, 0), True))
    clock[0] += 3.0
    receiver.feed(Message("a:1", 7, encode_notification(b"alive", 2, 1, 0, 0), True))
    assert receiver.progress(7, b"broken") is not None
    clock[0] += 3.0  # "broken" idle 6 s, "alive" 3 s
    receiver.feed(Message("a:1", 7, encode_notification(b"other", 2, 1, 0, 0), True))
    assert receiver.progress(7, b"broken") is None and receiver.progress(7, b"alive") is not None
    with pytest.raises(StreamError):
        LayerStreamReceiver(expire_s=0)
