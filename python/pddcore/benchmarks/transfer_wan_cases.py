"""The transfer engine across an emulated WAN (root): goodput against line rate on fresh and
kept connections, and priority-lane latency idle, under bulk, paced and self-paced (see
:mod:`.transfer_cases` for what each row means).

Example::

    r = wan_case(rate="1gbit", delay_ms=25)
    print(format_wan(r))
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

from .auth import bench_token
from .results import Result
from .sink import PROBE, desc_address, engine_sink, read_info

def engine_source(info_path: str, nbytes: int, piece_bytes: int, streams: int | str, chunk_bytes: int,
                  probes: int, probe_gap_s: float, pace_bps: float, queue_delay_target_s: float,
                  settle_s: float, kept_idle_s: float = 2.0) -> dict:
    """Sender side of :func:`wan_case`; runs inside namespace a."""
    import numpy as np

    from pddcore.transfer import TransferEngine

    desc = bytes.fromhex(read_info(info_path))
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    pages = nbytes // piece_bytes
    order = list(range(pages))
    random.Random(1).shuffle(order)
    batch = 1024

    def writes(region):
        return [[(region, i * piece_bytes, desc, order[i] * piece_bytes, piece_bytes)
                 for i in range(b, min(b + batch, pages))] for b in range(0, pages, batch)]

    def bulk(engine, peer, region):
        return [engine.write_batch(peer, w) for w in writes(region)]

    def probe(engine, peer, phase, busy):
        for _ in range(probes):
            engine.send(peer, PROBE.pack(b"lat", phase, time.monotonic()))
            time.sleep(probe_gap_s)
            if busy and all(t.done() for t in busy):
                raise RuntimeError("the bulk transfer ended before the probes: make it bigger")

    def loaded(engine, phase):
        src = engine.register(data)
        peer = engine.connect(desc_address(desc))
        transfers = bulk(engine, peer, src)
        time.sleep(1.0)  # let the bulk flows fill the pipe and the bottleneck queue
        probe(engine, peer, phase, transfers)
        for t in transfers:
            t.cancel()
        return peer

    def drain_link():
        # A cancelled transfer's bytes already in the kernel's socket buffers still cross
        # the link (up to tcp_wmem's 4 MiB per connection): let them leave before measuring.
        time.sleep(streams * (4 << 20) * 8 / pace_bps + 0.5)

    out = {}
    with TransferEngine(streams=streams, chunk_bytes=chunk_bytes, auth_token=bench_token()) as engine:
        region = engine.register(data)
        peer = engine.connect(desc_address(desc))
        engine.write(peer, region, 0, desc, 0, piece_bytes).wait()  # opens the streams
        start = time.perf_counter()
        for t in bulk(engine, peer, region):
            t.wait()
        out["seconds"] = time.perf_counter() - start
        out["peer_stats"] = engine.stats()["peers"][peer.address]
        # The same writes again on the connections the first ones warmed, after an idle
        # pause: what a peer the engine keeps connected gets (no slow start).
        time.sleep(kept_idle_s)
        start = time.perf_counter()
        for t in bulk(engine, peer, region):
            t.wait()
        out["kept_seconds"] = time.perf_counter() - start
        probe(engine, peer, 0, None)
        loaded(engine, 1)
    drain_link()
    # Paced just below the line rate, the bulk flows keep the bottleneck queue short.
    with TransferEngine(streams=streams, chunk_bytes=chunk_bytes, rate_limit_bps=pace_bps,
                        auth_token=bench_token()) as paced:
        loaded(paced, 2)
    drain_link()
    # Paced by the engine itself: the whole bulk transfer, probed once the pacer settled.
    with TransferEngine(streams=streams, chunk_bytes=chunk_bytes, queue_delay_target_s=queue_delay_target_s,
                        auth_token=bench_token()) as auto:
        region = auto.register(data)
        peer = auto.connect(desc_address(desc))
        start = time.perf_counter()
        transfers = bulk(auto, peer, region)
        time.sleep(settle_s)  # slow start's overshoot drained, the pacer settled
        probe(auto, peer, 3, transfers)
        out["auto_stats"] = auto.stats()["peers"][peer.address]  # mid-transfer: the pacer's rate and queue
        for t in transfers:
            t.wait()
        out["auto_seconds"] = time.perf_counter() - start
        auto.send(peer, b"exit")
    return out


@dataclass
class WanResult(Result):
    rate_bps: int
    rtt_ms: float
    nbytes: int
    piece_bytes: int
    streams: int | str
    goodput_gbps: float  # the first writes, on freshly opened connections
    idle_latency_ms: float
    loaded_latency_ms: float
    paced_latency_ms: float
    pace_bps: float
    stats_throughput_gbps: float  # what TransferEngine.stats() reported for the peer
    stats_rtt_ms: float
    queue_delay_target_ms: float
    auto_goodput_gbps: float  # the same bulk transfer with queue_delay_target_s
    auto_latency_ms: float
    auto_paced_gbps: float  # the engine pacer's rate mid-transfer
    auto_queue_delay_ms: float  # the queueing delay it measured then
    kept_goodput_gbps: float = 0.0  # the same writes again on the connections kept from the first
    streams_used: int = 0  # data connections the engine ran (streams="auto" chooses)
    latencies_ms: dict = field(default_factory=dict)

    @property
    def ratio_to_line_rate(self) -> float:
        return self.goodput_gbps * 1e9 / self.rate_bps

    @property
    def kept_ratio_to_line_rate(self) -> float:
        return self.kept_goodput_gbps * 1e9 / self.rate_bps

    @property
    def auto_ratio_to_line_rate(self) -> float:
        return self.auto_goodput_gbps * 1e9 / self.rate_bps

    @property
    def loaded_over_idle(self) -> float:
        return self.loaded_latency_ms / self.idle_latency_ms

    @property
    def paced_over_idle(self) -> float:
        return self.paced_latency_ms / self.idle_latency_ms

    @property
    def auto_over_idle(self) -> float:
        return self.auto_latency_ms / self.idle_latency_ms


def wan_case(rate: str = "1gbit", delay_ms: float = 25.0, nbytes: int = 1 << 30, piece_bytes: int = 64 << 10,
             streams: int | str = 4, chunk_bytes: int = 1 << 20, probes: int = 20, pace_fraction: float = 0.9,
             queue_delay_target_s: float = 0.002, settle_s: float = 3.0) -> WanResult:
    from ..testing.wan import WanLink

    with WanLink(rate=rate, delay_ms=delay_ms) as link, tempfile.TemporaryDirectory() as tmp:
        info = os.path.join(tmp, "engine")
        pace_bps = link.rate_bps * pace_fraction
        sink = link.b.spawn(engine_sink, f"{link.b.address}:9300", nbytes, info)
        sent = link.a.call(engine_source, info, nbytes, piece_bytes, streams, chunk_bytes, probes,
                           max(0.02, 2 * delay_ms / 1000), pace_bps, queue_delay_target_s, settle_s, timeout=600)
        samples = sink.result(60)
        rate_bps = link.rate_bps
    lat = {phase: [1000 * (arrived - sent_at) for p, sent_at, arrived in samples if p == phase]
           for phase in (0, 1, 2, 3)}
    med = {phase: statistics.median(v) for phase, v in lat.items()}
    return WanResult(rate_bps, 2 * delay_ms, nbytes, piece_bytes, streams, nbytes * 8 / sent["seconds"] / 1e9,
                     med[0], med[1], med[2], pace_bps, sent["peer_stats"]["throughput_bps"] / 1e9,
                     sent["peer_stats"]["rtt_s"] * 1000, queue_delay_target_s * 1000,
                     nbytes * 8 / sent["auto_seconds"] / 1e9, med[3],
                     sent["auto_stats"].get("paced_bps", 0.0) / 1e9, sent["auto_stats"].get("queue_delay_s", 0.0) * 1000,
                     nbytes * 8 / sent["kept_seconds"] / 1e9, int(sent["peer_stats"].get("streams", 0)),
                     {str(k): v for k, v in lat.items()})


def fresh_and_kept_source(info_path: str, nbytes: int, piece_bytes: int, streams: int | str, rounds: int,
                          idle_s: float) -> list[tuple[float, float, int, float]]:
    """Sender side of :func:`fresh_and_kept`; runs inside namespace a. Per round:
    (first seconds, kept seconds, streams, warm-up padding bytes)."""
    import numpy as np

    from pddcore.transfer import TransferEngine

    desc = bytes.fromhex(read_info(info_path))
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    pages = nbytes // piece_bytes
    order = list(range(pages))
    random.Random(1).shuffle(order)

    def bulk_seconds(engine, peer, region) -> float:
        start = time.perf_counter()
        transfers = [engine.write_batch(peer, [(region, i * piece_bytes, desc, order[i] * piece_bytes, piece_bytes)
                                               for i in range(b, min(b + 1024, pages))])
                     for b in range(0, pages, 1024)]
        for t in transfers:
            t.wait()
        return time.perf_counter() - start

    def wait_warm(engine, peer, settled_s: float = 0.3, limit_s: float = 10.0) -> None:
        # connect() dials the data connections; on a long path they warm up while idle
        # (padding until past slow start). Wait until the padding stopped growing.
        last, since, deadline = -1.0, time.monotonic(), time.monotonic() + limit_s
        while time.monotonic() < deadline:
            stats = engine.stats()["peers"][peer.address]
            now = time.monotonic()
            if stats.get("warmup_bytes", 0.0) != last or stats.get("live_streams", 0.0) < stats.get("streams", 1.0):
                last, since = stats.get("warmup_bytes", 0.0), now
            elif now - since >= settled_s:
                return
            time.sleep(0.05)

    out = []
    for _ in range(rounds):
        with TransferEngine(streams=streams, auth_token=bench_token()) as engine:
            region = engine.register(data)
            peer = engine.connect(desc_address(desc))
            wait_warm(engine, peer)
            fresh = bulk_seconds(engine, peer, region)
            time.sleep(idle_s)
            kept = bulk_seconds(engine, peer, region)
            stats = engine.stats()["peers"][peer.address]
            out.append((fresh, kept, int(stats.get("streams", 0)), stats.get("warmup_bytes", 0.0)))
        time.sleep(idle_s)  # the closed connections' last bytes leave the bottleneck
    return out


@dataclass
class FreshKeptResult(Result):
    rate_bps: int
    rtt_ms: float
    nbytes: int
    piece_bytes: int
    streams: int | str
    rounds: int
    fresh_gbps: float  # median: a new engine's first write, once the connections connect() opened warmed up
    kept_gbps: float  # median: the same write again after an idle pause, on the same connections
    streams_used: int  # data connections the engine ran by the end (streams="auto" chooses)
    warmup_bytes: float  # median padding the connections sent to warm up (warmup.h)

    @property
    def fresh_ratio(self) -> float:
        return self.fresh_gbps * 1e9 / self.rate_bps

    @property
    def kept_ratio(self) -> float:
        return self.kept_gbps * 1e9 / self.rate_bps


def fresh_and_kept(rate: str = "1gbit", delay_ms: float = 25.0, nbytes: int = 256 << 20, piece_bytes: int = 64 << 10,
                   streams: int | str = "auto", rounds: int = 3, idle_s: float = 2.0) -> FreshKeptResult:
    """Through :class:`~pddcore.testing.wan.WanLink`: per round, a new engine connects,
    waits while its fresh connections warm up (they send padding while idle, until past
    slow start) and writes ``nbytes`` as scattered ``piece_bytes`` pieces; then, after
    ``idle_s``, the same writes on the connections it kept. Medians of ``rounds``; ratios
    to the line rate."""
    from ..testing.wan import WanLink

    with WanLink(rate=rate, delay_ms=delay_ms) as link, tempfile.TemporaryDirectory() as tmp:
        info = os.path.join(tmp, "engine")
        sink = link.b.spawn(engine_sink, f"{link.b.address}:9300", nbytes, info)
        try:
            runs = link.a.call(fresh_and_kept_source, info, nbytes, piece_bytes, streams, rounds, idle_s, timeout=600)
        finally:
            sink.kill()
        rate_bps = link.rate_bps
    return FreshKeptResult(rate_bps, 2 * delay_ms, nbytes, piece_bytes, streams, rounds,
                           statistics.median(nbytes * 8 / f / 1e9 for f, _, _, _ in runs),
                           statistics.median(nbytes * 8 / k / 1e9 for _, k, _, _ in runs), runs[-1][2],
                           statistics.median(w for _, _, _, w in runs))


def format_fresh_kept(r: FreshKeptResult) -> str:
    return (f"{r.rate_bps / 1e9:.1f} Gbit/s, RTT {r.rtt_ms:.0f} ms, {r.nbytes >> 20} MiB as {r.piece_bytes >> 10} KiB "
            f"pieces, streams={r.streams} ({r.streams_used} ran), medians of {r.rounds}: a new engine's first write "
            f"after its connections warmed up ({r.warmup_bytes / 1e6:.0f} MB of padding) {r.fresh_gbps:.3f} Gbit/s = "
            f"{r.fresh_ratio:.3f}x line rate; again on the kept ones {r.kept_gbps:.3f} Gbit/s = {r.kept_ratio:.3f}x")


def format_wan(r: WanResult) -> str:
    d = r.as_dict()
    return (f"{r.rate_bps / 1e9:.1f} Gbit/s, RTT {r.rtt_ms:.0f} ms, {r.nbytes >> 20} MiB as {r.piece_bytes >> 10} KiB "
            f"pieces, streams={r.streams} ({r.streams_used} ran): goodput on fresh connections {r.goodput_gbps:.3f} "
            f"Gbit/s = {d['ratio_to_line_rate']:.3f}x line rate, again on the kept ones {r.kept_goodput_gbps:.3f} "
            f"Gbit/s = {d['kept_ratio_to_line_rate']:.3f}x; priority one-way latency idle {r.idle_latency_ms:.2f} ms, under bulk {r.loaded_latency_ms:.2f} ms "
            f"({d['loaded_over_idle']:.2f}x), under bulk paced at {r.pace_bps / 1e9:.2f} Gbit/s "
            f"{r.paced_latency_ms:.2f} ms ({d['paced_over_idle']:.2f}x); self-paced to a "
            f"{r.queue_delay_target_ms:g} ms queue: goodput {r.auto_goodput_gbps:.3f} Gbit/s = "
            f"{d['auto_ratio_to_line_rate']:.3f}x line rate, latency under it {r.auto_latency_ms:.2f} ms "
            f"({d['auto_over_idle']:.2f}x); the pacer mid-transfer: {r.auto_paced_gbps:.3f} Gbit/s, queue "
            f"{r.auto_queue_delay_ms:.2f} ms")
