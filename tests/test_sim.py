"""Tests of pddcore.sim: cost model, links and decode against plain reference models,
cluster invariants, a small calibration regression, traces and the CLI."""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from pddcore.cli import main as cli_main
from pddcore.router import Pipeline
from pddcore.sim import (AccountingError, AgenticConfig, ClusterSim, CostModel, HARDWARE, MODELS, HardwareSpec,
                         Request, TraceError, agentic, calibration_configs, check_accounting, max_goodput,
                         read_jsonl, run_trace, summarize, write_jsonl)
from pddcore.sim.cluster import Pool
from pddcore.sim.costmodel import prefill_flops
from pddcore.sim.economics import Prices
from pddcore.sim.engine import EventLoop
from pddcore.sim.instances import DecodeInstance, KVPool
from pddcore.sim.links import SharedLink
from pddcore.sim.scenarios import calibration_trace
from pddcore.sim.sweeps import plot, rld_count

MOE = MODELS["moe-64k"]


# ---- cost model ---------------------------------------------------------------------------------

@pytest.mark.parametrize("new,cached", [(1, 0), (7, 0), (5, 13), (64, 1000), (0, 50)])
def test_prefill_flops_matches_per_token_sum(new, cached):
    m = MOE
    ref = sum(2 * m.active_params + 4 * m.q_heads * m.head_dim * m.layers * (p + 1) for p in range(cached, cached + new))
    assert prefill_flops(m, new, cached) == pytest.approx(ref, rel=1e-12)


def _reference_step(cost: CostModel, batch: int, ctx: int) -> float:
    m, hw = cost.model, cost.hardware
    touched = 1 - (1 - m.experts_per_token / m.num_experts) ** batch
    weights = (m.total_params - m.expert_params + m.expert_params * touched) * m.weight_bytes
    mem = (weights + ctx * m.layers * 2 * m.kv_heads * m.head_dim * m.kv_bytes) / (hw.hbm_gbps * 1e9 * cost.gpus * cost.mbu)
    flops = (2 * m.active_params * batch + 4 * m.q_heads * m.head_dim * m.layers * ctx) / (hw.tflops * 1e12 * cost.gpus * cost.mfu)
    return cost.step_overhead_s + max(mem, flops)


def test_decode_steps_closed_form_matches_step_by_step():
    rng = random.Random(3)
    # A compute-starved chip makes the memory and compute lines cross inside a segment.
    slow = HardwareSpec("slow", tflops=2.0, hbm_gbps=3000.0, memory_gb=200.0, price_per_hour=1.0)
    costs = [CostModel(MOE, HARDWARE["H100"]), CostModel(MOE, HARDWARE["H200"], gpus=2), CostModel(MOE, slow),
             CostModel(MODELS["llama3-8b"], HARDWARE["A100"])]
    for _ in range(300):
        cost = rng.choice(costs)
        batch, ctx, steps = rng.randint(1, 200), rng.randint(0, 2_000_000), rng.randint(1, 300)
        ref = sum(_reference_step(cost, batch, ctx + batch * i) for i in range(steps))
        assert cost.decode_steps_seconds(batch, ctx, steps) == pytest.approx(ref, rel=1e-9)


def test_cost_model_rejects_a_model_that_does_not_fit():
    with pytest.raises(ValueError, match="more GPUs per instance"):
        CostModel(MODELS["llama3-70b"], HARDWARE["H100"])
    assert CostModel(MODELS["llama3-70b"], HARDWARE["H100"], gpus=2).kv_capacity_tokens() > 65536
    with pytest.raises(ValueError, match="mfu"):
        CostModel(MOE, HARDWARE["H100"], mfu=0)


def test_kv_capacity_follows_memory():
    h100, h200 = CostModel(MOE, HARDWARE["H100"]), CostModel(MOE, HARDWARE["H200"])
    assert h100.kv_capacity_tokens() == math.floor((80e9 * 0.9 - 60e9) / 49152)
    assert h200.kv_capacity_tokens() > 5 * h100.kv_capacity_tokens()


# ---- engine and links -----------------------------------------------------------------------------

def test_event_loop_orders_ties_and_cancels():
    loop, seen = EventLoop(), []
    loop.at(1.0, seen.append, "a")
    loop.at(0.5, seen.append, "b")
    loop.at(1.0, seen.append, "c")
    loop.at(0.7, seen.append, "x").cancel()
    loop.run()
    assert seen == ["b", "a", "c"] and loop.now == 1.0
    with pytest.raises(ValueError, match="clock"):
        loop.at(0.1, seen.append, "late")


