"""pddcore against its peers on the WAN leg (P -> MD): goodput of the same writes on the
same emulated link, measured back to back in one run.

For each link point (rate, one-way delay, loss) one :class:`~pddcore.testing.wan.WanLink`
is built. On it, for each piece size (64 KiB pages and 1 MiB pages scattered over the
destination, so nothing coalesces, and one bulk write), every contender writes the same
``nbytes`` from namespace a into a region registered in namespace b: pddcore's
TransferEngine first, then each installed peer engine. Each contender first writes a
4 MiB warm-up (connections opened, handshakes done) into a tail of the region that is not
checked; the timed part is the whole set of pieces, submitted at once and waited for.
All TCP connections use the same congestion control (bbr where the kernel offers it, set
as the namespaces' default) and start without cached path metrics.

Afterwards the receiver hashes its region; the digest must equal the one of the expected
layout, computed here from the same source bytes with numpy (a mismatch is reported as
WRONG BYTES and gives no summary row), and the delay line must have forwarded at least
``nbytes`` meanwhile (the bytes took the emulated link, not a shortcut between the
namespaces of one host; else the row says failed). Each row: pddcore / peer / line rate, and the bandwidth-delay
product.

Contenders (a peer that is not installed gives a "skipped: <reason>" line):

- ``pddcore``: ``TransferEngine(streams=4, chunk_bytes=1 MiB)`` as in the ``wan`` and
  ``loss`` cases; pieces in ``write_batch`` calls of 1024.
- ``mooncake``: Mooncake Transfer Engine (``pip install 'pddcore[peers]'``), TCP transport,
  P2P handshake (no metadata server); pieces in ``batch_transfer_async_write`` calls of
  1024, then ``get_batch_transfer_status``. Twice: with its defaults and with the knobs
  of :data:`MOONCAKE_TUNED` (environment variables, set at both ends).
- ``nixl``: NIXL with its UCX backend restricted to TCP over the link's device (UCX would
  otherwise use shared memory between the two namespaces, which share one host);
  pieces in WRITE requests of 1024 descriptors.

Example (root)::

    from pddcore.benchmarks import peer_cases

    report = peer_cases.peers_case([peer_cases.LinkPoint("200mbit", 10.0, 0.0)], nbytes=8 << 20)
    print(peer_cases.format_table(report))   # pddcore / peer / line rate per piece size
    report.results[0].measurements[0].goodput_gbps   # pddcore, 64 KiB pieces, in Gbit/s
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import numpy as np

from .auth import bench_token
from .transfer_cases import desc_address, read_info, write_info

PIECES: tuple[int | None, ...] = (64 << 10, 1 << 20, None)  # None: the whole transfer as one write
WARMUP_BYTES = 4 << 20
BATCH = 1024  # pieces per submitted call, for every contender
_RECEIVER_WAIT_S = 1800.0  # a receiver outlives the slowest sender it waits for
_SENDER_TIMEOUT_S = 900.0

# What a user who knows Mooncake's TCP transport sets for a long path: a lane (a connection
# to the peer) carries one write at a time and waits for its acknowledgement, so the most
# lanes it allows (16; default 4). Its slice size, MC_TCP_SLICE_SIZE, changed nothing
# measurable on this path.
MOONCAKE_TUNED = {"MC_TCP_LANES_PER_PEER": "16"}
# Both Mooncake configurations: room for every piece in the per-peer queue (with the
# default 1024, writes beyond it fail), no transfer cut off by the default timeout on a
# slow path, and only warnings and errors in the log. None of these changes speed.
_MOONCAKE_COMMON = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535", "MC_TRANSFER_TIMEOUT": "900",
                    "MC_LOG_LEVEL": "WARNING"}


@dataclass(frozen=True)
class LinkPoint:
    """One emulated path: tc-style rate, one-way delay (RTT = 2 x delay_ms), loss probability,
    MTU (a lossy path forwards packet by packet: jumbo frames keep that within the delay
    line's core, as in the ``loss`` case)."""

    rate: str
    delay_ms: float
    loss: float
    mtu: int = 1500


FULL_POINTS = (LinkPoint("1gbit", 25.0, 0.0), LinkPoint("1gbit", 25.0, 0.001, mtu=9000))
QUICK_POINTS = (LinkPoint("200mbit", 10.0, 0.0),)


# ---- the bytes and where they go ----------------------------------------------------------


def source_bytes(nbytes: int) -> np.ndarray:
    """The sender's data: ``nbytes`` uint8, the same in every process."""
    return np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)


