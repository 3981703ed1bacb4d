"""`pddcore bench` in tiny modes: results.json structure, the table, the plots; and the
handoff and extend cases on a few points (no assertion on speed)."""

from __future__ import annotations

import json
import os

import pytest

from pddcore import bench_cli
from pddcore import _C
from pddcore.benchmarks import crc_cases, extend_cases, handoff_cases
from pddcore.cli import main
from pddcore.testing.wan import unavailable_reason


def _png(path: str) -> None:
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", path
    assert os.path.getsize(path) > 1000, path


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
    assert pack_points and all(p["pack_gbps"] > 0 and p["copy_gbps"] > 0 for p in pack_points)
    radix_points = res["cases"]["radix"]["points"]
    assert radix_points and all(0 < p["radix_hit_rate"] <= 1 for p in radix_points)
    rows = res["table"]
    assert {r["case"] for r in rows} == {"pack", "radix"}
    for r in rows:
        assert r["baseline"] > 0 and r["ratio"] == pytest.approx(r["value"] / r["baseline"])
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
    assert bench_cli.write_plots(data, str(tmp_path)) == [str(tmp_path / "extend.png")]
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
    assert bench_cli.write_plots(data, str(tmp_path)) == [str(tmp_path / "handoff.png")]
    _png(str(tmp_path / "handoff.png"))
