"""TransferEngine throughput and priority-lane latency, each against an in-run baseline.

- Loopback: the engine writes ``nbytes`` from this process into a region of an engine in
  another process, as one write with the given ``chunk_bytes`` over ``streams``
  connections; the baseline is a plain-socket ``sendall`` / ``recv_into`` loop between two
  processes moving the same bytes over the same number of connections, in pieces of the
  same size. Engine and raw rounds alternate; best of ``rounds`` for each; ratio = engine / raw.
- Congestion control on loopback: the same writes from engines whose data connections run
  ``"auto"``, cubic and bbr, interleaved round by round; the median round of each
  (:class:`~pddcore.benchmarks.loss_cases.AutoComparison`).
- WAN (root): through :class:`~pddcore.testing.wan.WanLink` at a given rate and RTT, the
  engine writes ``nbytes`` as ``piece_bytes`` pieces scattered over the destination (KV
  pages: nothing coalesces); ratio = goodput / line rate. Then priority-lane one-way
  latency (both namespaces share CLOCK_MONOTONIC): probes on an idle link, then under a
  bulk transfer that saturates it, unpaced and paced by ``rate_limit_bps`` just below
  the line rate; last, the whole bulk transfer again with ``queue_delay_target_s`` (the
  engine paces itself to the path, knowing no rate), its goodput and the latency under it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import socket
import statistics
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field

from .auth import bench_token
from .results import Result

CHUNK_BYTES = (64 << 10, 1 << 20, 16 << 20)
STREAMS = (1, 4, 8)
_PROBE = struct.Struct("<3sBd")  # b"lat", phase, send time


def write_info(path: str, text: str) -> None:
    """Publishes a receiver's address/descriptor to a sender in another process or namespace."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


