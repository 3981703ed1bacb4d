"""Router decisions per regime and as properties, and priced at the compressed size;
BandwidthEstimator and CompressionEstimator arithmetic; the former's tolerance of
TransferEngine.stats() shapes."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from pddcore import KVLayout
from pddcore.router import (BandwidthEstimator, CompressionEstimator, Pipeline, Route, RouteRequest, Router,
                            RouterConfig)

BPT = 46_000  # ~4.6 MB per 100 tokens, the PDD report's model
ROUTER = Router(RouterConfig(kv_bytes_per_token=BPT))
GBIT10 = 1.25e9


def fast(max_examples):
    return settings(max_examples=max_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def req(**kw):
    base = dict(prompt_tokens=65536, wan_bytes_per_s=GBIT10, wan_rtt_s=0.03, prefill_s=1.0)
    base.update(kw)
    return RouteRequest(**base)


# ---- regimes -------------------------------------------------------------------------------------

def test_high_hit_goes_p_md():
    r = ROUTER.route(req(md_cached_tokens=62000, expected_output_tokens=300))
    assert r.pipeline is Pipeline.P_MD
    assert r.tokens_to_md == 3536 and r.bytes_to_md == 3536 * BPT
    assert r.expected_md_ready_s == pytest.approx(1.0 + 0.03 + 3536 * BPT / GBIT10)
    assert "within the TTFT SLO" in r.reason


def test_low_hit_long_output_goes_through_rld():
    r = ROUTER.route(req(md_cached_tokens=6000, expected_output_tokens=2000))
    assert r.pipeline is Pipeline.P_RLD_MD and r.bytes_to_md == (65536 - 6000) * BPT
    assert "MD takes over" in r.reason


def test_short_output_stays_on_rld():
    r = ROUTER.route(req(expected_output_tokens=40))
    assert r.pipeline is Pipeline.RLD_ONLY and r.bytes_to_md == 0 and math.isinf(r.expected_md_ready_s)
    assert "RLD finishes the expected 40 output tokens" in r.reason


def test_few_md_tokens_stay_on_rld():
    md_ready = 1.0 + 0.03 + 65536 * BPT / GBIT10  # ~3.44 s: RLD makes 81 tokens meanwhile
    r = ROUTER.route(req(expected_output_tokens=90))
    assert r.pipeline is Pipeline.RLD_ONLY and "take over only 9" in r.reason
    assert math.floor((md_ready - 1.0) / 0.03) == 81


def test_transfer_costing_more_than_it_saves_stays_on_rld():
    # 2.4 s of WAN to save 0.03 * (160 - 81) = 2.37 s of RLD time
    r = ROUTER.route(req(expected_output_tokens=160))
    assert r.pipeline is Pipeline.RLD_ONLY and "holds the WAN" in r.reason
    cheap_wan = Router(RouterConfig(kv_bytes_per_token=BPT, wan_value_ratio=2.0))
    assert cheap_wan.route(req(expected_output_tokens=160)).pipeline is Pipeline.P_RLD_MD


def test_full_rld_sends_everything_to_md():
    r = ROUTER.route(req(expected_output_tokens=40, rld_load=1.0))
    assert r.pipeline is Pipeline.P_MD and "RLD is full" in r.reason


def test_unknown_output_disables_the_singular_filter_and_max_is_used_otherwise():
    assert ROUTER.route(req()).pipeline is Pipeline.P_RLD_MD
    r = ROUTER.route(req(max_output_tokens=20))
    assert r.pipeline is Pipeline.RLD_ONLY and "max 20" in r.reason
    assert ROUTER.route(req(max_output_tokens=20, expected_output_tokens=5000)).pipeline is Pipeline.P_RLD_MD


def test_request_overrides_and_prefill_estimate():
    r = ROUTER.route(req(md_cached_tokens=62000, ttft_slo_s=0.5))
    assert r.pipeline is Pipeline.P_RLD_MD
    r = ROUTER.route(req(md_cached_tokens=65000, kv_bytes_per_token=1.0, expected_output_tokens=100))
    assert r.bytes_to_md == 536
    timed = Router(RouterConfig(kv_bytes_per_token=BPT, prefill_tokens_per_s=10_000))
    r = timed.route(RouteRequest(prompt_tokens=20_000, p_cached_tokens=10_000, md_cached_tokens=20_000,
                                 wan_bytes_per_s=GBIT10))
    assert r.expected_md_ready_s == pytest.approx(1.0) and r.bytes_to_md == 0


def test_kv_layout_gives_bytes_per_token():
    k = [torch.zeros(8, 16, 2, 64, dtype=torch.bfloat16) for _ in range(3)]
    layout = KVLayout.from_tensors(k, [torch.zeros_like(t) for t in k])
    cfg = RouterConfig(kv_bytes_per_token=layout)
    assert cfg.kv_bytes_per_token == layout.bytes_per_token() == 3 * 2 * 2 * 64 * 2
    r = Router(cfg).route(RouteRequest(prompt_tokens=100, md_cached_tokens=50, wan_bytes_per_s=1e9))
    assert r.bytes_to_md == 50 * 1536


@pytest.mark.parametrize("kw, message", [
    (dict(prompt_tokens=-1), "prompt_tokens must be an integer >= 0"),
    (dict(md_cached_tokens=70000), "md_cached_tokens=70000 exceeds prompt_tokens"),
    (dict(p_cached_tokens=70000), "p_cached_tokens=70000 exceeds"),
    (dict(wan_bytes_per_s=0), "wan_bytes_per_s must be > 0"),
    (dict(wan_bytes_per_s=float("nan")), "wan_bytes_per_s must be a finite number"),
    (dict(wan_rtt_s=-0.1), "wan_rtt_s"),
    (dict(expected_output_tokens=-5), "expected_output_tokens"),
    (dict(rld_load=-1), "rld_load"),
    (dict(prefill_s=float("inf")), "prefill_s"),
    (dict(kv_bytes_per_token=0), "kv_bytes_per_token"),
])
def test_bad_requests_are_rejected(kw, message):
    with pytest.raises(ValueError, match=message):
        req(**kw)


@pytest.mark.parametrize("kw, message", [
    (dict(kv_bytes_per_token=-1), "kv_bytes_per_token"),
    (dict(kv_bytes_per_token="big"), "kv_bytes_per_token"),
    (dict(kv_bytes_per_token=BPT, rld_tpot_s=0), "rld_tpot_s must be > 0"),
    (dict(kv_bytes_per_token=BPT, min_md_tokens=1.5), "min_md_tokens"),
    (dict(kv_bytes_per_token=BPT, prefill_tokens_per_s=0), "prefill_tokens_per_s"),
])
def test_bad_configs_are_rejected(kw, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**kw)
    with pytest.raises(ValueError, match="RouterConfig"):
        Router({"kv_bytes_per_token": 1})


# ---- compressed KV on the WAN ---------------------------------------------------------------------

def test_without_a_codec_the_wire_carries_the_raw_kv():
    assert RouterConfig(kv_bytes_per_token=BPT).kv_compression_ratio == 1.0
    r = ROUTER.route(req(md_cached_tokens=62000))
    assert r.wire_bytes_to_md == r.bytes_to_md == 3536 * BPT and "compression" not in r.reason


def test_a_2x_ratio_halves_the_priced_transfer_time():
    tokens = 65536 - 62000
    wire = tokens * BPT / 2  # BPT is even: no rounding
    halved = Router(RouterConfig(kv_bytes_per_token=BPT, kv_compression_ratio=2.0))
    for route in (halved.route(req(md_cached_tokens=62000)),
                  ROUTER.route(req(md_cached_tokens=62000, kv_compression_ratio=2.0))):
        assert route.bytes_to_md == tokens * BPT and route.wire_bytes_to_md == wire
        assert route.expected_md_ready_s == pytest.approx(1.0 + 0.03 + wire / GBIT10)
        assert "on the WAN at compression ratio 2" in route.reason
    raw_transfer_s = ROUTER.route(req(md_cached_tokens=62000)).expected_md_ready_s - 1.03
    assert halved.route(req(md_cached_tokens=62000)).expected_md_ready_s - 1.03 == pytest.approx(raw_transfer_s / 2)


def test_the_compressed_size_flips_a_decision():
    # The whole 65536-token prompt: 3.01 GB raw, 1.03 + 2.41 s = 3.44 s past the 3 s SLO;
    # at ratio 2 the WAN carries 1.51 GB: 1.03 + 1.21 s = 2.24 s, within it.
    assert ROUTER.route(req(expected_output_tokens=2000)).pipeline is Pipeline.P_RLD_MD
    r = ROUTER.route(req(expected_output_tokens=2000, kv_compression_ratio=2.0))
    assert r.pipeline is Pipeline.P_MD and r.expected_md_ready_s == pytest.approx(1.03 + 65536 * BPT / 2 / GBIT10)
    # The request's observed ratio overrides the config's expected one.
    expects_2x = Router(RouterConfig(kv_bytes_per_token=BPT, kv_compression_ratio=2.0))
    assert expects_2x.route(req(expected_output_tokens=2000, kv_compression_ratio=1.0)).pipeline is Pipeline.P_RLD_MD


@pytest.mark.parametrize("ratio", [0, 0.0, -2.0, float("nan"), float("inf"), True, "2", None])
def test_bad_compression_ratios_are_rejected(ratio):
    with pytest.raises(ValueError, match="kv_compression_ratio must be a finite number > 0"):
        RouterConfig(kv_bytes_per_token=BPT, kv_compression_ratio=ratio)
    if ratio is not None:  # None: the request takes the config's ratio
        with pytest.raises(ValueError, match="kv_compression_ratio must be a finite number > 0"):
            req(kv_compression_ratio=ratio)
        with pytest.raises(ValueError, match="prior_ratio"):
            CompressionEstimator(prior_ratio=ratio)


def test_compression_estimator_is_a_byte_weighted_ewma():
    est = CompressionEstimator(prior_ratio=1.5)
    assert est.ratio == 1.5 and est.samples == 0
    est.observe(raw_bytes=300, wire_bytes=100)  # the first send replaces the prior
    assert est.ratio == pytest.approx(3.0)
    est.observe(raw_bytes=1000, wire_bytes=1000)  # incompressible and larger: it weighs more
    raw, wire = 300 + 0.25 * (1000 - 300), 100 + 0.25 * (1000 - 100)
    assert est.ratio == pytest.approx(raw / wire) and est.samples == 2
    assert est.ratio < (3.0 + 0.25 * (1.0 - 3.0))  # below the EWMA of the per-send ratios
    est.observe(raw_bytes=100, wire_bytes=120)  # a frame larger than its raw bytes: ratio below 1
    assert est.ratio == pytest.approx((raw + 0.25 * (100 - raw)) / (wire + 0.25 * (120 - wire)))
    for bad in (dict(raw_bytes=0, wire_bytes=5), dict(raw_bytes=5, wire_bytes=0), dict(raw_bytes=-1, wire_bytes=5),
                dict(raw_bytes=5, wire_bytes=2.5)):
        with pytest.raises(ValueError, match="raw_bytes|wire_bytes"):
            est.observe(**bad)
    with pytest.raises(ValueError, match="alpha"):
        CompressionEstimator(alpha=0)


def test_compression_estimator_learns_from_a_real_codec_send():
    """A zstd send between loopback engines: the ratio learned is the KV's bytes over the
    frame the receiver got, and the router prices that frame's share of the bytes."""
    from pddcore import TransferEngine, codec

    kv = torch.randn(64, 16, 2, 64).to(torch.bfloat16)
    token = b"router-test-token-6e1d4a8c2f7b9053"
    with TransferEngine(auth_token=token) as md, TransferEngine(auth_token=token) as p:
        inbox, outbox = codec.Staging(md, 1 << 20, target=True), codec.Staging(p, 1 << 20)
        send = codec.send_compressed(p, p.connect(md.address), kv, "zstd", inbox.descriptor(), key=b"r",
                                     staging=outbox)
        send.wait(timeout=60)
        [note] = md.poll_messages(timeout=5)
        frame_len = codec.FrameNotice.parse(note.payload).length
    est = CompressionEstimator()
    est.observe(raw_bytes=kv.nbytes, wire_bytes=send.nbytes)
    assert send.nbytes == frame_len < kv.nbytes  # bfloat16's exponent plane compresses
    assert est.ratio == pytest.approx(kv.nbytes / frame_len) and est.ratio > 1
    route = ROUTER.route(req(md_cached_tokens=62000, kv_compression_ratio=est.ratio))
    assert route.wire_bytes_to_md == math.ceil(3536 * BPT / est.ratio)


