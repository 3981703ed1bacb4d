"""`pddcore bench` case ``codec``: what each KV codec saves on the WAN and what it costs a core.

Per codec and dtype: ratio (raw bytes / frame bytes), encode and decode GB/s of raw bytes
on one core (decode into a preallocated tensor), beside a one-core memcpy of the same
bytes in the same run. ``zstd, interleaved`` is zstandard level 1 on the bytes as they
lie, without the byte-plane split: the split's own gain.

FP8 error per dtype: max and mean absolute error, and relative to each page's amax,
beside E4M3's bound 2^-4 of the page amax.

The KV comes from :mod:`.codec_kv`, greedy agreement on FP8 KV from :mod:`.codec_greedy`,
and each codec end to end on the emulated WAN from :mod:`.codec_wan`.

Example::

    print(format_report(run(quick=True)))
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .. import codec
from .codec_greedy import GreedyAgreement, greedy_agreement
from .codec_kv import checkpoint_kv, embedded_kv, one_thread
from .results import Result
from .timing import best_seconds

CODECS = ("none", "zstd", "lz4", "fp8")
INTERLEAVED = "zstd, interleaved"
FP8_BOUND = 2.0 ** -4  # half of E4M3's relative step 2^-3: the rounding bound, relative to a page's amax


@dataclass
class CodecPoint(Result):
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


@dataclass
class Fp8Error(Result):
    kv: str
    max_abs: float
    mean_abs: float
    max_rel_amax: float  # max over elements of |error| / the amax of its page
    mean_rel_amax: float
    bound_rel_amax: float = FP8_BOUND


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
    memcpy = raw / one_thread(lambda: best_seconds(lambda: dst.copy_(src), repeats=repeats)) / 1e9
    points = []
    cpus = len(os.sched_getaffinity(0))
    variants = [(name, codec.get(name)) for name in CODECS]
    if cpus > 1:
        variants.append((threaded_name(cpus), codec.get("zstd", threads=cpus)))
    for name, c in variants:
        frame = c.encode(kv)
        out = torch.empty_like(kv)
        enc = one_thread(lambda: best_seconds(lambda: c.encode(kv), repeats=repeats))
        dec = one_thread(lambda: best_seconds(lambda: c.decode(frame, out=out), repeats=repeats))
        points.append(CodecPoint(kv_name, name, raw, len(frame), raw / enc / 1e9, raw / dec / 1e9, memcpy))
    plain = src.numpy()
    compressor, decompressor = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    packed = compressor.compress(plain)
    enc = one_thread(lambda: best_seconds(lambda: compressor.compress(plain), repeats=repeats))
    dec = one_thread(lambda: best_seconds(lambda: decompressor.decompress(packed), repeats=repeats))
    points.append(CodecPoint(kv_name, INTERLEAVED, raw, len(packed), raw / enc / 1e9, raw / dec / 1e9, memcpy))
    return points


def fp8_error(kv_name: str, kv: torch.Tensor) -> Fp8Error:
    got = codec.decode(codec.get("fp8").encode(kv), max_bytes=kv.nbytes).double()
    x = kv.double()
    err = (got - x).abs()
    amax = x.abs().amax(dim=1, keepdim=True)
    rel = torch.where(amax > 0, err / amax, torch.zeros_like(err))
    return Fp8Error(kv_name, err.max().item(), err.mean().item(), rel.max().item(), rel.mean().item())


# ---- the case ---------------------------------------------------------------------------------------------


@dataclass
class CodecReport(Result):
    points: list[CodecPoint]
    fp8_error: list[Fp8Error]
    greedy: list[GreedyAgreement]
    checkpoint: str  # "measured: <name>" or why it was skipped


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
    for e in r.fp8_error:
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
