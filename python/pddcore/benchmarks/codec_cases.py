"""`pddcore bench` case ``codec``: what each KV codec saves on the WAN and what it costs a core.

Real KV: the embedded model (``pddcore.model`` defaults, seeded weights) prefills the
opening documents of the demo's agentic trace (``pddcore.deploy.trace.agentic_trace``) in
each engine dtype (bfloat16, float16, float32, and float64, the demo's); the pages are
packed (``pddcore.pack``) and viewed as ``[layers * 2 * pages, page elements]``, one row
per page of a layer's K or V. A Hugging Face checkpoint's KV is added when
``PDDCORE_BENCH_CHECKPOINT`` names a Llama / Qwen2 folder on disk; otherwise that part
says "skipped: no checkpoint".

Per codec and dtype: ratio (raw bytes / frame bytes), encode and decode GB/s of raw bytes
on one core (decode into a preallocated tensor), beside a one-core memcpy of the same
bytes in the same run. ``zstd, interleaved`` is zstandard level 1 on the bytes as they
lie, without the byte-plane split: the split's own gain.

FP8 error per dtype: max and mean absolute error, and relative to each page's amax,
beside E4M3's bound 2^-4 of the page amax.

Greedy agreement: every request of the demo trace (``quick``: the first sessions) is
decoded greedily by the demo's float64 model from the same prefill: on the exact prefix
KV, after that KV went through FP8 and back (as MD would receive it), and, as a control
for how fragile the model's greedy choices are, after rounding it to bfloat16. The first
token comes from the prefill's logits in every arm, as P samples it. Reported per arm:
the fraction of requests whose continuation is identical to the exact one, and where
the others first differ.

End to end on the emulated WAN (:func:`wan_case`, root only): per codec, the time from
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
"""

from __future__ import annotations

import hashlib
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

from .. import codec, pack, unpack
from ..deploy.trace import Scenario, agentic_trace
from ..model import Model, SamplerState, SamplingParams, sample, token_agreement
from ..transfer import TransferEngine
from .auth import bench_token
from .handoff_cases import MODELS, await_message, bench_model, handoff_tokens
from .handoff_cases import PAGE_SIZE as WAN_PAGE_SIZE  # 100 handed-off tokens fill whole pages
from .timing import best_seconds
from .transfer_cases import desc_address, read_info, write_info

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
CODECS = ("none", "zstd", "lz4", "fp8")
INTERLEAVED = "zstd, interleaved"
PAGE_SIZE = 16
CHECKPOINT_ENV = "PDDCORE_BENCH_CHECKPOINT"
FP8_BOUND = 2.0 ** -4  # half of E4M3's relative step 2^-3: the rounding bound, relative to a page's amax


@dataclass
class CodecPoint:
    kv: str  # where the KV came from and its dtype
    codec: str
    raw_bytes: int
    frame_bytes: int
    encode_gbps: float
    decode_gbps: float
    memcpy_gbps: float

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.frame_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


@dataclass
class Fp8Error:
    kv: str
    max_abs: float
    mean_abs: float
    max_rel_amax: float  # max over elements of |error| / the amax of its page
    mean_rel_amax: float
    bound_rel_amax: float = FP8_BOUND

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class GreedyAgreement:
    arm: str  # how the prefix KV was altered (a key of ROUNDTRIPS)
    requests: int
    identical: int
    tokens_compared: int
    tokens_matched: int
    first_divergences: list[tuple[int, int]] = field(default_factory=list)  # (request, output position)
    note: str = ""

    @property
    def identical_fraction(self) -> float:
        return self.identical / self.requests

    def as_dict(self) -> dict:
        return {**asdict(self), "identical_fraction": self.identical_fraction}


def _one_thread(fn):
    """Runs ``fn`` with torch on one thread: every figure here is per core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


# ---- real KV -----------------------------------------------------------------------------------------------


def documents(scenario: Scenario, quick: bool) -> list[list[int]]:
    """The distinct opening contexts of the trace's sessions (quick: the first)."""
    seen, out = set(), []
    for s in scenario.sessions:
        if s.first_context not in seen:
            seen.add(s.first_context)
            out.append(list(s.first_context))
    return out[:1] if quick else out


