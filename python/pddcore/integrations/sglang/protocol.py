"""The control messages between the decode and prefill ranks of one request (each names it
by its ``room``, SGLang's ``bootstrap_room``):

* ``reg`` (decode rank -> each prefill rank it needs): its rank ``d_rank`` and TP size
  ``d_tp``; the staging region (``region``, hex descriptor) and, in it, this prefill rank's
  segment (``offset``, ``seg_bytes``) for ``num_pages`` pages of the prefill's local heads
  ``src_heads`` (None: all); where the aux item goes (``aux_offset``, -1: nowhere) and which
  one (``aux_index``); the decode side's ``decode_prefix_len``;
* ``unread`` (MLA, decode rank -> a prefill rank no decode rank reads, when the prefill TP is
  the larger): decode rank ``d_rank`` of TP ``d_tp`` reads the one latent from another prefill
  rank; this one sends nothing for the room, and takes its ``num_pages`` and
  ``decode_prefix_len`` from here so that every prefill rank schedules the request alike (as
  SGLang's own backends' dummy registrations);
* ``chunk`` (prefill -> decode, the write notification): chunk ``idx`` of prefill rank
  ``src`` landed, ``last`` when it was the request's final one;
* ``fail`` (either way): the request failed for ``reason``.

Example::

    MESSAGES.encode("fail", room=7, reason="aborted")   # b'PDDSGL1{"k": "fail", "room": 7, "reason": "aborted"}'
"""

from __future__ import annotations

from dataclasses import dataclass

from .._messages import MessageSchema, is_bool, is_head_range, is_hex, is_int, is_str

__all__ = ["MAGIC", "MESSAGES", "Registration", "Unread"]

MAGIC = b"PDDSGL1"
MESSAGES = MessageSchema(MAGIC, "pddcore SGLang", key="room", key_check=is_int, kinds={
    "reg": {"d_rank": is_int, "d_tp": is_int, "region": is_hex, "offset": is_int, "seg_bytes": is_int,
            "num_pages": is_int, "src_heads": is_head_range, "aux_offset": is_int, "aux_index": is_int,
            "decode_prefix_len": is_int},
    "unread": {"d_rank": is_int, "d_tp": is_int, "num_pages": is_int, "decode_prefix_len": is_int},
    "fail": {"reason": is_str},
    "chunk": {"src": is_int, "idx": is_int, "last": is_bool},
})


@dataclass
class Registration:
    """A decode rank's ``reg``: its request for one prefill rank's share of a room."""

    peer_address: str
    d_rank: int
    d_tp: int
    region: bytes
    offset: int
    seg_bytes: int
    num_pages: int
    src_heads: tuple[int, int] | None
    aux_offset: int
    aux_index: int
    decode_prefix_len: int

    @classmethod
    def from_message(cls, peer_address: str, msg: dict) -> "Registration":
        return cls(peer_address, msg["d_rank"], msg["d_tp"], bytes.fromhex(msg["region"]), msg["offset"],
                   msg["seg_bytes"], msg["num_pages"], tuple(msg["src_heads"]) if msg["src_heads"] else None,
                   msg["aux_offset"], msg["aux_index"], msg["decode_prefix_len"])


@dataclass
class Unread:
    """A decode rank's ``unread``: this prefill rank sends nothing for the room."""

    d_rank: int
    d_tp: int
    num_pages: int
    decode_prefix_len: int

    @classmethod
    def from_message(cls, msg: dict) -> "Unread":
        return cls(msg["d_rank"], msg["d_tp"], msg["num_pages"], msg["decode_prefix_len"])
