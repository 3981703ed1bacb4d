"""The MD role (MainDecode): receives KV over the slow link into a decode-side radix cache
(DRC), takes requests over from RLD with an extend pass over the handed-off token ids,
and produces most of the tokens.

Front -> MD: ``("lookup", rid, context)``: MD matches its radix cache, pins the hit and
answers ``("lookup_ok", rid, cached_tokens)``, so P sends only the pages MD lacks;
``("release", rid)``: forget the request (it finishes on RLD); ``("cache_only", rid)``:
RLD finished it before any handoff, keep its KV in the radix cache only.
MD -> front: ``("md_ready", rid)``, ``("took_over", rid, index)`` (MD owns the output from
``index`` on), ``("tokens", "MD", [...], step_s)`` (``step_s``: the decode step's seconds;
absent for the token of an extend pass), ``("done", rid, "MD")``, ``("rejected", reason)``,
``("staging_free", "md", offset)``.

A malformed or inconsistent handoff message is rejected (logged, counted, answered with
``NACK`` so RLD re-sends what MD has not confirmed); it never changes a request's state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..handoff import Handoff, HandoffAssembler, HandoffError
from ..radix import RadixCache, RadixNode
from ..transfer import Message, TransferError
from . import wire
from .decoding import DecodeLoop, DecodeRole, Running, land_kv
from .kv_arrivals import KvArrivals
from ..model.prefix_cache import cache_sequence, cached_prefix, with_room
from .node import Node

__all__ = ["serve"]


@dataclass
class _Lookup:
    context: list[int]
    node: RadixNode
    cached: int


@dataclass
class _Awaiting:
    """KV is here; waiting for RLD's handoff messages."""

    note: wire.KvReady
    context: list[int]
    seq: object
    assembler: HandoffAssembler
    logits: torch.Tensor | None = None