def read_info(path: str, timeout: float = 60.0) -> str:
    """Waits for :func:`write_info`'s file and returns its text."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"receiver did not start ({path})")
        time.sleep(0.01)
    with open(path) as f:
        return f.read()


# ---- receivers (run in another process or namespace) -------------------------------------


def engine_sink(listen: str, nbytes: int, info_path: str, backend: str = "tcp",
                tls: bool = False) -> list[tuple[int, float, float]]:
    """Registers ``nbytes``, publishes address and descriptor, records latency probes
    (phase, sent, arrived) until an ``exit`` message."""
    from pddcore.transfer import TransferEngine

    probes = []
    with TransferEngine(backend, listen=listen, auth_token=bench_token(), tls=tls) as engine:
        region = engine.register(bytearray(nbytes), target=True)
        write_info(info_path, region.descriptor().hex())
        while True:
            for message in (m.payload for m in engine.poll_messages(timeout=1.0)):
                now = time.monotonic()
                if message == b"exit":
                    return probes
                if len(message) == _PROBE.size and message[:3] == b"lat":
                    _, phase, sent = _PROBE.unpack(message)
                    probes.append((phase, sent, now))


def raw_sink(port_path: str, plan: list[tuple[int, int]]) -> None:
    """For each (streams, nbytes) of the plan, each ``rounds`` times (given by the sender):
    accepts ``streams`` connections, receives nbytes split evenly, answers one byte each."""
    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen(64)
    write_info(port_path, str(listener.getsockname()[1]))
    buf = bytearray(max(n for _, n in plan))
    view = memoryview(buf)
    for streams, nbytes in plan:
        conns = [listener.accept()[0] for _ in range(streams)]
        share = nbytes // streams

        def receive(conn: socket.socket, part: memoryview) -> None:
            got = 0
            while got < len(part):
                n = conn.recv_into(part[got:])
                if n == 0:
                    raise ConnectionError("sender closed early")
                got += n
            conn.sendall(b"k")

        threads = [threading.Thread(target=receive, args=(c, view[i * share:(i + 1) * share]))
                   for i, c in enumerate(conns)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c in conns:
            c.close()


# ---- loopback ---------------------------------------------------------------------------


def _raw_round(port: int, data: memoryview, streams: int, piece: int) -> float:
    share = len(data) // streams
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]

    def send(conn: socket.socket, part: memoryview) -> None:
        for off in range(0, len(part), piece):
            conn.sendall(part[off:off + piece])
        if conn.recv(1) != b"k":
            raise ConnectionError("receiver did not confirm")

    start = time.perf_counter()
    threads = [threading.Thread(target=send, args=(c, data[i * share:(i + 1) * share])) for i, c in enumerate(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    for c in conns:
        c.close()
    return elapsed


@dataclass
class LoopbackResult(Result):
    chunk_bytes: int
    streams: int
    nbytes: int
    engine_gbps: float
    raw_gbps: float
    backend: str = "tcp"

    @property
    def ratio(self) -> float:
        return self.engine_gbps / self.raw_gbps


def loopback_matrix(nbytes: int = 256 << 20, rounds: int = 4, chunk_sizes=CHUNK_BYTES,
                    streams_list=STREAMS, backend: str = "tcp") -> list[LoopbackResult]:
    """Every (chunk size, streams) point, engine and raw socket, in one run. ``backend``
    "rdma" needs a NIC, or PDDCORE_VERBS=emulator in the environment (the verbs emulator:
    its numbers measure the emulator, not RDMA hardware)."""
    import torch

    from pddcore.transfer import TransferEngine

    configs = [(c, s) for c in chunk_sizes for s in streams_list]
    ctx = mp.get_context("spawn")
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        info, port_path = os.path.join(tmp, "engine"), os.path.join(tmp, "raw")
        sink = ctx.Process(target=engine_sink, args=("127.0.0.1:0", nbytes, info, backend), daemon=True)
        plan = [(s, nbytes) for _, s in configs for _ in range(rounds + 1)]
        raw = ctx.Process(target=raw_sink, args=(port_path, plan), daemon=True)
        sink.start()
        raw.start()
        try:
            desc = bytes.fromhex(read_info(info))
            port = int(read_info(port_path))
            raw_view = memoryview(data.numpy())
            for chunk, streams in configs:
                with TransferEngine(backend, streams=streams, chunk_bytes=chunk,
                                    auth_token=bench_token()) as engine:
                    src = engine.register(data)
                    peer = engine.connect(desc_address(desc))
                    engine_times, raw_times = [], []
                    # Alternating rounds, so both sides see the same load on a shared machine;
                    # the first round of each also opens the connections and is not counted.
                    for _ in range(rounds + 1):
                        start = time.perf_counter()
                        engine.write(peer, src, 0, desc, 0, nbytes).wait()
                        engine_times.append(time.perf_counter() - start)
                        raw_times.append(_raw_round(port, raw_view, streams, chunk))
                    if (chunk, streams) == configs[-1]:
                        engine.send(peer, b"exit")
                engine_s, raw_s = min(engine_times[1:]), min(raw_times[1:])
                results.append(LoopbackResult(chunk, streams, nbytes, nbytes / engine_s / 1e9, nbytes / raw_s / 1e9,
                                              backend))
        finally:
            sink.join(30)
            raw.join(30)
            for p in (sink, raw):
                if p.is_alive():
                    p.kill()
    return results


def congestion_loopback(nbytes: int = 256 << 20, rounds: int = 5, chunk_sizes=(64 << 10, 1 << 20),
                        streams: int = 4) -> list:
    """"auto" against cubic and bbr chosen by hand, one write of ``nbytes`` per round from
    each, to an engine in another process over loopback."""
    import torch

    from pddcore.transfer import TransferEngine

    from .loss_cases import CONGESTION_CONTROLS, AutoComparison

    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    comparisons = []
    with tempfile.TemporaryDirectory() as tmp:
        info = os.path.join(tmp, "engine")
        sink = mp.get_context("spawn").Process(target=engine_sink, args=("127.0.0.1:0", nbytes, info), daemon=True)
        sink.start()
        try:
            desc = bytes.fromhex(read_info(info))
            for chunk in chunk_sizes:
                engines = {cc: TransferEngine(streams=streams, chunk_bytes=chunk, auth_token=bench_token(),
                                              congestion_control=cc) for cc in CONGESTION_CONTROLS}
                try:
                    peers = {cc: e.connect(desc_address(desc)) for cc, e in engines.items()}
                    sources = {cc: e.register(data) for cc, e in engines.items()}
                    gbps: dict[str, list[float]] = {cc: [] for cc in engines}
                    # The first round opens the connections and is not counted; each round
                    # starts one engine later, so none always follows the same one.
                    for r in range(rounds + 1):
                        for cc in (CONGESTION_CONTROLS[(r + i) % len(engines)] for i in range(len(engines))):
                            engine = engines[cc]
                            start = time.perf_counter()
                            engine.write(peers[cc], sources[cc], 0, desc, 0, nbytes).wait()
                            if r > 0:
                                gbps[cc].append(nbytes * 8 / (time.perf_counter() - start) / 1e9)
                    running = engines["auto"].stats()["peers"][peers["auto"].address]["congestion_control"]
                    if chunk == chunk_sizes[-1]:
                        engines["auto"].send(peers["auto"], b"exit")
                finally:
                    for engine in engines.values():
                        engine.close()
                comparisons.append(AutoComparison(f"loopback, {streams} streams, {chunk >> 10} KiB chunks",
                                                  *(statistics.median(gbps[cc]) for cc in CONGESTION_CONTROLS),
                                                  running, rounds))
        finally:
            sink.join(30)
            if sink.is_alive():
                sink.kill()
    return comparisons


def desc_address(descriptor: bytes) -> str:
    from pddcore.transfer import RegionDescriptor

    return RegionDescriptor.from_bytes(descriptor).address


# ---- WAN --------------------------------------------------------------------------------


def engine_source(info_path: str, nbytes: int, piece_bytes: int, streams: int, chunk_bytes: int,
                  probes: int, probe_gap_s: float, pace_bps: float, queue_delay_target_s: float,
                  settle_s: float) -> dict:
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
            engine.send(peer, _PROBE.pack(b"lat", phase, time.monotonic()))
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
    streams: int
    goodput_gbps: float
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
    latencies_ms: dict = field(default_factory=dict)

    @property
    def ratio_to_line_rate(self) -> float:
        return self.goodput_gbps * 1e9 / self.rate_bps

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
             streams: int = 4, chunk_bytes: int = 1 << 20, probes: int = 20, pace_fraction: float = 0.9,
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
                     {str(k): v for k, v in lat.items()})


def format_loopback(results: list[LoopbackResult]) -> str:
    lines = ["chunk     streams  engine GB/s  raw GB/s  ratio"]
    for r in results:
        lines.append(f"{r.chunk_bytes >> 10:>6} KiB {r.streams:>6} {r.engine_gbps:>11.2f} {r.raw_gbps:>9.2f} {r.ratio:>6.2f}")
    return "\n".join(lines)


def format_wan(r: WanResult) -> str:
    d = r.as_dict()
    return (f"{r.rate_bps / 1e9:.1f} Gbit/s, RTT {r.rtt_ms:.0f} ms, {r.nbytes >> 20} MiB as {r.piece_bytes >> 10} KiB "
            f"pieces, {r.streams} streams: goodput {r.goodput_gbps:.3f} Gbit/s = {d['ratio_to_line_rate']:.3f}x line "
            f"rate; priority one-way latency idle {r.idle_latency_ms:.2f} ms, under bulk {r.loaded_latency_ms:.2f} ms "
            f"({d['loaded_over_idle']:.2f}x), under bulk paced at {r.pace_bps / 1e9:.2f} Gbit/s "
            f"{r.paced_latency_ms:.2f} ms ({d['paced_over_idle']:.2f}x); self-paced to a "
            f"{r.queue_delay_target_ms:g} ms queue: goodput {r.auto_goodput_gbps:.3f} Gbit/s = "
            f"{d['auto_ratio_to_line_rate']:.3f}x line rate, latency under it {r.auto_latency_ms:.2f} ms "
            f"({d['auto_over_idle']:.2f}x); the pacer mid-transfer: {r.auto_paced_gbps:.3f} Gbit/s, queue "
            f"{r.auto_queue_delay_ms:.2f} ms")
