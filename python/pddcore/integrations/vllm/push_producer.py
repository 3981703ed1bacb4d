"""The producer's half of push mode: a request whose ``kv_transfer_params`` name the consumer
ranks (``pdd_push_to``) is streamed to them layer by layer from ``save_kv_layer``, while the
later layers still compute.

At the request's first layer each consumer rank this rank feeds gets a ``reserve``; its
``reserved`` answer names a push buffer there. The push's control messages are posted
(``Peers.post``: a first connection to a consumer never stalls the forward, and a
``stream_failed`` never overtakes its ``reserve`` to that consumer). From then on every packed layer
is posted at once as one part of a :class:`~pddcore.streaming.LayerStreamSender`; the layers
packed before the answer go out from whichever runs first of the next ``save_kv_layer``,
``wait_for_save`` or the worker's message pump. On a GPU a layer is posted once its pack
kernel ran (its event completed): each hook and the message pump post the layers whose event
completed and never wait for one, so the forward does not stall on the push.

The push buffer mirrors the staged copy (layer-major), so each layer keeps its offsets::

    staged bytes [lo, hi) of layer l  ->  push buffer [offset + lo, offset + hi)   (notify: layer l landed)

A push that fails (refused, a write failed, the request was dropped) tells the consumer with
``stream_failed``, so that its load pulls the KV at once rather than wait for its timeout.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ...streaming import LayerStreamSender
from ...transfer import Message, Transfer, TransferError
from .._device import record_event
from .base_worker import Handler
from .metadata import PDDConnectorMetadata
from .producer import ProducerWorker, _Staged
from .shares import PUSH_SHARE, Share

__all__ = ["PushProducer"]

log = logging.getLogger(__name__)


@dataclass
class _PushTarget:
    """One consumer rank a request's KV is pushed to."""

    address: str
    stream: LayerStreamSender | None = None   # set by the consumer's ``reserved`` answer
    region: bytes = b""
    offset: int = 0
    posted: set[int] = field(default_factory=set)
    transfers: list[Transfer] = field(default_factory=list)
    ended: bool = False                        # landed or failed: counted as served


@dataclass
class _Push:
    """A request's push: the staged copy it streams, its targets, and its packed layers with
    the CUDA event each pack recorded (None on the CPU, where pack returns only once it copied)."""

    staged: _Staged
    targets: list[_PushTarget]
    packed: dict[int, "torch.cuda.Event | None"] = field(default_factory=dict)

    @property
    def awaiting_reservation(self) -> bool:
        return any(t.stream is None and not t.ended for t in self.targets)


