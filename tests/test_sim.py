"""Tests of pddcore.sim: cost model, links, decode and prefix caches against plain
reference models, cluster invariants, the pinned calibration table, traces and the CLI."""

from __future__ import annotations

import json
import math
import random
from collections import OrderedDict
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from pddcore.cli import main as cli_main
from pddcore.router import Pipeline
from pddcore.sim import (AccountingError, AgenticConfig, ClusterSim, CostModel, HARDWARE, MODELS, HardwareSpec,
                         Request, TraceError, agentic, calibration_configs, check_accounting, max_goodput,
                         read_jsonl, run_trace, summarize, write_jsonl)
from pddcore.sim.deployment import Pool
from pddcore.sim.costmodel import prefill_flops
from pddcore.sim.economics import Prices
from pddcore.sim.engine import EventLoop
from pddcore.sim.calibration import comparison_rows
from pddcore.sim.instances import DecodeInstance, KVPool, PrefillInstance
from pddcore.sim.links import SharedLink
from pddcore.sim.scenarios import CALIBRATION_WORKLOAD, REPORT, calibration_trace
from pddcore.sim.sensitivity import Variation, format_sensitivity, sensitivity
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


def test_prefill_cache_matches_a_session_lru_reference():
    """Disjoint sessions of equal length in a P cache that holds exactly three: the radix
    cache's page LRU hits exactly when a whole-session LRU does, and each prefill takes
    the cost model's time for the tokens it recomputes."""
    pt, pages = 64, 10
    loop = EventLoop()
    cost = CostModel(MOE, HARDWARE["H100"])
    p = PrefillInstance(loop, cost, "P", cache_tokens=3 * pages * pt, page_tokens=pt)
    rng, lru, done = random.Random(7), OrderedDict(), []
    prompt = pages * pt
    for _ in range(300):
        s = rng.randrange(5)
        expected = prompt if s in lru else 0
        start = loop.now
        hit = p.submit(tuple(range(s * 100, s * 100 + pages)), prompt, 0, lambda: done.append(loop.now))
        loop.run()
        assert hit == expected
        assert done[-1] - start == pytest.approx(cost.prefill_seconds(prompt - hit, hit), rel=1e-12)
        lru[s] = True
        lru.move_to_end(s)
        if len(lru) > 3:
            lru.popitem(last=False)
    assert p.hit_tokens((7777,), trace_cached=5) == 0 and p.hit_tokens(None, trace_cached=5) == 5


def test_prefill_cache_size_sets_the_hit_rate():
    """Unbounded: P hits what the trace says. Bounded: never more, and less when smaller.
    P's busy time is the cost model's prefill time for what each request recomputed."""
    trace = _stress_trace(n=300, seed=3)
    by_ratio = {}
    for ratio in (None, 3.0, 0.25):
        cfg = calibration_configs(prefill_cache_ratio=ratio)["same-DC PD"]
        run = ClusterSim(cfg).run(trace)
        check_accounting(run)
        cost = cfg.cost_model(cfg.prefill)
        expected_busy = sum(cost.prefill_seconds(j.req.prompt_tokens - j.p_hit_tokens, j.p_hit_tokens)
                            for j in run.jobs)
        assert sum(v for k, v in run.instance_busy.items() if k.startswith("P")) == pytest.approx(expected_busy)
        assert all(j.p_hit_tokens <= j.req.cached_tokens for j in run.jobs)
        by_ratio[ratio] = summarize(run)
    assert by_ratio[None]["p_hit_rate"] == by_ratio[None]["trace_hit_rate"]
    assert by_ratio[0.25]["p_hit_rate"] < by_ratio[3.0]["p_hit_rate"] - 0.2
    assert by_ratio[0.25]["ttft_p90_s"] > by_ratio[None]["ttft_p90_s"]


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


@pytest.mark.parametrize("changes", [{"drc": False}, {"warm_start": False}, {"max_batch": 2},
                                     {"prefill_cache_ratio": None}])
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
    assert with_drc["md_hit_rate"] == pytest.approx(with_drc["trace_hit_rate"], abs=0.03)


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
    for gbps in (6, 9, 12.5, 25, 400):
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


# The calibrated table at the default 2000 requests (`pddcore sim`, docs/simulator.md).
# The run is deterministic; the 3 % tolerance only absorbs floating-point and library
# differences, so any change to the model shows up here and the docs must follow.
PINNED_AT_REPORT_LOAD = {
    "same-DC PD": {"ttft_p90_s": 1.80, "ttft_p99_s": 3.87, "p_hit_rate": 0.834, "sla_attainment": 1.0},
    "cross-DC PD": {"ttft_p90_s": 5.44, "ttft_p99_s": 18.64, "wan_busy_fraction": 0.638, "md_hit_rate": 0.892},
    "PDD": {"ttft_p90_s": 2.66, "ttft_p99_s": 6.79, "rld_token_share": 0.0252, "wan_busy_fraction": 0.604},
}


