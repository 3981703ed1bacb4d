"""The P role: prefix-cached prefill and the dual KV send.

P keeps its own :class:`pddcore.radix.RadixCache` over its KV pool and prefills only the
suffix of a context it lacks. Each receiver gets the pages it lacks (all of them for
RLD; for MD those past MD's cached prefix, which the front learned from MD's radix
cache), packed into P's registered send buffer and written into the receiver's staging
region: to RLD over the local link, to MD over the WAN. With ``stream_kv`` (the default)
every layer is packed and posted as soon as prefill wrote it (:mod:`pddcore.streaming`),
so the transfer overlaps prefill; once P sampled the first output token it writes a small
commit (the token) whose notification is the :class:`~.wire.KvReady` note, which the
receiver handles once every layer landed (:mod:`.kv_arrivals`). Without ``stream_kv`` the
pages go as one write after prefill, its notification the note. A notification is
delivered only after every byte of its write was verified and applied.

Front -> P: ``("peers", {"rld": descriptor hex, "md": ...})``, ``("job", dict)``,
``("staging_free", target, offset)``, ``("md_lost",)``.
P -> front: ``("xfer", rid, target, status, bytes, link)`` with status ``done``,
``failed``, ``timeout`` or ``cancelled`` and ``link`` the engine's counters for that
peer (``TransferEngine.stats()["peers"][...]``: bytes, busy seconds, RTT); ``("prefilled", rid, p_cached, seconds)``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .. import pack
from ..model import SamplerState, SamplingParams, sample
from ..radix import RadixCache
from ..streaming import LayerStreamSender
from ..transfer import Peer, RegionDescriptor, Transfer, TransferError
from . import wire
from ..model.prefix_cache import cache_sequence, cached_prefix, with_room
from .node import Node
from .staging import RangeAllocator

__all__ = ["serve"]


_COMMIT_BYTES = 8  # the first token, written after the streamed layers; its notification is the note


@dataclass
class _Send:
    """One request's KV to one receiver: its ranges, then its transfers (one per layer and
    the commit when streamed, else one)."""

    rid: str
    target: str
    pages: slice          # of the request's pages, the ones this receiver lacks
    src_offset: int
    dst_offset: int
    nbytes: int           # the packed pages (the commit slot follows them when streamed)
    started: float
    deadline: float | None
    stream: LayerStreamSender | None = None
    transfers: list[Transfer] = field(default_factory=list)
    broken: bool = False  # a post was refused: the send fails as soon as it is polled

    @property
    def status(self) -> str:
        states = {t.status for t in self.transfers}
        if self.broken or "failed" in states:
            return "failed"
        if "cancelled" in states:
            return "cancelled"
        return "pending" if "pending" in states or not self.transfers else "done"

    @property
    def bytes_acked(self) -> int:
        return sum(t.bytes_acked for t in self.transfers)


@dataclass
class _Target:
    peer: Peer
    descriptor: bytes
    ranges: RangeAllocator


class Prefill:
    def __init__(self, config: dict):
        self.node = Node("P", config)
        self.page_size = config["page_size"]
        self.cache = RadixCache(self.page_size)
        self.send_buf = torch.empty(config["send_bytes"], dtype=torch.uint8)
        self.send_region = self.node.engine.register(self.send_buf)
        self.send_ranges = RangeAllocator(self.send_buf.numel())
        self.md_timeout_s = config.get("md_transfer_timeout_s")
        self.stream_kv = config.get("stream_kv", True)
        self.targets: dict[str, _Target] = {}
        self.jobs: deque[dict] = deque()
        self.sends: list[_Send] = []
        self.params = SamplingParams()

    def serve(self) -> None:
        while True:
            for msg in self.node.hub_messages():
                self.handle(msg)
            self.poll_sends()
            if self.jobs and self.targets:
                self.run_job(self.jobs.popleft())
            elif not self.sends:
                self.node.hub.poll(0.005)
            else:
                time.sleep(0.001)

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "peers":
            for name, (address, descriptor) in msg[1].items():
                peer = self.node.engine.connect(address)
                desc = bytes.fromhex(descriptor)
                self.targets[name] = _Target(peer, desc, RangeAllocator(RegionDescriptor.from_bytes(desc).size))
        elif kind == "job":
            self.jobs.append(msg[1])
        elif kind == "staging_free" and msg[1] in self.targets:
            self.targets[msg[1]].ranges.free(msg[2])
        elif kind == "md_lost":
            self.targets.pop("md", None)
            for s in self.sends:
                if s.target == "md":
                    self.fence(s)

    # ---- prefill ----------------------------------------------------------------------
    def run_job(self, job: dict) -> None:
        rid, context = job["rid"], job["context"]
        started = time.perf_counter()
        pool = self.node.pool
        seq, cached = cached_prefix(pool, self.cache, context[:len(context) - 1])  # >= 1 token left to prefill
        num_pages = pool.pages_for(len(context))
        try:
            sends = [s for s in (self.open_send(job, name, num_pages) for name in job["targets"]) if s is not None]

            def post_layer(layer: int) -> None:
                for s in sends:
                    self.post_layer(s, seq.pages[:num_pages], layer)

            logits = with_room(pool, self.cache, lambda: self.node.model.prefill(
                [seq], [context[cached:]], on_layer=post_layer if self.stream_kv else None))
            token = sample(logits, [self.params], [SamplerState(job["seed"], job["out_index"])])[0]
            cache_sequence(pool, self.cache, context, seq)
            self.node.to_hub("prefilled", rid, cached, time.perf_counter() - started)
            for s in sends:
                self.commit(s, job, seq.pages[:num_pages], token)
        finally:
            self.node.pool.release(seq)

    # ---- sends -----------------------------------------------------------------------
    def open_send(self, job: dict, name: str, num_pages: int) -> _Send | None:
        """Reserves the ranges of one receiver's send (None, reported failed, when the
        receiver is lost meanwhile)."""
        rid = job["rid"]
        first = (job["md_cached"] if name == "md" else 0) // self.page_size
        nbytes = self.node.layout.packed_nbytes(num_pages - first)
        span = nbytes + (_COMMIT_BYTES if self.stream_kv else 0)
        src = self.wait_for(self.send_ranges, span)
        target = self.targets.get(name)
        dst = None if target is None else self.wait_for(target.ranges, span, name)
        if dst is None:
            self.send_ranges.free(src)
            self.node.to_hub("xfer", rid, name, "failed", 0, {})
            return None
        now = time.perf_counter()
        deadline = now + self.md_timeout_s if name == "md" and self.md_timeout_s else None
        s = _Send(rid, name, slice(first, num_pages), src, dst, nbytes, now, deadline)
        if self.stream_kv:
            s.stream = LayerStreamSender(self.node.engine, target.peer, rid.encode(), self.node.model.config.num_layers)
        return s

    def post_layer(self, s: _Send, pages: list[int], layer: int) -> None:
        """Packs and posts one layer of ``s`` (layers are contiguous in the packed order)."""
        if s.broken:
            return
        per_layer = s.nbytes // self.node.model.config.num_layers
        lo = s.src_offset + layer * per_layer
        pack(self.node.layout, torch.tensor(pages[s.pages], dtype=torch.int64), layers=[layer],
             out=self.send_buf[lo:lo + per_layer])
        target = self.targets.get(s.target)
        try:
            if target is None:
                raise TransferError(f"{s.target} was lost")
            s.transfers.append(s.stream.post(layer, [(self.send_region, lo, target.descriptor,
                                                      s.dst_offset + layer * per_layer, per_layer)]))
        except TransferError as e:
            self.node.log.warning("layer %d of %s to %s refused: %s", layer, s.rid, s.target, e)
            s.broken = True

    def commit(self, s: _Send, job: dict, pages: list[int], token: int) -> None:
        """Sends what is left of ``s`` with the KV-ready note as its notification: the commit
        after the streamed layers, or (unstreamed) all the pages."""
        note = wire.KvReady(s.rid, len(job["context"]), s.pages.start * self.page_size, s.dst_offset, s.nbytes, token,
                            job["out_index"], job["pipeline"], job["max_new_tokens"], job["seed"],
                            streamed=s.stream is not None)
        target = self.targets.get(s.target)
        if s.stream is not None:  # the commit slot right after the streamed pages
            offset, nbytes = s.nbytes, _COMMIT_BYTES
            self.send_buf[s.src_offset + offset:s.src_offset + offset + nbytes].view(torch.int64)[0] = token
        else:
            offset, nbytes = 0, s.nbytes
            pack(self.node.layout, torch.tensor(pages[s.pages], dtype=torch.int64),
                 out=self.send_buf[s.src_offset:s.src_offset + s.nbytes])
        if not s.broken:
            try:
                if target is None:
                    raise TransferError(f"{s.target} was lost")
                s.transfers.append(self.node.engine.write(target.peer, self.send_region, s.src_offset + offset,
                                                          target.descriptor, s.dst_offset + offset, nbytes,
                                                          notify=wire.encode_kv(note)))
            except TransferError as e:
                self.node.log.warning("write of %s to %s refused: %s", s.rid, s.target, e)
                s.broken = True
        if s.broken and not s.transfers:  # refused before a byte was sent: nothing to fence
            self.send_ranges.free(s.src_offset)
            if target is not None:
                target.ranges.free(s.dst_offset)
            self.node.to_hub("xfer", s.rid, s.target, "failed", 0, {})
            return
        self.sends.append(s)

    def wait_for(self, ranges: RangeAllocator, nbytes: int, target: str | None = None) -> int | None:
        """A range of ``nbytes``, serving the front and the sends while none is free; None
        when ``target`` is dropped meanwhile (MD lost)."""
        while True:
            if target is not None and target not in self.targets:
                return None
            offset = ranges.alloc(nbytes)
            if offset is not None:
                return offset
            for msg in self.node.hub_messages():
                self.handle(msg)
            self.poll_sends()
            time.sleep(0.002)

    def poll_sends(self) -> None:
        now = time.perf_counter()
        still = []
        for s in self.sends:
            status = s.status
            if status == "pending" and s.deadline is not None and now > s.deadline:
                self.finish(s, "timeout")
            elif status == "pending":
                still.append(s)
            else:
                self.finish(s, status)
        self.sends = still

    def fence(self, s: _Send) -> bool:
        """Cancels ``s`` (a failed one too) and waits for the receiver's fence: afterwards no
        byte of it lands. False when the receiver could not confirm (it is gone or frozen)."""
        try:
            for t in s.transfers:
                t.cancel()
            return True
        except TransferError as e:
            self.node.log.warning("transfer of %s to %s not fenced: %s", s.rid, s.target, e)
            return False

    def finish(self, s: _Send, status: str) -> None:
        self.send_ranges.free(s.src_offset)
        if status != "done" and s.target in self.targets and self.fence(s):
            # the receiver never saw the notification, so its range comes back here; an
            # unfenced one stays taken (nothing may reuse bytes a late chunk could still hit)
            self.targets[s.target].ranges.free(s.dst_offset)
        sent = s.nbytes if status == "done" else s.bytes_acked
        target = self.targets.get(s.target)
        link = self.node.engine.stats()["peers"].get(target.peer.address, {}) if target else {}
        self.node.to_hub("xfer", s.rid, s.target, status, sent, link)


def serve(config: dict) -> None:
    Prefill(config).serve()
