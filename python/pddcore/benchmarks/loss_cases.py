"""Goodput on a long path, lossy or fast, per TCP congestion control, as a ratio to the line rate.

Through :class:`~pddcore.testing.wan.WanLink` (the delay line drops each packet with the
given probability), one engine writes ``nbytes`` to another as one transfer of
``piece_bytes`` writes (KV pages of that size) over ``streams`` connections whose congestion
control is set with ``TransferEngine(congestion_control=...)``; a small write first opens
the connections, so slow start of the timed write is counted but not the handshakes. The
bandwidth-delay product is reported beside each row. At 10 Gbit/s the emulator itself (its
delay line and tbf on this machine's cores) may not reach the line rate: one plain TCP
stream through the same link, measured in the same run, shows what it reaches.

With ``rounds`` above 1 every congestion control runs once per round, the rounds
interleaved so that each sees the same load on a shared machine (each round starting one
point later), and a row reports the median round. :func:`compare_auto` sets ``"auto"`` (chosen per connection from the path)
beside the better of cubic and bbr chosen by hand on the same path, in the same run.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field

from .auth import bench_token
from .results import Result
from .sink import desc_address, engine_sink, read_info

LOSSES = (0.0001, 0.001, 0.01)
#: "auto" beside both algorithms it chooses between, as :func:`compare_auto` reads them.
CONGESTION_CONTROLS = ("auto", "cubic", "bbr")


@dataclass
class LossResult(Result):
    rate_bps: float
    rtt_ms: float
    loss: float
    mtu: int
    congestion_control: str
    streams: int
    piece_bytes: int
    nbytes: int
    goodput_gbps: float   # the median round's
    packets_dropped: int  # by the delay line's loss draw, a -> b, during the median round
    cwnd_bytes: float       # the data connections' congestion windows summed, as the write ended
    tcp_retransmits: float  # segments the data connections sent again
    rounds_gbps: list = field(default_factory=list)  # every round's goodput, in order
    running: dict = field(default_factory=dict)  # algorithm -> data connections running it at the end

    @property
    def ratio(self) -> float:
        return self.goodput_gbps * 1e9 / self.rate_bps

    @property
    def bdp_bytes(self) -> float:
        return self.rate_bps / 8 * self.rtt_ms / 1000


def _source(info_path: str, nbytes: int, piece_bytes: int, streams: int, chunk_bytes: int,
            congestion_control: str) -> tuple[float, dict]:
    """Runs in namespace a: seconds for one transfer of ``nbytes`` as ``piece_bytes`` writes,
    and the engine's stats of that peer as it ended."""
    import numpy as np

    from pddcore.transfer import TransferEngine

    desc = bytes.fromhex(read_info(info_path))
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    with TransferEngine(streams=streams, chunk_bytes=chunk_bytes, auth_token=bench_token(),
                        congestion_control=congestion_control) as engine:
        src = engine.register(data)
        peer = engine.connect(desc_address(desc))
        engine.write(peer, src, 0, desc, 0, min(nbytes, streams * chunk_bytes)).wait()
        writes = [(src, off, desc, off, min(piece_bytes, nbytes - off)) for off in range(0, nbytes, piece_bytes)]
        start = time.perf_counter()
        engine.write_batch(peer, writes).wait()
        seconds = time.perf_counter() - start
        link = engine.stats()["peers"][peer.address]
        engine.send(peer, b"exit")
    return seconds, link