class MainDecode(DecodeRole):
    def __init__(self, config: dict):
        self.node = Node("MD", config)
        self.page_size = config["page_size"]
        self.cache = RadixCache(self.page_size)
        self.loop = DecodeLoop(self.node.model)
        self.kv_arrivals = KvArrivals()
        self.rld_address = config.get("rld_address")
        self.lookups: dict[str, _Lookup] = {}
        self.awaiting: dict[str, _Awaiting] = {}
        self.contexts: dict[str, list[int]] = {}
        self.keep_only: set[str] = set()  # finished on RLD before their KV landed here

    # ---- front --------------------------------------------------------------------------
    def handle_front(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "lookup":
            rid, context = msg[1], msg[2]
            usable = (len(context) - 1) // self.page_size * self.page_size  # P always sends >= 1 page
            hit = self.cache.match_prefix(context[:usable])
            self.cache.lock(hit.node)
            self.lookups[rid] = _Lookup(context, hit.node, hit.matched_len)
            self.node.to_hub("lookup_ok", rid, hit.matched_len)
        elif kind == "release":
            self.release(msg[1])
        elif kind == "cache_only":
            self.cache_only(msg[1])

    def release(self, rid: str) -> None:
        lookup = self.lookups.pop(rid, None)
        if lookup is not None:
            self.cache.unlock(lookup.node)
        waiting = self.awaiting.pop(rid, None)
        if waiting is not None:
            self.node.pool.release(waiting.seq)
            self.contexts.pop(rid, None)

    def cache_only(self, rid: str) -> None:
        """The request finished on RLD: keep its context's KV in the radix cache (now, or
        when it lands) and drop the request."""
        waiting = self.awaiting.pop(rid, None)
        if waiting is None:
            self.keep_only.add(rid)
            return
        cache_sequence(self.node.pool, self.cache, waiting.context, waiting.seq)
        self.node.pool.release(waiting.seq)
        self.contexts.pop(rid, None)

    # ---- lanes --------------------------------------------------------------------------
    def handle_lane(self, message: Message) -> None:
        kind, body = wire.parse(message)
        if kind == "kv":
            self.land(body)
        elif kind == "handoff":
            self.handoff(body)
        else:
            self.node.log.warning("ignored a %s message: MD does not take those", kind)

    def land(self, note: wire.KvReady) -> None:
        lookup = self.lookups.pop(note.rid, None)
        if lookup is None:  # released meanwhile (finished on RLD)
            self.node.to_hub("staging_free", "md", note.offset)
            return
        pool = self.node.pool
        seq, cached = cached_prefix(pool, self.cache, lookup.context[:lookup.cached])
        self.cache.unlock(lookup.node)
        with_room(pool, self.cache, lambda: land_kv(pool, seq, note, self.node.staging))
        # The context's whole pages are final now: share them at once (the system prompt, the
        # session so far), not only when this request finishes, so requests arriving meanwhile
        # do not make P send them again.
        cache_sequence(pool, self.cache, lookup.context, seq)
        self.node.to_hub("staging_free", "md", note.offset)
        self.contexts[note.rid] = lookup.context
        self.node.to_hub("md_ready", note.rid)
        if note.rid in self.keep_only:
            self.keep_only.discard(note.rid)
            self.awaiting[note.rid] = _Awaiting(note, lookup.context, seq, HandoffAssembler(note.rid, note.context_len))
            self.cache_only(note.rid)
        elif note.pipeline == "P_MD":
            self.start(Running(note.rid, seq, note.context_len, note.max_new_tokens, note.seed, note.out_index,
                               [note.token]), [(note.rid, note.out_index, note.token)])
        else:
            self.awaiting[note.rid] = _Awaiting(note, lookup.context, seq,
                                                HandoffAssembler(note.rid, start_pos=note.context_len))
            self.send_rld(wire.encode_ready(note.rid))

    def handoff(self, data: bytes) -> None:
        try:
            msg = Handoff.decode(data)
            waiting = self.awaiting.get(msg.request_id)
            if waiting is None:
                return  # a re-send for a request MD already took over, or one that stays on RLD
            ranges = waiting.assembler.accept(msg)
        except HandoffError as e:
            self.node.log.warning("rejected a handoff message: %s", e)
            self.node.to_hub("rejected", str(e))
            self.send_rld(wire.encode_nack(str(e)[:200]))
            return
        pool = self.node.pool
        for r in ranges:
            if r.token_ids:
                waiting.logits = with_room(pool, self.cache,
                                           lambda: self.node.model.extend([waiting.seq], [list(r.token_ids)]))
        if waiting.assembler.done:
            del self.awaiting[msg.request_id]
            note = waiting.note
            run = Running(note.rid, waiting.seq, note.context_len, note.max_new_tokens, note.seed, 0,
                          list(waiting.assembler.tokens))
            event = self.loop.sample_after(run, waiting.logits)
            self.node.to_hub("took_over", note.rid, event[1])
            self.start(run, [event])

    def start(self, r: Running, events: list) -> None:
        self.loop.running[r.rid] = r
        self.node.to_hub("tokens", "MD", events)
        if self.loop.is_done(r):
            self.finish(r)

    # ---- decoding -----------------------------------------------------------------------
    def decode(self) -> None:
        rids = list(self.loop.running)
        events = with_room(self.node.pool, self.cache, lambda: self.loop.step(rids))
        if events:
            self.node.to_hub("tokens", "MD", events, self.loop.last_step_s)
        for r in list(self.loop.running.values()):
            if self.loop.is_done(r):
                self.finish(r)

    def finish(self, r: Running) -> None:
        del self.loop.running[r.rid]
        context = self.contexts.pop(r.rid)
        cache_sequence(self.node.pool, self.cache, context + r.outputs, r.seq)  # DRC keeps the turn for the next
        self.node.pool.release(r.seq)
        self.node.to_hub("done", r.rid, "MD")

    def send_rld(self, data: bytes) -> None:
        if not self.rld_address:
            return
        try:
            self.node.peers.send(self.rld_address, data)
        except TransferError as e:
            self.node.log.warning("message to RLD not sent: %s", e)


def serve(config: dict) -> None:
    MainDecode(config).serve()