def write_plan(nbytes: int, piece_bytes: int | None) -> list[tuple[int, int, int]]:
    """``(source offset, destination offset, length)`` per piece: piece i lands in a shuffled
    slot (KV pages of a paged cache), or one write of everything when ``piece_bytes`` is None.

    Example: ``write_plan(4, 2)`` is ``[(0, 2, 2), (2, 0, 2)]`` or the identity, as drawn."""
    if piece_bytes is None:
        return [(0, 0, nbytes)]
    if piece_bytes <= 0 or nbytes <= 0 or nbytes % piece_bytes:
        raise ValueError(f"nbytes ({nbytes}) must be a positive multiple of the piece size ({piece_bytes})")
    slots = list(range(nbytes // piece_bytes))
    random.Random(1).shuffle(slots)
    return [(i * piece_bytes, slot * piece_bytes, piece_bytes) for i, slot in enumerate(slots)]


def expected_digest(nbytes: int, piece_bytes: int | None) -> str:
    """Digest of the receiver's region once every piece of :func:`write_plan` has landed."""
    data = source_bytes(nbytes)
    if piece_bytes is None:
        return _digest(data)
    pieces = nbytes // piece_bytes
    slots = [dst // piece_bytes for _, dst, _ in write_plan(nbytes, piece_bytes)]
    landed = np.empty_like(data)
    landed.reshape(pieces, piece_bytes)[slots] = data.reshape(pieces, piece_bytes)
    return _digest(landed)


def _digest(view: np.ndarray) -> str:
    return hashlib.blake2b(memoryview(np.ascontiguousarray(view)), digest_size=16).hexdigest()


def _batches(plan: list[tuple[int, int, int]]) -> Iterator[list[tuple[int, int, int]]]:
    for start in range(0, len(plan), BATCH):
        yield plan[start:start + BATCH]


# ---- contenders ----------------------------------------------------------------------------
#
# A contender gives two context managers, each run inside a namespace:
#   target(address, nbytes) -> (the registered buffer as uint8 numpy, text for the sender)
#   source(address, text, data) -> write(plan): returns once every piece has landed


@dataclass(frozen=True)
class Contender:
    name: str
    module: str  # what must import for this contender to run
    knobs: dict[str, str]  # environment both ends set before their engine starts
    target: Callable
    source: Callable

    def unavailable_reason(self) -> str | None:
        """None when ``module`` imports, else the import's last error line. The import runs in
        a child interpreter: the namespaces' helpers fork from this process, which therefore
        loads no peer library itself."""
        proc = subprocess.run([sys.executable, "-c", f"import {self.module}"], capture_output=True, text=True,
                              env={**os.environ, **self.knobs})
        if proc.returncode == 0:
            return None
        lines = proc.stderr.strip().splitlines()
        return f"import {self.module} failed: {lines[-1] if lines else f'exit {proc.returncode}'}"


@contextlib.contextmanager
def _pddcore_target(address: str, nbytes: int):
    from pddcore.transfer import TransferEngine

    with TransferEngine(listen=f"{address}:0", auth_token=bench_token()) as engine:
        buffer = np.zeros(nbytes, dtype=np.uint8)
        region = engine.register(buffer, target=True)
        yield buffer, region.descriptor().hex()


@contextlib.contextmanager
def _pddcore_source(address: str, text: str, data: np.ndarray):
    from pddcore.transfer import TransferEngine

    desc = bytes.fromhex(text)
    # congestion_control=None: the namespace's default, which the run sets for every contender.
    with TransferEngine(listen=f"{address}:0", streams=4, chunk_bytes=1 << 20, auth_token=bench_token(),
                        congestion_control=None) as engine:
        region = engine.register(data)
        peer = engine.connect(desc_address(desc))

        def write(plan):
            transfers = [engine.write_batch(peer, [(region, s, desc, d, n) for s, d, n in batch])
                         for batch in _batches(plan)]
            for t in transfers:
                t.wait()

        yield write


def _mooncake_engine(address: str):
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(address, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize({address!r}, P2PHANDSHAKE, tcp) failed")
    return engine


def _mooncake_register(engine, buffer: np.ndarray) -> int:
    base = buffer.ctypes.data
    if engine.register_memory(base, buffer.nbytes) != 0:
        raise RuntimeError(f"Mooncake register_memory of {buffer.nbytes} bytes failed")
    return base


@contextlib.contextmanager
def _mooncake_target(address: str, nbytes: int):
    engine = _mooncake_engine(address)
    buffer = np.zeros(nbytes, dtype=np.uint8)
    base = _mooncake_register(engine, buffer)
    yield buffer, json.dumps({"session": f"{address}:{engine.get_rpc_port()}", "base": base})
    engine.unregister_memory(base)


@contextlib.contextmanager
def _mooncake_source(address: str, text: str, data: np.ndarray):
    target = json.loads(text)
    engine = _mooncake_engine(address)
    base = _mooncake_register(engine, data)

    def write(plan):
        batch_ids = []
        for batch in _batches(plan):
            batch_id = engine.batch_transfer_async_write(target["session"], [base + s for s, _, _ in batch],
                                                         [target["base"] + d for _, d, _ in batch],
                                                         [n for _, _, n in batch])
            if batch_id <= 0:
                raise RuntimeError(f"Mooncake batch_transfer_async_write to {target['session']} failed")
            batch_ids.append(batch_id)
        if engine.get_batch_transfer_status(batch_ids) != 0:
            raise RuntimeError(f"Mooncake transfer to {target['session']} failed")

    yield write
    engine.unregister_memory(base)


def _see_namespace_devices() -> None:
    """Remounts /sys in a mount namespace of this process alone, as ``ip netns exec`` does:
    UCX finds network devices in /sys/class/net, which otherwise shows the host's devices
    and not the link's ``wan0``."""
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_slave, mnt_detach = 0x00020000, 0x4000, 0x80000, 2
    if (libc.unshare(clone_newns) != 0 or libc.mount(b"none", b"/", None, ms_rec | ms_slave, None) != 0
            or libc.umount2(b"/sys", mnt_detach) != 0 or libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None) != 0):
        err = ctypes.get_errno()
        raise OSError(err, f"remounting /sys for the network namespace: {os.strerror(err)}")


def _nixl_agent(name: str, buffer: np.ndarray):
    import nixl_cu12._api as api  # the CUDA 12 build, as 'pddcore[peers]' installs it; it runs without CUDA

    _see_namespace_devices()
    agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    agent.register_memory([(buffer.ctypes.data, buffer.nbytes, 0, "")], "DRAM")
    return agent


@contextlib.contextmanager
def _nixl_target(address: str, nbytes: int):
    buffer = np.zeros(nbytes, dtype=np.uint8)
    agent = _nixl_agent("pddcore-bench-target", buffer)
    yield buffer, json.dumps({"metadata": agent.get_agent_metadata().hex(), "base": buffer.ctypes.data})


@contextlib.contextmanager
def _nixl_source(address: str, text: str, data: np.ndarray):
    target = json.loads(text)
    agent = _nixl_agent("pddcore-bench-source", data)
    remote = agent.add_remote_agent(bytes.fromhex(target["metadata"]))
    base = data.ctypes.data

    def write(plan):
        handles = []
        for batch in _batches(plan):
            local = agent.get_xfer_descs([(base + s, n, 0) for s, _, n in batch], "DRAM")
            far = agent.get_xfer_descs([(target["base"] + d, n, 0) for _, d, n in batch], "DRAM")
            handle = agent.initialize_xfer("WRITE", local, far, remote)
            if agent.transfer(handle) == "ERR":
                raise RuntimeError("NIXL transfer could not be posted")
            handles.append(handle)
        for handle in handles:
            while (state := agent.check_xfer_state(handle)) == "PROC":
                time.sleep(0.0005)
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer ended in state {state}")
            handle.release()

    yield write


PDDCORE = Contender("pddcore", "pddcore.transfer", {}, _pddcore_target, _pddcore_source)


def peers() -> tuple[Contender, ...]:
    """The peer engines, each with the environment both of its ends run under."""
    mooncake = dict(module="mooncake.engine", target=_mooncake_target, source=_mooncake_source)
    return (Contender("mooncake", knobs=dict(_MOONCAKE_COMMON), **mooncake),
            Contender("mooncake-tuned", knobs={**_MOONCAKE_COMMON, **MOONCAKE_TUNED}, **mooncake),
            Contender("nixl", "nixl_cu12._api", {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "wan0",
                                                  "NIXL_LOG_LEVEL": "WARN"}, _nixl_target, _nixl_source))


# ---- one transfer across the link ------------------------------------------------------------


def _warmup_plan(nbytes: int) -> list[tuple[int, int, int]]:
    # From the start of the source into the region's unchecked tail, in 64 KiB pieces
    # so that every connection a contender keeps to its peer carries some.
    return [(off, nbytes + off, 64 << 10) for off in range(0, min(WARMUP_BYTES, nbytes), 64 << 10)]


def _receive(contender: Contender, address: str, info_path: str, done_path: str, nbytes: int) -> str:
    """Runs in namespace b: serves a region of nbytes + warm-up; after the sender is done,
    the digest of the first nbytes."""
    os.environ.update(contender.knobs)
    with contender.target(address, nbytes + WARMUP_BYTES) as (buffer, text):
        write_info(info_path, text)
        read_info(done_path, timeout=_RECEIVER_WAIT_S)
        return _digest(buffer[:nbytes])


def _send(contender: Contender, address: str, info_path: str, nbytes: int, piece_bytes: int | None) -> float:
    """Runs in namespace a: the warm-up, then seconds for every piece of the plan."""
    os.environ.update(contender.knobs)
    plan = write_plan(nbytes, piece_bytes)
    with contender.source(address, read_info(info_path), source_bytes(nbytes)) as write:
        write(_warmup_plan(nbytes))
        start = time.perf_counter()
        write(plan)
        return time.perf_counter() - start


@dataclass
class Measurement:
    contender: str
    seconds: float | None = None
    goodput_gbps: float | None = None
    digest_ok: bool | None = None  # the receiver's region matched the expected layout
    link_bytes: int | None = None  # what the delay line forwarded a -> b meanwhile: the bytes took the link
    error: str | None = None

    @property
    def good(self) -> bool:
        return self.error is None and bool(self.digest_ok)


@dataclass
class PeerResult:
    """One link point and piece size: pddcore's and each peer's goodput beside the line rate."""

    rate_bps: int
    rtt_ms: float
    loss: float
    piece_bytes: int | None
    nbytes: int
    mtu: int = 1500
    measurements: list[Measurement] = field(default_factory=list)  # pddcore first

    @property
    def line_gbps(self) -> float:
        return self.rate_bps / 1e9

    @property
    def bdp_bytes(self) -> float:
        return self.rate_bps / 8 * self.rtt_ms / 1000

    @property
    def pieces_label(self) -> str:
        if self.piece_bytes is None:
            return f"1 x {self.nbytes >> 20} MiB"
        return f"{self.piece_bytes >> 10} KiB" if self.piece_bytes < 1 << 20 else f"{self.piece_bytes >> 20} MiB"

    @property
    def link_label(self) -> str:
        mtu = "" if self.mtu == 1500 else f", MTU {self.mtu}"
        return f"{self.line_gbps:g} Gbit/s, {self.rtt_ms:g} ms RTT, {100 * self.loss:g} % loss{mtu}"

    def as_dict(self) -> dict:
        return {**asdict(self), "line_gbps": self.line_gbps, "bdp_bytes": self.bdp_bytes}


@dataclass
class PeersReport:
    results: list[PeerResult]
    skipped: dict[str, str]  # peer -> why it did not run here
    knobs: dict[str, dict[str, str]]  # peer -> the environment it ran under
    congestion_control: str  # of every contender's connections

    def as_dict(self) -> dict:
        return asdict(self)


def _wait_for_receiver(receiver, info_path: str, timeout_s: float = 60.0) -> None:
    """Returns once the receiver published its text; raises its own error if it died first."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(info_path):
        if not receiver.alive:
            receiver.result(1)  # raises NamespaceCallError with the receiver's traceback
            raise RuntimeError("the receiver exited without publishing its region")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the receiver did not publish its region within {timeout_s:g} s")
        time.sleep(0.01)


def _measure(link, contender: Contender, nbytes: int, piece_bytes: int | None, expected: str) -> Measurement:
    forwarded_before = link.stats().a_to_b.forwarded_bytes
    with tempfile.TemporaryDirectory() as tmp:
        info, done = os.path.join(tmp, "target"), os.path.join(tmp, "done")
        receiver = link.b.spawn(_receive, contender, link.b.address, info, done, nbytes)
        try:
            _wait_for_receiver(receiver, info)
            seconds = link.a.call(_send, contender, link.a.address, info, nbytes, piece_bytes,
                                  timeout=_SENDER_TIMEOUT_S)
        except Exception as e:  # a peer that breaks on this path is a result, not a crash of the case
            receiver.kill()
            return Measurement(contender.name, error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
        write_info(done, "done")
        digest = receiver.result(120)
    link_bytes = link.stats().a_to_b.forwarded_bytes - forwarded_before
    measurement = Measurement(contender.name, seconds, nbytes * 8 / seconds / 1e9, digest == expected, link_bytes)
    if link_bytes < nbytes:
        measurement.error = f"only {link_bytes} of its {nbytes} bytes crossed the emulated link"
    return measurement


def peers_case(points=FULL_POINTS, nbytes: int = 128 << 20, pieces=PIECES, only: tuple[str, ...] | None = None,
               congestion_control: str | None = "bbr") -> PeersReport:
    """Every link point x piece size: pddcore, then each peer that runs here (``only``:
    these peers by name). Every contender's TCP connections use ``congestion_control``
    (set as the namespaces' default, so the peers use it unchanged; pddcore's engines
    default to bbr too); None, or a kernel without it: the host's default. With no peer to
    run, no link is built. Needs root (see :func:`pddcore.testing.wan.unavailable_reason`)."""
    from ..testing import netns
    from ..testing.wan import WanLink
    from ..transfer import available_congestion_controls

    if nbytes <= 0 or nbytes % (64 << 10):
        raise ValueError(f"nbytes must be a positive multiple of 64 KiB, got {nbytes}")
    if congestion_control not in available_congestion_controls():
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
            congestion_control = f.read().strip()  # what new namespaces start with
    # Every contender also starts from the same slow-start threshold, not from what the
    # kernel cached for this destination after the previous one's connections.
    sysctls = {"net.ipv4.tcp_congestion_control": congestion_control, "net.ipv4.tcp_no_metrics_save": 1}
    chosen = [p for p in peers() if only is None or p.name in only]
    skipped = {p.name: reason for p in chosen if (reason := p.unavailable_reason()) is not None}
    running = [p for p in chosen if p.name not in skipped]
    results = []
    for point in points if running else ():
        with WanLink(rate=point.rate, delay_ms=point.delay_ms, loss=point.loss, seed=1, mtu=point.mtu) as link:
            for ns in (link.a.netns, link.b.netns):
                netns.write_sysctls(ns, sysctls)
            for piece in pieces:
                expected = expected_digest(nbytes, piece)
                result = PeerResult(link.rate_bps, link.rtt_ms, point.loss, piece, nbytes, point.mtu)
                result.measurements = [_measure(link, c, nbytes, piece, expected) for c in (PDDCORE, *running)]
                results.append(result)
    return PeersReport(results, skipped, {p.name: p.knobs for p in running}, congestion_control)


# ---- report ---------------------------------------------------------------------------------------


def format_row(result: PeerResult, peer: Measurement) -> str:
    """One line: pddcore / peer / line rate (Gbit/s) on a link and piece size, with the BDP.

    Example: ``1 Gbit/s, 50 ms RTT, 0 % loss |      64 KiB | pddcore 0.912 / mooncake 0.041 /
    line 1.000 Gbit/s = 22.2x | BDP 6.0 MiB``."""
    head = f"{result.link_label} | {result.pieces_label:>11} | "
    ours = result.measurements[0]
    for m in (ours, peer):
        if m.error is not None:
            return head + f"{m.contender}: failed: {m.error}"
    wrong = [m.contender for m in (ours, peer) if not m.digest_ok]
    return (head + f"pddcore {ours.goodput_gbps:.3f} / {peer.contender} {peer.goodput_gbps:.3f} / "
            f"line {result.line_gbps:.3f} Gbit/s = {ours.goodput_gbps / peer.goodput_gbps:.1f}x | "
            f"BDP {result.bdp_bytes / 2**20:.1f} MiB" + (f" | WRONG BYTES: {', '.join(wrong)}" if wrong else ""))


def format_table(report: PeersReport) -> str:
    lines = [f"{name}: skipped: {reason}" for name, reason in report.skipped.items()]
    lines += [format_row(r, m) for r in report.results for m in r.measurements[1:]]
    lines += [f"{name} ran with " + " ".join(f"{k}={v}" for k, v in env.items())
              for name, env in report.knobs.items()]
    if report.results:
        lines.append(f"every contender's TCP connections: congestion control {report.congestion_control}")
    return "\n".join(lines)


def summary(report: PeersReport) -> list[tuple[str, float, str, float]]:
    """``(what, pddcore Gbit/s, peer, peer Gbit/s)`` for every pair whose bytes both landed right;
    ``what`` fits the bench summary's 45 columns: ``"pddcore 64 KiB, 1G 50ms 0.1% loss"``."""
    return [(f"pddcore {r.pieces_label}, {r.line_gbps:g}G {r.rtt_ms:g}ms {100 * r.loss:g}% loss",
             r.measurements[0].goodput_gbps, m.contender, m.goodput_gbps)
            for r in report.results for m in r.measurements[1:] if r.measurements[0].good and m.good]
