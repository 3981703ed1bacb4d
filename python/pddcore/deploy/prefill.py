"""The P role: prefix-cached prefill and the dual KV send.

P keeps its own :class:`pddcore.radix.RadixCache` over its KV pool and prefills only the
suffix of a context it lacks. It samples the first output token from the prefill
logits, packs the pages each receiver lacks (all of them for RLD; for MD those past
MD's cached prefix, which the front learned from MD's radix cache) into its registered
send buffer, and writes them into the receivers' staging regions at once: to RLD over
the local link, to MD over the WAN. Each write carries a :class:`~.wire.KvReady`
notification, delivered only after every byte was verified and applied.

Front -> P: ``("peers", {"rld": descriptor hex, "md": ...})``, ``("job", dict)``,
``("staging_free", target, offset)``, ``("md_lost",)``.
P -> front: ``("xfer", rid, target, status, bytes, link)`` with status ``done``,
``failed``, ``timeout`` or ``cancelled`` and ``link`` the engine's counters for that
peer (``TransferEngine.stats()["peers"][...]``: bytes, busy seconds, RTT); ``("prefilled", rid, p_cached, seconds)``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from .. import pack
from ..model import SamplerState, SamplingParams, sample
from ..radix import RadixCache
from ..transfer import Peer, RegionDescriptor, Transfer, TransferError
from . import wire
from .node import Node, cache_sequence, cached_prefix, with_room
from .staging import RangeAllocator

__all__ = ["serve"]


@dataclass
class _Send:
    rid: str
    target: str
    transfer: Transfer
    src_offset: int
    dst_offset: int
    nbytes: int
    started: float
    deadline: float | None


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
        try:
            logits = with_room(pool, self.cache, lambda: self.node.model.prefill([seq], [context[cached:]]))
            token = sample(logits, [self.params], [SamplerState(job["seed"], job["out_index"])])[0]
            cache_sequence(pool, self.cache, context, seq)
            self.node.to_hub("prefilled", rid, cached, time.perf_counter() - started)
            pages = seq.pages[:self.node.pool.pages_for(len(context))]
            for target in job["targets"]:
                first = job["md_cached"] if target == "md" else 0
                self.send(job, target, pages[first // self.page_size:], first, token)
        finally:
            self.node.pool.release(seq)

    # ---- sends -----------------------------------------------------------------------
    def send(self, job: dict, name: str, pages: list[int], first_token: int, token: int) -> None:
        rid = job["rid"]
        nbytes = self.node.layout.packed_nbytes(len(pages))
        src = self.wait_for(self.send_ranges, nbytes)
        target = self.targets.get(name)
        dst = None if target is None else self.wait_for(target.ranges, nbytes, name)
        if dst is None:
            self.send_ranges.free(src)
            self.node.to_hub("xfer", rid, name, "failed", 0, {})
            return
        pack(self.node.layout, torch.tensor(pages, dtype=torch.int64), out=self.send_buf[src:src + nbytes])
        note = wire.KvReady(rid, len(job["context"]), first_token, dst, nbytes, token, job["out_index"],
                            job["pipeline"], job["max_new_tokens"], job["seed"])
        now = time.perf_counter()
        try:
            transfer = self.node.engine.write(target.peer, self.send_region, src, target.descriptor, dst, nbytes,
                                              notify=wire.encode_kv(note))
        except TransferError as e:  # refused before a byte was sent
            self.node.log.warning("write of %s to %s refused: %s", rid, name, e)
            self.send_ranges.free(src)
            target.ranges.free(dst)
            self.node.to_hub("xfer", rid, name, "failed", 0, {})
            return
        deadline = now + self.md_timeout_s if name == "md" and self.md_timeout_s else None
        self.sends.append(_Send(rid, name, transfer, src, dst, nbytes, now, deadline))

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
            status = s.transfer.status
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
            s.transfer.cancel()
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
        sent = s.nbytes if status == "done" else s.transfer.bytes_acked
        target = self.targets.get(s.target)
        link = self.node.engine.stats()["peers"].get(target.peer.address, {}) if target else {}
        self.node.to_hub("xfer", s.rid, s.target, status, sent, link)


def serve(config: dict) -> None:
    Prefill(config).serve()