# ---- properties ----------------------------------------------------------------------------------

request_st = st.builds(
    lambda prompt, md_frac, out, bw, rtt, load, prefill: RouteRequest(
        prompt_tokens=prompt, md_cached_tokens=int(prompt * md_frac), expected_output_tokens=out,
        wan_bytes_per_s=bw, wan_rtt_s=rtt, rld_load=load, prefill_s=prefill),
    st.integers(0, 200_000), st.floats(0, 1), st.none() | st.integers(0, 5000),
    st.floats(1e6, 1.25e10), st.floats(0, 0.2), st.floats(0, 1.2), st.floats(0, 10))


@fast(300)
@given(request_st)
def test_route_is_consistent_with_its_model(r):
    route = ROUTER.route(r)
    assert isinstance(route, Route) and route.reason
    assert route == ROUTER.route(r), "deterministic"
    md_ready = r.prefill_s + r.wan_rtt_s + math.ceil((r.prompt_tokens - r.md_cached_tokens) * BPT) / r.wan_bytes_per_s
    if route.pipeline is Pipeline.RLD_ONLY:
        assert route.bytes_to_md == 0 and r.expected_output_tokens is not None and r.rld_load < 1.0
        assert md_ready > 3.0
    else:
        assert route.bytes_to_md == route.wire_bytes_to_md == math.ceil((r.prompt_tokens - r.md_cached_tokens) * BPT)
        assert route.expected_md_ready_s == pytest.approx(md_ready)
        assert (route.pipeline is Pipeline.P_MD) == (md_ready <= 3.0 or r.rld_load >= 1.0)


