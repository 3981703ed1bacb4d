"""The prefill side of one SGLang request: :class:`PDDKVSender` reports ``WaitingForInput``
once every decode rank it feeds has registered, then on each ``send(page_indices)`` packs
those pages (``pddcore.pack``, head-sliced when the TP sizes differ) into a pooled buffer and
writes them into each decode rank's staging buffer with a ``chunk`` notification; the last
chunk also carries the aux (metadata buffer) item.

``send`` runs on SGLang's scheduler thread and never waits on the GPU there: the pack is
queued on the current stream (after SGLang's early-send event, which the stream waits for),
an event is recorded after it, and the manager's :class:`~.._posting.Poster` thread waits on
that event before it posts the write, so the engine never reads a buffer the kernel is still
filling.

The decode rank's staging buffer, and one prefill rank's segment in it (layer-major, every
plane holding all ``num_pages`` pages; a chunk of ``n`` pages after ``sent`` fills pages
``sent .. sent + n`` of each plane)::

    [segment of prefill rank s0][segment of s1] ... [aux items]
    [layer 0 K: pages 0 .. num_pages-1][layer 0 V: ...][layer 1 K: ...] ...
"""

from __future__ import annotations

import functools
import time
from typing import Any, Optional

import numpy as np
import torch

from sglang.srt.disaggregation.base.conn import BaseKVSender, KVPoll, KVTransferMetric

from ...pack import pack
from ...transfer import Transfer
from .._device import on_device, record_event, stream_waits_for
from .._heads import destinations_of
from .._posting import PostedWrite, cancel_all
from .._staging import StagingBuffer
from .manager import PDDKVManager
from .protocol import MESSAGES, Registration, Unread
from .states import TERMINAL, PDDTransferError, state_indices_reason

__all__ = ["PDDKVSender"]


