"""Joins a request's streamed KV with its KV-ready note at RLD and MD.

P streams a request's KV layer by layer during prefill (:mod:`pddcore.streaming`, keyed by
the request id) and, once it sampled the first token, writes a small commit whose
notification is the :class:`~.wire.KvReady` note (``streamed=True``). Each layer's
notification and the note arrive in any order; the note is handed on only once every
layer of that request from that sender landed, so a receiver never reads a layer that is
still on the wire. A note of an unstreamed send (``streamed=False``) passes at once.
"""

from __future__ import annotations

import time

from ..streaming import LayerStreamReceiver
from ..transfer import Message
from . import wire

__all__ = ["KvArrivals"]


class KvArrivals:
    """Feed every lane message through :meth:`feed`; it returns the messages to handle now."""

    def __init__(self, expire_s: float = 600.0):
        self._streams = LayerStreamReceiver(expire_s)
        self._landed: dict[tuple[int, str], float] = {}           # streams complete, note not yet here
        self._parked: dict[tuple[int, str], tuple[Message, float]] = {}  # notes whose stream is not complete
        self._expire_s = expire_s  # a stream whose transfer failed never completes; forget it after this

    def feed(self, message: Message) -> list[Message]:
        self._expire(time.monotonic())
        progress = self._streams.feed(message)
        if progress is not None:
            if not progress.complete:
                return []
            key = (message.sender_engine_id, progress.key.decode())
            parked = self._parked.pop(key, None)
            if parked is not None:
                return [parked[0]]
            self._landed[key] = time.monotonic()
            return []
        kind, note = wire.parse(message)
        if kind != "kv" or not note.streamed:
            return [message]
        key = (message.sender_engine_id, note.rid)
        if self._landed.pop(key, None) is not None:
            return [message]
        self._parked[key] = (message, time.monotonic())
        return []

    def _expire(self, now: float) -> None:
        oldest = now - self._expire_s
        self._landed = {k: t for k, t in self._landed.items() if t >= oldest}
        self._parked = {k: (m, t) for k, (m, t) in self._parked.items() if t >= oldest}
