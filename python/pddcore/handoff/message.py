"""The handoff message on the wire: :class:`Handoff` (the token ids RLD sends MD, with
its flags and :class:`SamplerState`) and the varints it is made of.

Wire format (version 1, little-endian)::

    offset  size  field
    0       4     magic b"PDDH"
    4       1     version (1)
    5       1     flags: bit 0 FINAL, bit 1 sampler state present; others reserved (0)
    6       4     body length in bytes (u32)
    10      n     body
    10+n    4     CRC32C of bytes [0, 10+n)

    body = varint len(request_id) | request_id (UTF-8) | varint seq | varint start_pos
           | varint count | count x varint token id
           | [varint seed | varint rng_offset | varint num_generated]   (if bit 1)

Varints are unsigned LEB128 (canonical: no overlong forms). Token ids are sent as plain
varints, not deltas: generated text is not sorted, so zig-zag deltas of neighbouring ids
are about twice as large as the ids themselves, while BPE vocabularies give the frequent
tokens small ids (1-2 bytes). Any id below 2**21 takes at most 3 bytes, so 100 tokens of
any vocabulary up to 2M entries, a request id of up to 64 bytes and a sampler state fit
in 512 bytes (the PDD report's payload was 1.5 KB).

Example::

    msg = Handoff("req-7", seq=0, start_pos=4096, token_ids=[11, 42, 7], flags=FINAL)
    data = msg.encode()                     # 27 bytes on the priority lane
    assert Handoff.decode(data) == msg
"""

from __future__ import annotations

import enum
import operator
import struct
from dataclasses import dataclass
from typing import Iterable

from .. import _C

__all__ = ["FINAL", "HandoffFlag", "HandoffError", "SamplerState", "Handoff"]

MAGIC = b"PDDH"
VERSION = 1
_HEADER = struct.Struct("<4sBBI")
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size
TRAILER_BYTES = _CRC.size

MAX_REQUEST_ID_BYTES = 256
MAX_TOKENS = 1 << 20  # far above any handoff; bounds what a corrupt count can make us allocate
_TOKEN_LIMIT = 1 << 32
_U63 = 1 << 63
_U64 = 1 << 64
_SAMPLER_BIT = 0x02


class HandoffError(ValueError):
    """A handoff message or sequence is malformed, inconsistent or not for this request."""


class HandoffFlag(enum.IntFlag):
    """Public flags of a :class:`Handoff`."""

    FINAL = 0x01  # RLD stops after this batch; MD owns the output from here on


FINAL = HandoffFlag.FINAL


@dataclass(frozen=True)
class SamplerState:
    """What MD needs to continue sampling exactly where RLD stopped.

    ``seed``: the request's sampling seed (u64). ``rng_offset``: random draws already
    consumed (e.g. the Philox offset), so MD's next draw is RLD's next draw.
    ``num_generated``: output tokens counted toward stop conditions (``max_tokens``,
    ``min_tokens``), including the ones carried by this handoff.
    """

    seed: int
    rng_offset: int
    num_generated: int

    def __post_init__(self):
        _check_uint("seed", self.seed, _U64)
        _check_uint("rng_offset", self.rng_offset, _U63)
        _check_uint("num_generated", self.num_generated, _U63)