class PDDKVSender(BaseKVSender):
    """Prefill side of one request (``bootstrap_room``)."""

    def __init__(self, mgr: PDDKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False):
        self.kv_mgr, self.room = mgr, int(bootstrap_room)
        self._state = KVPoll.Bootstrapping
        self._failure: str | None = None
        self._num_pages: int | None = None
        self._aux_index: int | None = None
        self._sent_pages = 0
        self._chunk_idx = 0
        self._transfers: list[PostedWrite] = []
        self._buffers: list[StagingBuffer] = []
        self._decode_prefix_len: int | None = None
        self._started = time.monotonic()
        self._closed = False   # the last chunk went out
        self._bytes = 0
        # SGLang's early send of a cached prefix sets this CUDA event: the forward that writes
        # those pages may still be running on SGLang's forward stream when send() is called.
        self._early_send_wait_event: Any = None

    def _registrations(self) -> list[Registration] | None:
        box = self.kv_mgr.inbox(self.room)
        if box.unread is not None:  # MLA: no decode rank reads this rank; it sends nothing
            return []
        regs = box.registrations
        if not regs:
            return None
        mgr = self.kv_mgr
        if mgr.is_mla:  # decode ranks r, r + tp, ... read this rank's latent
            expected = len(range(mgr.rank, regs[0].d_tp, mgr.tp_size))
        else:
            expected = destinations_of(mgr.total_kv_heads, mgr.tp_size, regs[0].d_tp, mgr.rank)
        return list(regs) if len(regs) >= expected else None

    def _fail(self, reason: str, tell_peers: bool = True) -> None:
        if self._state == KVPoll.Failed:
            return
        self._failure, self._state = reason, KVPoll.Failed
        # Returns at once: each transfer's cancel (which waits for its peer's fence, up to the
        # engine's timeout_s when the peer is gone) runs on the poster's threads, and the buffers
        # go back once no write can read them any more, whether or not SGLang polls again.
        cancel_all(self._transfers, then=functools.partial(self._release, self._take_buffers()))
        if tell_peers:  # posted too: a notice to a peer gone may first wait on a reconnect
            for reg in self.kv_mgr.inbox(self.room).registrations:
                self.kv_mgr.peers.post(reg.peer_address, "fail", room=self.room, reason=reason)

    def _take_buffers(self) -> list[StagingBuffer]:
        buffers, self._buffers = self._buffers, []
        return buffers

    def _release(self, buffers: list[StagingBuffer]) -> None:
        for buf in buffers:
            self.kv_mgr.staging.release(buf)

    def poll(self) -> int:
        if self._state in TERMINAL:
            return self._state
        box = self.kv_mgr.inbox(self.room)
        if box.failure:
            self._fail(box.failure, tell_peers=False)
        elif self._state == KVPoll.Bootstrapping and self._registrations() is not None:
            self._state = KVPoll.WaitingForInput
        elif self._state == KVPoll.Bootstrapping and time.monotonic() - self._started > self.kv_mgr.bootstrap_timeout_s:
            # As SGLang's own senders: the decode side never registered, so the prefill's pages
            # would stay held for good; SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT relaxes it.
            self._fail(f"no decode rank registered within {self.kv_mgr.bootstrap_timeout_s:g} s (Bootstrapping; "
                       "raise SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT to wait longer)", tell_peers=False)
        elif self._state == KVPoll.Transferring:
            try:
                if all(t.done() for t in self._transfers) and self._sent_pages == self._num_pages:
                    self._release(self._take_buffers())
                    self._state = KVPoll.Success
            except Exception as exc:
                self._fail(f"transfer failed: {exc}")
        return self._state

    def _asked(self) -> list[Registration | Unread]:
        """What the decode side asked of this rank: its registrations, or its notice that no
        decode rank reads this one (each names the pages and ``decode_prefix_len``)."""
        unread = self.kv_mgr.inbox(self.room).unread
        return [unread] if unread is not None else self._registrations() or []

    def pop_decode_prefix_len(self) -> int:
        asked = self._asked()
        value = asked[0].decode_prefix_len if asked and self._decode_prefix_len is None else 0
        self._decode_prefix_len = value
        return value

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """A last chunk goes out even without pages (e.g. the decode side's prefix cache held
        them all): its notice closes the stream and carries the aux item, as with SGLang's
        ``CommonKVSender``."""
        return num_pages > 0 or last_chunk

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        if self._registrations() is None:
            raise RuntimeError(f"room {self.room}: init() before the decode side registered (poll WaitingForInput)")
        for reg in self._asked():
            if reg.num_pages != num_kv_indices:
                self._fail(f"decode rank {reg.d_rank} expects {reg.num_pages} pages, prefill sends {num_kv_indices}")
        self._num_pages, self._aux_index = int(num_kv_indices), aux_index

    def send(self, kv_indices: np.ndarray, state_indices: Optional[list] = None,
             num_kv_tokens: Optional[int] = None, **_: Any) -> None:
        if self._state == KVPoll.Failed:
            return
        if self._num_pages is None:
            raise RuntimeError(f"room {self.room}: send() before init()")
        reason = state_indices_reason(state_indices)
        if reason:
            return self._fail(reason)
        pages = torch.as_tensor(np.asarray(kv_indices, dtype=np.int64))
        n = int(pages.numel())
        if self._closed and n == 0:
            return  # an empty final segment after a chunk that already completed the pages
        if self._sent_pages + n > self._num_pages:
            return self._fail(f"{self._sent_pages} + {n} pages exceeds the {self._num_pages} announced in init()")
        forward_done, self._early_send_wait_event = self._early_send_wait_event, None
        with on_device(self.kv_mgr.device):
            stream_waits_for(self.kv_mgr.device, forward_done)  # the packs read what that forward writes
        last = self._sent_pages + n == self._num_pages
        try:
            for reg in self._registrations() or []:
                self._send_chunk(reg, pages, last)
        except Exception as exc:
            return self._fail(f"send failed: {exc}")
        self._sent_pages += n
        self._chunk_idx += 1
        self._closed = last
        self._state = KVPoll.Transferring

    def _send_chunk(self, reg: Registration, pages: torch.Tensor, last: bool) -> None:
        mgr, layout = self.kv_mgr, self.kv_mgr.layout
        if layout.packed_nbytes(reg.num_pages, heads=reg.src_heads) != reg.seg_bytes:
            raise ValueError(f"decode rank {reg.d_rank} staged {reg.seg_bytes} bytes for {reg.num_pages} pages, "
                             f"this prefill layout packs {layout.packed_nbytes(reg.num_pages, heads=reg.src_heads)}")
        ops = []
        packed = None
        n = int(pages.numel())
        if n:
            buf = mgr.staging.acquire(layout.packed_nbytes(n, heads=reg.src_heads))
            self._buffers.append(buf)
            with on_device(mgr.device):
                pack(layout, pages, heads=reg.src_heads, out=buf.tensor)
                packed = record_event(mgr.device)  # the poster posts the write once it completed
            # The decode segment is layer-major with every plane holding all reg.num_pages pages;
            # this chunk's pages go after the _sent_pages already written in each plane.
            src_off = dst_off = 0
            for layer in range(layout.num_layers):
                plane_page = layout.packed_nbytes(1, layers=[layer], heads=reg.src_heads) // layout.planes_per_layer
                for _ in range(layout.planes_per_layer):
                    ops.append((buf.region, src_off, reg.region, reg.offset + dst_off + self._sent_pages * plane_page,
                                n * plane_page))
                    src_off += n * plane_page
                    dst_off += reg.num_pages * plane_page
        if last and reg.aux_offset >= 0:
            dst = reg.aux_offset
            for region, item_len in zip(mgr._aux_regions, mgr.kv_args.aux_item_lens):
                ops.append((region, self._aux_index * item_len, reg.region, dst, item_len))
                dst += item_len
        notice = dict(room=self.room, src=mgr.rank, idx=self._chunk_idx, last=last)
        if ops:
            write = functools.partial(self._write, reg.peer_address, ops, MESSAGES.encode("chunk", **notice))
        else:  # nothing to move (an empty last chunk): the notice alone closes the stream
            write = functools.partial(mgr.peers.send, reg.peer_address, "chunk", **notice)
        # Posted in order from the manager's thread (a connect to a new peer does not stall the scheduler either).
        self._transfers.append(mgr.poster.post(write, after=packed, device=mgr.device))
        self._bytes += sum(op[4] for op in ops)

    def _write(self, address: str, ops: list, notify: bytes) -> Transfer:
        mgr = self.kv_mgr
        return mgr.engine.write_batch(mgr.peers.connect(address), ops, notify=notify)

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric(transfer_latency_s=time.monotonic() - self._started, transfer_total_bytes=self._bytes)

    def failure_exception(self) -> None:
        raise PDDTransferError(self.room, self._failure or f"state {self._state}")

    def abort(self) -> None:
        self._fail("aborted by the prefill side")

    def clear(self) -> None:
        if self._state not in TERMINAL:
            self._fail("cleared before the transfer finished")
        self.kv_mgr.drop_room(self.room)
