"""The producer (prefill) half of :class:`~pddcore.integrations.vllm.PDDConnector`'s worker:
``save_kv_layer`` packs each layer of a request whose prefill completes this step into a
staging buffer (:class:`_Staged`, layer-major) as the forward proceeds; each consumer rank's
``pull`` is answered by writing its blocks (head-sliced when the TP sizes differ) into the
consumer's staging buffer with a ``done`` notification. Push mode (:mod:`.push_producer`)
derives from this class and streams each packed layer at once. The staged copy is kept until
every consumer it expects (``pdd_consumers`` in the request's ``kv_transfer_params``, default
1) was served, or dropped it, or its lease ran out. A consumer is one engine (its ``d_engine``,
vLLM's ``engine_id``, shared by its ranks) pulling one request (``d_req``); it is served once
each of its ranks that needs this rank was answered: the ranks whose heads overlap this rank's
(MLA: consumer ranks ``r, r + tp, ...``, which all read this rank's one latent copy).

Staged bytes of a request with ``n`` pages, per layer ``l`` (K then V, each all ``n`` pages;
see :mod:`.layer_major`)::

    [layer 0: K pages 0..n | V pages 0..n][layer 1: ...] ...     layer_range(l) -> (lo, hi)
"""

from __future__ import annotations

import functools
import hmac
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ...layout import KVLayout
from ...pack import pack
from ...transfer import Message, Transfer
from .._device import on_kv_device, record_event
from .._heads import destinations_of
from .._messages import MalformedMessage
from .._posting import PostedWrite, Poster
from .._staging import StagingBuffer, StagingExhausted, StagingPool
from .base_worker import Handler, WorkerBase
from .layer_major import layer_major_layout, layer_offsets
from .metadata import PDDConnectorMetadata
from .protocol import MESSAGES
from .shares import Share

__all__ = ["ProducerWorker"]

log = logging.getLogger(__name__)


@dataclass
class _Staged:
    """A producer's packed copy of one request's KV, and a KVLayout over that copy
    (same cells as the pool, pages ``0..num_pages`` in request order)."""

    pages: torch.Tensor
    buffer: StagingBuffer
    layout: KVLayout
    layer_offsets: list[int]
    packed: set[int] = field(default_factory=set)
    saved: bool = False                              # this step's save queued every layer's pack
    packs_done: "torch.cuda.Event | None" = None     # ... and they ran once it completes (None: they ran)
    deadline: float | None = None
    lease_key: str | None = None     # what a heartbeat must bear to start the lease again
    consumers: int = 1
    shares: dict[tuple[str, str], Share] = field(default_factory=dict)

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @classmethod
    def allocate(cls, src: KVLayout, pages: torch.Tensor, pool: StagingPool) -> "_Staged":
        n = len(pages)
        offsets = layer_offsets(src, n)
        buffer = pool.acquire(offsets[-1])
        return cls(pages, buffer, layer_major_layout(src, n, buffer.tensor, pool.buffer_device), offsets)

    def layer_range(self, layer: int) -> tuple[int, int]:
        return self.layer_offsets[layer], self.layer_offsets[layer + 1]

    @property
    def ready(self) -> bool:
        """Whether the staged bytes are all there, so a write may read them."""
        return self.saved and (self.packs_done is None or self.packs_done.query())

    @property
    def served(self) -> bool:
        """Whether every expected consumer was served (or dropped it)."""
        return sum(s.complete and not s.superseded for s in self.shares.values()) >= self.consumers


