"""What TLS costs the transfer engine: the same writes with ``tls=True`` and without, in
the same run, on loopback (where the CPU is the limit: encryption shows in full) and through
the emulated WAN (where the link is the limit).

- Loopback: one sink process holds a plain and a TLS engine; the sender alternates rounds
  between them; best of ``rounds``; ratio = TLS / plain GB/s. With one stream, the TLS rate is
  what one core encrypts (and the other decrypts) per second: compare with a 10 Gbit/s link's
  1.25 GB/s.
- WAN (root): through :class:`~pddcore.testing.wan.WanLink`, ``nbytes`` each way as one write;
  goodput of each as a ratio to the line rate, and TLS / plain.
- The cipher alone: GB/s one core seals in 16 KiB AES-128-GCM records, against the 1.25 GB/s
  a 10 Gbit/s link carries.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import dataclass

from .auth import bench_token
from .results import Result
from .transfer_cases import desc_address, engine_sink, read_info


@dataclass
class TlsResult(Result):
    where: str  # "loopback" or "wan <rate> <rtt>"
    streams: int
    chunk_bytes: int
    nbytes: int
    plain_gbps: float  # GB/s on loopback, Gbit/s on the WAN
    tls_gbps: float
    line_gbps: float = 0.0  # WAN only

    @property
    def ratio(self) -> float:
        return self.tls_gbps / self.plain_gbps


def _write_rounds(descs: dict[bool, bytes], data, streams: int, chunk_bytes: int, rounds: int) -> dict[bool, float]:
    """Best seconds per write of ``data`` for each of plain (False) and TLS (True), alternating."""
    from pddcore.transfer import TransferEngine

    best = {}
    with TransferEngine(streams=streams, chunk_bytes=chunk_bytes, auth_token=bench_token()) as plain, \
            TransferEngine(streams=streams, chunk_bytes=chunk_bytes, auth_token=bench_token(), tls=True) as tls:
        engines = {False: plain, True: tls}
        sources = {k: e.register(data) for k, e in engines.items()}
        peers = {k: e.connect(desc_address(descs[k])) for k, e in engines.items()}
        times = {False: [], True: []}
        for _ in range(rounds + 1):  # the first round opens the connections: not counted
            for k, e in engines.items():
                start = time.perf_counter()
                e.write(peers[k], sources[k], 0, descs[k], 0, len(data)).wait()
                times[k].append(time.perf_counter() - start)
        for k, e in engines.items():
            e.send(peers[k], b"exit")
            best[k] = min(times[k][1:])
    return best


def loopback(nbytes: int = 256 << 20, chunk_bytes: int = 1 << 20, streams_list=(1, 4),
             rounds: int = 3) -> list[TlsResult]:
    import torch

    ctx = mp.get_context("spawn")
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    results = []
    for streams in streams_list:
        with tempfile.TemporaryDirectory() as tmp:
            infos = {k: os.path.join(tmp, f"sink-{k}") for k in (False, True)}
            sinks = [ctx.Process(target=engine_sink, args=("127.0.0.1:0", nbytes, infos[k], "tcp", k), daemon=True)
                     for k in (False, True)]
            for p in sinks:
                p.start()
            try:
                descs = {k: bytes.fromhex(read_info(infos[k])) for k in infos}
                best = _write_rounds(descs, data, streams, chunk_bytes, rounds)
            finally:
                for p in sinks:
                    p.join(30)
                    if p.is_alive():
                        p.kill()
        results.append(TlsResult("loopback", streams, chunk_bytes, nbytes, nbytes / best[False] / 1e9,
                                 nbytes / best[True] / 1e9))
    return results


def _wan_source(infos: dict[bool, str], nbytes: int, streams: int, chunk_bytes: int) -> dict[bool, float]:
    import numpy as np

    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    return _write_rounds({k: bytes.fromhex(read_info(v)) for k, v in infos.items()}, data, streams, chunk_bytes, 1)


def wan(rate: str = "1gbit", delay_ms: float = 25.0, nbytes: int = 512 << 20, streams: int = 4,
        chunk_bytes: int = 1 << 20) -> TlsResult:
    from ..testing.wan import WanLink

    with WanLink(rate=rate, delay_ms=delay_ms) as link, tempfile.TemporaryDirectory() as tmp:
        infos = {k: os.path.join(tmp, f"sink-{k}") for k in (False, True)}
        sinks = [link.b.spawn(engine_sink, f"{link.b.address}:{9300 + k}", nbytes, infos[k], "tcp", k)
                 for k in (False, True)]
        best = link.a.call(_wan_source, infos, nbytes, streams, chunk_bytes, timeout=600)
        for sink in sinks:
            sink.result(60)
        return TlsResult(f"wan {rate} {2 * delay_ms:g} ms", streams, chunk_bytes, nbytes,
                         nbytes * 8 / best[False] / 1e9, nbytes * 8 / best[True] / 1e9, link.rate_bps / 1e9)


def cipher_gbps(nbytes: int = 1 << 30) -> float:
    """GB/s one core seals with TLS 1.3's AES-128-GCM in 16 KiB records (no network, no copies)."""
    from pddcore import _C

    return _C.aes_gcm_seal_rate(nbytes) / 1e9


def format_table(results: list[TlsResult]) -> str:
    lines = ["where                  streams  plain      TLS        TLS/plain  TLS/line"]
    for r in results:
        unit = "GB/s  " if r.where == "loopback" else "Gbit/s"
        line = f"{r.tls_gbps / r.line_gbps:>8.3f}" if r.line_gbps else "       -"
        lines.append(f"{r.where:<22} {r.streams:>7}  {r.plain_gbps:>5.2f} {unit} {r.tls_gbps:>5.2f} {unit} "
                     f"{r.ratio:>9.2f}  {line}")
    return "\n".join(lines)