def _fluid_reference(bw, rtt, transfers):
    """Processor sharing by brute force: (start, bytes) -> completion times."""
    remaining = {i: b for i, (s, b) in enumerate(transfers)}
    joins = sorted((s + rtt, i) for i, (s, b) in enumerate(transfers))
    active, done, now = set(), {}, 0.0
    while remaining:
        next_join = joins[0][0] if joins else math.inf
        if active:
            share = bw / len(active)
            i_min = min(active, key=lambda i: remaining[i])
            t_finish = now + remaining[i_min] / share
        else:
            t_finish = math.inf
        t = min(next_join, t_finish)
        if active:
            for i in active:
                remaining[i] -= (t - now) * bw / len(active)
        now = t
        for i in [i for i in active if remaining[i] <= 1e-6 * transfers[i][1] + 1e-9]:
            active.discard(i)
            del remaining[i]
            done[i] = now
        while joins and joins[0][0] <= now:
            _, i = joins.pop(0)
            if transfers[i][1] == 0:
                del remaining[i]
                done[i] = now
            else:
                active.add(i)
    return done


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.integers(0, 5_000_000)), min_size=1, max_size=12),
       st.sampled_from([0.0, 0.02]))
def test_shared_link_matches_fluid_reference(transfers, rtt):
    transfers = sorted(transfers)
    bw = 1e6
    loop = EventLoop()
    link = SharedLink(loop, bw, rtt)
    done = {}
    for i, (start, nbytes) in enumerate(transfers):
        loop.at(start, lambda i=i, n=nbytes: link.send(n, lambda: done.__setitem__(i, loop.now)))
    loop.run()
    ref = _fluid_reference(bw, rtt, transfers)
    assert done.keys() == ref.keys()
    for i in ref:
        # The link finishes a transfer within one byte of its end (float slack): at most
        # 12 sharers x 1 byte / 1 MB/s late or early.
        assert done[i] == pytest.approx(ref[i], rel=1e-6, abs=2e-5)
    assert link.bytes_delivered == pytest.approx(sum(b for _, b in transfers), rel=1e-9)


def test_cancelled_transfer_frees_the_link():
    loop = EventLoop()
    link = SharedLink(loop, 1e9, 0.0)
    done = {}
    a = link.send(2e9, lambda: done.setdefault("a", loop.now))
    link.send(2e9, lambda: done.setdefault("b", loop.now))
    loop.at(1.0, link.cancel, a)          # both at 0.5 GB/s until 1 s, then b alone
    loop.run()
    assert "a" not in done and done["b"] == pytest.approx(2.5)
    assert link.bytes_delivered == pytest.approx(2.5e9)


# ---- decode instance against a per-step reference ---------------------------------------------------

def _per_step_reference(cost, arrivals):
    """(arrival, context, tokens) joined at step boundaries -> finish times; the first
    token is emitted at the join."""
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    running, done, now = {}, {}, 0.0
    while pending or running:
        while pending and arrivals[pending[0]][0] <= now:
            i = pending.pop(0)
            _, ctx, tokens = arrivals[i]
            if tokens == 1:
                done[i] = now
            else:
                running[i] = [ctx, tokens - 1]
        if not running:
            now = arrivals[pending[0]][0]
            continue
        now += cost.decode_step_seconds(len(running), sum(c for c, _ in running.values()))
        for i in list(running):
            running[i][0] += 1
            running[i][1] -= 1
            if running[i][1] == 0:
                done[i] = now
                del running[i]
    return done


def test_decode_segments_match_per_step_reference():
    rng = random.Random(11)
    cost = CostModel(MOE, HARDWARE["H200"])
    arrivals = [(rng.uniform(0, 3), rng.randint(100, 60000), rng.randint(1, 300)) for _ in range(40)]
    loop = EventLoop()
    inst = DecodeInstance(loop, cost, KVPool(cost.kv_capacity_tokens(), 256), "D")
    done = {}
    for i, (t, ctx, tokens) in enumerate(arrivals):
        loop.at(t, inst.join, i, ctx, tokens, True, None, lambda job: done.__setitem__(job, loop.now))
    loop.run()
    ref = _per_step_reference(cost, arrivals)
    assert done.keys() == ref.keys()
    for i in ref:
        assert done[i] == pytest.approx(ref[i], rel=1e-9), i


