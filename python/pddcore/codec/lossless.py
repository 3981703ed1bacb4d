"""Lossless codecs: a byte-plane split, then a general-purpose compressor per plane.

A float's bytes are far from equally compressible: in bfloat16 KV the high byte (sign and
7 exponent bits) takes few distinct values, the low byte (mantissa) is close to noise.
Kept interleaved, a compressor sees mostly noise; split into planes (byte ``b`` of every
element, one plane per byte position), the exponent plane shrinks and the mantissa plane
is stored as it is (``pddcore bench --cases codec`` shows both ways side by side).
Every dtype is split into all of its byte planes (2 for float16 / bfloat16, 4 for
float32, 8 for float64, 1 for bytes), in memory order (little-endian: the last plane
holds the sign and exponent bits).

Each plane is cut into segments of at most ``SEGMENT_BYTES``; a segment is compressed or,
when that would not make it smaller, stored. A plane whose sample does not shrink by
``1 / MIN_GAIN_DIVISOR`` is stored whole without trying (saves the compressor's time on
mantissa noise). The frame's meta lists ``segment_bytes`` and, per segment, plane-major,
``(method u8, length u64)``; its content CRC covers the decoded tensor's bytes.

Codecs: ``"zstd"`` (zstandard level 1, the default lossless codec), ``"lz4"`` (LZ4 block),
``"none"`` (no split, stored: the frame and its CRC around the raw bytes).

Segments are independent, so ``codec.get("zstd", threads=4)`` compresses and expands them
on four threads (both libraries release the GIL); the frame is the same byte for byte.

Example::

    import torch
    from pddcore import codec

    kv = torch.randn(64, 16, 8, 128).to(torch.bfloat16)   # [pages, tokens, heads, head_dim]
    frame = codec.get("zstd").encode(kv)                   # bytes: a self-describing frame
    out = torch.empty_like(kv)
    codec.decode(frame, out)                               # bit-identical to kv
"""

from __future__ import annotations

import itertools
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import lz4.block
import numpy as np
import torch
import zstandard

from .base import Codec
from .frame import CodecError, FrameHeader, crc32c_of, element_size, read_source, tensor_of, write_out

__all__ = ["BytePlaneCodec", "SEGMENT_BYTES"]

# 1 MiB: the same ratio as 4 MiB on the embedded model's bf16 KV, and faster even on one
# thread (a segment's planes stay in cache between the split and the compressor).
SEGMENT_BYTES = 1 << 20
MIN_GAIN_DIVISOR = 16
_SAMPLES, _SAMPLE_BYTES = 4, 16 << 10
_STORED, _COMPRESSED = 0, 1
_ENTRY = struct.Struct("<BQ")
_SEGMENT_SIZE = struct.Struct("<Q")


class _Zstd:
    """zstandard at level 1, its fastest regular level: on an exponent plane the Huffman
    coding of literals does the work, which every level has; higher levels only search
    longer for repeats."""

    def __init__(self, level: int = 1):
        self.level = level
        self._local = threading.local()  # zstandard contexts must not be shared between threads

    def _contexts(self) -> tuple[Any, Any]:
        if not hasattr(self._local, "contexts"):
            self._local.contexts = (zstandard.ZstdCompressor(level=self.level), zstandard.ZstdDecompressor())
        return self._local.contexts

    def compress(self, data: np.ndarray) -> bytes:
        return self._contexts()[0].compress(data)

    def decompress(self, data: memoryview, nbytes: int) -> bytes:
        return self._contexts()[1].decompress(data, max_output_size=nbytes)


class _Lz4:
    """LZ4 block format (the frame records sizes, so no LZ4 frame header is needed)."""

    def compress(self, data: np.ndarray) -> bytes:
        return lz4.block.compress(data, store_size=False)

    def decompress(self, data: memoryview, nbytes: int) -> bytes:
        return lz4.block.decompress(data, uncompressed_size=nbytes)


