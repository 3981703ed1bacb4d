"""Messages the roles exchange over the TransferEngine lanes (besides the handoffs).

* ``KV``: the notification of P's KV write (reaches the receiver only once every byte
  was verified and applied): which request, where the packed pages lie in the staging
  region, and the first output token P sampled.
* ``READY``: MD tells RLD it holds a request's prompt KV (handoffs may start).
* ``NACK``: MD rejected a malformed message from RLD (its request id cannot be trusted,
  so RLD re-sends every handoff MD has not confirmed).

Handoffs travel as raw :class:`pddcore.handoff.Handoff` bytes (magic ``PDDH``); every
other tag is 4 bytes followed by JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from ..transfer import Message

__all__ = ["KvReady", "encode_kv", "encode_ready", "encode_nack", "parse"]

_KV, _READY, _NACK = b"PKV1", b"PRDY", b"PNAK"


@dataclass(frozen=True)
class KvReady:
    """P's KV for ``rid`` landed at ``[offset, offset + nbytes)`` of the staging region:
    the pages of context tokens ``[first_token, context_len)`` (``first_token`` is the
    receiver's cached prefix, page-aligned). ``token`` is output token number
    ``out_index``, sampled by P from the prefill logits; the request stops after
    ``max_new_tokens`` output tokens (or an EOS token) and samples with ``seed``.
    ``streamed``: the pages came as a layer stream keyed by ``rid`` during prefill, and this
    note is the notification of the commit written after it (:mod:`.kv_arrivals`)."""

    rid: str
    context_len: int
    first_token: int
    offset: int
    nbytes: int
    token: int
    out_index: int
    pipeline: str
    max_new_tokens: int
    seed: int
    streamed: bool = False


def encode_kv(msg: KvReady) -> bytes:
    return _KV + json.dumps(asdict(msg)).encode()


def encode_ready(rid: str) -> bytes:
    return _READY + rid.encode()


def encode_nack(reason: str) -> bytes:
    return _NACK + reason.encode()


def parse(message: Message) -> tuple[str, object]:
    """("kv", KvReady) | ("ready", rid) | ("nack", reason) | ("handoff", raw bytes) |
    ("forged", reason): anything without a known tag is treated as a handoff and left to its
    own decoder to judge. A KV-ready counts only as the notification of the write that
    carried the KV: sent as a plain message it claims bytes that never landed."""
    payload = message.payload
    tag, body = payload[:4], payload[4:]
    if tag == _KV:
        if not message.notification:
            return "forged", f"a KV-ready from {message.sender} that is no write notification"
        return "kv", KvReady(**json.loads(body))
    if tag == _READY:
        return "ready", body.decode()
    if tag == _NACK:
        return "nack", body.decode(errors="replace")
    return "handoff", payload
