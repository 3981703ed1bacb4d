"""`pddcore bench --cases peers`: the write layout and its expected digest, the rows'
formatting, a peer that is not installed, and (root, Mooncake installed) one small run
on the emulated WAN whose bytes are checked at the receiver. No assertion on speed."""

from __future__ import annotations

import hashlib
import re

import numpy as np
import pytest

from pddcore.benchmarks import peer_cases, peer_engines, runners
from pddcore.benchmarks.peer_cases import Measurement, PeerResult, PeersReport
from pddcore.testing.wan import unavailable_reason

MOONCAKE = peer_engines.peers()[0]


@pytest.mark.parametrize("nbytes, piece", [(1 << 20, 64 << 10), (3 << 20, 1 << 20), (1 << 20, None)])
def test_expected_digest_matches_a_piece_by_piece_copy(nbytes, piece):
    plan = peer_cases.write_plan(nbytes, piece)
    # Every destination byte written exactly once, and pages really scattered.
    assert sorted(d for _, d, _ in plan) == list(range(0, nbytes, piece or nbytes))
    assert sum(n for _, _, n in plan) == nbytes
    if piece is not None:
        assert [d for _, d, _ in plan] != [s for s, _, _ in plan]
    data = peer_cases.source_bytes(nbytes)
    landed = bytearray(nbytes)
    for src, dst, n in plan:
        landed[dst:dst + n] = data[src:src + n].tobytes()
    assert peer_cases.expected_digest(nbytes, piece) == hashlib.blake2b(bytes(landed), digest_size=16).hexdigest()
    if piece is not None:  # the layout matters: the bytes in source order are another digest
        assert peer_cases.expected_digest(nbytes, piece) != peer_cases.expected_digest(nbytes, None)


def test_write_plan_refuses_partial_pieces():
    with pytest.raises(ValueError, match="multiple of the piece size"):
        peer_cases.write_plan((1 << 20) + 1, 64 << 10)


def _result(pddcore: Measurement, *peers: Measurement) -> PeerResult:
    return PeerResult(rate_bps=1_000_000_000, rtt_ms=50.0, loss=0.001, piece_bytes=64 << 10, nbytes=128 << 20,
                      measurements=[pddcore, *peers])


def test_row_shows_pddcore_peer_and_line_rate_with_the_bdp():
    ours = Measurement("pddcore", 1.2, 0.9, True, 140 << 20)
    theirs = Measurement("mooncake", 24.0, 0.045, True, 140 << 20)
    assert peer_cases.format_row(_result(ours, theirs), theirs) == (
        "1 Gbit/s, 50 ms RTT, 0.1 % loss |      64 KiB | pddcore 0.900 / mooncake 0.045 / line 1.000 Gbit/s = 20.0x"
        " | BDP 6.0 MiB")  # 1e9 / 8 * 0.05 = 6.25e6 bytes


def test_rows_flag_failures_and_wrong_bytes_and_leave_them_out_of_the_summary():
    ours = Measurement("pddcore", 1.2, 0.9, True, 140 << 20)
    wrong = Measurement("mooncake", 2.0, 0.5, False, 140 << 20)
    broken = Measurement("nixl", error="RuntimeError: NIXL transfer ended in state ERR")
    good = Measurement("mooncake-tuned", 3.0, 0.3, True, 140 << 20)
    result = _result(ours, wrong, broken, good)
    assert peer_cases.format_row(result, wrong).endswith("| WRONG BYTES: mooncake")
    assert peer_cases.format_row(result, broken).endswith("| nixl: failed: RuntimeError: NIXL transfer ended in state ERR")
    report = PeersReport([result], {"other": "import other failed: ModuleNotFoundError"}, {}, "bbr")
    assert peer_cases.summary(report) == [("pddcore 64 KiB, 1G 50ms 0.1% loss", 0.9, "mooncake-tuned", 0.3)]
    table = peer_cases.format_table(report).splitlines()
    assert table[0] == "other: skipped: import other failed: ModuleNotFoundError"
    assert len(table) == 1 + 3 + 1  # skipped, one row per peer, the congestion control


def test_a_peer_that_is_not_installed_is_skipped_with_the_import_error(monkeypatch):
    missing = peer_engines.Contender("ghost", "pddcore_ghost_engine", {}, MOONCAKE.target, MOONCAKE.source)
    monkeypatch.setattr(peer_cases, "peers", lambda: (missing,))
    report = peer_cases.peers_case(nbytes=1 << 20)
    assert report.results == [] and report.knobs == {}
    assert report.skipped == {"ghost": "import pddcore_ghost_engine failed: "
                                       "ModuleNotFoundError: No module named 'pddcore_ghost_engine'"}
    assert peer_cases.format_table(report) == f"ghost: skipped: {report.skipped['ghost']}"


def test_the_bench_registers_the_case():
    assert "peers" in runners.CASES and runners.RUNNERS["peers"] is runners.case_peers


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif(unavailable_reason() is not None, reason=f"WAN emulator: {unavailable_reason()}")
@pytest.mark.skipif(MOONCAKE.unavailable_reason() is not None, reason=f"Mooncake: {MOONCAKE.unavailable_reason()}")
def test_mooncake_and_pddcore_move_the_same_bytes_across_the_emulated_wan():
    nbytes = 4 << 20
    report = peer_cases.peers_case([peer_cases.LinkPoint("200mbit", 5.0, 0.0)], nbytes=nbytes, only=("mooncake",))
    assert report.skipped == {} and set(report.knobs) == {"mooncake"}
    assert [r.piece_bytes for r in report.results] == [64 << 10, 1 << 20, None]
    rows = peer_cases.format_table(report).splitlines()
    for result, row in zip(report.results, rows):
        assert [m.contender for m in result.measurements] == ["pddcore", "mooncake"]
        for m in result.measurements:
            assert m.error is None, m.error
            assert m.digest_ok, f"{m.contender}: the receiver's region is not the expected layout"
            assert m.link_bytes >= nbytes, f"{m.contender}: its bytes did not cross the emulated link"
        ours, theirs = (m.goodput_gbps for m in result.measurements)
        numbers = re.search(r"pddcore ([\d.]+) / mooncake ([\d.]+) / line ([\d.]+) Gbit/s", row)
        assert numbers, row
        assert [float(x) for x in numbers.groups()] == pytest.approx([ours, theirs, 0.2], abs=0.0005)
    assert len(peer_cases.summary(report)) == 3
