"""TransferEngine throughput and priority-lane latency, each against an in-run baseline.

- Loopback: the engine writes ``nbytes`` from this process into a region of an engine in
  another process, as one write with the given ``chunk_bytes`` over ``streams``
  connections; the baseline (:class:`RawSockets`) is as many kept plain TCP connections,
  each moving its share of the same source with one ``sendall`` and ``recv_into`` the same
  destination buffer in the sink's process. Engine and raw rounds alternate; the median
  of ``rounds`` for each; ratio = engine / raw.
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
                engine_kwargs: dict | None = None, raw_info_path: str | None = None) -> list[tuple[int, float, float]]:
    """Registers ``nbytes``, publishes address and descriptor, records latency probes
    (phase, sent, arrived) until an ``exit`` message. ``engine_kwargs``: more TransferEngine
    arguments (TLS, certificates) beside the run's token. With ``raw_info_path``, also serves
    :func:`raw_receive` into the same registered buffer and publishes its port there."""
    from pddcore.transfer import TransferEngine

    probes = []
    destination = bytearray(nbytes)
    if raw_info_path is not None:
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=raw_receive, args=(listener, memoryview(destination)), daemon=True).start()
        write_info(raw_info_path, str(listener.getsockname()[1]))
    with TransferEngine(backend, listen=listen, auth_token=bench_token(), **(engine_kwargs or {})) as engine:
        region = engine.register(destination, target=True)
        write_info(info_path, region.descriptor().hex())
        while True:
            for message in (m.payload for m in engine.poll_messages(timeout=1.0)):
                now = time.monotonic()
                if message == b"exit":
                    return probes
                if len(message) == _PROBE.size and message[:3] == b"lat":
                    _, phase, sent = _PROBE.unpack(message)
                    probes.append((phase, sent, now))


_RAW_SPAN = struct.Struct("<QQ")  # offset, length of one round's share on one connection


def raw_receive(listener: socket.socket, destination: memoryview) -> None:
    """The raw-socket baseline's receiver: each accepted connection, round after round,
    reads a (offset, length) span, ``recv_into``s that span of ``destination`` and
    answers one byte once all of it arrived. MSG_WAITALL lets the kernel fill the whole
    span in one call: no interpreter work (or lock) between the kernel's copies."""

    def serve(conn: socket.socket) -> None:
        with conn:
            head = bytearray(_RAW_SPAN.size)
            while conn.recv_into(head, _RAW_SPAN.size, socket.MSG_WAITALL) == _RAW_SPAN.size:
                offset, length = _RAW_SPAN.unpack(head)
                part = destination[offset:offset + length]
                got = 0
                while got < length:  # more than one call only if a signal cut one short
                    n = conn.recv_into(part[got:], length - got, socket.MSG_WAITALL)
                    if n == 0:
                        return
                    got += n
                conn.sendall(b"k")

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


