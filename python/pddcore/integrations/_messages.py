"""The control messages an adapter's prefill and decode sides exchange (pull requests, page
registrations, chunk and completion notices, failures): how they are framed and checked.
Each adapter states its messages as one :class:`MessageSchema`.

A message is the adapter's magic prefix followed by a JSON object: the kind under ``"k"``,
the request it concerns under the adapter's key field (vLLM: ``"req"``, a str; SGLang:
``"room"``, an int) and the fields of that kind. Each adapter has its own magic, so neither
takes the other's messages for its own. Everything a peer sends is checked against the
kind's fields on receipt: a message that does not fit raises :class:`MalformedMessage`,
which carries the request's key whenever it could be read, so the receiver fails only
that request.

Example::

    schema = MessageSchema(b"PDDX1", "example", key="req", key_check=is_str, kinds={"done": {"src": is_int}})
    schema.encode("done", req="r-1", src=0)       # b'PDDX1{"k": "done", "req": "r-1", "src": 0}'
    schema.decode(b'PDDX1{"k": "done", "req": "r-1", "src": 0}')    # {'k': 'done', 'req': 'r-1', 'src': 0}
    schema.decode(b'PDDX1{"k": "done", "req": "r-1"}')
    # MalformedMessage: 'done' message with missing or mistyped src   (its .key is "r-1")
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MessageSchema", "MalformedMessage", "is_int", "is_str", "is_bool", "is_hex", "is_head_range"]

Check = Callable[[Any], bool]


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_str(value: Any) -> bool:
    return isinstance(value, str)


def is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def is_hex(value: Any) -> bool:
    """A non-empty hex string (a registered region's descriptor)."""
    try:
        return isinstance(value, str) and bool(bytes.fromhex(value))
    except ValueError:
        return False


def is_head_range(value: Any) -> bool:
    """None (every head) or ``[h0, h1]``, a half-open range of local KV heads."""
    return value is None or (isinstance(value, list) and len(value) == 2 and all(map(is_int, value)))


class MalformedMessage(ValueError):
    """A message that does not follow its schema; ``key`` names its request when it could be read."""

    def __init__(self, reason: str, key: Any = None):
        super().__init__(reason)
        self.key = key


@dataclass(frozen=True)
class MessageSchema:
    """One adapter's messages: its ``magic``, a ``name`` for errors and logs, the ``key``
    field every message carries (checked by ``key_check``) and, per kind, its other fields
    with their checks."""

    magic: bytes
    name: str
    key: str
    key_check: Check
    kinds: Mapping[str, Mapping[str, Check]]

    def encode(self, kind: str, **fields: Any) -> bytes:
        """The message; unchecked, since only :meth:`decode` meets what a peer sent."""
        return self.magic + json.dumps({"k": kind, **fields}).encode()

    def decode(self, payload: bytes) -> dict:
        """The message in ``payload`` once every field is checked; raises :class:`MalformedMessage`."""
        if not payload.startswith(self.magic):
            raise MalformedMessage(f"not a {self.name} message")
        try:
            msg = json.loads(payload[len(self.magic):])
        except ValueError as exc:  # bad UTF-8 or bad JSON
            raise MalformedMessage(f"bad JSON: {exc}") from None
        if not isinstance(msg, dict) or not self.key_check(msg.get(self.key)):
            raise MalformedMessage(f"no valid {self.key!r} in {str(msg)[:200]}")
        key, fields = msg[self.key], self.kinds.get(msg.get("k"))
        if fields is None:
            raise MalformedMessage(f"unknown message kind {msg.get('k')!r}", key)
        bad = [name for name, check in fields.items() if name not in msg or not check(msg[name])]
        if bad:
            raise MalformedMessage(f"{msg['k']!r} message with missing or mistyped {', '.join(bad)}", key)
        return msg
