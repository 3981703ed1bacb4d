"""The ``codec`` bench case end to end on the emulated WAN (root only).

End to end on the emulated WAN (:func:`wan_case`): per codec, the time from
"P starts packing and encoding" to "the KV is in MD's pool" through a
:class:`~pddcore.testing.wan.WanLink`, for (a) a 100-token handoff (RLD's KV of the
tokens it decoded) and (b) a fresh document's KV (the demo trace's first context), in
bfloat16 on the ``report_kv`` model (12 KiB of KV per token). P (namespace a) packs the
pages, encodes them into its staging region and writes the frame
(:func:`pddcore.codec.send_compressed`); MD (namespace b) decodes the frame from its
staging region as the write's notification arrives (:func:`pddcore.codec.decode_notified`)
and unpacks it into its own pool's pages, then acknowledges, so trials never overlap.
Both stamp the shared CLOCK_MONOTONIC. The codecs take turns, trial by trial, so
``none``, the baseline, sees the same link and machine; every trial also checks that
MD's pages hold exactly P's bytes (for the lossless codecs).

Example::

    print(format_wan(wan_case("1gbit", trials=3)))
"""

from __future__ import annotations

import hashlib
import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from .. import codec, pack, unpack
from ..deploy.trace import agentic_trace
from ..transfer import TransferEngine
from .auth import bench_token
from .codec_cases import CODECS
from .handoff_cases import MODELS, await_message, bench_model, handoff_tokens
from .handoff_cases import PAGE_SIZE as WAN_PAGE_SIZE  # 100 handed-off tokens fill whole pages
from .results import Result
from .sink import desc_address, read_info, write_info

WAN_RATES = ("200mbit", "1gbit")
WAN_DELAY_MS = 25.0  # one way: 50 ms RTT
WAN_MODEL = "report_kv"
_STAGING_SLACK = 1 << 20  # frame header and segment table on top of the raw KV (a frame never grows more)
_WAN_PORTS = (9540, 9541)  # MD, P
_WARM_UP = -1  # an untimed first send opens the data connections


@dataclass
class WanPoint(Result):
    """One payload through one codec, per trial, in milliseconds. ``end_to_end``: P starts
    packing until MD's unpack into its pool returned; the sum of ``sender`` (pack, encode,
    copy into staging, post the write), ``wire`` (until MD has the notification: every byte
    verified and applied) and ``receiver`` (decode, unpack)."""

    payload: str  # "handoff" or "document"
    codec: str
    tokens: int
    raw_bytes: int
    wire_bytes: int  # the frame, as MD's notification announced it
    end_to_end_ms: list[float]
    sender_ms: list[float]
    wire_ms: list[float]
    receiver_ms: list[float]
    rebuilt_equal: list[bool]  # per trial: MD's pages hold exactly P's bytes

    @property
    def median_ms(self) -> float:
        return statistics.median(self.end_to_end_ms)

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.wire_bytes


@dataclass
class WanResult(Result):
    model: str
    dtype: str
    rate_bps: int
    rtt_ms: float
    points: list[WanPoint]

    @property
    def link(self) -> str:
        return f"{self.rate_bps / 1e6:g} Mbit/s, {self.rtt_ms:g} ms RTT"

    def baseline(self, point: WanPoint) -> WanPoint:
        """The ``none`` point of the same payload."""
        return next(p for p in self.points if p.payload == point.payload and p.codec == "none")

    def line_rate_ms(self, point: WanPoint) -> float:
        """The raw KV at the link's rate plus one one-way delay: the floor without a codec."""
        return point.raw_bytes * 8 / self.rate_bps * 1e3 + self.rtt_ms / 2


def _ms(earlier: tuple[float, ...], later: tuple[float, ...]) -> list[float]:
    return [1e3 * (b - a) for a, b in zip(earlier, later)]


def _sha256(buf: torch.Tensor) -> str:
    return hashlib.sha256(buf.numpy()).hexdigest()


