"""`pddcore.codec`: fewer KV bytes on the WAN. Never on by itself: a caller picks a codec
by name, and the default everywhere in pddcore stays ``"none"``.

Codecs (:func:`available`):

* ``"none"`` — the raw bytes in a frame with a CRC32C (the baseline).
* ``"zstd"`` — lossless: byte-plane split, then zstandard level 1 per plane. The default
  lossless codec (:data:`DEFAULT_LOSSLESS`): on real bfloat16 and float16 KV it sends
  fewer bytes than ``"lz4"`` at about the same encode speed, because zstandard
  entropy-codes the exponent plane and LZ4 only finds repeats
  (``pddcore bench --cases codec`` measures both, ratio and GB/s).
* ``"lz4"`` — lossless: the same split, then LZ4 block: a lower ratio, a faster decoder.
* ``"fp8"`` — lossy, opt-in: FP8 E4M3 with one scale per page (dim 0), decoded into the
  frame's dtype; each element within 2^-4 of its page's amax. See :mod:`.fp8`.

Each frame is self-describing (magic, codec id, version, dtype, shape, segment lengths or
scales, CRC32C; see :mod:`.frame`): :func:`decode` needs nothing else, and a truncated,
corrupted or foreign frame raises :class:`CodecError` instead of yielding wrong bytes.
Decoding into a new tensor takes ``max_bytes``, the most the caller expects: a header's
claim beyond it is refused before anything is allocated.
:func:`send_compressed` / :func:`decode_notified` move frames between
:class:`pddcore.TransferEngine` peers through registered staging regions.

Example::

    import torch
    from pddcore import codec

    kv = torch.randn(37, 16, 2, 64).to(torch.bfloat16)     # [pages, tokens, kv heads, head_dim]
    frame = codec.get(codec.DEFAULT_LOSSLESS).encode(kv)   # bytes
    assert torch.equal(codec.decode(frame, max_bytes=kv.nbytes), kv)   # bit-exact
    out = torch.empty_like(kv)
    codec.decode(codec.get("fp8").encode(kv), out=out)     # approximately kv
"""

from .base import Codec
from .frame import CodecError
from .registry import DEFAULT_LOSSLESS, available, decode, get
from .stage import FrameNotice, Staging, decode_notified, send_compressed

__all__ = ["Codec", "CodecError", "get", "available", "decode", "DEFAULT_LOSSLESS",
           "Staging", "FrameNotice", "send_compressed", "decode_notified"]