def test_calibrated_table_is_pinned():
    trace = calibration_trace()
    configs = calibration_configs()
    for name, pinned in PINNED_AT_REPORT_LOAD.items():
        s = run_trace(configs[name], trace)
        for key, value in pinned.items():
            assert s[key] == pytest.approx(value, rel=0.03), (name, key)
    # Goodput witnesses for the judged figures (report +-15 %): same-DC PD meets the SLA
    # at 9 req/s but not at 12, where it sends 10.5 req/s; PDD meets it at 11.5 req/s
    # with a goodput above the report's 11.5 - 15 %.
    def at(name, rate):
        return run_trace(configs[name], agentic(replace(CALIBRATION_WORKLOAD, rate=rate), seed=1))
    same_high, pdd = at("same-DC PD", 12.0), at("PDD", 11.5)
    assert same_high["sla_attainment"] < 0.9 and same_high["sent_rps"] == pytest.approx(10.49, rel=0.03)
    assert pdd["sla_attainment"] >= 0.9 and pdd["sla_goodput_rps"] >= (1 - 0.15) * REPORT["pdd_goodput_rps"]


def _scenario(goodput, bcr10, bcr25, **at_load):
    return {"goodput_rps": goodput, "bcr": {"0.1": bcr10, "0.25": bcr25},
            "at_offered_load": {"ttft_p90_s": 1.0, "ttft_p99_s": 2.0, "rld_token_share": 0.0, **at_load}}


def test_comparison_rows_judge_against_the_report():
    scenarios = {"same-DC PD": _scenario(9.0 * 1.14, 2.0, 3.0),
                 "cross-DC PD": _scenario(8.0, 1.0, 1.5, ttft_p90_s=18.3 * 0.84, ttft_p99_s=29.7),
                 "PDD": _scenario(11.5 * 0.86, 2.2, 2.9, ttft_p90_s=9.8, ttft_p99_s=14.4 * 1.2)}
    rows = {r["metric"]: r for r in comparison_rows(scenarios)}
    verdicts = {m: r["ok"] for m, r in rows.items() if "ok" in r}
    assert verdicts == {"cross-DC PD TTFT p90 (s)": False, "cross-DC PD TTFT p99 (s)": True,
                        "PDD TTFT p90 (s)": True, "PDD TTFT p99 (s)": False,
                        "goodput, 88 H100 same-DC PD (req/s)": True, "goodput, PDD (req/s)": True,
                        "BCR change, PDD vs same-DC PD (cached 10% / 25%)": False}
    assert rows["BCR change, PDD vs same-DC PD (cached 10% / 25%)"]["sim"] == pytest.approx((0.1, 2.9 / 3 - 1))
    assert rows["TTFT p90 change, PDD vs cross-DC"]["sim"] == pytest.approx(9.8 / (18.3 * 0.84) - 1)


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


def test_sensitivity_rows_read_the_calibration_result():
    """The baseline row reuses a given calibration result; its cells are that result's figures."""
    scenarios = {"same-DC PD": _scenario(9.0, 2.0, 3.0), "cross-DC PD": _scenario(8.0, 1.0, 1.5, ttft_p90_s=18.0),
                 "PDD": _scenario(11.0, 2.4, 3.3, ttft_p99_s=14.0, rld_token_share=0.05, p_hit_rate=0.8)}
    baseline = {"scenarios": scenarios, "comparison": comparison_rows(scenarios)}
    rows = sensitivity([Variation("calibrated")], baseline=baseline, progress=False)
    assert rows == [{"label": "calibrated", "config": {}, "workload": {}, "same-DC gp": 9.0, "PDD gp": 11.0,
                     "BCR vs same": pytest.approx(0.2), "cross p90": 18.0, "cross p99": 2.0, "PDD p90": 1.0,
                     "PDD p99": 14.0, "RLD share": 0.05, "P hit": 0.8}]
    table = format_sensitivity(rows).splitlines()
    assert table[1].split() == ["the", "report", "9.00", "11.50", "+32%", "18.30", "29.70", "9.80", "14.40", "6.0%", "-"]
    assert table[2].split() == ["calibrated", "9.00", "11.00", "+20%", "18.00", "2.00", "1.00", "14.00", "5.0%",
                                "80.0%"]


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