def test_kv_pool_waits_in_order_and_rejects_oversize():
    pool, granted = KVPool(100, 2), []
    for job, tokens in (("a", 60), ("b", 60), ("c", 10)):
        pool.reserve(job, tokens, granted.append)
    assert granted == ["a"]                       # c waits behind b: first come, first served
    pool.release("a", 60)
    assert granted == ["a", "b", "c"]
    with pytest.raises(ValueError, match="capacity"):
        pool.reserve("d", 101, granted.append)


# ---- cluster invariants ---------------------------------------------------------------------------

def _stress_trace(n=400, seed=5, rate=12.0):
    return agentic(AgenticConfig(rate=rate, num_requests=n, session_turn_s=60.0), seed=seed)


@pytest.fixture(scope="module")
def stressed_runs():
    """Three deployments on one trace over a slow WAN, so every PDD path is taken."""
    trace = _stress_trace()
    configs = calibration_configs(wan_gbps=10.0)
    return trace, {name: ClusterSim(cfg).run(trace) for name, cfg in configs.items()}


def test_every_request_and_token_accounted_for(stressed_runs):
    trace, runs = stressed_runs
    for run in runs.values():
        check_accounting(run)
        assert sorted(j.req.id for j in run.jobs) == sorted(r.id for r in trace)
        assert sum(j.tokens_rld + j.tokens_md for j in run.jobs) == sum(r.output_tokens for r in trace)
    pdd = runs["PDD"]
    routes = {j.pipeline for j in pdd.jobs}
    assert routes == {Pipeline.P_MD, Pipeline.P_RLD_MD, Pipeline.RLD_ONLY}
    modes = {m for j in pdd.jobs for m in j.handoffs}
    assert {"one_shot", "catch_up"} <= modes
    for j in pdd.jobs:
        if j.pipeline is Pipeline.RLD_ONLY:
            assert j.tokens_md == 0 and j.tokens_rld == j.req.output_tokens
        if j.pipeline is Pipeline.P_MD:
            assert j.tokens_rld == 0
    assert all(j.tokens_rld == 0 for j in runs["cross-DC PD"].jobs)
    assert runs["same-DC PD"].wan_bytes == 0


@pytest.mark.parametrize("changes", [{"drc": False}, {"warm_start": False}, {"max_batch": 2}])
def test_variants_account_for_everything(changes):
    trace = _stress_trace(n=200, seed=6)
    for name, cfg in calibration_configs(wan_gbps=10.0, **changes).items():
        run = ClusterSim(cfg).run(trace)
        check_accounting(run)
        if name != "same-DC PD" and changes.get("drc", True) is False:
            assert run.md_lookup_pages == 0


def test_decode_side_cache_cuts_wan_bytes():
    trace = _stress_trace(n=200, seed=6)
    with_drc = run_trace(calibration_configs(wan_gbps=100.0)["cross-DC PD"], trace)
    without = run_trace(calibration_configs(wan_gbps=100.0, drc=False)["cross-DC PD"], trace)
    assert with_drc["wan_gb"] < 0.3 * without["wan_gb"]
    assert with_drc["md_hit_rate"] == pytest.approx(with_drc["p_hit_rate"], abs=0.03)


def test_md_serves_alone_when_ready_before_rld_has_room():
    """RLD (one H100) is full of three long RLD-only requests; the fourth was routed to
    RLD while it still looked free, waits for RLD memory, and MD gets its KV first."""
    reqs = [Request(i, 0.1 * i, 62000, 0, 2000) for i in range(3)] + [Request(3, 0.3, 51000, 0, 2000)]
    cfg = calibration_configs(wan_gbps=2.0)["PDD"].with_(rld=Pool(HARDWARE["H100"], 1))
    run = ClusterSim(cfg).run(reqs)
    check_accounting(run)
    assert [j.pipeline for j in run.jobs[:3]] == [Pipeline.RLD_ONLY] * 3
    last = run.jobs[3]
    assert last.pipeline is Pipeline.P_RLD_MD and last.handoffs == []
    assert (last.tokens_rld, last.tokens_md) == (0, 2000)
    assert last.t_first < min(j.t_done for j in run.jobs[:3])   # did not wait for RLD to free up


def test_accounting_check_catches_a_lost_token(stressed_runs):
    _, runs = stressed_runs
    run = runs["cross-DC PD"]
    job = run.jobs[7]
    job.tokens_md -= 1
    try:
        with pytest.raises(AccountingError, match="tokens"):
            check_accounting(run)
    finally:
        job.tokens_md += 1


