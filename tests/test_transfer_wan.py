"""The TCP transfer engine through the WAN emulator (needs root and /dev/net/tun): data
verified across a real bottleneck and RTT, stats() reporting that RTT and the path's rate
under a streaming sender, the engine pacing itself to the path (queue_delay_target_s), and
congestion_control="auto" choosing from the path: bbr on a long one, cubic on a short
clean one, bbr once a short one loses packets."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time

import pytest

from pddcore.benchmarks.sink import read_info, write_info, desc_address
from pddcore.testing.wan import WanLink, tbf_burst_bytes, unavailable_reason
from pddcore.transfer import available_congestion_controls

WAN_TOKEN = b"wan-test-token-9b4e7a2d5c1f80634e6a"

_REASON = unavailable_reason()
pytestmark = [pytest.mark.root, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

NBYTES = 16 << 20


def _sink(listen: str, info_path: str, nbytes: int = NBYTES, writes: int = 1) -> str:
    """Receives until ``writes`` writes notified b"done" (writes may complete in any order)."""
    from pddcore.transfer import TransferEngine

    with TransferEngine(listen=listen, auth_token=WAN_TOKEN) as engine:
        buf = bytearray(nbytes)
        region = engine.register(buf, target=True)
        write_info(info_path, region.descriptor().hex())
        done = 0
        while done < writes:
            got = engine.poll_messages(timeout=60)
            assert got and all(m.payload == b"done" and m.notification for m in got), got
            done += len(got)
        return hashlib.sha256(buf).hexdigest()


def _source(info_path: str, nbytes: int = NBYTES, queue_delay_target_s: float | None = None,
            congestion_control: str = "cubic") -> tuple[str, dict]:
    """Writes ``nbytes`` as 64 KiB pages in reverse order; the data's hash as the sink must
    see it, and the sender's stats of the peer as the write ended. The default, cubic: a
    loss-based sender fills the bottleneck queue, which is what the delay pacer exists to
    drain (bbr keeps that queue short by itself)."""
    from pddcore.transfer import TransferEngine

    desc = bytes.fromhex(read_info(info_path))
    data = os.urandom(nbytes)
    with TransferEngine(auth_token=WAN_TOKEN, streams=4, chunk_bytes=64 << 10, congestion_control=congestion_control,
                        queue_delay_target_s=queue_delay_target_s) as engine:
        region = engine.register(bytearray(data))
        peer = engine.connect(desc_address(desc))
        # Pages in reverse order: scattered 64 KiB writes.
        pages = nbytes // (64 << 10)
        writes = [(region, i << 16, desc, (pages - 1 - i) << 16, 1 << 16) for i in range(pages)]
        engine.write_batch(peer, writes, notify=b"done").wait()
        stats = engine.stats()["peers"][peer.address]
    expected = b"".join(data[(pages - 1 - i) << 16:(pages - i) << 16] for i in range(pages))
    return hashlib.sha256(expected).hexdigest(), stats


def test_scattered_pages_through_a_wan_link():
    with WanLink(rate="1gbit", delay_ms=10) as link, tempfile.TemporaryDirectory() as tmp:
        info = os.path.join(tmp, "sink")
        sink = link.b.spawn(_sink, f"{link.b.address}:9400", info)
        expected, stats = link.a.call(_source, info, timeout=120)
        assert sink.result(60) == expected
    assert stats["bytes_sent"] == NBYTES
    assert 0.018 < stats["rtt_s"] < 0.2  # 20 ms RTT plus queueing
    assert 0 < stats["throughput_bps"] <= 1.0e9


def test_self_paced_transfer_through_a_wan_link():
    # 64 MiB at 1 Gbit/s, 20 ms RTT: slow start overshoots the bottleneck queue, the pacer
    # takes over; the data still arrives whole and stats() shows the pacer at work.
    nbytes = 64 << 20
    with WanLink(rate="1gbit", delay_ms=10) as link, tempfile.TemporaryDirectory() as tmp:
        info = os.path.join(tmp, "sink")
        sink = link.b.spawn(_sink, f"{link.b.address}:9400", info, nbytes)
        expected, stats = link.a.call(_source, info, nbytes, 0.002, timeout=120)
        assert sink.result(60) == expected
    assert stats["bytes_sent"] == nbytes
    assert stats["paced_bps"] > 0  # pacing engaged
    # It measured the link, and no more than a 1 Gbit/s link carries (how much less depends
    # on how much CPU the delay line gets on a loaded machine).
    assert 0 < stats["link_rate_bps"] < 1.5e9
    assert stats["queue_delay_s"] >= 0


def _streaming_source(info_path: str, piece: int, pieces: int, gap_s: float) -> dict:
    """Posts one piece every ``gap_s``, as a prefill posts each layer's KV once written."""
    from pddcore.transfer import TransferEngine

    desc = bytes.fromhex(read_info(info_path))
    with TransferEngine(auth_token=WAN_TOKEN, streams=4) as engine:
        region = engine.register(bytearray(os.urandom(piece * pieces)))
        peer = engine.connect(desc_address(desc))
        futures = []
        for i in range(pieces):
            futures.append(engine.write(peer, region, i * piece, desc, i * piece, piece, notify=b"done"))
            time.sleep(gap_s)
        for future in futures:
            future.wait(60)
        return engine.stats()["peers"][peer.address]