@fast(200)
@given(request_st, st.floats(1.0, 100.0), st.floats(0, 1))
def test_more_bandwidth_or_cache_never_moves_away_from_p_md(r, faster, more_hit):
    """Hit-rate-aware routing is monotone: a request that fits P_MD still does with a faster
    link or more of its prompt already on MD."""
    if ROUTER.route(r).pipeline is not Pipeline.P_MD:
        return
    md_cached = r.md_cached_tokens + int((r.prompt_tokens - r.md_cached_tokens) * more_hit)
    better = RouteRequest(**{**r.__dict__, "wan_bytes_per_s": r.wan_bytes_per_s * faster,
                             "md_cached_tokens": md_cached})
    route = ROUTER.route(better)
    assert route.pipeline is Pipeline.P_MD and route.bytes_to_md <= ROUTER.route(r).bytes_to_md


@fast(200)
@given(request_st, st.integers(0, 5000))
def test_longer_output_never_turns_a_handoff_into_rld_only(r, extra):
    route = ROUTER.route(r)
    if route.pipeline is not Pipeline.P_RLD_MD or r.expected_output_tokens is None:
        return
    longer = RouteRequest(**{**r.__dict__, "expected_output_tokens": r.expected_output_tokens + extra})
    assert ROUTER.route(longer).pipeline is Pipeline.P_RLD_MD


