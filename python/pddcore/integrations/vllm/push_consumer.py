"""The consumer's half of push mode: push buffers reserved for producers, the layer streams
that fill them, and the loads that take them.

A producer rank's ``reserve`` (stream key: the producer's request id) gets a target buffer
from the :class:`~pddcore.integrations._staging.StagingPool`, registered for that engine
alone to be told of; the answer ``reserved`` names it. The producer's layer-stream
notifications (:mod:`pddcore.streaming`) are believed only from the engine that reserved the
buffer: each reservation feeds its own :class:`~pddcore.streaming.LayerStreamReceiver`,
found by ``(sender engine id, key)``, so another engine's stream of the same key reaches
nothing. Layers may land before the scheduler sees the request; ``start_load_kv`` of a
request with ``pdd_pushed`` claims the reservation of the engine it names (waiting for it
when it is not there yet) and the load completes as soon as the stream is complete.

A buffer nobody claims within ``lease_s`` is freed, like one whose stream failed: back to
the pool once its stream was complete, unregistered otherwise (the producer may still be
writing into it, so it must never serve another request).

Reservations, keyed by the reserving engine and the stream key::

    {(engine_id, b"p-req-7"): _Reservation(address="10.0.0.1:7000", nbytes=..., buffer=...)}
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ...pack import pack, unpack
from ...streaming import LayerStreamReceiver, StreamError, decode_notification
from ...transfer import Message, TransferError
from .._messages import MalformedMessage
from .._staging import StagingBuffer, StagingExhausted
from .base_worker import Handler
from .consumer import ConsumerWorker, _PendingLoad
from .layer_major import layer_major_layout
from .metadata import _Load, producer_addresses

__all__ = ["PushConsumer"]

log = logging.getLogger(__name__)

StreamId = tuple[int, bytes]   # (the producer engine's id, the stream key)


@dataclass
class _PushedLoad:
    """A load served from a push buffer: the stream it waits for, and which of the pushed
    pages it takes (``skip_pages`` the consumer's own prefix cache already held)."""

    stream: StreamId
    skip_pages: int
    total_pages: int


@dataclass
class _Reservation:
    """A push buffer handed to one producer engine for one stream."""

    address: str                      # the producer's reply address
    nbytes: int
    num_layers: int
    deadline: float                   # freed unless a load claimed it by then
    buffer: StagingBuffer | None
    receiver: LayerStreamReceiver = field(default_factory=LayerStreamReceiver)
    complete: bool = False
    failure: str | None = None
    load: str | None = None           # the consumer request that claimed it


class PushConsumer(ConsumerWorker):
    """The consumer with push mode: push buffers for producers, and the loads of pushed KV
    (``pdd_pushed``) taken from them; every other load is pulled as in
    :class:`~.consumer.ConsumerWorker`."""

    def _init_worker(self, extra: dict) -> None:
        super()._init_worker(extra)
        self._reservations: dict[StreamId, _Reservation] = {}
        self._pushed: dict[str, _PushedLoad] = {}   # consumer req -> the stream its load takes

    def _message_handlers(self) -> dict[str, Handler]:
        return {**super()._message_handlers(), "reserve": self._on_reserve, "stream_failed": self._on_stream_failed}

    def _on_notification(self, message: Message) -> bool:
        return self._on_stream_notification(message) or super()._on_notification(message)

    def _progress(self) -> None:
        super()._progress()
        self._expire_reservations()

    def _start(self, req_id: str, load: _Load) -> None:
        """A load of KV the producer pushes: from its rank this rank's heads come from (the
        rank of the same index; with MLA, as for a pull), under its request id as the key."""
        if not load.params.get("pdd_pushed"):
            super()._start(req_id, load)
            return
        params, remote_blocks = load.params, self._remote_blocks(load)
        addresses = producer_addresses(params)
        if not self.layout.is_mla and len(addresses) != self.tp_size:
            raise ValueError(f"pushed KV needs equal TP sizes (or MLA); the producer has {len(addresses)} ranks, "
                             f"this consumer {self.tp_size}")
        producer = self._peers.connect(addresses[self.tp_rank % len(addresses)])
        pending = _PendingLoad(req_id, load.local_block_ids, self._pages(load.local_block_ids), time.monotonic(),
                               load)
        self._pending_loads[req_id] = pending
        self._pushed[req_id] = _PushedLoad((producer.engine_id, str(params["remote_request_id"]).encode()),
                                           load.skip_blocks * self.pages_per_block,
                                           remote_blocks * self.pages_per_block)
        self._claim_push(pending)

    def _on_reserve(self, message: Message, msg: dict) -> None:
        key, reply = msg["req"], msg["reply"]
        if not self._peers.is_from(message, reply):
            raise MalformedMessage(f"reserve from {message.sender} names another engine ({reply}) to answer", key)
        stream = (message.sender_engine_id, key.encode())
        if stream in self._reservations:
            self._peers.post(reply, "refused", req=key, reason=f"a push buffer for {key} is reserved already")
            return
        problem, buffer = self._reservation_problem(msg["nbytes"], msg["num_layers"]), None
        if problem is None:
            try:
                buffer = self.staging.acquire(msg["nbytes"], target=True)
            except (StagingExhausted, TransferError) as exc:  # the arena is full, or registration refused
                problem = f"no push buffer: {exc}"
        reservation = self._reservations[stream] = _Reservation(
            reply, msg["nbytes"], msg["num_layers"], time.monotonic() + self.lease_s, buffer, failure=problem)
        if problem:
            self._peers.post(reply, "refused", req=key, reason=problem)
        else:
            self._peers.post(reply, "reserved", req=key, region=reservation.buffer.region.descriptor().hex(), offset=0)
        waiting = next((req for req, pushed in self._pushed.items() if pushed.stream == stream), None)
        if waiting is not None:
            self._claim_push(self._pending_loads[waiting])

    def _reservation_problem(self, nbytes: int, num_layers: int) -> str | None:
        if num_layers != self.layout.num_layers:
            return f"a stream of {num_layers} layers; this consumer has {self.layout.num_layers}"
        whole_pool = self.layout.packed_nbytes(self.layout.num_pages)
        if not 0 < nbytes <= whole_pool:
            return f"{nbytes} bytes; this consumer's whole KV cache packs to {whole_pool}"
        return None

    def _on_stream_notification(self, message: Message) -> bool:
        """Feeds a layer-stream notification to the stream it names; False for any other message."""
        if not message.notification:
            return False
        try:
            decoded = decode_notification(message.payload)
        except StreamError as exc:
            log.warning("PDDConnector: dropped a layer-stream notification from %s: %s", message.sender, exc)
            return True
        if decoded is None:
            return False
        stream = (message.sender_engine_id, decoded[0])
        reservation = self._reservations.get(stream)
        if reservation is None or reservation.buffer is None:
            log.warning("PDDConnector: ignored layer %d of stream %r from %s: that engine holds no push buffer "
                        "for it", decoded[3], decoded[0], message.sender)
            return True
        try:
            progress = reservation.receiver.feed(message)
            if progress.num_layers != reservation.num_layers:
                raise StreamError(f"{progress.num_layers} layers, {reservation.num_layers} were reserved")
        except StreamError as exc:
            self._end_reservation(stream, f"bad layer stream: {exc}")
            return True
        if progress.complete:
            reservation.complete = True
            if reservation.load is not None:
                self._finish_load(self._pending_loads[reservation.load])
        return True

    def _on_stream_failed(self, message: Message, msg: dict) -> None:
        stream = (message.sender_engine_id, msg["req"].encode())
        if stream in self._reservations:
            self._end_reservation(stream, f"the producer gave up: {msg['reason']}")

    def _end_reservation(self, stream: StreamId, failure: str) -> None:
        """The stream failed: its buffer goes, and the load that claimed it pulls instead; an
        unclaimed entry stays until its lease ends, so that a later load of it pulls at once."""
        reservation = self._reservations[stream]
        reservation.failure = failure
        self._discard_buffer(reservation)
        if reservation.load is not None:
            self._pull_instead(self._pending_loads[reservation.load], failure)

    def _claim_push(self, pending: _PendingLoad) -> None:
        """Ties ``pending`` to its stream's reservation once there is one; completes it when
        the stream already is."""
        pushed = self._pushed[pending.req_id]
        reservation = self._reservations.get(pushed.stream)
        if reservation is None:
            return  # the producer's reserve is still on its way
        expected = self.layout.packed_nbytes(pushed.total_pages)
        problem = (reservation.failure or (f"claimed by {reservation.load} already" if reservation.load else None)
                   or (f"{reservation.nbytes} bytes pushed, this layout needs {expected} (block geometry differs)"
                       if reservation.nbytes != expected else None))
        if problem is not None:
            del self._pushed[pending.req_id]  # the reservation is not this load's to free
            self._pull_instead(pending, f"pushed KV: {problem}")
            return
        reservation.load = pending.req_id
        if reservation.complete:
            self._finish_load(pending)

    def _unpack_load(self, pending: _PendingLoad) -> StagingBuffer | None:
        """A pushed load unpacks from its push buffer (through a scratch buffer when it takes
        only some of the pushed pages); any other as a pull."""
        pushed = self._pushed.get(pending.req_id)
        if pushed is None:
            return super()._unpack_load(pending)
        reservation = self._reservations[pushed.stream]
        if pushed.skip_pages == 0 and pushed.total_pages == len(pending.pages):
            unpack(self.layout, pending.pages, reservation.buffer.tensor)
            return None
        # Only some pages of every layer: gather them through a layout over the push buffer.
        part = self.staging.acquire(self.layout.packed_nbytes(len(pending.pages)))
        try:
            view = layer_major_layout(self.layout, pushed.total_pages, reservation.buffer.tensor,
                                      self.staging.buffer_device)
            pack(view, torch.arange(pushed.skip_pages, pushed.skip_pages + len(pending.pages)), out=part.tensor)
            unpack(self.layout, pending.pages, part.tensor)
        except Exception:
            self.staging.release(part)
            raise
        return part

    def _release_staging(self, pending: _PendingLoad) -> None:
        super()._release_staging(pending)
        pushed = self._pushed.pop(pending.req_id, None)
        if pushed is not None:
            self._free_reservation(pushed.stream)

    def _pull_instead(self, pending: _PendingLoad, reason: str) -> None:
        """The push of ``pending`` failed: the producer keeps its staged copy for a pull (the
        push's share stays open), so pull it; a failed pull fails the load."""
        log.warning("PDDConnector: push of %s failed (%s); pulling it", pending.req_id, reason)
        self._release_staging(pending)
        del self._pending_loads[pending.req_id]
        try:
            self._start_load(pending.req_id, pending.load)
        except Exception as exc:
            log.warning("PDDConnector: load of %s failed to start: %s", pending.req_id, exc)
            self._fail_load(pending.req_id, pending.block_ids)

    def _free_reservation(self, stream: StreamId) -> None:
        reservation = self._reservations.pop(stream, None)
        if reservation is not None:
            self._discard_buffer(reservation)

    def _discard_buffer(self, reservation: _Reservation) -> None:
        if reservation.buffer is None:
            return
        buffer, reservation.buffer = reservation.buffer, None
        if reservation.complete:
            self.staging.release(buffer)
        else:  # the producer may still write into it: withdrawn before it serves another request
            self.staging.discard(buffer)

    def _expire_reservations(self) -> None:
        now = time.monotonic()
        for stream, reservation in list(self._reservations.items()):
            if reservation.load is None and now > reservation.deadline:
                if reservation.failure is None:
                    log.warning("PDDConnector: nobody claimed the push buffer of %r from %s within its lease",
                                stream[1], reservation.address)
                self._free_reservation(stream)