class PushProducer(ProducerWorker):
    """The producer with push mode: a request whose save names consumer ranks
    (``PDDConnectorMetadata.pushes``) is streamed to them from the hooks of
    :class:`~.producer.ProducerWorker`; the rest is pulled as there."""

    def _init_worker(self, extra: dict) -> None:
        super()._init_worker(extra)
        self._pushes: dict[str, _Push] = {}   # req -> its push, while its staged copy lasts

    def _message_handlers(self) -> dict[str, Handler]:
        return {**super()._message_handlers(), "reserved": self._on_reserved, "refused": self._on_refused}

    def _progress(self) -> None:
        self._progress_pushes()
        super()._progress()

    def _staged_started(self, req_id: str, staged: _Staged, meta: PDDConnectorMetadata) -> None:
        """Asks each consumer rank this rank feeds for a push buffer. Rank ``r`` of ``tp``
        feeds consumer ranks ``r, r + tp, ...``: the one rank of its own index with equal TP
        sizes; with MLA (one latent, all ranks alike) also the ranks beyond a smaller TP size."""
        super()._staged_started(req_id, staged, meta)
        if req_id not in meta.pushes:
            return
        targets = [_PushTarget(address) for address in meta.pushes[req_id][self.tp_rank::self.tp_size]]
        self._pushes[req_id] = _Push(staged, targets)
        staged.shares[PUSH_SHARE] = Share(len(targets))
        for target in targets:
            self._peers.post(target.address, "reserve", req=req_id, nbytes=staged.buffer.nbytes,
                             num_layers=self.layout.num_layers, reply=self.address)

    def _layer_packed(self, layer: int, req_ids: list[str]) -> None:
        """Notes ``layer`` packed for the pushed requests and posts what is ready to go."""
        super()._layer_packed(layer, req_ids)
        pushing = [(req_id, self._pushes[req_id]) for req_id in req_ids if req_id in self._pushes]
        for _, push in pushing:
            push.packed[layer] = record_event(self.kv_device)
        if any(push.awaiting_reservation for _, push in pushing):
            self._pump()  # a reservation may have come back since the last layer
        for req_id, push in pushing:
            if self._pushes.get(req_id) is push:  # the pump may have ended it
                self._post_packed_layers(req_id, push)

    def _saved(self, req_id: str, staged: _Staged, late_layers: list[int]) -> None:
        super()._saved(req_id, staged, late_layers)
        push = self._pushes.get(req_id)
        if push is not None:
            push.packed.update(dict.fromkeys(late_layers, staged.packs_done))
            self._post_packed_layers(req_id, push)

    def _staged_dropped(self, req_id: str, staged: _Staged) -> None:
        super()._staged_dropped(req_id, staged)
        push = self._pushes.pop(req_id, None)
        if push is not None:
            self._stop_push(req_id, push)

    def _post_packed_layers(self, req_id: str, push: _Push) -> None:
        """Posts every packed layer (whose pack ran) to every reserved target that lacks it."""
        staged = push.staged
        for target in push.targets:
            if target.stream is None or target.ended:
                continue
            for layer, event in push.packed.items():
                if layer in target.posted or (event is not None and not event.query()):
                    continue
                lo, hi = staged.layer_range(layer)
                try:
                    transfer = target.stream.post(layer, [(staged.buffer.region, lo, target.region, target.offset + lo,
                                                           hi - lo)])
                except (TransferError, ValueError) as exc:  # StreamError is a ValueError
                    self._end_push_target(req_id, target, f"could not post layer {layer}: {exc}")
                    break
                target.posted.add(layer)
                target.transfers.append(transfer)

    def _on_reserved(self, message: Message, msg: dict) -> None:
        """A consumer rank's push buffer: believed only from the engine asked."""
        req = msg["req"]
        push = self._pushes.get(req)
        targets = push.targets if push is not None else []
        waiting = (t for t in targets if t.stream is None and not t.ended)
        target = next((t for t in waiting if self._peers.is_from(message, t.address)), None)
        if target is None:
            log.warning("PDDConnector: ignored a push buffer for %s from %s: no push of it waits for one", req,
                        message.sender)
            return
        try:
            target.stream = LayerStreamSender(self.engine, self._peers.connect(target.address), req.encode(),
                                              self.layout.num_layers)
        except (TransferError, ValueError) as exc:
            self._end_push_target(req, target, f"cannot stream to {target.address}: {exc}")
            return
        target.region, target.offset = bytes.fromhex(msg["region"]), msg["offset"]
        self._post_packed_layers(req, push)

    def _on_refused(self, message: Message, msg: dict) -> None:
        """The consumer would not take the push (its load pulls instead)."""
        req = msg["req"]
        push = self._pushes.get(req)
        for target in push.targets if push is not None else []:
            if not target.ended and self._peers.is_from(message, target.address):
                log.warning("PDDConnector: %s refused the push of %s (it pulls instead): %s", target.address, req,
                            msg["reason"])
                target.ended = True
                push.staged.shares[PUSH_SHARE].superseded = True
                return
        log.warning("PDDConnector: ignored a refusal of %s from %s, which was offered no push of it", req,
                    message.sender)

    def _progress_pushes(self) -> None:
        """Counts each target whose every layer landed (or whose stream failed) as served."""
        for req_id, push in list(self._pushes.items()):
            self._post_packed_layers(req_id, push)  # layers whose pack finished since
            for target in push.targets:
                if target.ended or target.stream is None:
                    continue
                failed = next((t for t in target.transfers if t.status in ("failed", "cancelled")), None)
                if failed is not None:
                    self._end_push_target(req_id, target, f"transfer {failed.error}")
                elif target.stream.complete and all(t.status == "done" for t in target.transfers):
                    self._end_push_target(req_id, target, None)
            self._finish_if_served(req_id)

    def _end_push_target(self, req_id: str, target: _PushTarget, failure: str | None) -> None:
        """A target's stream landed, or failed: then its consumer pulls instead (under its own
        share), so the staged copy stays for that pull."""
        target.ended = True
        share = self._pushes[req_id].staged.shares[PUSH_SHARE]
        if failure is None:
            share.answered.add(target.address)
        else:
            share.superseded = True
            log.warning("PDDConnector: push of %s to %s failed: %s", req_id, target.address, failure)
            self._peers.post(target.address, "stream_failed", req=req_id, reason=failure)

    def _stop_push(self, req_id: str, push: _Push) -> None:
        """The staged copy goes away: stops what is still in flight, so that it no longer reads
        the buffer, and tells the consumers whose stream stays incomplete."""
        for target in push.targets:
            if target.ended:
                continue
            if target.stream is not None:
                try:
                    target.stream.cancel()
                except TransferError as exc:
                    log.warning("PDDConnector: cancelling the push of %s to %s: %s", req_id, target.address, exc)
            target.ended = True
            self._peers.post(target.address, "stream_failed", req=req_id, reason="the producer dropped the request")