class RawSockets:
    """The loopback baseline: ``streams`` plain TCP connections, opened once and kept (as
    the engine keeps its data connections), each moving an even share of the source with
    one ``sendall`` into the same span of the engine's destination buffer (the receiver
    is :func:`raw_receive` in the sink's process). Nothing is chunked, framed or checked:
    the fastest a socket moves these bytes. Like the engine's, the connections send with
    TCP_NODELAY, and :meth:`run` puts them on the congestion control the engine's run (on
    loopback bbr moves about 0.6x what cubic does, so any other choice compares algorithms)."""

    def __init__(self, port: int, streams: int):
        self.conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
        for c in self.conns:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.congestion_control = self.conns[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
        self.congestion_control = self.congestion_control.rstrip(b"\0").decode()

    def run(self, congestion_control: str) -> None:
        for c in self.conns:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion_control.encode())
        self.congestion_control = congestion_control

    def move(self, data: memoryview) -> float:
        """Moves ``data`` to the same offsets at the receiver; returns the seconds taken."""
        share = len(data) // len(self.conns)
        spans = [(i * share, len(data) - i * share if i == len(self.conns) - 1 else share)
                 for i in range(len(self.conns))]

        def send(conn: socket.socket, offset: int, length: int) -> None:
            conn.sendall(_RAW_SPAN.pack(offset, length))
            conn.sendall(data[offset:offset + length])
            if conn.recv(1) != b"k":
                raise ConnectionError("raw receiver did not confirm")

        threads = [threading.Thread(target=send, args=(c, *span)) for c, span in zip(self.conns, spans)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - start

    def close(self) -> None:
        for c in self.conns:
            c.close()


# ---- loopback ---------------------------------------------------------------------------


@dataclass
class LoopbackResult(Result):
    chunk_bytes: int
    streams: int
    nbytes: int
    engine_gbps: float  # median round
    raw_gbps: float  # median round of the raw-socket baseline, interleaved with the engine's
    rounds: int
    backend: str = "tcp"
    congestion_control: str = ""  # what the engine's data connections and the raw ones ran (tcp)

    @property
    def ratio(self) -> float:
        return self.engine_gbps / self.raw_gbps


def loopback_matrix(nbytes: int = 256 << 20, rounds: int = 7, chunk_sizes=CHUNK_BYTES,
                    streams_list=STREAMS, backend: str = "tcp") -> list[LoopbackResult]:
    """Every (chunk size, streams) point, engine and raw sockets (:class:`RawSockets`, as many
    connections, same source, same destination buffer), one round of each in turn, the
    median of ``rounds``. ``backend`` "rdma" needs a NIC, or PDDCORE_VERBS=emulator in the
    environment (the verbs emulator: its numbers measure the emulator, not RDMA hardware)."""
    import torch

    from pddcore.transfer import TransferEngine

    ctx = mp.get_context("spawn")
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    source = memoryview(data.numpy())
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        info, raw_info = os.path.join(tmp, "engine"), os.path.join(tmp, "raw")
        sink = ctx.Process(target=engine_sink, args=("127.0.0.1:0", nbytes, info, backend, None, raw_info),
                           daemon=True)
        sink.start()
        try:
            desc = bytes.fromhex(read_info(info))
            port = int(read_info(raw_info))
            configs = [(c, s) for c in chunk_sizes for s in streams_list]
            for chunk, streams in configs:
                raw = RawSockets(port, streams)
                with TransferEngine(backend, streams=streams, chunk_bytes=chunk,
                                    auth_token=bench_token()) as engine:
                    src = engine.register(data)
                    peer = engine.connect(desc_address(desc))
                    engine_times, raw_times = [], []
                    # One round of each in turn, so both see the same load on a shared
                    # machine; round 0 opens (and warms) the engine's connections and the
                    # raw ones, and is not counted.
                    for r in range(rounds + 1):
                        start = time.perf_counter()
                        engine.write(peer, src, 0, desc, 0, nbytes).wait()
                        engine_s = time.perf_counter() - start
                        if r == 0 and backend == "tcp":
                            running = engine.stats()["peers"][peer.address]["congestion_control"]
                            raw.run(max(running, key=running.get))
                        raw_s = raw.move(source)
                        if r > 0:
                            engine_times.append(engine_s)
                            raw_times.append(raw_s)
                    if (chunk, streams) == configs[-1]:
                        engine.send(peer, b"exit")
                raw.close()
                results.append(LoopbackResult(chunk, streams, nbytes, nbytes / statistics.median(engine_times) / 1e9,
                                              nbytes / statistics.median(raw_times) / 1e9, rounds, backend,
                                              raw.congestion_control if backend == "tcp" else ""))
        finally:
            sink.join(30)
            if sink.is_alive():
                sink.kill()
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


def format_loopback(results: list[LoopbackResult]) -> str:
    lines = ["chunk     streams rounds  cc     engine GB/s  raw GB/s  ratio   (medians, interleaved rounds)"]
    for r in results:
        lines.append(f"{r.chunk_bytes >> 10:>6} KiB {r.streams:>6} {r.rounds:>6}  {r.congestion_control or '-':<6}"
                     f"{r.engine_gbps:>11.2f} {r.raw_gbps:>9.2f} {r.ratio:>6.2f}")
    return "\n".join(lines)


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
