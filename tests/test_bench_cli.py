"""`pddcore bench` in tiny modes: results.json structure, the table, the plots; and the
handoff and extend cases on a few points (no assertion on speed)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import pytest

from pddcore import _C
from pddcore.benchmarks import crc_cases, demo_cases, extend_cases, handoff_cases, loss_cases, radix_cases, stream_cases
from pddcore.benchmarks.plots import write_plots
from pddcore.benchmarks.results import Result
from pddcore.benchmarks.runners import RUNNERS
from pddcore.cli import main
from pddcore.testing.wan import tbf_burst_bytes, unavailable_reason


def _png(path: str) -> None:
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", path
    assert os.path.getsize(path) > 1000, path


def _shared_whole_pages(requests, page_size: int) -> list[int]:
    """Per request: tokens of the longest whole-page prefix it shares with an earlier
    request, i.e. what a prefix cache that never evicts finds for it."""
    earlier, shared = [], []
    for tokens in requests:
        t = np.asarray(tokens)
        best = 0
        for e in earlier:
            if e[0] != t[0]:
                continue
            n = min(len(e), len(t))
            differ = np.flatnonzero(e[:n] != t[:n])
            best = max(best, int(differ[0]) if len(differ) else n)
        shared.append(best // page_size * page_size)
        earlier.append(t[:len(t) // page_size * page_size])  # a cache holds whole pages only
    return shared


def _expected_rows(cases: dict) -> dict:
    """(case, what) -> (value, baseline), recomputed from the raw figures of the points."""
    expected = {}
    for p in cases["pack"]["points"]:
        pages = "vLLM rows" if p["vllm_rows"] else f"{p['page_bytes'] >> 10} KiB pages"
        tag = f"{pages}, {p['threads']} thr"
        copy_gbps = p["total_bytes"] / p["copy_s"] / 1e9
        expected["pack", f"pack {tag}"] = (p["total_bytes"] / p["pack_s"] / 1e9, copy_gbps)
        expected["pack", f"unpack {tag}"] = (p["total_bytes"] / p["unpack_s"] / 1e9, copy_gbps)
        expected["pack", f"pack pool order {tag}"] = (p["total_bytes"] / p["pool_pack_s"] / 1e9, copy_gbps)
        expected["pack", f"unpack pool order {tag}"] = (p["total_bytes"] / p["pool_unpack_s"] / 1e9, copy_gbps)
    for p in cases["radix"]["points"]:
        n = p["requests"]
        expected["radix", f"match, page {p['page_size']}"] = (n / p["radix_match_s"], n / p["chain_match_s"])
        expected["radix", f"insert, page {p['page_size']}"] = (n / p["radix_insert_s"], n / p["chain_insert_s"])
    return expected


def test_cli_pack_and_radix(tmp_path, capsys):
    assert main(["bench", "--quick", "--cases", "pack,radix", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "results.json") as f:
        res = json.load(f)
    assert res["cases_selected"] == ["pack", "radix"] and res["quick"] is True
    machine = res["machine"]
    for key in ("pddcore", "cpu_count", "cpu_model", "torch", "cuda_usable"):
        assert key in machine
    assert set(res["cases"]) == {"pack", "radix"}
    pack_points = res["cases"]["pack"]["points"]
    # --quick: the goal rows, dense 128 KiB pages and vLLM rows on 1 and 2 threads; each moves 16 MiB
    assert [(p["page_bytes"], p["threads"], p["vllm_rows"]) for p in pack_points] == [
        (128 << 10, 1, False), (128 << 10, 2, False), (32 << 10, 1, True), (32 << 10, 2, True)]
    assert all(p["total_bytes"] == 16 << 20 for p in pack_points)
    assert all(p["pack_gbps"] == pytest.approx(p["total_bytes"] / p["pack_s"] / 1e9) for p in pack_points)
    # The radix hit rate, recomputed from the trace itself: the quick point's 2M-token
    # capacity keeps every shared context, so both caches find exactly the longest
    # whole-page prefix each request shares with an earlier one.
    for p in res["cases"]["radix"]["points"]:
        requests = list(radix_cases.workload(p["requests"]))
        total = sum(len(t) // p["page_size"] * p["page_size"] for t in requests)
        assert p["tokens"] == total
        hit_rate = sum(_shared_whole_pages(requests, p["page_size"])) / total
        assert 0.5 < hit_rate < 0.9  # the trace: 90 % of a request shared, a context's first request misses
        assert p["radix_hit_rate"] == pytest.approx(hit_rate, rel=1e-12)
        assert p["chain_hit_rate"] == pytest.approx(hit_rate, rel=1e-12)
    # Every table row is its points' raw bytes, counts and seconds, divided here.
    table = {(r["case"], r["what"]): r for r in res["table"]}
    expected = _expected_rows(res["cases"])
    assert table.keys() == expected.keys()
    for key, (value, baseline) in expected.items():
        row = table[key]
        assert (row["value"], row["baseline"]) == pytest.approx((value, baseline), rel=1e-12), key
        assert row["ratio"] == pytest.approx(value / baseline, rel=1e-12), key
    assert res["plots"] == ["pack.png"]
    _png(str(tmp_path / "pack.png"))
    out = capsys.readouterr().out
    assert "ratio = value / baseline" in out and "copy_" in out and "hash chain" in out


def test_cli_rejects_unknown_case(tmp_path):
    with pytest.raises(SystemExit, match="nosuch"):
        main(["bench", "--cases", "pack,nosuch", "--out", str(tmp_path)])
    assert not os.path.exists(tmp_path / "results.json")


def test_crc_rates_cover_every_implementation():
    results = crc_cases.crc32c_rates(1 << 20)
    in_cache = [r.implementation for r in results if r.where == "in cache"]
    assert in_cache == _C.crc32c_implementations()
    assert all(r.crc_gbps > 0 and r.memcpy_gbps > 0 for r in results)
    assert "from memory" in crc_cases.format_table(results)


def test_extend_sweep_points_and_plot(tmp_path):
    results = extend_cases.extend_sweep((1, 5), prefix_len=32, repeats=1)  # checks extend == decode logits
    assert [r.new_tokens for r in results] == [1, 5]
    data = {"extend": {"points": [r.as_dict() for r in results]}}
    assert write_plots(data, str(tmp_path)) == [str(tmp_path / "extend.png")]
    _png(str(tmp_path / "extend.png"))


@pytest.mark.root
@pytest.mark.skipif(unavailable_reason() is not None, reason=f"WAN emulator: {unavailable_reason()}")
def test_handoff_case_few_trials(tmp_path):
    r = handoff_cases.handoff_case("embedded", trials=3, prefix_len=64, background_bulk=True)
    cfg = handoff_cases.MODELS["embedded"]
    assert r.kv.payload_bytes == r.tokens * 2 * cfg.num_layers * cfg.kv_size * 8 == r.tokens * r.kv_bytes_per_token
    assert 0 < r.ids.payload_bytes < 512
    assert len(r.kv.samples_ms) == len(r.ids.samples_ms) == 3
    # Both paths leave the same KV in MD's pool (same float64 computation on both sides).
    assert r.max_abs_kv_diff < 1e-12
    # Nothing arrives before the one-way delay of the link.
    assert min(r.kv.transport_ms + r.ids.transport_ms) >= r.rtt_ms / 2
    assert all(s >= t for s, t in zip(r.kv.samples_ms, r.kv.transport_ms))
    assert r.bulk_gbps > 0
    data = {"handoff": {"models": [r.as_dict()], "report": handoff_cases.REPORT}}
    assert write_plots(data, str(tmp_path)) == [str(tmp_path / "handoff.png")]
    _png(str(tmp_path / "handoff.png"))


@pytest.mark.root
@pytest.mark.skipif(unavailable_reason() is not None, reason=f"WAN emulator: {unavailable_reason()}")
def test_loss_rows_at_ci_size():
    results = loss_cases.loss_case(0.01, ("cubic", "bbr"), rate="200mbit", delay_ms=5, nbytes=4 << 20,
                                   piece_sizes=(64 << 10, 1 << 20))
    assert [(r.congestion_control, r.piece_bytes) for r in results] == [
        ("cubic", 64 << 10), ("cubic", 1 << 20), ("bbr", 64 << 10), ("bbr", 1 << 20)]
    for r in results:
        # 4 MiB is ~2900 packets: at 1 % the delay line drops some in every row (p(none) ~ 1e-13),
        # and the engine's data connections had to send segments again.
        assert r.packets_dropped > 0 and r.tcp_retransmits > 0 and r.cwnd_bytes > 0
        # Every byte arrived (each chunk is CRC-checked and acknowledged) despite the drops, in finite time.
        assert 0 < r.goodput_gbps and r.nbytes == 4 << 20
        assert r.as_dict()["bdp_bytes"] == pytest.approx(200e6 / 8 * 0.010)
    assert "64 KiB" in loss_cases.format_table(results) and "bbr" in loss_cases.format_table(results)


@pytest.mark.root
@pytest.mark.skipif(unavailable_reason() is not None, reason=f"WAN emulator: {unavailable_reason()}")
def test_stream_case_few_trials():
    r = stream_cases.stream_case("embedded", tokens=64, trials=2, rate="200mbit", delay_ms=5)
    assert len(r.streamed_ms) == len(r.after_prefill_ms) == 1 and len(r.prefill_ms) == 2
    # Posted after prefill, the KV needs at least the link's one-way delay after its end.
    # (Streamed, the last layer leaves from inside prefill: its time may even be negative
    # when the prefill's tail outlasts the delay, so only the after-prefill bound holds.)
    assert min(r.after_prefill_ms) >= r.rtt_ms / 2
    cfg = handoff_cases.MODELS["embedded"]
    assert r.kv_bytes == 64 * 2 * cfg.num_layers * cfg.kv_size * 8
    assert "streamed per layer" in stream_cases.format_table(r)
    # Both modes moved the KV, so both have a busy-time reading; no reading exceeds what the
    # link carries (by more than the kernel's sample noise). A path-limited stretch may also
    # carry the shaper's full bucket once per layer: each layer may start after an idle gap.
    bucket_bits = 8 * tbf_burst_bytes(r.rate_bps) * cfg.num_layers
    for mode in stream_cases.MODES:
        reading = r.link_readings[mode]
        assert 0 < reading["busy_bps"] <= 1.05 * r.rate_bps, r.link_readings
        limited_bits = reading["path_limited_bps"] * reading["path_limited_seconds"]
        assert 0 <= limited_bits <= 1.05 * r.rate_bps * reading["path_limited_seconds"] + bucket_bits, r.link_readings


def test_a_result_is_its_fields_then_each_derived_figure_with_nested_results_expanded():
    @dataclass
    class Leg(Result):
        seconds: float

        @property
        def ms(self) -> float:
            return 1000 * self.seconds

    @dataclass
    class Trip(Result):
        legs: list[Leg]
        name: str

        @property
        def total_ms(self) -> float:
            return sum(leg.ms for leg in self.legs)

    assert Trip([Leg(0.5), Leg(0.25)], "x").as_dict() == {
        "legs": [{"seconds": 0.5, "ms": 500.0}, {"seconds": 0.25, "ms": 250.0}], "name": "x", "total_ms": 750.0}
    # A real case: the speedup and the per-token time are derived, not stored.
    assert extend_cases.ExtendResult(prefix=100, new_tokens=4, decode_steps_s=0.8, extend_s=0.2).as_dict() == {
        "prefix": 100, "new_tokens": 4, "decode_steps_s": 0.8, "extend_s": 0.2, "speedup": 4.0,
        "extend_ms_per_token": 50.0}


def test_demo_case_rows_put_pdd_beside_cross_dc_pd(monkeypatch):
    ttft = {"pd": {"p50": 0.2, "p90": 0.6, "p99": 1.5}, "pdd": {"p50": 0.1, "p90": 0.5, "p99": 1.8}}
    measured = demo_cases.DemoResult(24, "100 Mbit/s", ttft, {"pd": True, "pdd": False})
    monkeypatch.setattr(demo_cases, "demo_case", lambda quick: measured)
    out = RUNNERS["demo"](True, "tcp")
    assert [(r.what, r.value, r.baseline, r.unit) for r in out.rows] == [
        ("PDD TTFT p50", 100.0, 200.0, "ms"), ("PDD TTFT p90", 500.0, 600.0, "ms"),
        ("PDD TTFT p99", 1800.0, 1500.0, "ms")]
    assert out.data["ttft_s"] == ttft and out.data["outputs_exact"] == {"pd": True, "pdd": False}
    assert "p90           600 ms    500 ms     0.83x" in out.text and "PDD: DIFFER" in out.text