# ---- bandwidth estimator -------------------------------------------------------------------------

MiB = 1 << 20


def test_ewma_floor_prior_and_rtt():
    est = BandwidthEstimator()
    assert est.estimate("md").bytes_per_s == 1.25e9 and est.estimate("md").samples == 0
    est.observe("md", 100 * MiB, 1.0, rtt_s=0.04)
    est.observe("md", 300 * MiB, 1.0, rtt_s=0.08)
    e = est.estimate("md")
    assert e.bytes_per_s == pytest.approx(100 * MiB + 0.25 * 200 * MiB)
    assert e.rtt_s == pytest.approx(0.04 + 0.125 * 0.04) and e.samples == 2
    est.observe("md", 4096, 1.0, rtt_s=0.04)  # too small for bandwidth, still an RTT sample
    assert est.estimate("md").samples == 2 and est.estimate("md").rtt_s < e.rtt_s
    for _ in range(40):
        est.observe("md", 2 * MiB, 100.0)  # a stalled link
    assert est.estimate("md").bytes_per_s == 1e6  # the floor
    assert est.estimate("other").bytes_per_s == 1.25e9 and est.peers == ["md"]


def test_decay_returns_to_the_prior_by_half_lives():
    est = BandwidthEstimator(prior_bytes_per_s=1e9, half_life_s=10.0)
    est.observe("md", 100 * MiB, 1.0, now=100.0)
    seen = 100 * MiB
    assert est.estimate("md", now=100.0).bytes_per_s == pytest.approx(seen)
    assert est.estimate("md", now=110.0).bytes_per_s == pytest.approx(1e9 + (seen - 1e9) / 2)
    assert est.estimate("md", now=130.0).bytes_per_s == pytest.approx(1e9 + (seen - 1e9) / 8)
    assert est.estimate("md").bytes_per_s == pytest.approx(seen)  # no clock, no decay
    est.observe("md", 100 * MiB, 1.0, now=110.0)  # weighed against the decayed view
    mid = 1e9 + (seen - 1e9) / 2
    assert est.estimate("md", now=110.0).bytes_per_s == pytest.approx(mid + 0.25 * (seen - mid))


