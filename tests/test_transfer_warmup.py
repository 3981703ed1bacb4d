"""Warm connections: on a long path a fresh data connection sends padding while nothing is
queued, until past its ramp (csrc/transport/tcp/warmup.h). The judge against hand-made
readings (C++, tests/cpp/warmup_test.cpp); no padding on loopback; as root, through the
WAN emulator, a new engine's connections come out of slow start before the first write,
whose data then arrives whole."""

from __future__ import annotations

import os
import tempfile
import time

import pytest
import torch

import cpp_unit
from pddcore.benchmarks.sink import desc_address, read_info, write_info
from pddcore.testing.wan import WanLink, unavailable_reason
from pddcore.transfer import TransferEngine

WARMUP_CASES = ["only_long_paths_are_warmed", "a_growing_rate_keeps_warming",
                "a_flat_rate_ends_it_after_three_rounds", "slow_start_end_ends_it_for_cubic_only", "caps_end_it"]

test_warmup_judge = cpp_unit.case_test("warmup_test", ["tests/cpp/warmup_test.cpp"], WARMUP_CASES)

WAN_TOKEN = b"warmup-test-token-8d2f61c0b9e74a35a1"


def test_no_padding_on_loopback():
    nbytes = 8 << 20
    with TransferEngine() as receiver, TransferEngine() as sender:
        destination = torch.zeros(nbytes, dtype=torch.uint8)
        region = receiver.register(destination, target=True)
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        peer = sender.connect(receiver.address)
        time.sleep(0.3)  # the connections are up and idle
        sender.write(peer, sender.register(data), 0, region.descriptor(), 0, nbytes).wait(timeout=60)
        stats = sender.stats()["peers"][peer.address]
    assert torch.equal(destination, data)
    assert stats["warmup_bytes"] == 0, stats


def _sink(listen: str, info_path: str, nbytes: int) -> bytes:
    with TransferEngine(listen=listen, auth_token=WAN_TOKEN) as engine:
        buf = bytearray(nbytes)
        region = engine.register(buf, target=True)
        write_info(info_path, region.descriptor().hex())
        got = engine.poll_messages(timeout=120)
        assert got and got[0].payload == b"done", got
        return bytes(buf)


def _warmed_source(info_path: str, nbytes: int) -> tuple[list[dict], bytes]:
    data = os.urandom(nbytes)
    desc = bytes.fromhex(read_info(info_path))
    with TransferEngine(auth_token=WAN_TOKEN) as engine:
        region = engine.register(bytearray(data))
        peer = engine.connect(desc_address(desc))
        readings = []
        for _ in range(40):  # 4 s: about 100 round trips
            readings.append(engine.stats()["peers"][peer.address])
            time.sleep(0.1)
        engine.write(peer, region, 0, desc, 0, nbytes, notify=b"done").wait(120)
        readings.append(engine.stats()["peers"][peer.address])
        return readings, data


@pytest.mark.root
@pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")
def test_fresh_connections_on_a_long_path_warm_up_before_the_first_write():
    # 200 Mbit/s at 40 ms RTT: a 1 MB bandwidth-delay product, ten segments per connection
    # when they are dialled.
    nbytes = 16 << 20
    with WanLink(rate="200mbit", delay_ms=20) as link, tempfile.TemporaryDirectory() as tmp:
        info = os.path.join(tmp, "sink")
        sink = link.b.spawn(_sink, f"{link.b.address}:9400", info, nbytes)
        readings, data = link.a.call(_warmed_source, info, nbytes, timeout=240)
        assert sink.result(60) == data
    idle = readings[-2]
    # The padding stopped by itself (the last idle second sent none) ...
    assert 0 < idle["warmup_bytes"] == readings[-12]["warmup_bytes"], idle
    # ... with the windows well past their initial ten segments each (4 x 14.5 KB).
    assert idle["cwnd_bytes"] > 8 * 4 * 14480, idle
    assert readings[-1]["bytes_sent"] == nbytes and readings[-1]["warmup_bytes"] == idle["warmup_bytes"]
