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

The contenders (pddcore, Mooncake, NIXL) and how each writes are in
:mod:`pddcore.benchmarks.peer_engines`; a peer that is not installed gives a
"skipped: <reason>" line.

Example (root)::

    from pddcore.benchmarks import peer_cases

    report = peer_cases.peers_case([peer_cases.LinkPoint("200mbit", 10.0, 0.0)], nbytes=8 << 20)
    print(peer_cases.format_table(report))   # pddcore / peer / line rate per piece size
    report.results[0].measurements[0].goodput_gbps   # pddcore, 64 KiB pieces, in Gbit/s
"""

from __future__ import annotations

import hashlib
import os
import random
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from .peer_engines import PDDCORE, Contender, peers
from .results import Result
from .sink import read_info, write_info

PIECES: tuple[int | None, ...] = (64 << 10, 1 << 20, None)  # None: the whole transfer as one write
WARMUP_BYTES = 4 << 20
_RECEIVER_WAIT_S = 1800.0  # a receiver outlives the slowest sender it waits for
_SENDER_TIMEOUT_S = 900.0


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
class PeerResult(Result):
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


@dataclass
class PeersReport(Result):
    results: list[PeerResult]
    skipped: dict[str, str]  # peer -> why it did not run here
    knobs: dict[str, dict[str, str]]  # peer -> the environment it ran under
    congestion_control: str  # of every contender's connections


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