@fast(100)
@given(st.lists(st.tuples(st.integers(MiB, 1 << 34), st.floats(1e-3, 100.0)), min_size=1, max_size=30))
def test_estimate_stays_between_floor_and_samples(samples):
    est = BandwidthEstimator()
    rates = [b / s for b, s in samples]
    for b, s in samples:
        est.observe("p", b, s)
    bw = est.estimate("p").bytes_per_s
    assert bw >= 1e6
    assert min(rates) * (1 - 1e-9) <= bw or bw == 1e6
    assert bw <= max(rates) * (1 + 1e-9) or bw == 1e6


def test_stats_counters_give_deltas_and_survive_restarts():
    est = BandwidthEstimator()
    stats = {"peers": {"md": {"bytes_sent": 200 * MiB, "seconds_busy": 2.0, "rtt_s": 0.05}}}
    assert est.update_from_stats(stats) == ["md"]
    assert est.estimate("md").bytes_per_s == pytest.approx(100 * MiB)
    stats["peers"]["md"].update(bytes_sent=200 * MiB + 512 * 1024, seconds_busy=2.5)
    assert est.update_from_stats(stats) == []  # half a MiB: keep accumulating
    stats["peers"]["md"].update(bytes_sent=600 * MiB, seconds_busy=4.0)
    assert est.update_from_stats(stats) == ["md"]
    assert est.estimate("md").bytes_per_s == pytest.approx(100 * MiB + 0.25 * (200 * MiB - 100 * MiB))
    stats["peers"]["md"].update(bytes_sent=50 * MiB, seconds_busy=1.0)  # engine restarted
    assert est.update_from_stats(stats) == ["md"] and est.estimate("md").samples == 3


def test_stats_alternative_shapes():
    est = BandwidthEstimator.from_stats(
        {"peers": [{"peer_id": "a", "bytes": 10 * MiB, "busy_s": 1.0, "rtt_ms": 30},
                   {"address": "b", "throughput_bytes_per_s": 5e8, "srtt_s": 0.01},
                   {"id": "d", "throughput_bps": 8e9, "rtt_s": 0.0},
                   {"peer": "c", "tx_bytes": 0, "active_s": 0.0}]},
        alpha=0.5)
    assert est.alpha == 0.5
    assert est.estimate("a").bytes_per_s == pytest.approx(10 * MiB) and est.estimate("a").rtt_s == pytest.approx(0.03)
    assert est.estimate("b").bytes_per_s == 5e8 and est.estimate("b").rtt_s == 0.01
    assert est.estimate("c").samples == 0
    assert est.estimate("d").bytes_per_s == 1e9 and est.estimate("d").rtt_s == est.prior_rtt_s  # rtt 0: unmeasured
    assert est.update_from_stats({"bytes": 5}) == []  # no per-peer section: nothing to learn