def prefilled_kv(model: Model, contexts: list[list[int]]) -> torch.Tensor:
    """The model's KV of ``contexts`` (each prefilled on its own), packed and viewed as
    ``[layers * 2 * pages, page elements]`` in the model's dtype. A page whose tokens up to
    its end were already taken (the shared system prompt) is taken once: a decode-side
    prefix cache holds it, so P would not send it again."""
    vocab = model.config.vocab_size
    pool = model.new_pool(sum(-(-len(c) // PAGE_SIZE) for c in contexts), PAGE_SIZE)
    pages, taken = [], set()
    for context in contexts:
        context = [t % vocab for t in context]
        seq = pool.new_sequence()
        model.prefill([seq], [context])
        for i, page in enumerate(seq.pages):
            prefix = tuple(context[:(i + 1) * PAGE_SIZE])
            if prefix not in taken:
                taken.add(prefix)
                pages.append(page)
    buf = pack(pool.layout(), torch.tensor(pages, dtype=torch.int64))
    return buf.view(model.dtype).view(model.config.num_layers * 2 * len(pages), -1)


def embedded_kv(quick: bool) -> dict[str, torch.Tensor]:
    contexts = documents(agentic_trace(), quick)
    return {f"embedded {str(d).removeprefix('torch.')}": _one_thread(
        lambda d=d: prefilled_kv(Model.default(seed=0, dtype=d), contexts)) for d in DTYPES}


def checkpoint_kv(quick: bool) -> tuple[dict[str, torch.Tensor], str | None]:
    """KV of the checkpoint named by ``PDDCORE_BENCH_CHECKPOINT``, or ({}, why not)."""
    path = os.environ.get(CHECKPOINT_ENV)
    if not path or not os.path.isdir(path):
        return {}, f"skipped: no checkpoint (set {CHECKPOINT_ENV} to a Hugging Face Llama / Qwen2 folder)"
    model = Model.from_pretrained(path)
    name = f"{os.path.basename(os.path.normpath(path))} {str(model.dtype).removeprefix('torch.')}"
    return {name: _one_thread(lambda: prefilled_kv(model, documents(agentic_trace(), quick)))}, None


# ---- ratio and speed --------------------------------------------------------------------------------------


def threaded_name(threads: int) -> str:
    return f"zstd, {threads} threads"


def is_threaded(codec_name: str) -> bool:
    return codec_name.startswith("zstd, ") and codec_name.endswith(" threads")


def measure(kv_name: str, kv: torch.Tensor, repeats: int) -> list[CodecPoint]:
    """Every codec (and zstd on interleaved bytes) on ``kv``, one core, best of ``repeats``;
    and zstd coding its segments on every usable CPU, where there are several."""
    import zstandard

    raw = kv.numel() * kv.element_size()
    src = kv.view(torch.uint8).view(-1)
    dst = torch.empty_like(src)
    memcpy = raw / _one_thread(lambda: best_seconds(lambda: dst.copy_(src), repeats=repeats)) / 1e9
    points = []
    cpus = len(os.sched_getaffinity(0))
    variants = [(name, codec.get(name)) for name in CODECS]
    if cpus > 1:
        variants.append((threaded_name(cpus), codec.get("zstd", threads=cpus)))
    for name, c in variants:
        frame = c.encode(kv)
        out = torch.empty_like(kv)
        enc = _one_thread(lambda: best_seconds(lambda: c.encode(kv), repeats=repeats))
        dec = _one_thread(lambda: best_seconds(lambda: c.decode(frame, out=out), repeats=repeats))
        points.append(CodecPoint(kv_name, name, raw, len(frame), raw / enc / 1e9, raw / dec / 1e9, memcpy))
    plain = src.numpy()
    compressor, decompressor = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    packed = compressor.compress(plain)
    enc = _one_thread(lambda: best_seconds(lambda: compressor.compress(plain), repeats=repeats))
    dec = _one_thread(lambda: best_seconds(lambda: decompressor.decompress(packed), repeats=repeats))
    points.append(CodecPoint(kv_name, INTERLEAVED, raw, len(packed), raw / enc / 1e9, raw / dec / 1e9, memcpy))
    return points


def fp8_error(kv_name: str, kv: torch.Tensor) -> Fp8Error:
    got = codec.decode(codec.get("fp8").encode(kv), max_bytes=kv.nbytes).double()
    x = kv.double()
    err = (got - x).abs()
    amax = x.abs().amax(dim=1, keepdim=True)
    rel = torch.where(amax > 0, err / amax, torch.zeros_like(err))
    return Fp8Error(kv_name, err.max().item(), err.mean().item(), rel.max().item(), rel.mean().item())


# ---- greedy tokens on FP8 KV ------------------------------------------------------------------------------

# How the prefix KV reaches MD in each arm of the greedy comparison: through the FP8 codec,
# and, as a control for how fragile the model's greedy choices are, rounded to bfloat16
# (what a bfloat16 engine stores anyway).
ROUNDTRIPS = {
    "fp8": lambda rows: codec.decode(codec.get("fp8").encode(rows), max_bytes=rows.nbytes),
    "bfloat16 rounding (control)": lambda rows: rows.to(torch.bfloat16).to(rows.dtype),
}


def _greedy(logits: torch.Tensor) -> list[int]:
    n = logits.shape[0]
    return sample(logits, [SamplingParams()] * n, [SamplerState(0) for _ in range(n)])


def _roundtrip_copy(model: Model, pool, seq, into, roundtrip) -> None:
    """Writes ``seq``'s KV pages, passed through ``roundtrip`` as ``[layers * 2 * pages,
    page elements]`` rows (one scale per row for fp8), into the sequence ``into``."""
    layout = pool.layout()
    buf = pack(layout, torch.tensor(seq.pages, dtype=torch.int64))
    rows = buf.view(model.dtype).view(model.config.num_layers * 2 * len(seq.pages), -1)
    unpack(layout, torch.tensor(into.pages, dtype=torch.int64), roundtrip(rows).contiguous().view(-1).view(torch.uint8))


def _decode_arms(model: Model, contexts: list[list[int]], max_new: list[int]) -> list[dict[str, list[int]]]:
    """Greedy continuations of each context on its exact prefix KV (``"exact"``) and on that
    KV passed through each of :data:`ROUNDTRIPS`; every request and arm in one decode batch.
    The first token comes from the prefill's logits in every arm, as P samples it."""
    arms = ["exact", *ROUNDTRIPS]
    pages = sum(-(-(len(c) + n) // PAGE_SIZE) for c, n in zip(contexts, max_new))
    pool = model.new_pool(len(arms) * pages, PAGE_SIZE)  # fresh (zeroed): no stale slots sway a page's scale
    seqs = {"exact": [pool.new_sequence() for _ in contexts]}
    first = _greedy(model.prefill(seqs["exact"], contexts))
    for arm, roundtrip in ROUNDTRIPS.items():
        seqs[arm] = [pool.allocate_sequence(len(c)) for c in contexts]
        for exact, copy in zip(seqs["exact"], seqs[arm]):
            _roundtrip_copy(model, pool, exact, copy, roundtrip)
    keys = [(arm, i) for arm in arms for i in range(len(contexts))]
    outputs = {key: [first[key[1]]] for key in keys}
    while True:
        live = [key for key in keys if len(outputs[key]) < max_new[key[1]]]
        if not live:
            break
        tokens = _greedy(model.decode([seqs[arm][i] for arm, i in live], [outputs[key][-1] for key in live]))
        for key, token in zip(live, tokens):
            outputs[key].append(token)
    return [{arm: outputs[arm, i] for arm in arms} for i in range(len(contexts))]


def greedy_agreement(quick: bool) -> list[GreedyAgreement]:
    """The demo trace's requests, turn by turn (a turn's context holds the previous exact
    answer), one :class:`GreedyAgreement` per arm of :data:`ROUNDTRIPS`."""
    scenario = agentic_trace()
    sessions = scenario.sessions[:2] if quick else scenario.sessions
    model = Model.default(seed=0)  # the demo's model: float64 on the CPU
    contexts = {s.sid: list(s.first_context) for s in sessions}
    runs: list[dict[str, list[int]]] = []
    for turn in range(max(len(s.outputs) for s in sessions)):
        active = [s for s in sessions if turn < len(s.outputs)]
        results = _one_thread(lambda: _decode_arms(model, [contexts[s.sid] for s in active],
                                                   [s.outputs[turn] for s in active]))
        for s, tokens in zip(active, results):
            runs.append(tokens)
            if turn + 1 < len(s.outputs):
                contexts[s.sid] = contexts[s.sid] + tokens["exact"] + list(s.followups[turn])
    note = f"{len(sessions)} of {len(scenario.sessions)} sessions of the demo trace"
    results = []
    for arm in ROUNDTRIPS:
        result = GreedyAgreement(arm, len(runs), 0, 0, 0, note=note)
        for i, tokens in enumerate(runs):
            agree = token_agreement(tokens["exact"], tokens[arm])
            result.identical += agree.identical
            result.tokens_compared += agree.compared
            result.tokens_matched += agree.matched
            if not agree.identical:
                result.first_divergences.append((i, agree.first_divergence))
        results.append(result)
    return results


# ---- the case ---------------------------------------------------------------------------------------------


@dataclass
class CodecReport:
    points: list[CodecPoint]
    fp8: list[Fp8Error]
    greedy: list[GreedyAgreement]
    checkpoint: str  # "measured: <name>" or why it was skipped

    def as_dict(self) -> dict:
        return {"points": [p.as_dict() for p in self.points], "fp8_error": [e.as_dict() for e in self.fp8],
                "greedy": [g.as_dict() for g in self.greedy], "checkpoint": self.checkpoint}


def run(quick: bool) -> CodecReport:
    kv = embedded_kv(quick)
    extra, skipped = checkpoint_kv(quick)
    kv.update(extra)
    repeats = 3 if quick else 7
    points = [p for name, t in kv.items() for p in measure(name, t, repeats)]
    errors = [fp8_error(name, t) for name, t in kv.items()]
    return CodecReport(points, errors, greedy_agreement(quick), skipped or f"measured: {', '.join(extra)}")


def format_report(r: CodecReport) -> str:
    lines = ["KV                   codec              ratio  encode GB/s  decode GB/s  memcpy GB/s  (one core unless named)"]
    for p in r.points:
        lines.append(f"{p.kv:<20} {p.codec:<17} {p.ratio:>6.3f}  {p.encode_gbps:>11.3f}  {p.decode_gbps:>11.3f}  "
                     f"{p.memcpy_gbps:>11.2f}")
    lines.append(f"\nFP8 E4M3, one scale per page (bound: {FP8_BOUND:g} of the page amax)")
    lines.append("KV                   max abs err  mean abs err  max err/amax  mean err/amax")
    for e in r.fp8:
        lines.append(f"{e.kv:<20} {e.max_abs:>11.4g}  {e.mean_abs:>12.4g}  {e.max_rel_amax:>12.4g}  "
                     f"{e.mean_rel_amax:>13.4g}")
    for g in r.greedy:
        lines.append(f"\ngreedy tokens, prefix KV through {g.arm} vs exact ({g.note}, float64 model): "
                     f"{g.identical}/{g.requests} requests identical ({100 * g.identical_fraction:.0f} %), "
                     f"{g.tokens_matched}/{g.tokens_compared} tokens agree")
        if g.first_divergences:
            lines.append("  first divergence (request, output position): "
                         + ", ".join(f"({i}, {pos})" for i, pos in g.first_divergences))
    lines.append(f"transformers checkpoint: {r.checkpoint}")
    return "\n".join(lines)


# ---- end to end on the emulated WAN -----------------------------------------------------------------------

WAN_RATES = ("200mbit", "1gbit")
WAN_DELAY_MS = 25.0  # one way: 50 ms RTT
WAN_MODEL = "report_kv"
_STAGING_SLACK = 1 << 20  # frame header and segment table on top of the raw KV (a frame never grows more)
_WAN_PORTS = (9540, 9541)  # MD, P
_WARM_UP = -1  # an untimed first send opens the data connections


@dataclass
class WanPoint:
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

    def as_dict(self) -> dict:
        return {**asdict(self), "median_ms": self.median_ms, "ratio": self.raw_bytes / self.wire_bytes}


@dataclass
class WanResult:
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

    def as_dict(self) -> dict:
        return {**asdict(self), "link": self.link, "points": [p.as_dict() for p in self.points]}


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
