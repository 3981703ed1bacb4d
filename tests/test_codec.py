"""pddcore.codec: lossless codecs are bit-exact, fp8 stays within E4M3's rounding bound,
bad frames raise without touching ``out``, frames cross a TransferEngine loopback and (as
root) the emulated WAN into MD's pool."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import pddcore
from pddcore import TransferEngine, codec
from pddcore.codec import CodecError, lossless
from pddcore.codec.fp8 import E4M3_MAX
from pddcore.codec.frame import FrameHeader
from pddcore.model import KVPool, Model, ModelConfig
from pddcore.testing.wan import unavailable_reason as wan_unavailable

LOSSLESS = ["none", "zstd", "lz4"]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
TOKEN = b"codec-test-token-3c9d2e7a1f5b8046"
# bfloat16 bit patterns a lossless codec must carry untouched: quiet and signalling NaNs
# with payloads, both infinities, denormals, negative zero, the extremes.
BF16_SPECIALS = [0x7FC0, 0x7F81, 0xFFC1, 0x7FFF, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x8000, 0x7F7F, 0x0080]


def bf16_from_bits(patterns: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(patterns, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def tensor_from_bytes(raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(raw.copy()).view(dtype).view(shape) if raw.size else torch.empty(shape, dtype=dtype)


def make_content(kind: str, dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    size = torch.empty((), dtype=dtype).element_size()
    n = int(np.prod(shape, dtype=np.int64)) * size
    if kind == "random":  # every bit pattern: NaN, inf, denormals included for floats
        raw = rng.integers(0, 256, n, dtype=np.uint8)
    elif kind == "low_entropy":  # few distinct bytes: the compressors get to work
        raw = rng.choice(np.array([0, 1, 0x3F, 0xC0], dtype=np.uint8), n)
    else:  # "specials"
        if dtype != torch.bfloat16:
            raw = np.resize(np.frombuffer(np.array(BF16_SPECIALS, dtype="<u2").tobytes(), np.uint8), n)
        else:
            raw = np.array(BF16_SPECIALS, dtype="<u2")[rng.integers(0, len(BF16_SPECIALS), n // 2)].view(np.uint8)
    return tensor_from_bytes(raw, dtype, shape)


# ---- lossless ----------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(LOSSLESS),
       dtype=st.sampled_from(FLOATS + [torch.uint8, torch.int16, torch.int32, torch.int64]),
       shape=st.lists(st.integers(0, 9), max_size=4).map(tuple),
       kind=st.sampled_from(["random", "low_entropy", "specials"]),
       segment_bytes=st.sampled_from([61, 1000, lossless.SEGMENT_BYTES]),
       seed=st.integers(0, 2 ** 32 - 1))
def test_lossless_round_trip_is_bit_exact(name, dtype, shape, kind, segment_bytes, seed):
    x = make_content(kind, dtype, shape, seed)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lossless, "SEGMENT_BYTES", segment_bytes)  # many segments per plane
        frame = codec.get(name).encode(x)
    assert same_bits(codec.decode(frame, max_bytes=x.nbytes), x)
    out = torch.empty_like(x)
    assert codec.get(name).decode(frame, out=out) is out
    assert same_bits(out, x)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(LOSSLESS), data=st.binary(max_size=3000))
def test_lossless_round_trip_of_bytes_like_input(name, data):
    for source in (data, bytearray(data), memoryview(data)):
        got = codec.decode(codec.get(name).encode(source), max_bytes=len(data))
        assert got.dtype == torch.uint8 and got.shape == (len(data),)
        assert got.numpy().tobytes() == data


def test_bf16_specials_survive_bit_for_bit():
    x = bf16_from_bits(BF16_SPECIALS * 50).view(50, -1)
    for name in LOSSLESS:
        assert same_bits(codec.decode(codec.get(name).encode(x), max_bytes=x.nbytes), x)


def test_non_contiguous_input_and_output():
    x = make_content("random", torch.float32, (6, 10), 3)
    frame = codec.get("zstd").encode(x.t())  # a strided source
    out = torch.zeros(6, 10, dtype=torch.float32).t()  # a strided destination
    codec.decode(frame, out=out)
    assert same_bits(out, x.t())


@pytest.mark.parametrize("threads", [1, 3])
def test_segments_hold_byte_planes_in_plane_major_order(threads):
    """The wire layout, read without the decoder: segment k of plane b holds byte b of
    elements [k * S, (k + 1) * S), planes in memory order, each expanded with the library."""
    import zstandard

    x = make_content("low_entropy", torch.float32, (11, 7), 1)  # 77 elements, 4 planes
    raw = x.numpy().tobytes()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lossless, "SEGMENT_BYTES", 20)  # 4 segments per plane, the last one short
        frame = codec.get("zstd", threads=threads).encode(x)
    header = FrameHeader.parse(frame)
    entries = list(struct.iter_unpack("<BQ", header.meta[8:]))
    body, offset, got = frame[header.header_len:], 0, []
    for method, length in entries:
        piece = body[offset:offset + length]
        got.append(piece if method == 0 else zstandard.ZstdDecompressor().decompress(piece, max_output_size=20))
        offset += length
    expected = [bytes(raw[i * 4 + b] for i in range(start, min(start + 20, 77)))
                for b in range(4) for start in range(0, 77, 20)]
    assert got == expected


def test_incompressible_planes_are_stored_not_inflated():
    x = make_content("random", torch.bfloat16, (512, 1024), 5)  # 1 MiB of noise
    for name in LOSSLESS:
        frame = codec.get(name).encode(x)
        assert FrameHeader.parse(frame).body_len == x.numel() * 2


@pytest.fixture(scope="module")
def real_bf16_kv() -> torch.Tensor:
    """The embedded model's bfloat16 KV of a 300-token prompt, packed, as [pages, page elements]."""
    torch.manual_seed(0)
    model = Model.default(seed=0, dtype=torch.bfloat16)
    pool = model.new_pool(32, 16)
    seq = pool.new_sequence()
    model.prefill([seq], [torch.randint(1, model.config.vocab_size, (300,)).tolist()])
    buf = pddcore.pack(pool.layout(), torch.tensor(seq.pages))
    return buf.view(torch.bfloat16).view(model.config.num_layers * 2 * len(seq.pages), -1)