@pytest.mark.parametrize("stats, message", [
    ([1, 2], "stats must be a mapping"),
    ({"peers": 5}, "mapping or a list"),
    ({"peers": [{"bytes": 5}]}, "names no peer"),
    ({"peers": {"a": 5}}, r"stats\['peers'\]\['a'\] must be a mapping"),
    ({"peers": {"a": {"bytes_sent": -5, "seconds_busy": 1.0}}}, "bytes"),
    ({"peers": {"a": {"rtt_s": "fast"}}}, "rtt"),
])
def test_bad_stats_are_rejected(stats, message):
    with pytest.raises(ValueError, match=message):
        BandwidthEstimator().update_from_stats(stats)


def test_bad_observations_and_config_are_rejected():
    est = BandwidthEstimator()
    with pytest.raises(ValueError, match="nbytes"):
        est.observe("p", -1, 1.0)
    with pytest.raises(ValueError, match="0 seconds"):
        est.observe("p", MiB, 0.0)
    with pytest.raises(ValueError, match="rtt_s"):
        est.observe("p", MiB, 1.0, rtt_s=-1)
    with pytest.raises(ValueError, match="alpha"):
        BandwidthEstimator(alpha=0)
    with pytest.raises(ValueError, match="below floor"):
        BandwidthEstimator(prior_bytes_per_s=1e5)


def test_router_and_estimator_together():
    est = BandwidthEstimator()
    est.observe("md", 1 << 30, 20.0, rtt_s=0.06)  # ~54 MB/s: a congested link
    link = est.estimate("md")
    slow = ROUTER.route(req(md_cached_tokens=62000, wan_bytes_per_s=link.bytes_per_s, wan_rtt_s=link.rtt_s,
                            expected_output_tokens=500))
    fast_link = ROUTER.route(req(md_cached_tokens=62000, expected_output_tokens=500))
    assert (slow.pipeline, fast_link.pipeline) == (Pipeline.P_RLD_MD, Pipeline.P_MD)


def test_estimator_reads_a_real_transfer_engine():
    """Two engines on loopback: the estimator learns the link from the sender's stats()."""
    from pddcore import TransferEngine

    nbytes = 32 * MiB
    with TransferEngine() as md, TransferEngine() as p:
        dst = md.register(torch.zeros(nbytes, dtype=torch.uint8), target=True)
        src = p.register(torch.ones(nbytes, dtype=torch.uint8))
        peer = p.connect(md.address)
        p.write(peer, src, 0, dst.descriptor(), 0, nbytes).wait(timeout=60)
        stats = p.stats()
    est = BandwidthEstimator.from_stats(stats)
    entry = stats["peers"][md.address]
    link = est.estimate(md.address)
    assert link.samples == 1
    # What TCP measured while the path set the pace, not bytes over busy time.
    assert link.bytes_per_s == pytest.approx(entry["path_limited_bytes"] / entry["path_limited_seconds"])
    assert entry["bytes_sent"] >= nbytes and link.bytes_per_s > est.floor_bytes_per_s


def test_path_limited_counters_win_over_busy_time():
    """A sender that streams KV as prefill writes it keeps its transfers open while the link
    waits: bytes over busy time read low; the path-limited counters read the link."""
    est = BandwidthEstimator()
    entry = {"bytes_sent": 100 * MiB, "seconds_busy": 10.0, "path_limited_bytes": 100 * MiB,
             "path_limited_seconds": 1.0}
    assert est.update_from_stats({"peers": {"md": entry}}) == ["md"]
    assert est.estimate("md").bytes_per_s == pytest.approx(100 * MiB)
    # More small streamed transfers: busy time grows, the path never set the pace. Nothing new
    # to learn; in particular not the 10 MiB/s that bytes over busy time would say.
    entry.update(bytes_sent=150 * MiB, seconds_busy=15.0)
    assert est.update_from_stats({"peers": {"md": entry}}) == []
    assert est.estimate("md").bytes_per_s == pytest.approx(100 * MiB)

