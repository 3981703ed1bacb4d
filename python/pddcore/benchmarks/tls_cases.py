"""What TLS costs the transfer engine: the same writes over plain TCP (with the token's
handshake), TLS keyed by the token (pre-shared key) and TLS with certificates, in the same
run, on loopback (where the CPU is the limit: encryption shows in full) and through the
emulated WAN (where the link is the limit).

- Loopback: one sink process per mode; the sender alternates between them, each round
  starting one mode later; best of ``rounds``; ratios against plain, and certificates against the
  pre-shared key. With one stream, a TLS rate is what one core encrypts (and the other
  decrypts) per second: compare with a 10 Gbit/s link's 1.25 GB/s. Also the median time of
  ``connects`` connect() calls per mode (the control and data connections' handshakes: the
  certificates' signatures and chain checks are what set the modes apart).
- WAN (root): through :class:`~pddcore.testing.wan.WanLink`, ``nbytes`` each way as one write;
  goodput of each as a ratio to the line rate, and against plain.
- The cipher alone: GB/s one core seals in 16 KiB AES-128-GCM records, against the 1.25 GB/s
  a 10 Gbit/s link carries.

Certificates come from a CA made for the run (:mod:`pddcore.certificates`), one per engine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

from .auth import bench_token
from .results import Result
from .sink import desc_address, engine_sink, read_info

#: plain TCP (token handshake), TLS keyed by the token, TLS with certificates
MODES = ("plain", "tls", "cert")


def mode_kwargs(directory: str) -> dict[str, dict[str, dict]]:
    """TransferEngine keyword arguments per mode for the "sink" and the "source" engine,
    with a CA and their certificates made in ``directory``."""
    from ..certificates import make_ca, make_engine_certificate

    ca = make_ca(directory, "pddcore bench CA")
    return {role: {"plain": {}, "tls": {"tls": True},
                   "cert": make_engine_certificate(directory, f"bench-{role}", ca).engine_kwargs()}
            for role in ("sink", "source")}


@dataclass
class TlsResult(Result):
    where: str  # "loopback" or "wan <rate> <rtt>"
    streams: int
    chunk_bytes: int
    nbytes: int
    plain_gbps: float  # GB/s on loopback, Gbit/s on the WAN
    tls_gbps: float  # TLS keyed by the token
    cert_gbps: float  # TLS with certificates
    line_gbps: float = 0.0  # WAN only
    connect_ms: dict | None = None  # loopback only: median connect() per mode

    @property
    def ratio(self) -> float:
        return self.tls_gbps / self.plain_gbps

    @property
    def cert_ratio(self) -> float:
        return self.cert_gbps / self.plain_gbps


def _write_rounds(descs: dict[str, bytes], data, streams: int, chunk_bytes: int, rounds: int,
                  kwargs: dict[str, dict], connects: int = 0) -> tuple[dict[str, float], dict[str, float]]:
    """Best seconds per write of ``data`` for each mode, alternating, and the median seconds
    of ``connects`` connect() calls to each mode's sink."""
    from contextlib import ExitStack

    from pddcore.transfer import TransferEngine

    with ExitStack() as stack:
        engines = {m: stack.enter_context(TransferEngine(streams=streams, chunk_bytes=chunk_bytes,
                                                         auth_token=bench_token(), **kwargs[m])) for m in descs}
        sources = {m: e.register(data) for m, e in engines.items()}
        peers = {m: e.connect(desc_address(descs[m])) for m, e in engines.items()}
        times = {m: [] for m in engines}
        order = list(engines)
        for i in range(rounds + 1):  # the first round opens the data connections: not counted
            # Each round starts one mode later: no mode always follows the same one.
            for m in order[i % len(order):] + order[:i % len(order)]:
                start = time.perf_counter()
                engines[m].write(peers[m], sources[m], 0, descs[m], 0, len(data)).wait()
                times[m].append(time.perf_counter() - start)
        connect_s = {m: [] for m in engines}
        for _ in range(connects):
            for m, e in engines.items():
                start = time.perf_counter()
                peer = e.connect(desc_address(descs[m]))
                connect_s[m].append(time.perf_counter() - start)
                peer.close()
        for m, e in engines.items():
            e.send(peers[m], b"exit")
    return ({m: min(t[1:]) for m, t in times.items()},
            {m: statistics.median(t) for m, t in connect_s.items() if t})