def test_byte_plane_split_beats_compressing_interleaved_bytes(real_bf16_kv):
    import zstandard

    raw = real_bf16_kv.view(torch.uint8).numpy().tobytes()
    interleaved = len(zstandard.ZstdCompressor(level=1).compress(raw))
    split = len(codec.get("zstd").encode(real_bf16_kv))
    assert split < interleaved < len(raw)
    assert same_bits(codec.decode(codec.get("zstd").encode(real_bf16_kv), max_bytes=real_bf16_kv.nbytes), real_bf16_kv)


# ---- fp8 ---------------------------------------------------------------------------------------------------


def fp8_error_bound(x: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |decoded - x|, derived from the formats, not measured.

    With page amax A and scale s = max(A / 448, float32 tiny), the codec sends v = x / s
    (|v| <= 448) rounded to E4M3. E4M3 has 3 mantissa bits: a relative step of 2^-3, so
    rounding to nearest errs by at most 2^-4 |v| for normals and by half the subnormal
    step 2^-9, i.e. 2^-10, below 2^-6. Scaled back: 2^-4 |x| + 2^-10 s. On top come a few
    float32 roundings (x to float32, the division, the product, the scale's own rounding:
    each 2^-24 relative, 2^-20 covers them) and the output dtype's rounding of the result
    (half its epsilon relative, half its subnormal step absolute).
    """
    xd, dd = x.double(), decoded.double()
    pages = xd.reshape(x.shape[0] if x.dim() >= 2 else 1, -1)
    amax = pages.abs().amax(dim=1, keepdim=True)
    scale = torch.clamp(amax / E4M3_MAX, min=torch.finfo(torch.float32).tiny).expand_as(pages).reshape(x.shape)
    info = torch.finfo(x.dtype)
    output_rounding = info.eps / 2 * dd.abs() + info.tiny * info.eps / 2
    return (2 ** -4 + 2 ** -20) * xd.abs() + 2 ** -10 * scale * (1 + 2 ** -20) + output_rounding


def fp8_input(dtype: torch.dtype, pages: int, page_elems: int, exponents: list[int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(pages, page_elems, dtype=torch.float64, generator=g)
    x *= torch.tensor([2.0 ** e for e in exponents], dtype=torch.float64)[:, None]
    if pages > 2:
        x[1] = 0.0  # an all-zero page
    return x.to(dtype)


@settings(max_examples=120, deadline=None)
@given(dtype=st.sampled_from(FLOATS), data=st.data(), seed=st.integers(0, 2 ** 32 - 1))
def test_fp8_error_within_the_e4m3_bound(dtype, data, seed):
    pages = data.draw(st.integers(1, 9), label="pages")
    page_elems = data.draw(st.integers(1, 200), label="page_elems")
    # Each page its own magnitude, over most of the dtype's range (float16: its normals).
    low, high = (-12, 12) if dtype == torch.float16 else (-120, 100)
    exponents = data.draw(st.lists(st.integers(low, high), min_size=pages, max_size=pages), label="exponents")
    x = fp8_input(dtype, pages, page_elems, exponents, seed)
    frame = codec.get("fp8").encode(x)
    out = torch.empty_like(x)
    codec.decode(frame, out=out)
    err = (out.double() - x.double()).abs()
    bound = fp8_error_bound(x, out)
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (f"element {worst}: x={x.flatten()[worst].item()} "
                                        f"got {out.flatten()[worst].item()} bound {bound.flatten()[worst].item()}")
    assert len(frame) == FrameHeader.parse(frame).header_len + x.numel()  # one byte per element


def test_fp8_scales_are_per_page():
    # One page near 1e4, one near 1e-4: a shared scale would flush the small page to zero.
    x = torch.cat([torch.full((1, 64), 1e4), torch.linspace(1e-4, 2e-4, 64)[None]]).to(torch.float32)
    got = codec.decode(codec.get("fp8").encode(x), max_bytes=x.nbytes)
    assert torch.allclose(got[1], x[1], rtol=2 ** -4, atol=0)


def test_fp8_bf16_denormal_page_stays_within_bound():
    x = bf16_from_bits([1, 3, 0x7F, 0x8005]).view(1, -1)  # bf16 denormals
    out = codec.decode(codec.get("fp8").encode(x), max_bytes=x.nbytes)
    assert bool(((out.double() - x.double()).abs() <= fp8_error_bound(x, out)).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_fp8_refuses_non_finite_values(bad):
    x = torch.ones(3, 8, dtype=torch.bfloat16)
    x[2, 5] = bad
    with pytest.raises(CodecError, match="page 2"):
        codec.get("fp8").encode(x)


@pytest.mark.parametrize("x", [torch.arange(6, dtype=torch.int32), b"bytes"])
def test_fp8_refuses_non_float_input(x):
    with pytest.raises(CodecError, match="fp8 encodes"):
        codec.get("fp8").encode(x)


# ---- bad frames and bad out ------------------------------------------------------------------------------


def sample_frame(name: str) -> tuple[torch.Tensor, bytes]:
    x = fp8_input(torch.bfloat16, 5, 48, [0, 3, -2, 1, 0], 9)
    x[0, :24] = 1.0  # a compressible stretch, so compressed segments get corrupted too
    return x, codec.get(name).encode(x)


def sentinel_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, 7.0)


@pytest.mark.parametrize("name", codec.available())
def test_every_byte_flip_raises_or_decodes_the_original(name):
    """A flipped byte anywhere must never yield other bytes: a CodecError with ``out``
    untouched, or (where the flip hits bits the format ignores) the original result."""
    x, frame = sample_frame(name)
    original = codec.decode(frame, max_bytes=x.nbytes)
    raised = 0
    for i in range(len(frame)):
        damaged = bytearray(frame)
        damaged[i] ^= 0x5A
        out = sentinel_like(x)
        try:
            got = codec.decode(bytes(damaged), out=out)
        except CodecError:
            raised += 1
            assert same_bits(out, sentinel_like(x)), f"byte {i}: out was written before the error"
            continue
        assert same_bits(got, original), f"byte {i}: a corrupted frame decoded to other bytes"
    assert raised >= len(frame) * 0.9


@pytest.mark.parametrize("name", codec.available())
def test_truncated_and_extended_frames_raise(name):
    x, frame = sample_frame(name)
    for cut in list(range(0, 40)) + [len(frame) // 2, len(frame) - 1]:
        out = sentinel_like(x)
        with pytest.raises(CodecError):
            codec.decode(frame[:cut], out=out)
        assert same_bits(out, sentinel_like(x))
    with pytest.raises(CodecError, match="header says"):
        codec.decode(frame + b"\0")


def test_wrong_magic_and_version_are_named():
    frame = bytearray(codec.get("zstd").encode(torch.ones(4)))
    with pytest.raises(CodecError, match="magic"):
        codec.decode(b"XXXX" + bytes(frame[4:]))
    frame[4] = 99
    with pytest.raises(CodecError, match="version 99"):
        codec.decode(bytes(frame))


@pytest.mark.parametrize("name", ["none", "zstd", "lz4", "fp8"])
@pytest.mark.parametrize("out", [torch.zeros(4, 6, dtype=torch.float16), torch.zeros(6, 4, dtype=torch.bfloat16),
                                 torch.zeros(24, dtype=torch.bfloat16)], ids=["dtype", "shape", "flat"])
def test_wrong_out_raises_and_is_untouched(name, out):
    frame = codec.get(name).encode(torch.ones(4, 6, dtype=torch.bfloat16))
    before = out.clone()
    with pytest.raises(CodecError, match="out is"):
        codec.decode(frame, out=out)
    assert same_bits(out, before)


def test_decoding_into_a_new_tensor_needs_max_bytes():
    x = torch.ones(4, 6, dtype=torch.bfloat16)
    for name in codec.available():
        frame = codec.get(name).encode(x)
        with pytest.raises(CodecError, match="needs max_bytes"):
            codec.decode(frame)
        with pytest.raises(CodecError, match="non-negative int"):
            codec.decode(frame, max_bytes=-1)
        assert same_bits(codec.decode(frame, max_bytes=x.nbytes), codec.decode(frame, out=torch.empty_like(x)))


@pytest.mark.parametrize("name", codec.available())
def test_a_frame_claiming_more_than_max_bytes_is_refused(name):
    """A compression bomb (64 MiB of zeros in a few KiB) decodes only when the caller expects
    that many bytes; one byte less is a CodecError naming both sizes."""
    x = torch.zeros(64 << 20, dtype=torch.uint8) if name != "fp8" else torch.zeros(16 << 20, dtype=torch.float32)
    frame = codec.get(name).encode(x)
    with pytest.raises(CodecError, match=f"frame decodes to {x.nbytes} bytes .* more than max_bytes={x.nbytes - 1}"):
        codec.decode(frame, max_bytes=x.nbytes - 1)
    assert int(codec.decode(frame, max_bytes=x.nbytes).count_nonzero()) == 0


@pytest.mark.parametrize("name", codec.available())
def test_a_shape_claiming_2_to_the_62_bytes_is_a_codec_error(name):
    """A header that claims 2^62 decoded bytes (its CRC right, its body tiny): CodecError
    before any allocation, never MemoryError; into an ``out`` it is a shape mismatch."""
    c = codec.get(name)
    header = FrameHeader(c.codec_id, torch.float64, (1 << 59,), b"\0" * 12, 4, 0)
    frame = header.to_bytes() + b"\0" * 4
    with pytest.raises(CodecError, match=f"frame decodes to {1 << 62} bytes"):
        codec.decode(frame, max_bytes=1 << 30)
    with pytest.raises(CodecError, match="out is"):
        codec.decode(frame, out=torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize("name", LOSSLESS)
def test_a_bool_frame_holding_bytes_other_than_0_or_1_is_refused(name):
    """A frame relabelled from uint8 to bool (header and CRCs consistent) decodes only while
    every byte is 0 or 1: a bool tensor holding 2 is no bool tensor."""
    for values, valid in (([0, 1, 1, 0], True), ([0, 1, 2, 255], False)):
        frame = codec.get(name).encode(torch.tensor(values, dtype=torch.uint8))
        h = FrameHeader.parse(frame)
        relabelled = (FrameHeader(h.codec_id, torch.bool, h.shape, h.meta, h.body_len, h.content_crc).to_bytes()
                      + frame[h.header_len:])
        out = torch.zeros(4, dtype=torch.bool)
        if valid:
            assert codec.decode(relabelled, out=out).tolist() == [False, True, True, False]
            continue
        with pytest.raises(CodecError, match="bool element"):
            codec.decode(relabelled, out=out)
        assert not bool(out.any())


def test_a_codec_refuses_another_codecs_frame():
    frame = codec.get("lz4").encode(torch.ones(8))
    with pytest.raises(CodecError, match="not by 'zstd'"):
        codec.get("zstd").decode(frame)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(LOSSLESS), dtype=st.sampled_from(FLOATS), rows=st.integers(0, 300),
       kind=st.sampled_from(["random", "low_entropy", "specials"]), threads=st.integers(2, 5),
       seed=st.integers(0, 2 ** 32 - 1))
def test_threads_write_the_same_frame_and_read_it_back(name, dtype, rows, kind, threads, seed):
    x = make_content(kind, dtype, (rows, 64), seed)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lossless, "SEGMENT_BYTES", 1000)  # many segments per plane for the threads
        frame = codec.get(name).encode(x)
        assert codec.get(name, threads=threads).encode(x) == frame
    out = torch.empty_like(x)
    assert codec.get(name, threads=threads).decode(frame, out=out) is out
    assert same_bits(out, x)


def test_threaded_decode_of_a_damaged_segment_raises_and_leaves_out_untouched():
    x = make_content("low_entropy", torch.bfloat16, (4096, 64), 7)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lossless, "SEGMENT_BYTES", 4096)
        frame = bytearray(codec.get("zstd").encode(x))
    frame[-100] ^= 0xFF  # inside the last segment of the body
    out = torch.zeros_like(x)
    with pytest.raises(CodecError, match="corrupted frame"):
        codec.get("zstd", threads=3).decode(frame, out=out)
    assert not out.view(torch.uint8).any()


def test_threads_argument_is_checked():
    assert codec.get("zstd", threads=3) is codec.get("zstd", threads=3)  # one pool per thread count
    assert codec.get("zstd", threads=3).threads == 3 and codec.get("zstd").threads == 1
    with pytest.raises(ValueError, match="threads must be an int >= 1"):
        codec.get("lz4", threads=0)
    with pytest.raises(ValueError, match="threads=1 only"):
        codec.get("fp8", threads=2)


def test_registry():
    assert set(codec.available()) == {"none", "zstd", "lz4", "fp8"}
    assert all(codec.get(n).name == n for n in codec.available())
    assert codec.get(codec.DEFAULT_LOSSLESS).lossless and not codec.get("fp8").lossless
    with pytest.raises(ValueError, match="unknown codec 'brotli'"):
        codec.get("brotli")
    with pytest.raises(CodecError, match="cannot encode list"):
        codec.get("zstd").encode([1, 2, 3])
    with pytest.raises(CodecError, match="complex"):
        codec.get("zstd").encode(torch.zeros(2, dtype=torch.complex64))


# ---- across a TransferEngine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines():
    with TransferEngine(auth_token=TOKEN, timeout_s=10.0) as md, TransferEngine(auth_token=TOKEN, timeout_s=10.0) as p:
        yield p, p.connect(md.address), md


def random_pool(config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, seed: int) -> KVPool:
    """A KV pool full of random bit patterns (floats: NaN, inf and denormals included)."""
    pool = KVPool(config, num_pages, page_size, dtype=dtype)
    for i, plane in enumerate(pool.k_layers + pool.v_layers):
        plane.copy_(make_content("random", dtype, tuple(plane.shape), seed * 1000 + i))
    return pool


# (layers, query heads, kv heads, head_dim, page size, pages sent): page size 1, odd page
# counts, GQA ratios 1, 4 and 8, and MQA.
SHAPES = [(2, 8, 2, 64, 1, 7), (3, 4, 1, 32, 16, 13), (1, 8, 8, 16, 5, 1), (2, 16, 2, 128, 3, 9)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "L{}-H{}-KV{}-D{}-page{}-n{}".format(*s))
@pytest.mark.parametrize("name", LOSSLESS)
def test_loopback_lossless_kv_pages_arrive_bit_exact(engines, name, shape, dtype):
    p, peer, md = engines
    layers, heads, kv_heads, head_dim, page_size, sent = shape
    config = ModelConfig(num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                         hidden_size=heads * head_dim)
    src = random_pool(config, 2 * sent + 1, page_size, dtype, seed=sent)
    dst = KVPool(config, sent + 3, page_size, dtype=dtype)
    src_pages = torch.arange(2 * sent, 0, -2)  # scattered, out of order
    dst_pages = torch.arange(3, 3 + sent)
    packed = pddcore.pack(src.layout(), src_pages)
    rows = packed.view(dtype).view(layers * 2 * sent, -1)  # one row per page of each layer's K / V
    inbox, outbox = codec.Staging(md, packed.numel() + 4096, target=True), codec.Staging(p, packed.numel() + 4096)
    try:
        codec.send_compressed(p, peer, rows, name, inbox.descriptor(), key=b"req-1", staging=outbox).wait()
        [note] = md.poll_messages(timeout=10)
        landed = torch.empty_like(rows)
        key, got = codec.decode_notified(note, inbox, out=landed)
        assert key == b"req-1" and got is landed
        pddcore.unpack(dst.layout(), dst_pages, landed.view(-1).view(torch.uint8))
        for a, b in zip(src.k_layers + src.v_layers, dst.k_layers + dst.v_layers):
            assert torch.equal(bits(b).view(dst.num_pages, -1)[dst_pages], bits(a).view(src.num_pages, -1)[src_pages])
    finally:
        md.unregister(inbox.region)
        p.unregister(outbox.region)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_loopback_fp8_pages_arrive_within_bound(engines, dtype):
    p, peer, md = engines
    x = fp8_input(dtype, 13, 16 * 2 * 64, [(i * 5) % 11 - 5 for i in range(13)], 4)  # 13 pages of 16 tok x 2 x 64
    inbox, outbox = codec.Staging(md, 1 << 20, target=True), codec.Staging(p, 1 << 20)
    try:
        t = codec.send_compressed(p, peer, x, "fp8", inbox.descriptor(), key=b"fp8", staging=outbox, src_offset=64,
                                  dst_offset=4096)
        t.wait()
        assert t.nbytes < x.numel() * x.element_size() // 2 + 1024
        [note] = md.poll_messages(timeout=10)
        key, got = codec.decode_notified(note, inbox, max_bytes=x.nbytes)
        assert key == b"fp8" and got.dtype == dtype
        assert bool(((got.double() - x.double()).abs() <= fp8_error_bound(x, got)).all())
    finally:
        md.unregister(inbox.region)
        p.unregister(outbox.region)


def test_loopback_two_frames_in_one_staging_region(engines):
    p, peer, md = engines
    a, b = make_content("random", torch.bfloat16, (3, 100), 1), make_content("low_entropy", torch.float32, (7, 5), 2)
    inbox, outbox = codec.Staging(md, 1 << 16, target=True), codec.Staging(p, 1 << 16)
    try:
        sends = [codec.send_compressed(p, peer, a, "zstd", inbox.descriptor(), key=b"a", staging=outbox),
                 codec.send_compressed(p, peer, b, "lz4", inbox.descriptor(), key=b"b", staging=outbox,
                                       src_offset=30000, dst_offset=30000)]
        for s in sends:
            s.wait()
        notes = []
        while len(notes) < 2:
            notes += md.poll_messages(timeout=10)
        got = dict(codec.decode_notified(n, inbox, max_bytes=a.nbytes) for n in notes)
        assert same_bits(got[b"a"], a) and same_bits(got[b"b"], b)
    finally:
        md.unregister(inbox.region)
        p.unregister(outbox.region)


def test_frame_larger_than_staging_is_refused_before_sending(engines):
    p, peer, md = engines
    inbox, outbox = codec.Staging(md, 1024, target=True), codec.Staging(p, 1024)
    try:
        x = make_content("random", torch.float32, (1000,), 3)
        with pytest.raises(ValueError, match="outside the 1024-byte staging buffer"):
            codec.send_compressed(p, peer, x, "zstd", inbox.descriptor(), key=b"big", staging=outbox)
        assert md.poll_messages(timeout=0.2) == []
    finally:
        md.unregister(inbox.region)
        p.unregister(outbox.region)


def test_decode_notified_refuses_other_messages(engines):
    p, peer, md = engines
    inbox = codec.Staging(md, 4096, target=True)
    try:
        p.send(peer, b"a plain priority message")
        [msg] = md.poll_messages(timeout=10)
        with pytest.raises(CodecError, match="write notification"):
            codec.decode_notified(msg, inbox)
        forged = msg._replace(notification=True)
        with pytest.raises(CodecError, match="not a codec frame notice"):
            codec.decode_notified(forged, inbox)
        outside = forged._replace(payload=codec.FrameNotice(b"k", 4000, 200).to_bytes())
        with pytest.raises(CodecError, match="outside the staging buffer"):
            codec.decode_notified(outside, inbox)
    finally:
        md.unregister(inbox.region)


# ---- docs and the benchmark's harness -----------------------------------------------------------------------


@pytest.mark.parametrize("module", ["pddcore.codec", "pddcore.codec.stage"])
def test_docstring_example_runs(module):
    import importlib

    doc = importlib.import_module(module).__doc__
    example = doc.split("Example")[1].split("::", 1)[1]
    code = "\n".join(line[4:] for line in example.splitlines())
    assert "assert" in code or "=" in code, f"{module}'s example does nothing to run"
    namespace: dict = {}
    exec(compile(code, module, "exec"), namespace)  # the example's own asserts check its results
    assert set(namespace) - {"__builtins__"}, f"{module}'s example defined nothing"


def test_bench_greedy_harness_matches_generate_and_really_quantizes():
    from pddcore.benchmarks import codec_greedy, codec_kv
    from pddcore.model import generate

    model = Model.default(seed=0)
    prompts = [[(7 * i + 3) % 4096 for i in range(37)], [(11 * i + 1) % 4096 for i in range(16)]]
    runs = codec_greedy._decode_arms(model, prompts, [6, 3])
    for prompt, n, tokens in zip(prompts, [6, 3], runs):
        assert tokens["exact"] == generate(model, prompt, n)  # the exact arm is the demo's reference decode
        assert set(tokens) == {"exact", *codec_greedy.ROUNDTRIPS} and all(len(t) == n for t in tokens.values())
    pool = model.new_pool(8, codec_kv.PAGE_SIZE)
    exact = pool.new_sequence()
    model.prefill([exact], [prompts[0]])
    lossy = pool.allocate_sequence(len(prompts[0]))
    codec_greedy._roundtrip_copy(model, pool, exact, lossy, codec_greedy.ROUNDTRIPS["fp8"])
    per_page = model.config.num_layers * 2  # rows of one page: every layer's K and V
    rows = [pddcore.pack(pool.layout(), torch.tensor(s.pages)).view(torch.float64).view(per_page * len(s.pages), -1)
            for s in (exact, lossy)]
    assert not torch.equal(rows[0], rows[1])
    assert bool(((rows[1] - rows[0]).abs() <= fp8_error_bound(rows[0], rows[1])).all())


def test_bench_measure_reports_the_frames_it_made():
    from pddcore.benchmarks import codec_cases

    kv = make_content("low_entropy", torch.bfloat16, (12, 64), 8)
    points = codec_cases.measure("test", kv, repeats=1)
    cpus = len(os.sched_getaffinity(0))
    threaded = {codec_cases.threaded_name(cpus)} if cpus > 1 else set()
    assert {p.codec for p in points} == set(codec_cases.CODECS) | {codec_cases.INTERLEAVED} | threaded
    for p in points:
        assert p.raw_bytes == kv.numel() * 2 and p.encode_gbps > 0 and p.decode_gbps > 0 and p.memcpy_gbps > 0
        if p.codec in codec_cases.CODECS or p.codec in threaded:  # threads write zstd's frame
            assert p.frame_bytes == len(codec.get(p.codec.split(",")[0]).encode(kv))


def test_bench_checkpoint_kv_is_measured_when_a_folder_is_named(tmp_path, monkeypatch):
    import transformers

    from pddcore.benchmarks import codec_kv

    monkeypatch.delenv(codec_kv.CHECKPOINT_ENV, raising=False)
    assert codec_kv.checkpoint_kv(quick=True) == ({}, "skipped: no checkpoint (set PDDCORE_BENCH_CHECKPOINT "
                                                         "to a Hugging Face Llama / Qwen2 folder)")
    config = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "tiny-llama")
    monkeypatch.setenv(codec_kv.CHECKPOINT_ENV, str(tmp_path / "tiny-llama"))
    kv, skipped = codec_kv.checkpoint_kv(quick=True)
    assert skipped is None and list(kv) == ["tiny-llama bfloat16"]
    rows = kv["tiny-llama bfloat16"]
    context = codec_kv.documents(codec_kv.agentic_trace(), quick=True)[0]
    assert rows.dtype == torch.bfloat16 and rows.shape == (2 * 2 * -(-len(context) // 16), 16 * 2 * 16)


@pytest.mark.root
@pytest.mark.skipif(wan_unavailable() is not None, reason=f"WAN emulator: {wan_unavailable()}")
def test_bench_wan_frames_rebuild_md_pages_across_the_emulated_link():
    """The WAN phase of the codec bench at CI size: MD's pool pages hold exactly P's bytes
    after each lossless codec (and not after fp8: the comparison can tell), zstd puts
    fewer bytes than the raw bfloat16 KV on the wire, and every frame crossed the delay."""
    from pddcore.benchmarks import codec_cases, codec_wan
    from pddcore.benchmarks.runners import codec_wan_rows

    cfg = codec_wan.MODELS["embedded"]
    r = codec_wan.wan_case("200mbit", delay_ms=5, trials=2, config="embedded", dtype=torch.bfloat16,
                             document_tokens=64, handoff=100)
    assert [(p.payload, p.tokens, p.codec) for p in r.points] == [
        (payload, n, c) for payload, n in (("handoff", 100), ("document", 64)) for c in codec_cases.CODECS]
    for p in r.points:
        rows = cfg.num_layers * 2 * p.tokens // codec_wan.WAN_PAGE_SIZE  # one per page of a layer's K or V
        assert p.raw_bytes == p.tokens * 2 * cfg.num_layers * cfg.kv_size * 2
        assert len(p.end_to_end_ms) == len(p.rebuilt_equal) == 2
        assert min(p.wire_ms) >= r.rtt_ms / 2
        if p.codec == "fp8":  # the documented frame: prefix, 2-D shape, a float32 scale per row, CRC; a byte a value
            assert p.wire_bytes == 24 + 2 * 8 + 4 * rows + 4 + p.raw_bytes // 2
            assert not any(p.rebuilt_equal)
        else:
            assert all(p.rebuilt_equal), p.codec
        if p.codec == "none":
            assert p.wire_bytes == len(codec.get("none").encode(torch.zeros(rows, p.raw_bytes // rows // 2,
                                                                            dtype=torch.bfloat16)))
        if p.codec == "zstd":
            assert p.wire_bytes < p.raw_bytes
    assert "64-token document" in codec_wan.format_wan(r) and "exact" in codec_wan.format_wan(r)
    # pddcore bench's rows: each codec's median beside none's, none's beside the line rate.
    rows = {row.what: row for row in codec_wan_rows([r])}
    assert len(rows) == len(r.points)
    for p in r.points:
        row = rows[f"{p.codec}, {p.tokens}-token {p.payload}, 200Mbit/s 10ms"]
        none = next(q for q in r.points if q.payload == p.payload and q.codec == "none")
        floor = p.raw_bytes * 8 / 200e6 * 1e3 + 5
        assert row.value == pytest.approx(sum(p.end_to_end_ms) / 2)  # the median of two trials
        assert row.baseline == pytest.approx(floor if p.codec == "none" else sum(none.end_to_end_ms) / 2)