class ProducerWorker(WorkerBase):
    """The producer's worker methods. Push mode overrides the hooks :meth:`_staged_started`,
    :meth:`_layer_packed`, :meth:`_saved` and :meth:`_staged_dropped`, which do nothing here."""

    def _init_worker(self, extra: dict) -> None:
        super()._init_worker(extra)
        self._staged: dict[str, _Staged] = {}          # req -> packed KV
        self._unstaged: dict[str, tuple[str, float]] = {}   # req -> why it has no staged copy, until when
        self._pulls: dict[str, list[tuple[str, dict]]] = {}   # req -> pull requests not served yet
        self._serving: dict[str, list[tuple[PostedWrite, StagingBuffer | None, dict]]] = {}
        # Pulls are answered from this thread: a write whose source a kernel still fills (a
        # head-sliced or partial pull out of GPUDirect staging) waits there for its event, and
        # a connect to a new consumer never stalls the step either.
        self._poster = Poster(f"pdd-post-{self.tp_rank}")

    def _message_handlers(self) -> dict[str, Handler]:
        return {**super()._message_handlers(), "pull": self._on_pull, "drop": self._on_drop, "alive": self._on_alive}

    def _progress(self) -> None:
        self._progress_sends()
        super()._progress()

    def _close_worker(self) -> None:
        self._poster.close()
        super()._close_worker()

    def _staged_started(self, req_id: str, staged: _Staged, meta: PDDConnectorMetadata) -> None:
        """A fresh staged copy of ``req_id`` for this step's save."""

    def _layer_packed(self, layer: int, req_ids: list[str]) -> None:
        """``save_kv_layer`` queued the pack of ``layer`` for ``req_ids``."""

    def _saved(self, req_id: str, staged: _Staged, late_layers: list[int]) -> None:
        """``wait_for_save`` queued the last packs of ``req_id`` (``late_layers``, which no
        ``save_kv_layer`` saw), and ``staged.packs_done`` follows them."""

    def _staged_dropped(self, req_id: str, staged: _Staged) -> None:
        """The staged copy of ``req_id`` goes (its buffer is released after this)."""

    @on_kv_device
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, PDDConnectorMetadata) or not meta.saves or layer_name not in self._layer_index:
            return
        layer = self._layer_index[layer_name]
        packed = []
        for req_id, block_ids in meta.saves.items():
            staged = self._staged_for_step(req_id, block_ids, meta)
            if staged is not None:
                self._pack_layer(staged, layer)
                packed.append(req_id)
        if packed:
            self._layer_packed(layer, packed)

    def _staged_for_step(self, req_id: str, block_ids: list[int], meta: PDDConnectorMetadata) -> _Staged | None:
        """The copy this step's save of ``req_id`` fills, staged from this step's blocks; None
        when the staging arena has no room for it (its consumers are then told why)."""
        if req_id in self._unstaged:
            return None
        staged = self._staged.get(req_id)
        if staged is None or staged.saved:  # a copy from an earlier step names blocks the request may have lost
            if staged is not None:
                self._drop_send(req_id)
            try:
                staged = _Staged.allocate(self.layout, self._pages(block_ids), self.staging)
            except StagingExhausted as exc:
                log.warning("PDDConnector: %s is not staged, its consumers will fail to load it: %s", req_id, exc)
                self._unstaged[req_id] = (str(exc), float("inf"))  # told to pulls until its lease ends
                return None
            self._staged[req_id] = staged
            staged.consumers = meta.consumers.get(req_id, 1)
            self._staged_started(req_id, staged, meta)
        return staged

    def _pack_layer(self, staged: _Staged, layer: int) -> None:
        lo, hi = staged.layer_range(layer)
        pack(self.layout, staged.pages, layers=[layer], out=staged.buffer.tensor[lo:hi])
        staged.packed.add(layer)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Frees the staged copy of every preempted request: vLLM freed its blocks, and no
        consumer was told of it yet (that happens when it finishes). Runs before the step."""
        if not isinstance(kv_connector_metadata, PDDConnectorMetadata):
            return
        for req_id in kv_connector_metadata.preempted:
            if req_id in self._staged and req_id not in self._serving:
                self._drop_send(req_id)

    @on_kv_device
    def wait_for_save(self) -> None:
        """Packs the layers ``save_kv_layer`` did not see (all of them when vLLM replays a full
        CUDA graph, which skips the per-layer hooks). It does not wait for the packs: an event
        after them tells the message pump when the copy may be served."""
        meta = self._connector_metadata
        if not isinstance(meta, PDDConnectorMetadata):
            return
        for req_id, block_ids in meta.saves.items():
            staged = self._staged_for_step(req_id, block_ids, meta)
            if staged is None:
                continue
            missing = [layer for layer in range(self.layout.num_layers) if layer not in staged.packed]
            for layer in missing:
                self._pack_layer(staged, layer)
            staged.packs_done, staged.saved = record_event(self.kv_device), True
            self._saved(req_id, staged, missing)
        for req_id in meta.saves:
            self._serve(req_id)
        for req_id, lease in meta.send_deadlines.items():
            if req_id in self._staged:
                self._staged[req_id].deadline = time.monotonic() + lease
                self._staged[req_id].lease_key = meta.lease_keys.get(req_id)
                self._finish_if_served(req_id)  # consumers may have been served within the last step
            elif req_id in self._unstaged:
                self._unstaged[req_id] = (self._unstaged[req_id][0], time.monotonic() + lease)
        for req_id in meta.dropped_sends:
            self._unstaged.pop(req_id, None)
        for req_id in meta.dropped_sends:
            self._drop_send(req_id)

    def _on_pull(self, message: Message, msg: dict) -> None:
        # Answers and KV go only to the engine that sent the pull: its reply address must lead
        # there, and the write into its staging region is checked against that engine's id.
        req = msg["req"]
        if not self._peers.is_from(message, msg["reply"]):
            raise MalformedMessage(f"pull from {message.sender} names another engine ({msg['reply']}) to answer", req)
        staged = self._staged.get(req)
        if staged is None:
            reason = f"producer has no KV for {req}"
            if req in self._unstaged:
                reason += f": {self._unstaged[req][0]}"
            self._peers.post(msg["reply"], "fail", req=msg["d_req"], reason=reason)
            return
        if msg["d_tp"] <= 0:
            raise MalformedMessage(f"pull for {req}: d_tp={msg['d_tp']}", req)
        staged.shares.setdefault((msg["d_engine"], msg["d_req"]), Share(self._ranks_reading(msg["d_tp"])))
        self._pulls.setdefault(req, []).append((msg["reply"], msg))
        self._serve(req)

    def _ranks_reading(self, d_tp: int) -> int:
        """How many ranks of a consumer of TP ``d_tp`` read from this rank."""
        if self.layout.is_mla:  # consumer rank r reads producer rank r % tp
            return len(range(self.tp_rank, d_tp, self.tp_size))
        return destinations_of(self.total_kv_heads, self.tp_size, d_tp, self.tp_rank)

    def _on_drop(self, message: Message, msg: dict) -> None:
        """A consumer needs nothing from this rank: it aborted before pulling, or (MLA) its TP
        size leaves this rank unread. Its share is complete; the copy goes once all are."""
        staged = self._staged.get(msg["req"])
        if staged is not None:
            staged.shares.setdefault((msg["d_engine"], msg["d_req"]), Share(0)).dropped = True
            self._finish_if_served(msg["req"])

    def _on_alive(self, message: Message, msg: dict) -> None:
        """A consumer's heartbeat: it still waits for the request's KV, so its lease starts
        again (as vLLM's NixlConnector extends a lease on a heartbeat). Only a finished
        request has a lease; one still prefilling needs none. Believed only with the request's
        lease key: an engine the request was not handed to cannot keep its KV held."""
        staged = self._staged.get(msg["req"])
        if staged is None or staged.deadline is None:
            return
        if staged.lease_key is None or not hmac.compare_digest(msg["key"], staged.lease_key):
            log.warning("PDDConnector: ignored a heartbeat for %s from %s: not the request's lease key", msg["req"],
                        message.sender)
            return
        staged.deadline = max(staged.deadline, time.monotonic() + self.lease_s)

    def _serve(self, req_id: str) -> None:
        staged = self._staged.get(req_id)
        if staged is None or not staged.ready:
            return
        for address, pull in self._pulls.pop(req_id, []):
            try:
                self._serve_one(req_id, staged, address, pull)
            except Exception as exc:
                self._peers.post(address, "fail", req=pull["d_req"], reason=f"producer could not send: {exc}")
                self._answered(staged, pull)
        self._finish_if_served(req_id)

    @staticmethod
    def _answered(staged: _Staged, pull: dict) -> None:
        staged.shares[(pull["d_engine"], pull["d_req"])].answered.add(pull["reply"])

    def _serve_one(self, req_id: str, staged: _Staged, address: str, pull: dict) -> None:
        heads = tuple(pull["src_heads"]) if pull["src_heads"] else None
        skip, n = pull["skip_blocks"], pull["num_blocks"]
        blocks = staged.num_pages // self.pages_per_block
        if skip < 0 or n <= 0 or skip + n > blocks:
            raise ValueError(f"pull for blocks [{skip}, {skip + n}) but the request has {blocks}")
        nbytes = self.layout.packed_nbytes(n * self.pages_per_block, heads=heads)
        if nbytes != pull["seg_bytes"]:
            raise ValueError(f"consumer staged {pull['seg_bytes']} bytes, this layout packs {nbytes} "
                             "(block geometry differs)")
        packed = None
        if heads is None and skip == 0 and n == blocks:
            src, own = staged.buffer, None
        else:
            src = own = self.staging.acquire(nbytes)
            first = skip * self.pages_per_block
            pack(staged.layout, torch.arange(first, first + n * self.pages_per_block), heads=heads, out=own.tensor)
            # GPUDirect staging: the kernel runs on the GPU and the NIC reads what it writes, so
            # the write waits on the posting thread for this event (None: host staging, copied).
            packed = record_event(self.staging.buffer_device)
        write = functools.partial(self._write, address, src, pull, nbytes)
        self._serving.setdefault(req_id, []).append((self._poster.post(write, after=packed, device=self.kv_device),
                                                     own, pull))

    def _write(self, address: str, src: StagingBuffer, pull: dict, nbytes: int) -> Transfer:
        return self.engine.write(self._peers.connect(address), src.region, 0, bytes.fromhex(pull["region"]),
                                 pull["offset"], nbytes, notify=MESSAGES.encode("done", req=pull["d_req"], src=self.tp_rank))

    def _drop_send(self, req_id: str) -> None:
        staged = self._staged.pop(req_id, None)
        if staged is not None:
            self._staged_dropped(req_id, staged)
            self.staging.release(staged.buffer)
        self._pulls.pop(req_id, None)

    def _progress_sends(self) -> None:
        now = time.monotonic()
        for req_id in list(self._pulls):  # pulls that came before the staged copy was ready
            self._serve(req_id)
        for req_id in list(self._serving):
            remaining = []
            for transfer, own, pull in self._serving[req_id]:
                if transfer.status == "pending":
                    remaining.append((transfer, own, pull))
                    continue
                if transfer.status != "done":
                    self._peers.post(pull["reply"], "fail", req=pull["d_req"], reason=f"transfer {transfer.error}")
                if own is not None:
                    self.staging.release(own)
                self._answered(self._staged[req_id], pull)
            self._serving[req_id] = remaining
            self._finish_if_served(req_id)
        for req_id, staged in list(self._staged.items()):
            if staged.deadline is not None and now > staged.deadline and req_id not in self._serving:
                log.warning("PDDConnector: lease of %s expired before a consumer pulled it", req_id)
                self._drop_send(req_id)
        for req_id, (_, until) in list(self._unstaged.items()):
            if now > until:
                del self._unstaged[req_id]

    def _finish_if_served(self, req_id: str) -> None:
        """Frees the staged copy once every consumer it expects
        was served and no write from it is still out, never before the scheduler finished the
        request (a push, or a pull under async scheduling, can complete within its last step)."""
        staged = self._staged.get(req_id)
        if staged is None or self._serving.get(req_id) or staged.deadline is None or not staged.served:
            return
        self._serving.pop(req_id, None)
        self._drop_send(req_id)
