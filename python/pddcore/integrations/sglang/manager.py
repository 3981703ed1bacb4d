"""The per-rank half of the SGLang backend: :class:`PDDKVManager` holds the KV pool's
:class:`KVLayout`, a :class:`TransferEngine`, a :class:`StagingPool` and a thread that
checks every incoming message and files it in its room's :class:`RoomInbox`, where the
room's sender or receiver reads it; on the prefill side also a :class:`Poster` thread, from
which the senders' writes leave once their packs ran on the GPU.

Example (one per scheduler rank; SGLang makes them)::

    mgr = PDDKVManager(kv_args, DisaggregationMode.PREFILL, server_args)   # registers at the bootstrap server
    mgr.inbox(room).registrations       # the decode ranks' ``reg`` messages for that room
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
from sglang.srt.disaggregation.base.conn import BaseKVManager, KVArgs
from sglang.srt.environ import envs

from ...layout import KVLayout
from ...transfer import Message, Region, TransferEngine
from .._messages import MalformedMessage
from .._peers import HeldMessages, NotKnownYet, Peers
from .._posting import Poster
from .._staging import StagingPool
from .bootstrap import PrefillInfo, bootstrap_url, fetch_prefill_info, register_prefill_rank
from .config import STAGING_ENV, advertised_host, check_supported, kv_device, mode_name, staging_bytes
from .protocol import MESSAGES, Registration, Unread

__all__ = ["PDDKVManager", "RoomInbox", "RoomListener"]

log = logging.getLogger(__name__)

_PUMP_WAIT_S = 0.02


class RoomListener(Protocol):
    """What the manager's message thread calls on the decode side of a room (a
    :class:`~.receiver.PDDKVReceiver`), so that the manager needs nothing else of it."""

    def prefill_address(self, src_rank: int) -> str | None:
        """The engine address of prefill rank ``src_rank``, once known: only its chunk notices count."""

    def on_inbox_changed(self) -> None:
        """A message for the room was filed in its inbox."""


@dataclass
class RoomInbox:
    """What arrived for one room: decode registrations, or the notice that no decode rank
    reads this rank (prefill side), the first failure, and each prefill rank's chunk notices
    (decode side)."""

    registrations: list[Registration] = field(default_factory=list)
    unread: Unread | None = None
    failure: str | None = None
    chunks: dict[int, set[int]] = field(default_factory=dict)
    last_chunk: dict[int, int] = field(default_factory=dict)


class PDDKVManager(BaseKVManager):
    """One per (prefill or decode) scheduler rank: the KV pool's :class:`KVLayout`, a
    :class:`TransferEngine`, a :class:`StagingPool` and a thread that routes incoming messages
    to rooms.

    ``args.engine_rank`` is the attention-TP rank; the TP size is
    ``args.total_kv_head_num // args.kv_head_num`` (``server_args.tp_size`` for MLA). SGLang's
    decode side fills ``kv_head_num`` only with its staging buffer on; without it the decode
    rank learns its head count from the first prefill it bootstraps against (its page size over
    the prefill's bytes per head). ``PDDCORE_AUTH_TOKEN``, the same on both sides, authenticates
    every connection; an engine listening beyond loopback refuses to start without it, unless
    ``PDDCORE_INSECURE=1`` says the network is trusted.
    """

    supports_role_switch = False

    def __init__(self, args: KVArgs, disaggregation_mode: Any, server_args: Any,
                 is_mla_backend: Optional[bool] = False):
        check_supported(args, server_args)
        self.kv_args = args
        self.mode = mode_name(disaggregation_mode)
        self.server_args = server_args
        self.is_mla = bool(is_mla_backend)
        self.device = kv_device(args, server_args)
        self.rank = int(args.engine_rank)
        # How long a prefill request waits for its decode ranks to register, as SGLang's own managers.
        self.bootstrap_timeout_s = float(envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get())
        self.layout: KVLayout | None = None
        self.tp_size = self.kv_heads = self.total_kv_heads = 0
        if self.is_mla:
            self._use_heads(1, 1, tp_size=int(getattr(server_args, "tp_size", 1)))
        elif getattr(args, "kv_head_num", None):
            self._use_heads(int(args.kv_head_num), int(args.total_kv_head_num))
        self.host = advertised_host()
        self.engine = TransferEngine(listen=f"{self.host}:0", auth_token=os.environ.get("PDDCORE_AUTH_TOKEN"),
                                     insecure=os.environ.get("PDDCORE_INSECURE") == "1",
                                     tls_cert=os.environ.get("PDDCORE_TLS_CERT"),
                                     tls_key=os.environ.get("PDDCORE_TLS_KEY"), tls_ca=os.environ.get("PDDCORE_TLS_CA"))
        try:
            self.staging = StagingPool(self.engine, self.device, staging_bytes(),
                                       name=f"pddcore staging ({STAGING_ENV})")
        except Exception:
            self.engine.close()
            raise
        self._aux_regions: list[Region] = []
        if self.mode == "prefill":
            self._aux_regions = [self.engine.register_pointer(p, n)
                                 for p, n in zip(args.aux_data_ptrs, args.aux_data_lens)]
        self.peers = Peers(self.engine, MESSAGES, log)
        self._held = HeldMessages(log)   # messages waiting to learn who sent them (Peers.is_from)
        # Prefill: the senders' writes leave from this thread, each once its pack ran on the GPU.
        self.poster = Poster(f"pdd-post-{self.rank}") if self.mode == "prefill" else None
        self._lock = threading.Lock()
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self._rooms: dict[int, RoomInbox] = {}
        self._receivers: dict[int, RoomListener] = {}
        self._unpack_stream: "torch.cuda.Stream | None" = None
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._pump_messages, name=f"pdd-{self.mode}-{self.rank}", daemon=True)
        self._pump.start()
        if self.mode == "prefill":
            try:
                self.register_to_bootstrap()
            except Exception:
                self.close()
                raise

    def _use_heads(self, kv_heads: int, total_kv_heads: int, tp_size: int | None = None) -> None:
        """Builds :attr:`layout` for ``kv_heads`` heads per rank out of ``total_kv_heads``."""
        if kv_heads <= 0 or total_kv_heads % kv_heads:
            raise ValueError(f"total_kv_head_num={total_kv_heads} is not a multiple of kv_head_num={kv_heads}")
        args = self.kv_args
        self.layout = KVLayout.from_sglang_kv_args(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens,
                                                   args.page_size, device=self.device, num_kv_heads=kv_heads,
                                                   is_mla=self.is_mla)
        self.tp_size = tp_size or total_kv_heads // kv_heads
        self.kv_heads, self.total_kv_heads = kv_heads, total_kv_heads

    def ensure_layout(self, info: PrefillInfo) -> None:
        """Decode side without ``kv_head_num``: derives the head count from ``info``'s bytes
        per head; raises ValueError when this pool's pages do not hold whole prefill heads."""
        if self.layout is not None:
            return
        page_bytes = int(self.kv_args.kv_item_lens[0])
        if not info.head_page_bytes or page_bytes % info.head_page_bytes:
            raise ValueError(f"decode pages of {page_bytes} bytes do not hold whole prefill KV heads "
                             f"({info.head_page_bytes} bytes each)")
        self._use_heads(page_bytes // info.head_page_bytes, info.total_kv_heads)

    # -- bootstrap -----------------------------------------------------------------------------
    def register_to_bootstrap(self) -> None:
        """Publishes this prefill rank's engine address at the bootstrap server, retrying like
        SGLang's ``CommonKVManager``; raises RuntimeError once every attempt failed."""
        register_prefill_rank(bootstrap_url(self.server_args), {
            "rank": self.rank, "address": self.engine.address, "tp_size": self.tp_size,
            "total_kv_heads": self.total_kv_heads, "is_mla": self.is_mla, "page_size": self.kv_args.page_size,
            "head_page_bytes": 0 if self.is_mla else int(self.kv_args.kv_item_lens[0]) // self.kv_heads})

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode side: fetches the prefill layout behind ``bootstrap_addr`` ("host:port") into
        :attr:`prefill_info_table`; False while not every prefill rank has registered."""
        if bootstrap_addr not in self.prefill_info_table:
            info = fetch_prefill_info(bootstrap_addr)
            if info is None:
                return False
            self.prefill_info_table[bootstrap_addr] = info
        return True

    # -- what SGLang's queues call on their non-default paths ---------------------------------------
    def clear_deferred_abort_state(self, room: int) -> None:
        """SGLang calls this when it releases a failed request; nothing is deferred here."""
        self.drop_room(room)

    def is_abort_release_safe(self, room: int, required_acks: int = 0) -> bool:
        """Always True: peers write only into staging buffers, never into KV pages, so the pages
        of a failed request can be reused at once."""
        return True

    def submit_prefill_recompute(self, receiver: Any, payload: Any) -> None:
        """PD rebootstrap (retracted requests recomputed by the prefill) is not implemented:
        the request fails with that reason instead of waiting forever."""
        receiver.abort("the pddcore backend does not support PD rebootstrap (retract and recompute)")

    def unpack_stream(self) -> "torch.cuda.Stream | None":
        """The CUDA stream decode-side unpacks run on (None off CUDA): the backend's own, so that
        the message thread waits on an event after its unpack alone, never on the work SGLang
        queued on the device's default stream (a forward pass)."""
        if self.device.type != "cuda":
            return None
        with self._lock:
            if self._unpack_stream is None:
                self._unpack_stream = torch.cuda.Stream(self.device)
            return self._unpack_stream

    # -- plumbing ------------------------------------------------------------------------------
    def inbox(self, room: int) -> RoomInbox:
        with self._lock:
            return self._rooms.setdefault(room, RoomInbox())

    def add_receiver(self, room: int, receiver: RoomListener) -> None:
        """Routes ``room``'s chunk notices to ``receiver`` and wakes it on every message."""
        with self._lock:
            self._receivers[room] = receiver

    def drop_room(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)
            self._receivers.pop(room, None)

    def _pump_messages(self) -> None:
        while not self._stop.is_set():
            try:
                messages = self.engine.poll_messages(timeout=_PUMP_WAIT_S)
            except Exception as exc:
                if not self._stop.is_set():
                    log.error("pddcore: message pump stopped, the engine failed: %s", exc)
                return
            self._held.handle(messages, self._handle)

    def _handle(self, message: Message) -> None:
        room = None
        try:
            msg = MESSAGES.decode(message.payload)
            room = msg["room"]
            self._dispatch(message, msg)
        except NotKnownYet:
            raise  # held, and handled again once its sender is known
        except Exception as exc:  # one bad message must not stop every later transfer
            if isinstance(exc, MalformedMessage):
                room = exc.key
            log.warning("pddcore: dropped a message from %s (room %s): %s", message.sender, room, exc)
            if room is not None:
                self._fail_room(room, f"bad message from {message.sender}: {exc}")

    def _dispatch(self, message: Message, msg: dict) -> None:
        room, kind, sender_address = msg["room"], msg["k"], message.sender
        box = self.inbox(room)
        if kind == "reg":
            # KV is written only to the engine that registered: its address must lead back to it.
            if not self.peers.is_from(message, sender_address):
                raise ValueError(f"registration names {sender_address}, which is not the engine that sent it")
            box.registrations.append(Registration.from_message(sender_address, msg))
        elif kind == "unread":
            if not self.is_mla or self.rank < msg["d_tp"]:
                raise ValueError(f"decode rank {msg['d_rank']} says no decode rank reads prefill rank {self.rank}, "
                                 f"but with MLA and a decode TP of {msg['d_tp']} one does")
            box.unread = Unread.from_message(msg)
        elif kind == "fail":
            box.failure = box.failure or f"peer {sender_address}: {msg['reason']}"
        else:  # "chunk": MESSAGES admits no other kind
            with self._lock:
                receiver = self._receivers.get(room)
            source = receiver.prefill_address(msg["src"]) if receiver is not None else None
            if source is None or not self.peers.is_from(message, source):
                log.warning("pddcore: ignored a chunk notice for room %s from %s: not prefill rank %s of that room",
                            room, sender_address, msg["src"])
                return
            box.chunks.setdefault(msg["src"], set()).add(msg["idx"])
            if msg["last"]:
                box.last_chunk[msg["src"]] = msg["idx"]
        self._wake_receiver(room)

    def _fail_room(self, room: int, reason: str) -> None:
        box = self.inbox(room)
        box.failure = box.failure or reason
        self._wake_receiver(room)

    def _wake_receiver(self, room: int) -> None:
        with self._lock:
            receiver = self._receivers.get(room)
        if receiver is not None:
            receiver.on_inbox_changed()

    def close(self) -> None:
        self._stop.set()
        self._pump.join()
        if self.poster is not None:
            self.poster.close()
        self.peers.close()
        self.staging.close()
        self.engine.close()