def test_more_wan_bandwidth_never_raises_cross_dc_ttft():
    trace = _stress_trace(n=300, seed=2)
    previous = None
    for gbps in (6, 8, 12, 16, 25, 50, 100, 400):
        s = run_trace(calibration_configs(wan_gbps=float(gbps))["cross-DC PD"], trace)
        current = [s["ttft_p50_s"], s["ttft_p90_s"], s["ttft_p99_s"]]
        if previous is not None:
            assert all(c <= p + 1e-9 for c, p in zip(current, previous)), (gbps, current, previous)
        previous = current


@pytest.mark.parametrize("seed,gbps,rate", [(1, 8.0, 9.0), (2, 12.0, 12.0), (3, 25.0, 9.0), (4, 40.0, 20.0)])
def test_pdd_p90_never_above_cross_dc(seed, gbps, rate):
    trace = _stress_trace(n=300, seed=seed, rate=rate)
    configs = calibration_configs(wan_gbps=gbps)
    cross = run_trace(configs["cross-DC PD"], trace)
    pdd = run_trace(configs["PDD"], trace)
    assert pdd["ttft_p90_s"] <= cross["ttft_p90_s"]


def test_calibration_regression():
    """Bands around the calibration scenario (1500 requests, the WAN ~85 % busy), not exact values."""
    trace = calibration_trace(1500)
    configs = calibration_configs()
    s = {name: run_trace(cfg, trace) for name, cfg in configs.items()}
    same, cross, pdd = s["same-DC PD"], s["cross-DC PD"], s["PDD"]
    assert 0.85 <= same["p_hit_rate"] <= 0.93
    assert cross["md_hit_rate"] >= cross["p_hit_rate"] - 0.03      # MD's cache keeps up at this load
    assert 6.0 <= cross["wan_gbps_mean"] <= 16.0 and 0.6 <= cross["wan_busy_fraction"] <= 1.0
    assert pdd["ttft_p90_s"] <= 0.5 * cross["ttft_p90_s"]           # the report: -46 %
    assert pdd["ttft_p99_s"] <= cross["ttft_p99_s"]
    assert 0.01 < pdd["rld_token_share"] < 0.15                     # the report: ~6 %
    assert same["ttft_p90_s"] < 5.0 and same["wan_gbps_mean"] == 0
    assert same["sla_attainment"] >= 0.99 and pdd["sla_attainment"] >= 0.95 > cross["sla_attainment"]
    for x in (same, cross, pdd):
        assert 0.005 < x["tpot_p50_s"] < 0.05


def test_goodput_search_brackets_the_sla():
    trace = _stress_trace(n=600, seed=9)
    cfg = calibration_configs(wan_gbps=10.0)["cross-DC PD"]
    base = (len(trace) - 1) / (trace[-1].arrival_s - trace[0].arrival_s)
    rate, summary = max_goodput(cfg, trace, iterations=4)
    assert rate > 0 and summary["sla_attainment"] >= 0.9
    assert summary["offered_rps"] == pytest.approx(rate, rel=0.05)
    doubled = run_trace(cfg, [Request(r.id, r.arrival_s / (2 * rate / base), r.prompt_tokens, r.cached_tokens,
                                      r.output_tokens, r.session) for r in trace])
    assert doubled["sla_attainment"] < 0.9
    with pytest.raises(ValueError, match="use more requests"):
        max_goodput(cfg, trace[:20])


def test_goodput_search_on_a_regenerated_workload():
    """Sessions grow with the rate; a faster WAN can only raise cross-DC goodput."""
    workload = AgenticConfig(rate=9.0, num_requests=400)
    slow, s_slow = max_goodput(calibration_configs(wan_gbps=8.0)["cross-DC PD"], workload, iterations=3, seed=2)
    fast, s_fast = max_goodput(calibration_configs(wan_gbps=50.0)["cross-DC PD"], workload, iterations=3, seed=2)
    assert 0 < slow < fast
    for s in (s_slow, s_fast):
        assert s["sla_attainment"] >= 0.9 and s["sent_rps"] <= s["offered_rps"] * 1.001


# ---- workload and traces ----------------------------------------------------------------------------