def loopback(nbytes: int = 256 << 20, chunk_bytes: int = 1 << 20, streams_list=(1, 4),
             rounds: int = 3, connects: int = 20) -> list[TlsResult]:
    import torch

    ctx = mp.get_context("spawn")
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    results = []
    for streams in streams_list:
        with tempfile.TemporaryDirectory() as tmp:
            kwargs = mode_kwargs(tmp)
            infos = {m: os.path.join(tmp, f"sink-{m}") for m in MODES}
            sinks = [ctx.Process(target=engine_sink, args=("127.0.0.1:0", nbytes, infos[m], "tcp", kwargs["sink"][m]),
                                 daemon=True) for m in MODES]
            for p in sinks:
                p.start()
            try:
                descs = {m: bytes.fromhex(read_info(infos[m])) for m in MODES}
                best, connect_s = _write_rounds(descs, data, streams, chunk_bytes, rounds, kwargs["source"], connects)
            finally:
                for p in sinks:
                    p.join(30)
                    if p.is_alive():
                        p.kill()
        results.append(TlsResult("loopback", streams, chunk_bytes, nbytes, *(nbytes / best[m] / 1e9 for m in MODES),
                                 connect_ms={m: 1e3 * s for m, s in connect_s.items()}))
    return results


def _wan_source(infos: dict[str, str], nbytes: int, streams: int, chunk_bytes: int,
                kwargs: dict[str, dict]) -> dict[str, float]:
    import numpy as np

    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    return _write_rounds({m: bytes.fromhex(read_info(v)) for m, v in infos.items()}, data, streams, chunk_bytes, 1,
                         kwargs)[0]


def wan(rate: str = "1gbit", delay_ms: float = 25.0, nbytes: int = 512 << 20, streams: int = 4,
        chunk_bytes: int = 1 << 20) -> TlsResult:
    from ..testing.wan import WanLink

    with WanLink(rate=rate, delay_ms=delay_ms) as link, tempfile.TemporaryDirectory() as tmp:
        kwargs = mode_kwargs(tmp)
        infos = {m: os.path.join(tmp, f"sink-{m}") for m in MODES}
        sinks = [link.b.spawn(engine_sink, f"{link.b.address}:{9300 + i}", nbytes, infos[m], "tcp", kwargs["sink"][m])
                 for i, m in enumerate(MODES)]
        best = link.a.call(_wan_source, infos, nbytes, streams, chunk_bytes, kwargs["source"], timeout=600)
        for sink in sinks:
            sink.result(60)
        return TlsResult(f"wan {rate} {2 * delay_ms:g} ms", streams, chunk_bytes, nbytes,
                         *(nbytes * 8 / best[m] / 1e9 for m in MODES), link.rate_bps / 1e9)


def cipher_gbps(nbytes: int = 1 << 30) -> float:
    """GB/s one core seals with TLS 1.3's AES-128-GCM in 16 KiB records (no network, no copies)."""
    from pddcore import _C

    return _C.aes_gcm_seal_rate(nbytes) / 1e9


def format_table(results: list[TlsResult]) -> str:
    lines = ["where                  streams  plain        TLS (token)  TLS (certs)  token/plain  certs/plain  "
             "certs/line"]
    for r in results:
        unit = "GB/s  " if r.where == "loopback" else "Gbit/s"
        line = f"{r.cert_gbps / r.line_gbps:>10.3f}" if r.line_gbps else "         -"
        lines.append(f"{r.where:<22} {r.streams:>7}  {r.plain_gbps:>5.2f} {unit} {r.tls_gbps:>5.2f} {unit} "
                     f"{r.cert_gbps:>5.2f} {unit} {r.ratio:>11.2f}  {r.cert_ratio:>11.2f}  {line}")
    connects = [r for r in results if r.connect_ms]
    if connects:
        lines.append("connect() median, ms:   " + "; ".join(
            f"{r.streams} stream{'s' * (r.streams > 1)}: " + ", ".join(f"{m} {r.connect_ms[m]:.2f}" for m in MODES)
            for r in connects))
    return "\n".join(lines)
