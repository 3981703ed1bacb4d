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
- WAN (root, :mod:`.transfer_wan_cases`): through :class:`~pddcore.testing.wan.WanLink` at a given rate and RTT, the
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
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass

from .auth import bench_token
from .results import Result
from .sink import RAW_SPAN, desc_address, engine_sink, read_info

CHUNK_BYTES = (64 << 10, 1 << 20, 16 << 20)
STREAMS = (1, 4, 8)


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
            conn.sendall(RAW_SPAN.pack(offset, length))
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


def format_loopback(results: list[LoopbackResult]) -> str:
    lines = ["chunk     streams rounds  cc     engine GB/s  raw GB/s  ratio   (medians, interleaved rounds)"]
    for r in results:
        lines.append(f"{r.chunk_bytes >> 10:>6} KiB {r.streams:>6} {r.rounds:>6}  {r.congestion_control or '-':<6}"
                     f"{r.engine_gbps:>11.2f} {r.raw_gbps:>9.2f} {r.ratio:>6.2f}")
    return "\n".join(lines)