def _wan_receiver(config: str, dtype: torch.dtype, tokens: dict[str, int], staging_bytes: int, info_path: str,
                  listen: str, exit_path: str) -> dict:
    """MD, namespace b: decodes and unpacks every frame into its pool's pages until
    ``exit_path`` exists; per send key: (notification seen, unpacked, frame bytes, digest
    of the pages)."""
    model = bench_model(config, dtype)
    pool = model.new_pool(sum(-(-n // WAN_PAGE_SIZE) for n in tokens.values()), WAN_PAGE_SIZE)
    layout = pool.layout()
    pages = {name: torch.tensor(pool.allocate_sequence(n).pages) for name, n in tokens.items()}
    decoded = {name: torch.empty(model.config.num_layers * 2 * len(p), WAN_PAGE_SIZE * model.config.kv_size,
                                 dtype=dtype) for name, p in pages.items()}
    zeros = torch.zeros(max(layout.packed_nbytes(len(p)) for p in pages.values()), dtype=torch.uint8)
    arrived = {}
    with TransferEngine(listen=listen, auth_token=bench_token()) as engine:
        inbox = codec.Staging(engine, staging_bytes, target=True)
        write_info(info_path, inbox.descriptor().hex())
        sender = None
        while not os.path.exists(exit_path):
            for message in engine.poll_messages(timeout=0.2):
                seen = time.monotonic()
                if message.payload == b"hello":
                    sender = engine.connect(message.sender)
                    engine.send(sender, b"ready")
                    continue
                notice = codec.FrameNotice.parse(message.payload)
                name = notice.key.split(b" ")[1].decode()
                codec.decode_notified(message, inbox, out=decoded[name])
                unpack(layout, pages[name], decoded[name].view(-1).view(torch.uint8))
                applied = time.monotonic()
                digest = _sha256(pack(layout, pages[name]))
                unpack(layout, pages[name], zeros)  # the next trial cannot find these bytes already there
                arrived[notice.key] = (seen, applied, notice.length, digest)
                engine.send(sender, b"ack " + notice.key)
    return arrived


def _wan_sender(config: str, dtype: torch.dtype, document: list[int], handoff_ids: list[int], codecs: tuple[str, ...],
                trials: int, staging_bytes: int, info_path: str, listen: str) -> dict:
    """P (and RLD), namespace a: prefills ``document``, extends it by the handed-off
    tokens, and sends each payload's pages through each codec ``trials`` times, waiting
    for MD's acknowledgement after each; returns per send key: (started, posted, frame
    bytes), and the digest of each payload's bytes."""
    model = bench_model(config, dtype)
    pool = model.new_pool(-(-(len(document) + len(handoff_ids)) // WAN_PAGE_SIZE), WAN_PAGE_SIZE)
    layout = pool.layout()
    seq = pool.new_sequence()
    model.prefill([seq], [document])
    document_pages = list(seq.pages)
    model.extend([seq], [handoff_ids])  # the KV RLD's decode steps left after the document
    ships = {"handoff": torch.tensor(seq.pages[len(document_pages):]), "document": torch.tensor(document_pages)}
    digests = {name: _sha256(pack(layout, p)) for name, p in ships.items()}
    packed = torch.empty(max(layout.packed_nbytes(len(p)) for p in ships.values()), dtype=torch.uint8)
    inbox = bytes.fromhex(read_info(info_path))
    sends = [(_WARM_UP, "document", "none")] + [
        (trial, name, c) for trial in range(trials) for name in ships for c in codecs]
    stamps = {}
    with TransferEngine(listen=listen, auth_token=bench_token()) as engine:
        outbox = codec.Staging(engine, staging_bytes)
        md = engine.connect(desc_address(inbox))
        engine.send(md, b"hello")
        await_message(engine, b"ready")
        for trial, name, c in sends:
            key = f"{trial} {name} {c}".encode()
            started = time.monotonic()
            buf = pack(layout, ships[name], out=packed[:layout.packed_nbytes(len(ships[name]))])
            rows = buf.view(dtype).view(model.config.num_layers * 2 * len(ships[name]), -1)  # one fp8 scale per row
            send = codec.send_compressed(engine, md, rows, c, inbox, key=key, staging=outbox)
            posted = time.monotonic()
            await_message(engine, b"ack " + key)
            send.wait()  # done before MD's ack; raises if the write failed
            stamps[key] = (started, posted, send.nbytes)
    return {"stamps": stamps, "digests": digests}


def wan_case(rate: str = WAN_RATES[0], delay_ms: float = WAN_DELAY_MS, *, trials: int = 10, config: str = WAN_MODEL,
             dtype: torch.dtype = torch.bfloat16, document_tokens: int | None = None, handoff: int = 100,
             codecs: tuple[str, ...] = CODECS) -> WanResult:
    """Every codec end to end through a fresh WanLink (see the module docstring). The
    document is the demo trace's first context (its first ``document_tokens`` when
    given); ``handoff`` tokens follow it. Both must be multiples of the page size (4)."""
    from ..testing.wan import WanLink

    vocab = MODELS[config].vocab_size
    document = [t % vocab for t in agentic_trace().sessions[0].first_context][:document_tokens]
    for what, n in (("document_tokens", len(document)), ("handoff", handoff)):
        if n < 1 or n % WAN_PAGE_SIZE:
            raise ValueError(f"{what} must be a positive multiple of {WAN_PAGE_SIZE}, got {n}")
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    codecs = tuple(codec.get(c).name for c in codecs)  # unknown names fail here, not in a namespace
    if "none" not in codecs:
        codecs = ("none", *codecs)
    tokens = {"handoff": handoff, "document": len(document)}
    per_token = 2 * MODELS[config].num_layers * MODELS[config].kv_size * dtype.itemsize
    staging = max(tokens.values()) * per_token + _STAGING_SLACK
    with WanLink(rate=rate, delay_ms=delay_ms) as link, tempfile.TemporaryDirectory() as tmp:
        info, md_exit = os.path.join(tmp, "md"), os.path.join(tmp, "exit")
        md = link.b.spawn(_wan_receiver, config, dtype, tokens, staging, info, f"{link.b.address}:{_WAN_PORTS[0]}",
                          md_exit)
        read_info(info, timeout=120)
        try:
            sent = link.a.call(_wan_sender, config, dtype, document, handoff_tokens(handoff, vocab), codecs, trials,
                               staging, info, f"{link.a.address}:{_WAN_PORTS[1]}", timeout=600 + 60 * trials)
        finally:
            write_info(md_exit, "")
        arrived = md.result(60)
        rate_bps, rtt_ms = link.rate_bps, link.rtt_ms
    points = []
    for name, n in tokens.items():
        for c in codecs:
            keys = [f"{trial} {name} {c}".encode() for trial in range(trials)]
            started, posted, sent_bytes = zip(*(sent["stamps"][k] for k in keys))
            seen, applied, frame_bytes, digests = zip(*(arrived[k] for k in keys))
            if set(sent_bytes) != set(frame_bytes) or len(set(frame_bytes)) != 1:
                raise RuntimeError(f"{c} {name}: P wrote frames of {set(sent_bytes)} bytes, MD was told "
                                   f"{set(frame_bytes)}")
            points.append(WanPoint(name, c, n, n * per_token, frame_bytes[0], _ms(started, applied),
                                   _ms(started, posted), _ms(posted, seen), _ms(seen, applied),
                                   [d == sent["digests"][name] for d in digests]))
    return WanResult(config, str(dtype).removeprefix("torch."), rate_bps, rtt_ms, points)


def format_wan(r: WanResult) -> str:
    lines = [f"end to end on the emulated WAN, {r.link}: {r.model} model, {r.dtype} KV, median of "
             f"{len(r.points[0].end_to_end_ms)} trials; P packs + encodes -> wire -> MD decodes + unpacks into "
             "its pool",
             "payload              codec   wire KiB   ratio  end to end ms  / none   sender + wire + receiver ms"
             "  line-rate floor ms  MD pages"]
    for p in r.points:
        base = r.baseline(p)
        parts = " + ".join(f"{statistics.median(x):.1f}" for x in (p.sender_ms, p.wire_ms, p.receiver_ms))
        exact = "exact" if all(p.rebuilt_equal) else ("differ" if not any(p.rebuilt_equal) else "some differ")
        lines.append(f"{f'{p.tokens}-token {p.payload}':<20} {p.codec:<6} {p.wire_bytes / 1024:>9.1f} "
                     f"{p.raw_bytes / p.wire_bytes:>7.3f} {p.median_ms:>14.1f} {p.median_ms / base.median_ms:>6.2f}x"
                     f"   {parts:<27} {r.line_rate_ms(p):>18.1f}  {exact}")
    return "\n".join(lines)