def test_streaming_sender_path_limited_rate_reads_the_link():
    # 512 KiB every 50 ms (84 Mbit/s offered) on a 100 Mbit/s, 40 ms RTT link: the writes
    # overlap, so the engine is busy all along while the link idles between pieces; bytes
    # over busy time reads that idling as a slow link, the path-limited counters do not.
    piece, pieces, line_bps = 512 << 10, 16, 100e6
    with WanLink(rate="100mbit", delay_ms=20) as link, tempfile.TemporaryDirectory() as tmp:
        info = os.path.join(tmp, "sink")
        sink = link.b.spawn(_sink, f"{link.b.address}:9400", info, piece * pieces, pieces)
        stats = link.a.call(_streaming_source, info, piece, pieces, 0.05, timeout=120)
        sink.result(60)
    path_bps = 8 * stats["path_limited_bytes"] / stats["path_limited_seconds"]
    # Each piece may start on the shaper's full bucket (the link idles between pieces), so
    # a reading may exceed the rate by one bucket per piece over the path-limited time.
    bucket_bps = 8 * tbf_burst_bytes(int(line_bps)) * pieces / stats["path_limited_seconds"]
    assert stats["throughput_bps"] < path_bps <= 1.05 * line_bps + bucket_bps, stats


@pytest.mark.skipif(not {"cubic", "bbr"} <= set(available_congestion_controls()), reason="needs cubic and bbr")
@pytest.mark.parametrize("delay_ms, loss, algorithm, switches", [
    (10, 0.0, "bbr", 0),     # 20 ms RTT: a long path from the handshake on
    (1, 0.0, "cubic", 0),    # 2 ms RTT, clean: a short path
    (1, 0.03, "bbr", 1),     # 2 ms RTT, 3 % of packets lost: cubic at first, bbr once it loses them
], ids=["long", "short", "short-lossy"])
def test_auto_congestion_control_follows_the_path(delay_ms, loss, algorithm, switches):
    with WanLink(rate="1gbit", delay_ms=delay_ms, loss=loss, seed=1) as link, \
            tempfile.TemporaryDirectory() as tmp:
        info = os.path.join(tmp, "sink")
        sink = link.b.spawn(_sink, f"{link.b.address}:9400", info, 2 * NBYTES)
        expected, stats = link.a.call(_source, info, 2 * NBYTES, None, "auto", timeout=120)
        assert sink.result(60) == expected
    live = stats["live_streams"]
    assert live >= 1 and stats["congestion_control"] == {algorithm: live}, stats
    # The RTT the choice read is the path's, on the side of the 5 ms line its delay puts it.
    rtt_s = stats["handshake_rtt_s"]
    assert rtt_s >= 0.9 * 2 * delay_ms / 1000 and (rtt_s < 0.005) == (2 * delay_ms < 5), stats
    assert (stats["congestion_switches"] >= 1) == (switches > 0), stats