def test_agentic_workload_shape():
    cfg = AgenticConfig(num_requests=6000)
    reqs = agentic(cfg, seed=4)
    hits = [r.hit_rate for r in reqs]
    assert 0.70 <= sum(h > 0.95 for h in hits) / len(hits) <= 0.80
    assert sum(hits) / len(hits) == pytest.approx(0.9, abs=0.03)
    assert all(r.prompt_tokens <= cfg.max_context and 0 <= r.cached_tokens <= r.prompt_tokens for r in reqs)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert reqs == agentic(cfg, seed=4)
    with pytest.raises(ValueError, match="unreachable"):
        AgenticConfig(mean_hit=0.99)


def test_jsonl_round_trip(tmp_path):
    reqs = agentic(AgenticConfig(num_requests=50), seed=2)
    reqs.append(Request("no-session", reqs[-1].arrival_s, 10, 3, 4))
    path = tmp_path / "t.jsonl"
    write_jsonl(reqs, path)
    assert read_jsonl(path) == reqs


@pytest.mark.parametrize("line,message", [
    ('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}', "missing required field 'cached_tokens'"),
    ('{"arrival_s": 0, "prompt_tokens": 5, "cached_tokens": 6, "output_tokens": 1}', "exceeds prompt_tokens"),
    ('{"arrival_s": -1, "prompt_tokens": 5, "cached_tokens": 0, "output_tokens": 1}', "arrival_s must be"),
    ('{"arrival_s": 0, "prompt_tokens": 5.5, "cached_tokens": 0, "output_tokens": 1}', "prompt_tokens must be"),
    ('{"arrival_s": 0, "prompt_tokens": 5, "cached_tokens": 0, "output_tokens": true}', "output_tokens must be"),
    ('{"arrival_s": 0, "prompt_tokens": 5, "cached_tokens": 0, "output_tokens": 1, "promt": 3}', "unknown field"),
    ('{"arrival_s": 0, "prompt_tokens": 5, "cached_tokens": 0, "output_tokens": 1, "session": [1]}', "session"),
    ('{"arrival_s": 0, "prompt_tokens": 5,', "not valid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"arrival_s": 0.5, "prompt_tokens": 5, "cached_tokens": 0, "output_tokens": 1}', "before the previous"),
])
def test_bad_trace_lines_name_the_problem(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    good = '{"arrival_s": 1.0, "prompt_tokens": 8, "cached_tokens": 0, "output_tokens": 2}'
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(TraceError, match=message) as info:
        read_jsonl(path)
    assert "bad.jsonl:3" in str(info.value)


def test_empty_trace_and_oversized_request_are_errors(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_jsonl(path)
    cfg = calibration_configs()["PDD"]
    with pytest.raises(ValueError, match="context"):
        ClusterSim(cfg).run([Request(0, 0.0, 200_000, 0, 10)])


# ---- economics, CLI, sweeps -------------------------------------------------------------------------

def test_benefit_bills_cached_input_at_a_fraction():
    prices = Prices(input_per_mtok=2.0, output_per_mtok=8.0, cached_fraction=0.25)
    assert prices.request_benefit(1_000_000, 800_000, 100_000) == pytest.approx(2.0 * 0.2 + 0.5 * 0.8 + 0.8)


def test_cli_trace_json_and_plot(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    assert cli_main(["sim", "--write-trace", str(trace), "--requests", "120"]) == 0
    out = tmp_path / "r.json"
    figs = tmp_path / "figs"
    assert cli_main(["sim", "--trace", str(trace), "--json", str(out), "--plot", str(figs), "--no-progress"]) == 0
    result = json.loads(out.read_text())
    assert set(result["scenarios"]) == {"same-DC PD", "cross-DC PD", "PDD"}
    assert all(s["requests"] == 120 for s in result["scenarios"].values())
    assert (figs / "ttft_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0}\n')
    assert cli_main(["sim", "--trace", str(bad), "--no-progress"]) == 2
    assert "missing required field" in capsys.readouterr().err


def test_rld_sweep_and_plot(tmp_path):
    rows = rld_count(counts=(0, 1, 3), num_requests=200, progress=False, wan_gbps=10.0)
    assert [r["rld_instances"] for r in rows] == [0, 1, 3]
    assert rows[0]["rld_token_share"] == 0 and rows[2]["rld_token_share"] > 0
    assert rows[2]["ttft_p90_s"] <= rows[0]["ttft_p90_s"]
    path = plot("rld", rows, tmp_path)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="unknown sweep"):
        plot("nope", rows, tmp_path)
