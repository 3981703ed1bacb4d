"""Goodput on a long path, lossy or fast, per TCP congestion control, as a ratio to the line rate.

Through :class:`~pddcore.testing.wan.WanLink` (the delay line drops each packet with the
given probability), one engine writes ``nbytes`` to another as one transfer of
``piece_bytes`` writes (KV pages of that size) over ``streams`` connections whose congestion
control is set with ``TransferEngine(congestion_control=...)``; a small write first opens
the connections, so slow start of the timed write is counted but not the handshakes. The
bandwidth-delay product is reported beside each row. At 10 Gbit/s the emulator itself (its
delay line and tbf on this machine's cores) may not reach the line rate: one plain TCP
stream through the same link, measured in the same run, shows what it reaches.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

from .auth import bench_token
from .results import Result
from .transfer_cases import desc_address, engine_sink, read_info

LOSSES = (0.0001, 0.001, 0.01)


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
    goodput_gbps: float
    packets_dropped: int  # by the delay line's loss draw, a -> b, during this row
    cwnd_bytes: float       # the data connections' congestion windows summed, as the write ended
    tcp_retransmits: float  # segments the data connections sent again

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
              mtu: int = 1500) -> list[LossResult]:
    """``offload``: as WanLink takes it (default: on without loss). Rows meant to be set
    beside lossy ones pass False, so that every packet crosses the delay line on its own
    as it must with loss, and only the loss differs. ``mtu``: the link's (9000: jumbo
    frames, as inter-DC links carry; the delay line's cost is per packet, so this is how a
    lossy path of 1 Gbit/s and more stays within what its core forwards)."""
    from ..testing.wan import WanLink

    results = []
    with WanLink(rate=rate, delay_ms=delay_ms, loss=loss, seed=1, offload=offload, mtu=mtu) as link:
        for i, (cc, piece) in enumerate((cc, piece) for cc in congestion_controls for piece in piece_sizes):
            dropped_before = link.stats().a_to_b.dropped_loss
            with tempfile.TemporaryDirectory() as tmp:
                info = os.path.join(tmp, "sink")
                sink = link.b.spawn(engine_sink, f"{link.b.address}:{9400 + i}", nbytes, info)
                seconds, peer = link.a.call(_source, info, nbytes, piece, streams, chunk_bytes, cc, timeout=900)
                sink.result(60)
            results.append(LossResult(link.rate_bps, 2 * delay_ms, loss, mtu, cc, streams, piece, nbytes,
                                      nbytes * 8 / seconds / 1e9, link.stats().a_to_b.dropped_loss - dropped_before,
                                      peer["cwnd_bytes"], peer["tcp_retransmits"]))
    return results


def format_table(results: list[LossResult]) -> str:
    lines = ["rate       RTT    loss     MTU   cc     streams  piece     goodput       x line   BDP        "
             "cwnd at end  retransmits"]
    for r in results:
        lines.append(f"{r.rate_bps / 1e9:>4.1f} Gb/s {r.rtt_ms:>4.0f} ms {100 * r.loss:>6.3f} % {r.mtu:>5} "
                     f"{r.congestion_control:<6} "
                     f"{r.streams:>7}  {r.piece_bytes >> 10:>5} KiB {r.goodput_gbps:>7.3f} Gb/s  {r.ratio:>6.3f}  "
                     f"{r.bdp_bytes / 2**20:>5.1f} MiB  {r.cwnd_bytes / 2**20:>7.1f} MiB  {r.tcp_retransmits:>11.0f}")
    return "\n".join(lines)
