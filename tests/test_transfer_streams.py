"""streams="auto": the stream-count rule against paths worked out by hand (C++,
tests/cpp/stream_choice_test.cpp), what the engine accepts, the count on loopback, and, as
root, a peer getting more connections on a path whose send buffers cap each one."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

import cpp_unit
from pddcore.benchmarks.sink import desc_address, read_info, write_info
from pddcore.testing.wan import WanLink, unavailable_reason
from pddcore.transfer import TransferEngine

STREAM_CASES = ["unmeasured_path_gets_the_initial_count", "short_path_keeps_the_initial_count",
                "bandwidth_delay_product_sets_the_count", "window_limited_connections_ask_for_more",
                "long_fat_path_is_capped", "loss_asks_for_more_cubic_connections_only"]

test_stream_choice = cpp_unit.case_test("stream_choice_test", ["tests/cpp/stream_choice_test.cpp"], STREAM_CASES)

WAN_TOKEN = b"streams-test-token-4f0c9e2b7a1d53e8b6"


@pytest.mark.parametrize("streams", [0, 65, -1, 2.0, True, "4", "many"])
def test_bad_stream_counts_are_refused(streams):
    with pytest.raises(ValueError, match="streams must be"):
        TransferEngine(streams=streams)


def _write_and_count(streams) -> dict:
    nbytes = 32 << 20
    with TransferEngine() as receiver, TransferEngine(streams=streams) as sender:
        destination = torch.zeros(nbytes, dtype=torch.uint8)
        region = receiver.register(destination, target=True)
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        src = sender.register(data)
        peer = sender.connect(receiver.address)
        for _ in range(3):
            sender.write(peer, src, 0, region.descriptor(), 0, nbytes).wait(timeout=60)
        assert torch.equal(destination, data)
        return sender.stats()["peers"][peer.address]


def test_auto_keeps_four_streams_on_loopback():
    # Loopback holds a few hundred KB in flight: far under what four send buffers carry.
    assert _write_and_count("auto")["streams"] == 4


def test_a_fixed_count_is_kept():
    assert _write_and_count(3)["streams"] == 3


def _sink(listen: str, info_path: str, nbytes: int) -> bytes:
    with TransferEngine(listen=listen, auth_token=WAN_TOKEN) as engine:
        buf = bytearray(nbytes)
        region = engine.register(buf, target=True)
        write_info(info_path, region.descriptor().hex())
        got = engine.poll_messages(timeout=120)
        assert got and got[0].payload == b"done", got
        return bytes(buf)


def _small_buffer_source(info_path: str, nbytes: int, wmem_max: int) -> tuple[dict, bytes]:
    # This namespace's own TCP send buffers: each connection holds at most about half of
    # wmem_max in flight.
    with open("/proc/sys/net/ipv4/tcp_wmem", "w") as f:
        f.write(f"4096 16384 {wmem_max}")
    data = os.urandom(nbytes)
    desc = bytes.fromhex(read_info(info_path))
    with TransferEngine(auth_token=WAN_TOKEN, chunk_bytes=256 << 10) as engine:
        region = engine.register(bytearray(data))
        peer = engine.connect(desc_address(desc))
        engine.write(peer, region, 0, desc, 0, nbytes, notify=b"done").wait(120)
        return engine.stats()["peers"][peer.address], data


@pytest.mark.root
@pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")
def test_auto_adds_streams_where_send_buffers_cap_each_one():
    # 100 Mbit/s at 40 ms RTT holds 500 KB in flight; with 128 KiB send buffers four
    # connections carry about 256 KB of it: the rule asks for more (up to 16) and the data
    # still arrives whole.
    nbytes = 24 << 20
    with WanLink(rate="100mbit", delay_ms=20) as link, tempfile.TemporaryDirectory() as tmp:
        info = os.path.join(tmp, "sink")
        sink = link.b.spawn(_sink, f"{link.b.address}:9400", info, nbytes)
        stats, data = link.a.call(_small_buffer_source, info, nbytes, 128 << 10, timeout=240)
        assert sink.result(60) == data
    assert stats["streams"] > 4, stats
    assert stats["live_streams"] <= stats["streams"] <= 16, stats