class BytePlaneCodec(Codec):
    """Byte planes + ``compressor`` (None: no split, every segment stored), its segments
    coded on ``threads`` threads."""

    lossless = True

    def __init__(self, name: str, codec_id: int, compressor: _Zstd | _Lz4 | None, threads: int = 1):
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        self.name = name
        self.codec_id = codec_id
        self.threads = threads
        self._compressor = compressor
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._variants: dict[int, BytePlaneCodec] = {threads: self}

    def with_threads(self, threads: int) -> "BytePlaneCodec":
        """The same codec coding its segments on ``threads`` threads (one instance, and one
        thread pool, per thread count)."""
        with self._pool_lock:
            if threads not in self._variants:
                self._variants[threads] = BytePlaneCodec(self.name, self.codec_id, self._compressor, threads)
            return self._variants[threads]

    def _map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """``[fn(x) for x in items]``, on the codec's threads when it has several."""
        if self.threads == 1 or len(items) < 2:
            return [fn(x) for x in items]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=f"pddcore-{self.name}")
        return list(self._pool.map(fn, items))

    def _plane_count(self, dtype: torch.dtype) -> int:
        return element_size(dtype) if self._compressor is not None else 1

    def encode(self, data: Any) -> bytes:
        src = read_source(data)
        num_planes = self._plane_count(src.dtype)
        elements = src.raw.reshape(-1, num_planes)  # column b: byte b of every element (a plane)
        try_planes = [self._worth_compressing(elements[:, b]) for b in range(num_planes)]
        ranges = [(start, min(start + SEGMENT_BYTES, len(elements))) for start in range(0, len(elements), SEGMENT_BYTES)]

        def code(span: tuple[int, int]) -> list[tuple[int, Any]]:
            # One element range of every plane: splitting it is part of the job a thread takes.
            planes = np.ascontiguousarray(elements[span[0]:span[1]].T)
            return [self._pack(plane, try_it) for plane, try_it in zip(planes, try_planes)]

        coded = self._map(code, ranges)
        segments = [coded[k][b] for b in range(num_planes) for k in range(len(ranges))]  # plane-major
        entries = [(method, len(piece) if method == _COMPRESSED else piece.size) for method, piece in segments]
        meta = _SEGMENT_SIZE.pack(SEGMENT_BYTES) + b"".join(_ENTRY.pack(*e) for e in entries)
        body_len = sum(length for _, length in entries)
        header = FrameHeader(self.codec_id, src.dtype, src.shape, meta, body_len, crc32c_of(src.raw))
        return b"".join([header.to_bytes(), *(piece for _, piece in segments)])

    def _pack(self, segment: np.ndarray, try_it: bool) -> tuple[int, Any]:
        """``(method, bytes)`` of one segment: compressed, or stored when that is not smaller."""
        compressed = self._compressor.compress(segment) if try_it else None
        if compressed is None or len(compressed) >= segment.size:
            return _STORED, segment
        return _COMPRESSED, compressed

    def _worth_compressing(self, plane: np.ndarray) -> bool:
        if self._compressor is None:
            return False
        if plane.size <= _SAMPLES * _SAMPLE_BYTES:
            return True
        step = plane.size // _SAMPLES
        sample = np.concatenate([plane[i * step:i * step + _SAMPLE_BYTES] for i in range(_SAMPLES)])
        return len(self._compressor.compress(sample)) <= sample.size * (1 - 1 / MIN_GAIN_DIVISOR)

    def _decode(self, header: FrameHeader, body: memoryview, out: torch.Tensor | None) -> torch.Tensor:
        num_planes = self._plane_count(header.dtype)
        plane_bytes = header.nbytes // num_planes
        segment_bytes, entries = self._read_meta(header, num_planes, plane_bytes)
        per_plane = len(entries) // num_planes
        # Each segment lands straight in its byte column: merging the planes costs no extra pass.
        columns = np.empty((plane_bytes, num_planes), dtype=np.uint8)
        offsets = list(itertools.accumulate((length for _, length in entries), initial=0))

        def expand(i: int) -> None:
            method, length = entries[i]
            plane, index = divmod(i, per_plane)
            start = index * segment_bytes
            size = min(segment_bytes, plane_bytes - start)
            segment = self._expand(method, body[offsets[i]:offsets[i] + length], size)
            columns[start:start + size, plane] = np.frombuffer(segment, dtype=np.uint8)

        self._map(expand, range(len(entries)))
        merged = columns.reshape(-1)
        if crc32c_of(merged) != header.content_crc:
            raise CodecError("corrupted frame: the decoded bytes fail their CRC32C")
        if header.dtype == torch.bool and merged.size and int(merged.max()) > 1:
            raise CodecError("corrupted frame: a bool element holds a byte other than 0 or 1")
        return write_out(tensor_of(merged, header.dtype, header.shape), out)

    def _expand(self, method: int, chunk: memoryview, size: int) -> bytes | memoryview:
        if method == _STORED:
            if len(chunk) != size:
                raise CodecError(f"corrupted frame: a stored segment of {len(chunk)} bytes, expected {size}")
            return chunk
        try:
            data = self._compressor.decompress(chunk, size)
        except Exception as e:  # each library raises its own error type on a damaged stream
            raise CodecError(f"corrupted frame: {self.name} could not decompress a segment ({e})") from e
        if len(data) != size:
            raise CodecError(f"corrupted frame: a segment decompressed to {len(data)} bytes, expected {size}")
        return data

    def _read_meta(self, header: FrameHeader, num_planes: int, plane_bytes: int) -> tuple[int, list[tuple[int, int]]]:
        """``(segment_bytes, [(method, length)] plane-major)``, checked against the header."""
        if len(header.meta) < _SEGMENT_SIZE.size:
            raise CodecError("corrupted frame: no segment table")
        (segment_bytes,) = _SEGMENT_SIZE.unpack_from(header.meta)
        if segment_bytes == 0:
            raise CodecError("corrupted frame: segment size 0")
        count = num_planes * -(-plane_bytes // segment_bytes)
        if len(header.meta) != _SEGMENT_SIZE.size + count * _ENTRY.size:
            raise CodecError(f"corrupted frame: segment table of {len(header.meta)} bytes for {count} segments")
        entries = list(_ENTRY.iter_unpack(header.meta[_SEGMENT_SIZE.size:]))
        allowed = (_STORED,) if self._compressor is None else (_STORED, _COMPRESSED)
        if any(method not in allowed for method, _ in entries):
            raise CodecError("corrupted frame: unknown segment method")
        if sum(length for _, length in entries) != header.body_len:
            raise CodecError("corrupted frame: segment lengths do not add up to the body")
        return segment_bytes, entries
