"""TransferEngine(congestion_control=...): the kernel's TCP congestion control of the data
connections an engine dials, checked on the live sockets with ss(8) and in stats(); "auto"
on a loopback path (tests/test_transfer_wan.py has it on emulated long and lossy paths), and
the rule behind it against hand-made readings (C++, tests/cpp/congestion_choice_test.cpp)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

import cpp_unit
from pddcore.transfer import TransferEngine, available_congestion_controls

CC_TOKEN = b"congestion-test-token-5d2a8f1c7e4b9036"

pytestmark = pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read the sockets")

CONGESTION_CASES = ["the_handshake_rtt_picks_the_algorithm", "a_lossy_path_is_found_after_enough_segments",
                    "light_loss_is_not_a_lossy_path", "drops_behind_a_standing_queue_are_not_counted",
                    "a_moments_queue_does_not_erase_the_count", "slow_start_and_short_paths_are_not_counted"]

test_congestion_rule = cpp_unit.case_test("congestion_choice_test", ["tests/cpp/congestion_choice_test.cpp"],
                                          CONGESTION_CASES)


def data_connection_algorithms(stats: dict | None = None, **sender_options) -> list[str]:
    """The congestion control of each established connection to a receiver the sender wrote
    to, as ss(8) reads it; ``stats`` gets the sender's stats() of that peer."""
    with TransferEngine(auth_token=CC_TOKEN) as receiver, \
            TransferEngine(auth_token=CC_TOKEN, streams=3, **sender_options) as sender:
        dst = torch.zeros(1 << 20, dtype=torch.uint8)
        region = receiver.register(dst, target=True)
        src = sender.register(torch.full((1 << 20,), 7, dtype=torch.uint8))
        sender.write(sender.connect(receiver.address), src, 0, region.descriptor(), 0, 1 << 20).wait(timeout=30)
        assert int(dst.eq(7).sum()) == 1 << 20
        if stats is not None:
            stats.update(sender.stats()["peers"][receiver.address])
        port = receiver.address.rsplit(":", 1)[1]
        out = subprocess.run(["ss", "-tin", "state", "established", "dport", f"= :{port}"], capture_output=True,
                             text=True, check=True).stdout
        return [line.split()[0] for line in out.splitlines() if line.startswith(("\t", " ")) and "rtt:" in line]


@pytest.mark.parametrize("cc", [c for c in ("reno", "bbr", "cubic") if c in available_congestion_controls()])
def test_data_connections_use_the_chosen_congestion_control(cc):
    # One control connection (the system default) and three data connections with ``cc``.
    stats = {}
    assert data_connection_algorithms(stats, congestion_control=cc).count(cc) >= 3
    assert stats["congestion_control"] == {cc: stats["live_streams"]}, stats


@pytest.mark.skipif("cubic" not in available_congestion_controls(), reason="needs cubic")
def test_auto_gives_a_loopback_peer_the_short_path_choice():
    # A loopback path's RTT is microseconds: "auto" (the default) runs cubic on it, whatever
    # the system default is; stats() and ss(8) both show it on the live connections.
    with TransferEngine() as engine:
        assert engine.congestion_control == "auto"
    stats = {}
    assert data_connection_algorithms(stats).count("cubic") >= 3
    assert stats["congestion_control"] == {"cubic": stats["live_streams"]}, stats
    assert 0 < stats["handshake_rtt_s"] < 0.005 and stats["congestion_switches"] == 0, stats


def test_none_keeps_the_system_default():
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        system_default = f.read().strip()
    stats = {}
    assert data_connection_algorithms(stats, congestion_control=None).count(system_default) >= 3
    assert stats["congestion_control"] == {system_default: stats["live_streams"]}, stats
    assert "handshake_rtt_s" not in stats, stats


def test_unknown_congestion_control_is_refused():
    with pytest.raises(ValueError, match="not offered by this kernel"):
        TransferEngine(congestion_control="no-such-cc")


def test_peer_stats_show_the_data_connections_window():
    with TransferEngine(auth_token=CC_TOKEN) as receiver, TransferEngine(auth_token=CC_TOKEN, streams=3) as sender:
        region = receiver.register(torch.zeros(8 << 20, dtype=torch.uint8), target=True)
        src = sender.register(torch.ones(8 << 20, dtype=torch.uint8))
        peer = sender.connect(receiver.address)
        sender.write(peer, src, 0, region.descriptor(), 0, 8 << 20).wait(timeout=30)
        link = sender.stats()["peers"][peer.address]
        # Streams connect as they get chunks: by the time the write is done, 1 to 3 are up.
        assert 1 <= link["live_streams"] <= 3
        # At least one full-sized segment per live connection: windows TCP_INFO really reported.
        assert link["cwnd_bytes"] >= link["live_streams"] * 1000 and link["tcp_retransmits"] >= 0


@pytest.mark.skipif(not {"cubic", "bbr"} <= set(available_congestion_controls()), reason="needs cubic and bbr")
def test_bench_compares_auto_with_both_by_hand_on_loopback():
    from pddcore.benchmarks.transfer_cases import congestion_loopback

    comparisons = congestion_loopback(4 << 20, rounds=1, chunk_sizes=(64 << 10,), streams=2)
    assert [c.path for c in comparisons] == ["loopback, 2 streams, 64 KiB chunks"]
    c = comparisons[0]
    assert c.auto_running == {"cubic": 2.0} and c.rounds == 1
    assert min(c.auto_gbps, c.cubic_gbps, c.bbr_gbps) > 0
    assert c.better_gbps == max(c.cubic_gbps, c.bbr_gbps) and c.ratio == c.auto_gbps / c.better_gbps
    assert c.as_dict()["better"] in ("cubic", "bbr")
