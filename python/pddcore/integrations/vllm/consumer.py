"""The consumer (decode) half of :class:`~pddcore.integrations.vllm.PDDConnector`'s worker:
``start_load_kv`` takes a staging buffer per request and sends each producer rank it needs
a ``pull`` (blocks to skip: the decode side's own prefix-cache hit; head range when the TP
sizes differ). The request's blocks are unpacked only once every producer rank's write
was verified and applied, then reported in ``finished_recving``; a failure reports its
blocks through ``get_block_ids_with_load_errors`` (and the request in ``failed_recving``),
so vLLM never reads a half-written block. Push mode (:mod:`.push_consumer`) derives from
this class: a request whose KV the producer pushed (``pdd_pushed``) is loaded from its push
buffer instead, and pulled after all when that push failed.

The staging buffer holds one segment per producer rank, in the order of the sources::

    [rank s0's heads of all pages][rank s1's heads of all pages] ...     _Segment.offset, .nbytes
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ...pack import unpack
from ...transfer import Message
from .._device import on_kv_device, record_event
from .._heads import head_slices
from .._messages import MalformedMessage
from .._staging import StagingBuffer
from .base_worker import Handler, WorkerBase
from .metadata import PDDConnectorMetadata, _Load, producer_addresses

__all__ = ["ConsumerWorker"]

log = logging.getLogger(__name__)


@dataclass
class _Segment:
    """One producer rank's share of a load: where it lands in the staging buffer."""

    src_rank: int
    address: str
    offset: int
    nbytes: int
    src_heads: tuple[int, int] | None
    dst_heads: tuple[int, int] | None


@dataclass
class _PendingLoad:
    req_id: str
    block_ids: list[int]
    pages: torch.Tensor
    started: float
    load: _Load
    segments: list[_Segment] = field(default_factory=list)
    staging: StagingBuffer | None = None
    done_sources: set[int] = field(default_factory=set)