@dataclass(frozen=True)
class Handoff:
    """One handoff message: the tokens RLD generated at positions
    ``[start_pos, start_pos + len(token_ids))`` of request ``request_id``.

    ``seq`` numbers the messages of one request (0, 1, ...); ``flags`` is 0 for a
    catch-up batch (RLD keeps decoding) or :data:`FINAL` (RLD has stopped; this is the
    last batch). ``sampler_state`` travels at least with the final message.
    """

    request_id: str
    seq: int
    start_pos: int
    token_ids: tuple[int, ...]
    flags: int = 0
    sampler_state: SamplerState | None = None

    def __post_init__(self):
        if not isinstance(self.request_id, str):
            raise HandoffError(f"request_id must be a str, got {type(self.request_id).__name__}")
        rid_bytes = len(self.request_id.encode("utf-8", "surrogatepass"))
        if not 0 < rid_bytes <= MAX_REQUEST_ID_BYTES:
            raise HandoffError(f"request_id must be 1..{MAX_REQUEST_ID_BYTES} UTF-8 bytes, got {rid_bytes}")
        _check_uint("seq", self.seq, _U63)
        _check_uint("start_pos", self.start_pos, _U63)
        try:
            tokens = tuple(map(operator.index, self.token_ids))
        except TypeError as e:
            raise HandoffError(f"token_ids must be a sequence of integers: {e}") from None
        if len(tokens) > MAX_TOKENS:
            raise HandoffError(f"{len(tokens)} tokens exceed the limit of {MAX_TOKENS} per message")
        if tokens and not (0 <= min(tokens) and max(tokens) < _TOKEN_LIMIT):
            bad = next(i for i, t in enumerate(tokens) if not 0 <= t < _TOKEN_LIMIT)
            raise HandoffError(f"token_ids[{bad}] = {tokens[bad]} is outside [0, 2**32)")
        object.__setattr__(self, "token_ids", tokens)
        if type(self.flags) is not int and not isinstance(self.flags, HandoffFlag):
            raise HandoffError(f"flags must be an int, got {type(self.flags).__name__}")
        if self.flags & ~int(HandoffFlag.FINAL):
            raise HandoffError(f"flags={self.flags:#x} has bits other than FINAL set")
        object.__setattr__(self, "flags", HandoffFlag(self.flags))
        if self.sampler_state is not None and not isinstance(self.sampler_state, SamplerState):
            raise HandoffError(f"sampler_state must be a SamplerState or None, got {type(self.sampler_state).__name__}")

    @property
    def final(self) -> bool:
        return bool(self.flags & HandoffFlag.FINAL)

    @property
    def end_pos(self) -> int:
        """Position just past the last carried token."""
        return self.start_pos + len(self.token_ids)

    def encode(self) -> bytes:
        """The message in wire format version 1 (see the module docstring)."""
        body = bytearray()
        rid = self.request_id.encode("utf-8")
        _put_varints(body, (len(rid),))
        body += rid
        _put_varints(body, (self.seq, self.start_pos, len(self.token_ids)))
        _put_varints(body, self.token_ids)
        wire_flags = int(self.flags)
        if self.sampler_state is not None:
            wire_flags |= _SAMPLER_BIT
            s = self.sampler_state
            _put_varints(body, (s.seed, s.rng_offset, s.num_generated))
        msg = bytearray(_HEADER.pack(MAGIC, VERSION, wire_flags, len(body)))
        msg += body
        msg += _CRC.pack(_C.crc32c(bytes(msg)))
        return bytes(msg)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> "Handoff":
        """Parses one whole message; raises :class:`HandoffError` naming the first problem."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise HandoffError(f"expected bytes, got {type(data).__name__}")
        buf = bytes(data)
        if len(buf) < HEADER_BYTES + TRAILER_BYTES:
            raise HandoffError(f"message is {len(buf)} bytes, shorter than the "
                               f"{HEADER_BYTES + TRAILER_BYTES}-byte header and checksum")
        magic, version, wire_flags, body_len = _HEADER.unpack_from(buf)
        if magic != MAGIC:
            raise HandoffError(f"bad magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise HandoffError(f"unsupported handoff version {version}, this build reads {VERSION}")
        if wire_flags & ~(int(HandoffFlag.FINAL) | _SAMPLER_BIT):
            raise HandoffError(f"reserved flag bits set: {wire_flags:#04x}")
        expected = HEADER_BYTES + body_len + TRAILER_BYTES
        if len(buf) != expected:
            raise HandoffError(f"length field says {expected} bytes in all, got {len(buf)} "
                               f"({'truncated' if len(buf) < expected else 'trailing bytes'})")
        (crc,) = _CRC.unpack_from(buf, HEADER_BYTES + body_len)
        actual = _C.crc32c(buf[: HEADER_BYTES + body_len])
        if crc != actual:
            raise HandoffError(f"CRC32C mismatch: message says {crc:#010x}, content gives {actual:#010x}")

        reader = _Reader(buf, HEADER_BYTES, HEADER_BYTES + body_len)
        rid_len = reader.varint("request_id length")
        if not 0 < rid_len <= MAX_REQUEST_ID_BYTES:
            raise HandoffError(f"request_id length {rid_len} is outside 1..{MAX_REQUEST_ID_BYTES}")
        try:
            request_id = reader.take(rid_len, "request_id").decode("utf-8")
        except UnicodeDecodeError as e:
            raise HandoffError(f"request_id is not valid UTF-8: {e}") from None
        seq = reader.varint("seq", _U63)
        start_pos = reader.varint("start_pos", _U63)
        count = reader.varint("token count", MAX_TOKENS + 1)
        if count > reader.remaining:  # each token takes at least one byte
            raise HandoffError(f"token count {count} exceeds the {reader.remaining} body bytes left")
        tokens = reader.varints(count, "token id", _TOKEN_LIMIT)
        sampler = None
        if wire_flags & _SAMPLER_BIT:
            sampler = SamplerState(reader.varint("seed", _U64), reader.varint("rng_offset", _U63),
                                   reader.varint("num_generated", _U63))
        if reader.remaining:
            raise HandoffError(f"{reader.remaining} unexpected bytes after the last field")
        return cls(request_id, seq, start_pos, tokens, wire_flags & int(HandoffFlag.FINAL), sampler)


def _check_uint(name: str, value: int, limit: int) -> None:
    if type(value) is not int or not 0 <= value < limit:
        raise HandoffError(f"{name} must be an integer in [0, 2**{limit.bit_length() - 1}), got {value!r}")


def _put_varints(out: bytearray, values: Iterable[int]) -> None:
    append = out.append
    for value in values:
        while value >= 0x80:
            append((value & 0x7F) | 0x80)
            value >>= 7
        append(value)


class _Reader:
    """Bounds-checked cursor over a message body."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: bytes, pos: int, end: int):
        self.buf, self.pos, self.end = buf, pos, end

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.remaining:
            raise HandoffError(f"{what} needs {n} bytes, only {self.remaining} left in the body")
        out = self.buf[self.pos: self.pos + n]
        self.pos += n
        return out

    def varint(self, what: str, limit: int = _U64) -> int:
        return self.varints(1, what, limit)[0]

    def varints(self, count: int, what: str, limit: int = _U64) -> list[int]:
        """``count`` canonical LEB128 values below ``limit``; one tight loop, since the
        token ids are most of a message."""
        buf, pos, end = self.buf, self.pos, self.end
        out: list[int] = []
        value = shift = 0
        while len(out) < count:
            if pos >= end:
                raise HandoffError(f"{what}: varint runs past the end of the body")
            byte = buf[pos]
            pos += 1
            if byte & 0x80:
                value |= (byte & 0x7F) << shift
                shift += 7
                if shift >= 70:
                    raise HandoffError(f"{what}: varint longer than 10 bytes")
                continue
            if byte == 0 and shift:
                raise HandoffError(f"{what}: overlong varint encoding")
            value |= byte << shift
            if value >= limit:
                raise HandoffError(f"{what} = {value} is out of range (limit {limit})")
            out.append(value)
            value = shift = 0
        self.pos = pos
        return out