def loss_case(loss: float, congestion_controls=("cubic", "bbr"), rate: str = "1gbit", delay_ms: float = 25.0,
              nbytes: int = 128 << 20, streams: int = 4, chunk_bytes: int = 1 << 20,
              piece_sizes: tuple[int, ...] = (1 << 20,), offload: bool | None = None,
              mtu: int = 1500, rounds: int = 1) -> list[LossResult]:
    """``offload``: as WanLink takes it (default: on without loss). Rows meant to be set
    beside lossy ones pass False, so that every packet crosses the delay line on its own
    as it must with loss, and only the loss differs. ``mtu``: the link's (9000: jumbo
    frames, as inter-DC links carry; the delay line's cost is per packet, so this is how a
    lossy path of 1 Gbit/s and more stays within what its core forwards). ``rounds``: each
    row's transfers, interleaved with the other rows'; the row reports the median one."""
    from ..testing.wan import WanLink

    points = [(cc, piece) for cc in congestion_controls for piece in piece_sizes]
    measured: dict[tuple[str, int], list[tuple[float, int, dict]]] = {point: [] for point in points}
    with WanLink(rate=rate, delay_ms=delay_ms, loss=loss, seed=1, offload=offload, mtu=mtu) as link:
        rate_bps = link.rate_bps
        for r in range(rounds):
            # Each round starts at the next point: no point always follows the same one.
            for i in _rotated(len(points), r):
                cc, piece = points[i]
                dropped_before = link.stats().a_to_b.dropped_loss
                with tempfile.TemporaryDirectory() as tmp:
                    info = os.path.join(tmp, "sink")
                    port = 9400 + r * len(points) + i  # a fresh port: no TIME_WAIT of an earlier row
                    sink = link.b.spawn(engine_sink, f"{link.b.address}:{port}", nbytes, info)
                    seconds, peer = link.a.call(_source, info, nbytes, piece, streams, chunk_bytes, cc, timeout=900)
                    sink.result(60)
                measured[(cc, piece)].append((nbytes * 8 / seconds / 1e9,
                                              link.stats().a_to_b.dropped_loss - dropped_before, peer))
    results = []
    for (cc, piece), runs in measured.items():
        goodput, dropped, peer = sorted(runs, key=lambda run: run[0])[len(runs) // 2]
        results.append(LossResult(rate_bps, 2 * delay_ms, loss, mtu, cc, streams, piece, nbytes, goodput, dropped,
                                  peer["cwnd_bytes"], peer["tcp_retransmits"], [run[0] for run in runs],
                                  peer.get("congestion_control", {})))
    return results


def _rotated(n: int, start: int) -> list[int]:
    return [(start + i) % n for i in range(n)]


@dataclass
class AutoComparison(Result):
    """``congestion_control="auto"`` beside cubic and bbr chosen by hand, on one path."""

    path: str
    auto_gbps: float
    cubic_gbps: float
    bbr_gbps: float
    auto_running: dict  # what "auto" ran at the end: algorithm -> data connections
    rounds: int

    @property
    def better(self) -> str:
        return "cubic" if self.cubic_gbps >= self.bbr_gbps else "bbr"

    @property
    def better_gbps(self) -> float:
        return max(self.cubic_gbps, self.bbr_gbps)

    @property
    def ratio(self) -> float:
        return self.auto_gbps / self.better_gbps


def describe_path(r: LossResult) -> str:
    return (f"{r.rate_bps / 1e9:g} Gbit/s, {r.rtt_ms:g} ms RTT, {100 * r.loss:g} % loss, "
            f"{r.piece_bytes >> 10} KiB pieces")


def compare_auto(results: list[LossResult]) -> list[AutoComparison]:
    """One comparison per path and piece size that ran all of :data:`CONGESTION_CONTROLS`."""
    by_path: dict[str, dict[str, LossResult]] = {}
    for r in results:
        by_path.setdefault(describe_path(r), {})[r.congestion_control] = r
    return [AutoComparison(path, rows["auto"].goodput_gbps, rows["cubic"].goodput_gbps, rows["bbr"].goodput_gbps,
                           rows["auto"].running, len(rows["auto"].rounds_gbps))
            for path, rows in by_path.items() if set(CONGESTION_CONTROLS) <= set(rows)]


def format_comparisons(comparisons: list[AutoComparison]) -> str:
    lines = ["path                                              rounds  auto        cubic       bbr         "
             "auto ran       auto / better"]
    for c in comparisons:
        ran = "+".join(f"{n:g} {name}" for name, n in sorted(c.auto_running.items()))
        lines.append(f"{c.path:<50}{c.rounds:>6}  {c.auto_gbps:>6.3f} Gb/s {c.cubic_gbps:>6.3f} Gb/s "
                     f"{c.bbr_gbps:>6.3f} Gb/s {ran:<14} {c.ratio:>6.3f}x ({c.better})")
    return "\n".join(lines)


def format_table(results: list[LossResult]) -> str:
    lines = ["rate       RTT    loss     MTU   cc     streams  piece     goodput       x line   BDP        "
             "cwnd at end  retransmits"]
    for r in results:
        lines.append(f"{r.rate_bps / 1e9:>4.1f} Gb/s {r.rtt_ms:>4.0f} ms {100 * r.loss:>6.3f} % {r.mtu:>5} "
                     f"{r.congestion_control:<6} "
                     f"{r.streams:>7}  {r.piece_bytes >> 10:>5} KiB {r.goodput_gbps:>7.3f} Gb/s  {r.ratio:>6.3f}  "
                     f"{r.bdp_bytes / 2**20:>5.1f} MiB  {r.cwnd_bytes / 2**20:>7.1f} MiB  {r.tcp_retransmits:>11.0f}")
    return "\n".join(lines)
