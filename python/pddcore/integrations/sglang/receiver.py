"""The decode side of one SGLang request: :class:`PDDKVReceiver` looks the prefill ranks up
at the bootstrap server, takes a staging buffer from the pool and sends each prefill rank it
needs a ``reg`` (its page count, ``decode_prefix_len``, head range, the staging region) on
the priority lane. It unpacks (``pddcore.unpack``) into its pages only once every chunk from
every prefill rank was verified and applied, so a page is never half written and a peer
never writes a KV page directly: ``Success``.

The staging buffer: one segment per prefill rank it pulls from, then the aux items::

    [segment of prefill rank s0][segment of s1] ... [aux items]     _segments: (rank, offset, nbytes, ...)
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Any, Optional

import numpy as np
import torch

from sglang.srt.disaggregation.base.conn import BaseKVReceiver, KVPoll

from ...pack import unpack
from .._device import on_device, on_stream, record_event
from .._heads import head_slices
from .._staging import StagingBuffer, StagingExhausted
from .manager import PDDKVManager
from .states import TERMINAL, PDDTransferError, state_indices_reason

__all__ = ["PDDKVReceiver"]

_BOOTSTRAP_RETRY_S = 0.1


class PDDKVReceiver(BaseKVReceiver):
    """Decode side of one request: bootstraps against ``bootstrap_addr`` ("host:port")."""

    def __init__(self, mgr: PDDKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None,
                 timeout_s: float = float(os.environ.get("PDDCORE_SGLANG_TIMEOUT_S", 300))):
        self.kv_mgr, self.bootstrap_addr, self.room = mgr, bootstrap_addr, int(bootstrap_room or 0)
        self._state = KVPoll.Bootstrapping
        self._failure: str | None = None
        self._sources: list = []
        self._unread: list[int] = []   # MLA: prefill ranks no decode rank reads, that this rank tells so
        self._addresses: dict[int, str] = {}
        self._peers_told = False
        self._next_try = 0.0
        self._deadline = time.monotonic() + timeout_s
        self._staging: StagingBuffer | None = None
        self._segments: list[tuple[int, int, int, Any, Any]] = []
        self._aux_offset = -1
        self._aux_index: int | None = None
        self._pages: torch.Tensor | None = None
        self._done_lock = threading.Lock()
        mgr.add_receiver(self.room, self)
        self._try_bootstrap()

    # -- what SGLang's decode queues read --------------------------------------------------------
    @property
    def supports_host_destination(self) -> bool:
        return False

    @property
    def conclude_state(self) -> int | None:
        """``Success`` or ``Failed`` once the request has ended, else None."""
        return self._state if self._state in TERMINAL else None

    @property
    def bootstrap_infos(self) -> list[str]:
        """The engine addresses of the prefill ranks this request pulls from."""
        return [self._addresses[src_rank] for src_rank, *_ in self._sources]

    @property
    def abort_notified(self) -> bool:
        """Whether the prefill ranks were told that this request failed."""
        return self._peers_told

    def ensure_abort_notified(self, force_arm: bool = False) -> None:
        with self._done_lock:
            if not self._peers_told:
                self._tell_peers(self._failure or "aborted by the decode side")

    def is_abort_release_safe(self) -> bool:
        """Always True: see :meth:`PDDKVManager.is_abort_release_safe`."""
        return True

    # -- protocol -------------------------------------------------------------------------------
    def _try_bootstrap(self) -> None:
        now = time.monotonic()
        if now < self._next_try:
            return
        self._next_try = now + _BOOTSTRAP_RETRY_S
        mgr = self.kv_mgr
        if not mgr.try_ensure_parallel_info(self.bootstrap_addr):
            return
        info = mgr.prefill_info_table[self.bootstrap_addr]
        if info.is_mla != mgr.is_mla or info.page_size != mgr.kv_args.page_size:
            return self._fail(f"prefill pool (mla={info.is_mla}, page_size={info.page_size}) does not match "
                              f"decode pool (mla={mgr.is_mla}, page_size={mgr.kv_args.page_size})", tell_peers=False)
        try:
            mgr.ensure_layout(info)
        except ValueError as exc:
            return self._fail(str(exc), tell_peers=False)
        if mgr.is_mla:  # every prefill rank holds the one latent: decode rank r reads prefill rank r % their TP
            self._sources = [(mgr.rank % info.tp_size, None, None)]
            # With the larger prefill TP, prefill ranks r + tp, r + 2 tp, ... are read by nobody:
            # this rank tells them, so that they send nothing and free the request.
            self._unread = list(range(mgr.rank + mgr.tp_size, info.tp_size, mgr.tp_size))
        else:
            if info.total_kv_heads != mgr.total_kv_heads:
                return self._fail(f"prefill has {info.total_kv_heads} KV heads, decode {mgr.total_kv_heads}",
                                  tell_peers=False)
            self._sources = head_slices(mgr.total_kv_heads, info.tp_size, mgr.tp_size, mgr.rank)
        self._addresses = info.ranks
        self._state = KVPoll.WaitingForInput

    def init(self, prefill_dp_rank: int = 0) -> None:
        return None

    def send_metadata(self, kv_indices: np.ndarray, aux_index: Optional[int] = None,
                      state_indices: Optional[list] = None, decode_prefix_len: Optional[int] = None,
                      destination: Any = None) -> None:
        if self._state != KVPoll.WaitingForInput:
            raise RuntimeError(f"room {self.room}: send_metadata() in state {self._state}, need WaitingForInput")
        reason = state_indices_reason(state_indices)
        if reason:
            with self._done_lock:
                return self._fail(reason)
        mgr, layout = self.kv_mgr, self.kv_mgr.layout
        pages = torch.as_tensor(np.asarray(kv_indices, dtype=np.int64))
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= layout.num_pages):
            raise ValueError(f"kv_indices hold a page outside [0, {layout.num_pages})")
        n = int(pages.numel())
        offset = 0
        self._segments = []
        for src_rank, src_heads, dst_heads in self._sources:
            nbytes = layout.packed_nbytes(n, heads=dst_heads)
            self._segments.append((src_rank, offset, nbytes, src_heads, dst_heads))
            offset += nbytes
        aux_bytes = sum(mgr.kv_args.aux_item_lens) if aux_index is not None else 0
        self._aux_offset = offset if aux_bytes else -1
        try:
            self._staging = mgr.staging.acquire(max(offset + aux_bytes, 1), target=True)
        except StagingExhausted as exc:
            with self._done_lock:
                return self._fail(str(exc))
        self._pages, self._aux_index = pages, aux_index
        self._state = KVPoll.Transferring
        region = self._staging.region.descriptor().hex()
        for i, (src_rank, seg_off, nbytes, src_heads, _) in enumerate(self._segments):
            mgr.peers.send(self._addresses[src_rank], "reg", room=self.room, d_rank=mgr.rank, d_tp=mgr.tp_size,
                             region=region, offset=seg_off, seg_bytes=nbytes, num_pages=n,
                             src_heads=list(src_heads) if src_heads else None,
                             aux_offset=self._aux_offset if i == 0 else -1,
                             aux_index=-1 if aux_index is None else int(aux_index),
                             decode_prefix_len=int(decode_prefix_len or 0))
        for src_rank in self._unread:
            mgr.peers.send(self._addresses[src_rank], "unread", room=self.room, d_rank=mgr.rank, d_tp=mgr.tp_size,
                           num_pages=n, decode_prefix_len=int(decode_prefix_len or 0))
        self.on_inbox_changed()

    def prefill_address(self, src_rank: int) -> str | None:
        """The engine address of prefill rank ``src_rank`` of this request's prefill, once known."""
        return self._addresses.get(src_rank)

    def on_inbox_changed(self) -> None:
        """The manager's message thread calls this after filing a message for this room:
        completes the request once every chunk landed, or fails it on a failure notice."""
        with self._done_lock:
            if self._state in TERMINAL:
                return
            box = self.kv_mgr.inbox(self.room)
            if box.failure:
                return self._fail(box.failure, tell_peers=False)
            if self._state != KVPoll.Transferring:
                return
            for src_rank, *_ in self._segments:
                last = box.last_chunk.get(src_rank)
                if last is None or len(box.chunks.get(src_rank, ())) != last + 1:
                    return
            try:
                with on_device(self.kv_mgr.device):  # the manager's message thread has GPU 0 current
                    self._apply()
            except Exception as exc:
                return self._fail(f"applying received KV failed: {exc}")
            self._state = KVPoll.Success

    def _apply(self) -> None:
        """Unpacks on the manager's unpack stream and waits on an event after the unpack (the
        pages are whole before ``Success``), then copies the aux item."""
        layout, staging = self.kv_mgr.layout, self._staging.tensor
        with on_stream(self.kv_mgr.unpack_stream()):
            for _, offset, nbytes, _, dst_heads in self._segments:
                if self._pages.numel():
                    unpack(layout, self._pages, staging[offset:offset + nbytes], heads=dst_heads)
            unpacked = record_event(self.kv_mgr.device)
        if unpacked is not None:
            unpacked.synchronize()
        if self._aux_offset >= 0:
            src = staging.data_ptr() + self._aux_offset
            for ptr, item_len in zip(self.kv_mgr.kv_args.aux_data_ptrs, self.kv_mgr.kv_args.aux_item_lens):
                ctypes.memmove(ptr + self._aux_index * item_len, src, item_len)
                src += item_len
        self.kv_mgr.staging.release(self._staging)
        self._staging = None

    def _fail(self, reason: str, tell_peers: bool = True) -> None:
        """Ends the request as Failed; callers hold ``_done_lock`` once the pump may be involved."""
        if self._state in TERMINAL:
            return
        self._failure, self._state = reason, KVPoll.Failed
        if self._staging is not None:
            # A prefill write may still be on its way: the pool withdraws the registration (the
            # engine then rejects it) before another request gets the buffer.
            staging, self._staging = self._staging, None
            self.kv_mgr.staging.discard(staging)
        if tell_peers:
            self._tell_peers(reason)

    def _tell_peers(self, reason: str) -> None:
        # Posted: on SGLang's scheduler thread, a notice to a prefill rank gone or frozen would
        # first wait on a reconnect (up to the engine's timeout_s).
        self._peers_told = True
        for address in self.bootstrap_infos + [self._addresses[src_rank] for src_rank in self._unread]:
            self.kv_mgr.peers.post(address, "fail", room=self.room, reason=reason)

    def poll(self) -> int:
        failure = self.kv_mgr.inbox(self.room).failure
        if failure:
            with self._done_lock:
                self._fail(failure, tell_peers=False)
        if self._state == KVPoll.Bootstrapping:
            self._try_bootstrap()
        if self._state not in TERMINAL and time.monotonic() > self._deadline:
            with self._done_lock:
                self._fail(f"timed out in state {self._state}")
        return self._state

    def failure_exception(self) -> None:
        raise PDDTransferError(self.room, self._failure or f"state {self._state}")

    def abort(self, reason: str = "aborted by the decode side") -> None:
        with self._done_lock:
            self._fail(reason)

    def clear(self) -> None:
        with self._done_lock:
            self._fail("cleared before the transfer finished")
            self._staging = None
        self.kv_mgr.drop_room(self.room)