class ConsumerWorker(WorkerBase):
    """The consumer's worker methods. Push mode overrides the hooks :meth:`_start`,
    :meth:`_unpack_load` and :meth:`_release_staging`."""

    def _init_worker(self, extra: dict) -> None:
        super()._init_worker(extra)
        self._pending_loads: dict[str, _PendingLoad] = {}
        self._load_errors: set[int] = set()
        # Loads reported finished whose unpack may still run: (event after it, load, scratch buffer).
        self._unpacking: list[tuple[Any, _PendingLoad, StagingBuffer | None]] = []

    def _message_handlers(self) -> dict[str, Handler]:
        return {**super()._message_handlers(), "done": self._on_done, "fail": self._on_fail}

    def _progress(self) -> None:
        self._expire_loads()
        self._release_unpacked()
        super()._progress()

    @on_kv_device
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, PDDConnectorMetadata):
            return
        # Drops and heartbeats are posted: a producer that does not answer a connect must not
        # hold up the forward.
        for req_id, params in meta.cancelled_loads.items():
            for address in producer_addresses(params):
                self._peers.post(address, "drop", req=params.get("remote_request_id"), d_req=req_id,
                                 d_engine=self.engine_id)
        for remote_req, heartbeat in meta.heartbeats.items():
            # Each producer rank hears from one rank of this consumer: r, r + tp, ... from rank r.
            for address in heartbeat.addresses[self.tp_rank::self.tp_size]:
                self._peers.post(address, "alive", req=remote_req, key=heartbeat.lease_key)
        for req_id, load in meta.loads.items():
            try:
                self._start(req_id, load)
            except Exception as exc:
                log.warning("PDDConnector: load of %s failed to start: %s", req_id, exc)
                self._fail_load(req_id, load.local_block_ids)

    def _start(self, req_id: str, load: _Load) -> None:
        """Starts ``load``: a pull."""
        self._start_load(req_id, load)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete between steps: a block is handed to vLLM only once whole

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    @staticmethod
    def _remote_blocks(load: _Load) -> int:
        """How many blocks the producer holds for ``load``; checks that they cover it."""
        remote_blocks, n = len(load.params.get("remote_block_ids") or ()), len(load.local_block_ids)
        if load.skip_blocks + n > remote_blocks:
            raise ValueError(f"needs blocks [{load.skip_blocks}, {load.skip_blocks + n}) but the producer holds "
                             f"{remote_blocks}")
        return remote_blocks

    def _start_load(self, req_id: str, load: _Load) -> None:
        params, n = load.params, len(load.local_block_ids)
        self._remote_blocks(load)
        addresses = producer_addresses(params)
        if self.layout.is_mla:  # every producer rank holds the one latent: rank r reads rank r % their TP
            sources = [(self.tp_rank % len(addresses), None, None)]
            # The producer ranks no rank of this TP size reads: rank r tells those of index r + k * tp.
            for unread in addresses[self.tp_size + self.tp_rank::self.tp_size]:
                self._peers.post(unread, "drop", req=params["remote_request_id"], d_req=req_id,
                                 d_engine=self.engine_id)
        else:
            sources = head_slices(self.total_kv_heads, len(addresses), self.tp_size, self.tp_rank)
        pending = _PendingLoad(req_id, load.local_block_ids, self._pages(load.local_block_ids), time.monotonic(),
                               load)
        offset = 0
        for src_rank, src_heads, dst_heads in sources:
            nbytes = self.layout.packed_nbytes(len(pending.pages), heads=dst_heads)
            pending.segments.append(_Segment(src_rank, addresses[src_rank], offset, nbytes, src_heads, dst_heads))
            offset += nbytes
        pending.staging = self.staging.acquire(offset, target=True)
        self._pending_loads[req_id] = pending
        for seg in pending.segments:
            self._peers.send(seg.address, "pull", req=params["remote_request_id"], d_req=req_id,
                             d_engine=self.engine_id, skip_blocks=load.skip_blocks, num_blocks=n, d_tp=self.tp_size,
                             src_heads=list(seg.src_heads) if seg.src_heads else None,
                             region=pending.staging.region.descriptor().hex(), offset=seg.offset,
                             seg_bytes=seg.nbytes, reply=self.address)

    def _on_done(self, message: Message, msg: dict) -> None:
        """Data applied: believed only as the write notification of the producer rank asked."""
        req = msg["req"]
        pending = self._pending_loads.get(req)
        if pending is None:
            return
        seg = next((s for s in pending.segments if s.src_rank == msg["src"]), None)
        if seg is None:
            raise MalformedMessage(f"done for {req} from rank {msg['src']}, which was not asked", req)
        if not message.notification or not self._peers.is_from(message, seg.address):
            log.warning("PDDConnector: ignored a 'done' for %s from %s: not the write notification of rank %d",
                        req, message.sender, seg.src_rank)
            return
        pending.done_sources.add(seg.src_rank)
        if len(pending.done_sources) == len(pending.segments):
            self._finish_load(pending)

    def _on_fail(self, message: Message, msg: dict) -> None:
        req = msg["req"]
        pending = self._pending_loads.get(req)
        if pending is None:
            return
        if not any(self._peers.is_from(message, seg.address) for seg in pending.segments):
            log.warning("PDDConnector: ignored a 'fail' for %s from %s, which it did not pull from", req,
                        message.sender)
            return
        log.warning("PDDConnector: load of %s failed: %s", req, msg["reason"])
        self._fail_load(req, pending.block_ids)

    def _on_malformed(self, req: Any, reason: str) -> None:
        """Fails the pending load a malformed message names (``req``: None when it named none)."""
        super()._on_malformed(req, reason)
        if isinstance(req, str) and req in self._pending_loads:
            log.warning("PDDConnector: load of %s failed: %s", req, reason)
            self._fail_load(req, self._pending_loads[req].block_ids)

    def _expire_loads(self) -> None:
        now = time.monotonic()
        for req_id, pending in list(self._pending_loads.items()):
            if now - pending.started > self.load_timeout_s:
                log.warning("PDDConnector: load of %s timed out", req_id)
                self._fail_load(req_id, pending.block_ids)

    def _fail_load(self, req_id: str, block_ids: list[int]) -> None:
        pending = self._pending_loads.pop(req_id, None)
        if pending is not None:
            self._release_staging(pending)
        self._load_errors.update(block_ids)
        self._failed_recving.add(req_id)
        self._finished_recving.add(req_id)

    def _finish_load(self, pending: _PendingLoad) -> None:
        """Queues the unpack and reports the load finished without waiting for it: the forward
        that reads the blocks is queued after it on the same stream. The buffers it reads go
        back once an event after it completed (:meth:`_release_unpacked`)."""
        scratch = self._unpack_load(pending)
        del self._pending_loads[pending.req_id]
        self._finished_recving.add(pending.req_id)
        self._unpacking.append((record_event(self.kv_device), pending, scratch))
        self._release_unpacked()

    def _unpack_load(self, pending: _PendingLoad) -> StagingBuffer | None:
        """Queues the unpack of every producer rank's segment into the load's blocks; returns
        the scratch buffer it reads besides the load's staging (None: none)."""
        staging = pending.staging.tensor
        for seg in pending.segments:
            unpack(self.layout, pending.pages, staging[seg.offset:seg.offset + seg.nbytes], heads=seg.dst_heads)
        return None

    def _release_unpacked(self) -> None:
        """Returns the staging of every load whose unpack ran."""
        running = []
        for done, pending, scratch in self._unpacking:
            if done is not None and not done.query():
                running.append((done, pending, scratch))
                continue
            self._release_staging(pending)
            if scratch is not None:
                self.staging.release(scratch)
        self._unpacking = running

    def _release_staging(self, pending: _PendingLoad) -> None:
        """Returns the buffers ``pending`` holds (its load ended, or its unpack ran)."""
        if pending.staging is not None:
            self.staging.release(pending.staging)
            pending.staging = None
