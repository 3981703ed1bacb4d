"""SGLang PD-disaggregation transfer backend on pddcore (tested with sglang 0.5.23).

Implements ``sglang.srt.disaggregation.base.conn``'s ``BaseKVManager``, ``BaseKVSender``,
``BaseKVReceiver`` and ``BaseKVBootstrapServer`` over :class:`pddcore.TransferEngine` (TCP):

* the prefill side's :class:`PDDKVManager` registers its engine address with the
  :class:`PDDKVBootstrapServer` (HTTP, ``disaggregation_bootstrap_port``);
* a decode :class:`PDDKVReceiver` looks the prefill ranks up there, allocates one staging
  buffer per request, and sends each prefill rank it needs a registration (its page count,
  ``decode_prefix_len``, head range, the staging region) on the priority lane;
* a prefill :class:`PDDKVSender` reports ``WaitingForInput`` once every decode rank it feeds
  has registered, then on each ``send(page_indices)`` packs those pages (``pddcore.pack``,
  head-sliced when the TP sizes differ) and writes them into the decode staging buffer; the
  last chunk also carries the aux (metadata buffer) item;
* the decode side unpacks (``pddcore.unpack``) into its pages only once every chunk from every
  prefill rank was verified and applied, so a page is never half written: ``Success``.

States follow ``KVPoll`` exactly: Bootstrapping -> WaitingForInput -> Transferring ->
Success | Failed; ``failure_exception()`` raises :class:`PDDTransferError` after ``Failed``.
An abort on either side fails the peer's side as well.

SGLang picks its backend from a closed enum; :func:`install` adds ``"pddcore"`` through
SGLang's plugin hook registry (``sglang.srt.plugins``; pddcore declares the entry point, so
``--disaggregation-transfer-backend pddcore`` works once pddcore is installed).
Not covered: per-request state buffers (``state_indices``: Mamba/SWA/DSA), MLA with differing
TP sizes, and the mooncake-only extras (staging handler, HiCache host destinations).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

import numpy as np
import torch

from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferMetric,
)

from ..layout import KVLayout
from ..pack import pack, unpack
from ..transfer import Peer, Region, Transfer, TransferEngine
from ._heads import destinations_of, head_sources

__all__ = ["PDDKVManager", "PDDKVSender", "PDDKVReceiver", "PDDKVBootstrapServer", "PDDTransferError",
           "PrefillInfo", "install", "BACKEND_NAME"]

log = logging.getLogger(__name__)

BACKEND_NAME = "pddcore"
_MAGIC = b"PDDSGL1"
_PUMP_WAIT_S = 0.02
_BOOTSTRAP_RETRY_S = 0.1


class PDDTransferError(Exception):
    """A request's KV transfer failed; ``bootstrap_room`` names the request."""

    def __init__(self, bootstrap_room: int, reason: str):
        super().__init__(f"room {bootstrap_room}: {reason}")
        self.bootstrap_room = bootstrap_room
        self.reason = reason


def _encode(kind: str, **fields: Any) -> bytes:
    return _MAGIC + json.dumps({"k": kind, **fields}).encode()


def _decode(payload: bytes) -> dict | None:
    if not payload.startswith(_MAGIC):
        return None
    return json.loads(payload[len(_MAGIC):])


def _mode_name(mode: Any) -> str:
    name = getattr(mode, "value", mode)
    if name not in ("prefill", "decode"):
        raise ValueError(f"disaggregation_mode must be prefill or decode, got {mode!r}")
    return name


# ---- bootstrap server --------------------------------------------------------------------------

class PDDKVBootstrapServer(BaseKVBootstrapServer):
    """HTTP registry of prefill ranks: ``PUT /route`` (a rank registers), ``GET /route``
    (all ranks). Started by the prefill server on ``disaggregation_bootstrap_port``."""

    def __init__(self, host: str, port: int):
        table: dict[str, Any] = {"ranks": {}}
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:  # noqa: N802 (http.server naming)
                if self.path != "/route":
                    return self._reply(404, {"error": f"unknown path {self.path}"})
                try:
                    info = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    rank, address = int(info["rank"]), str(info["address"])
                    shape = {k: info[k] for k in ("tp_size", "total_kv_heads", "is_mla", "page_size")}
                except (ValueError, KeyError, TypeError) as exc:
                    return self._reply(400, {"error": f"bad registration: {exc}"})
                with lock:
                    if table["ranks"] and any(table.get(k) != v for k, v in shape.items()):
                        return self._reply(409, {"error": f"rank {rank} disagrees with registered shape {table}"})
                    table.update(shape)
                    table["ranks"][str(rank)] = address
                self._reply(200, {"ok": True})

            def do_GET(self) -> None:  # noqa: N802
                if self.path != "/route":
                    return self._reply(404, {"error": f"unknown path {self.path}"})
                with lock:
                    self._reply(200, json.loads(json.dumps(table)))

            def log_message(self, *args: Any) -> None:
                return

        self.host, self.port = host, int(port)
        self._server = ThreadingHTTPServer((host, self.port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="pdd-bootstrap", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _http(method: str, url: str, body: dict | None = None, timeout: float = 5.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


# ---- manager -------------------------------------------------------------------------------------

@dataclass
class _Registration:
    """A decode rank's request for one prefill rank's share of a room."""

    peer_address: str
    d_rank: int
    d_tp: int
    region: bytes
    offset: int
    seg_bytes: int
    num_pages: int
    src_heads: tuple[int, int] | None
    aux_offset: int
    aux_index: int
    decode_prefix_len: int


@dataclass
class _RoomInbox:
    registrations: list[_Registration] = field(default_factory=list)
    failure: str | None = None
    chunks: dict[int, set[int]] = field(default_factory=dict)
    last_chunk: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PrefillInfo:
    """A prefill server's parallel layout as its ranks registered it at the bootstrap server;
    the entries of ``PDDKVManager.prefill_info_table`` that SGLang's decode queue reads."""

    tp_size: int
    total_kv_heads: int
    is_mla: bool
    page_size: int
    ranks: dict[int, str]
    dp_size: int = 1
    follow_bootstrap_room: bool = True

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size


class PDDKVManager(BaseKVManager):
    """One per (prefill or decode) scheduler rank: the KV pool's :class:`KVLayout`, a
    :class:`TransferEngine`, and a thread that routes incoming messages to rooms.

    ``args.engine_rank`` is the attention-TP rank; the TP size is
    ``args.total_kv_head_num // args.kv_head_num`` (``server_args.tp_size`` for MLA).
    Set ``PDDCORE_AUTH_TOKEN`` on both sides to authenticate every connection.
    """

    supports_role_switch = False

    def __init__(self, args: KVArgs, disaggregation_mode: Any, server_args: Any,
                 is_mla_backend: Optional[bool] = False):
        self.kv_args = args
        self.mode = _mode_name(disaggregation_mode)
        self.server_args = server_args
        self.is_mla = bool(is_mla_backend)
        self.layout = KVLayout.from_sglang_kv_args(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens,
                                                   args.page_size, num_kv_heads=1 if self.is_mla else args.kv_head_num,
                                                   is_mla=self.is_mla)
        self.rank = int(args.engine_rank)
        if self.is_mla:
            self.tp_size = int(getattr(server_args, "tp_size", 1))
            self.total_kv_heads = 1
        else:
            if args.total_kv_head_num % args.kv_head_num:
                raise ValueError(f"total_kv_head_num={args.total_kv_head_num} is not a multiple of "
                                 f"kv_head_num={args.kv_head_num}")
            self.tp_size = args.total_kv_head_num // args.kv_head_num
            self.total_kv_heads = int(args.total_kv_head_num)
        self.host = getattr(server_args, "host", "127.0.0.1") or "127.0.0.1"
        self.engine = TransferEngine(listen=f"{self.host}:0", auth_token=os.environ.get("PDDCORE_AUTH_TOKEN"))
        self._aux_regions: list[Region] = []
        if self.mode == "prefill":
            self._aux_regions = [self.engine.register_pointer(p, n)
                                 for p, n in zip(args.aux_data_ptrs, args.aux_data_lens)]
        self._peers: dict[str, Peer] = {}
        self._lock = threading.Lock()
        self.prefill_info_table: dict[str, PrefillInfo] = {}
        self._rooms: dict[int, _RoomInbox] = {}
        self._receivers: dict[int, PDDKVReceiver] = {}
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._pump_messages, name=f"pdd-{self.mode}-{self.rank}", daemon=True)
        self._pump.start()
        if self.mode == "prefill":
            self.register_to_bootstrap()

    # -- bootstrap -----------------------------------------------------------------------------
    def register_to_bootstrap(self) -> None:
        """Publishes this prefill rank's engine address at the bootstrap server."""
        port = getattr(self.server_args, "disaggregation_bootstrap_port")
        _http("PUT", f"http://{self.host}:{port}/route", {
            "rank": self.rank, "address": self.engine.address, "tp_size": self.tp_size,
            "total_kv_heads": self.total_kv_heads, "is_mla": self.is_mla, "page_size": self.kv_args.page_size})

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode side: fetches the prefill layout behind ``bootstrap_addr`` ("host:port") into
        :attr:`prefill_info_table`; False while not every prefill rank has registered."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        try:
            table = _http("GET", f"http://{bootstrap_addr}/route", timeout=1.0)
        except (urllib.error.URLError, OSError, ValueError):
            return False
        if not table.get("ranks") or len(table["ranks"]) < table["tp_size"]:
            return False
        self.prefill_info_table[bootstrap_addr] = PrefillInfo(
            table["tp_size"], table["total_kv_heads"], table["is_mla"], table["page_size"],
            {int(r): a for r, a in table["ranks"].items()})
        return True

    def clear_deferred_abort_state(self, room: int) -> None:
        """SGLang calls this when it releases a failed request; nothing is deferred here."""
        self.drop_room(room)

    # -- plumbing ------------------------------------------------------------------------------
    def peer(self, address: str) -> Peer:
        with self._lock:
            if address not in self._peers or not self._peers[address].connected:
                self._peers[address] = self.engine.connect(address)
            return self._peers[address]

    def inbox(self, room: int) -> _RoomInbox:
        with self._lock:
            return self._rooms.setdefault(room, _RoomInbox())

    def drop_room(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)
            self._receivers.pop(room, None)

    def send_control(self, address: str, kind: str, **fields: Any) -> None:
        try:
            self.engine.send(self.peer(address), _encode(kind, **fields))
        except Exception as exc:  # the peer may be gone already; its own timeout covers it
            log.warning("pddcore: could not send %s to %s: %s", kind, address, exc)

    def _pump_messages(self) -> None:
        while not self._stop.is_set():
            try:
                messages = self.engine.poll_messages(timeout=_PUMP_WAIT_S)
            except Exception:
                return  # engine closed
            for sender_address, payload in messages:
                msg = _decode(payload)
                if msg is None:
                    log.warning("pddcore: ignoring a foreign message from %s", sender_address)
                    continue
                self._dispatch(sender_address, msg)

    def _dispatch(self, sender_address: str, msg: dict) -> None:
        room = int(msg["room"])
        box = self.inbox(room)
        if msg["k"] == "reg":
            box.registrations.append(_Registration(
                sender_address, msg["d_rank"], msg["d_tp"], bytes.fromhex(msg["region"]), msg["offset"],
                msg["seg_bytes"], msg["num_pages"], tuple(msg["src_heads"]) if msg["src_heads"] else None,
                msg["aux_offset"], msg["aux_index"], msg["decode_prefix_len"]))
        elif msg["k"] == "fail":
            box.failure = box.failure or f"peer {sender_address}: {msg['reason']}"
        elif msg["k"] == "chunk":
            box.chunks.setdefault(msg["src"], set()).add(msg["idx"])
            if msg["last"]:
                box.last_chunk[msg["src"]] = msg["idx"]
        with self._lock:
            receiver = self._receivers.get(room)
        if receiver is not None:
            receiver._on_message()

    def close(self) -> None:
        self._stop.set()
        self._pump.join()
        self.engine.close()


# ---- prefill side ---------------------------------------------------------------------------------

class PDDKVSender(BaseKVSender):
    """Prefill side of one request (``bootstrap_room``)."""

    def __init__(self, mgr: PDDKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False):
        self.mgr, self.room = mgr, int(bootstrap_room)
        self._state = KVPoll.Bootstrapping
        self._failure: str | None = None
        self._num_pages: int | None = None
        self._aux_index: int | None = None
        self._sent_pages = 0
        self._chunk_idx = 0
        self._transfers: list[tuple[Transfer, Region]] = []
        self._decode_prefix_len: int | None = None
        self._started = time.monotonic()
        self._bytes = 0

    def _registrations(self) -> list[_Registration] | None:
        regs = self.mgr.inbox(self.room).registrations
        if not regs:
            return None
        expected = destinations_of(self.mgr.total_kv_heads, self.mgr.tp_size, regs[0].d_tp, self.mgr.rank) \
            if not self.mgr.is_mla else 1
        return list(regs) if len(regs) >= expected else None

    def _fail(self, reason: str, tell_peers: bool = True) -> None:
        if self._state == KVPoll.Failed:
            return
        self._failure, self._state = reason, KVPoll.Failed
        for transfer, _ in self._transfers:
            transfer.cancel()
        if tell_peers:
            for reg in self.mgr.inbox(self.room).registrations:
                self.mgr.send_control(reg.peer_address, "fail", room=self.room, reason=reason)

    def poll(self) -> int:
        if self._state in (KVPoll.Success, KVPoll.Failed):
            return self._state
        box = self.mgr.inbox(self.room)
        if box.failure:
            self._fail(box.failure, tell_peers=False)
        elif self._state == KVPoll.Bootstrapping and self._registrations() is not None:
            self._state = KVPoll.WaitingForInput
        elif self._state == KVPoll.Transferring:
            try:
                if all(t.done() for t, _ in self._transfers) and self._sent_pages == self._num_pages:
                    self._release()
                    self._state = KVPoll.Success
            except Exception as exc:
                self._fail(f"transfer failed: {exc}")
        return self._state

    def pop_decode_prefix_len(self) -> int:
        regs = self._registrations() or []
        value = regs[0].decode_prefix_len if regs and self._decode_prefix_len is None else 0
        self._decode_prefix_len = value
        return value

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        regs = self._registrations()
        if regs is None:
            raise RuntimeError(f"room {self.room}: init() before the decode side registered (poll WaitingForInput)")
        for reg in regs:
            if reg.num_pages != num_kv_indices:
                self._fail(f"decode rank {reg.d_rank} expects {reg.num_pages} pages, prefill sends {num_kv_indices}")
        self._num_pages, self._aux_index = int(num_kv_indices), aux_index

    def send(self, kv_indices: np.ndarray, state_indices: Optional[list] = None,
             num_kv_tokens: Optional[int] = None, **_: Any) -> None:
        if self._state == KVPoll.Failed:
            return
        if self._num_pages is None:
            raise RuntimeError(f"room {self.room}: send() before init()")
        if state_indices is not None and any(s is not None for s in state_indices):
            raise ValueError("the pddcore backend moves KV pages and aux data only, not state_indices")
        pages = torch.as_tensor(np.asarray(kv_indices, dtype=np.int64))
        n = int(pages.numel())
        if self._sent_pages + n > self._num_pages:
            raise ValueError(f"room {self.room}: {self._sent_pages} + {n} pages exceeds the {self._num_pages} "
                             f"announced in init()")
        last = self._sent_pages + n == self._num_pages
        try:
            for reg in self._registrations() or []:
                self._send_chunk(reg, pages, last)
        except Exception as exc:
            self._fail(f"send failed: {exc}")
            return
        self._sent_pages += n
        self._chunk_idx += 1
        self._state = KVPoll.Transferring

    def _send_chunk(self, reg: _Registration, pages: torch.Tensor, last: bool) -> None:
        layout, mgr = self.mgr.layout, self.mgr
        if layout.packed_nbytes(reg.num_pages, heads=reg.src_heads) != reg.seg_bytes:
            raise ValueError(f"decode rank {reg.d_rank} staged {reg.seg_bytes} bytes for {reg.num_pages} pages, "
                             f"this prefill layout packs {layout.packed_nbytes(reg.num_pages, heads=reg.src_heads)}")
        ops = []
        src_region = None
        n = int(pages.numel())
        if n:
            buf = pack(layout, pages, heads=reg.src_heads)
            src_region = mgr.engine.register(buf)
            src_off = dst_off = 0
            for layer in range(layout.num_layers):
                plane_page = layout.packed_nbytes(1, layers=[layer], heads=reg.src_heads) // layout.planes_per_layer
                for _ in range(layout.planes_per_layer):
                    ops.append((src_region, src_off, reg.region, reg.offset + dst_off + self._sent_pages * plane_page,
                                n * plane_page))
                    src_off += n * plane_page
                    dst_off += reg.num_pages * plane_page
        if last and reg.aux_offset >= 0:
            dst = reg.aux_offset
            for region, item_len in zip(mgr._aux_regions, self.mgr.kv_args.aux_item_lens):
                ops.append((region, self._aux_index * item_len, reg.region, dst, item_len))
                dst += item_len
        note = _encode("chunk", room=self.room, src=mgr.rank, idx=self._chunk_idx, last=last)
        if not ops:  # nothing to move (an empty last chunk): the notice alone closes the stream
            mgr.send_control(reg.peer_address, "chunk", room=self.room, src=mgr.rank, idx=self._chunk_idx, last=last)
            return
        transfer = mgr.engine.write_batch(mgr.peer(reg.peer_address), ops, notify=note)
        self._bytes += sum(op[4] for op in ops)
        self._transfers.append((transfer, src_region))

    def _release(self) -> None:
        for _, region in self._transfers:
            if region is not None:
                self.mgr.engine.unregister(region)
        self._transfers = [(t, None) for t, _ in self._transfers]

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric(transfer_latency_s=time.monotonic() - self._started, transfer_total_bytes=self._bytes)

    def failure_exception(self) -> None:
        raise PDDTransferError(self.room, self._failure or f"state {self._state}")

    def abort(self) -> None:
        self._fail("aborted by the prefill side")

    def clear(self) -> None:
        self.mgr.drop_room(self.room)


# ---- decode side -----------------------------------------------------------------------------------

class PDDKVReceiver(BaseKVReceiver):
    """Decode side of one request: bootstraps against ``bootstrap_addr`` ("host:port")."""

    def __init__(self, mgr: PDDKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None,
                 timeout_s: float = float(os.environ.get("PDDCORE_SGLANG_TIMEOUT_S", 300))):
        self.mgr, self.bootstrap_addr, self.room = mgr, bootstrap_addr, int(bootstrap_room or 0)
        self._state = KVPoll.Bootstrapping
        self._failure: str | None = None
        self._sources: list = []
        self._addresses: dict[int, str] = {}
        self._next_try = 0.0
        self._deadline = time.monotonic() + timeout_s
        self._staging: torch.Tensor | None = None
        self._region: Region | None = None
        self._segments: list[tuple[int, int, Any]] = []
        self._aux_offset = -1
        self._aux_index: int | None = None
        self._pages: torch.Tensor | None = None
        self._done_lock = threading.Lock()
        with mgr._lock:
            mgr._receivers[self.room] = self
        self._try_bootstrap()

    @property
    def supports_host_destination(self) -> bool:
        return False

    def _try_bootstrap(self) -> None:
        now = time.monotonic()
        if now < self._next_try:
            return
        self._next_try = now + _BOOTSTRAP_RETRY_S
        mgr = self.mgr
        if not mgr.try_ensure_parallel_info(self.bootstrap_addr):
            return
        info = mgr.prefill_info_table[self.bootstrap_addr]
        if info.is_mla != mgr.is_mla or info.page_size != mgr.kv_args.page_size:
            return self._fail(f"prefill pool (mla={info.is_mla}, page_size={info.page_size}) does not match "
                              f"decode pool (mla={mgr.is_mla}, page_size={mgr.kv_args.page_size})", tell_peers=False)
        if mgr.is_mla:
            if info.tp_size != mgr.tp_size:
                return self._fail("MLA with differing prefill/decode TP sizes is not supported", tell_peers=False)
            self._sources = [(mgr.rank, None, None)]
        else:
            if info.total_kv_heads != mgr.total_kv_heads:
                return self._fail(f"prefill has {info.total_kv_heads} KV heads, decode {mgr.total_kv_heads}",
                                  tell_peers=False)
            full, per_src = (0, mgr.total_kv_heads // mgr.tp_size), mgr.total_kv_heads // info.tp_size
            self._sources = [(s.src_rank, None if s.src_heads == (0, per_src) else s.src_heads,
                              None if s.dst_heads == full else s.dst_heads)
                             for s in head_sources(mgr.total_kv_heads, info.tp_size, mgr.tp_size, mgr.rank)]
        self._addresses = info.ranks
        self._state = KVPoll.WaitingForInput

    def init(self, prefill_dp_rank: int = 0) -> None:
        return None

    def send_metadata(self, kv_indices: np.ndarray, aux_index: Optional[int] = None,
                      state_indices: Optional[list] = None, decode_prefix_len: Optional[int] = None,
                      destination: Any = None) -> None:
        if self._state != KVPoll.WaitingForInput:
            raise RuntimeError(f"room {self.room}: send_metadata() in state {self._state}, need WaitingForInput")
        if state_indices is not None and any(s is not None for s in state_indices):
            raise ValueError("the pddcore backend moves KV pages and aux data only, not state_indices")
        mgr, layout = self.mgr, self.mgr.layout
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
        self._staging = torch.empty(max(offset + aux_bytes, 1), dtype=torch.uint8)
        self._region = mgr.engine.register(self._staging)
        self._pages, self._aux_index = pages, aux_index
        self._state = KVPoll.Transferring
        for i, (src_rank, seg_off, nbytes, src_heads, _) in enumerate(self._segments):
            mgr.send_control(self._addresses[src_rank], "reg", room=self.room, d_rank=mgr.rank, d_tp=mgr.tp_size,
                             region=self._region.descriptor().hex(), offset=seg_off, seg_bytes=nbytes, num_pages=n,
                             src_heads=list(src_heads) if src_heads else None,
                             aux_offset=self._aux_offset if i == 0 else -1,
                             aux_index=-1 if aux_index is None else int(aux_index),
                             decode_prefix_len=int(decode_prefix_len or 0))
        self._on_message()

    def _on_message(self) -> None:
        """Called by the manager's thread: completes the request once every chunk landed."""
        with self._done_lock:
            if self._state != KVPoll.Transferring:
                return
            box = self.mgr.inbox(self.room)
            if box.failure:
                return self._fail(box.failure, tell_peers=False)
            for src_rank, *_ in self._segments:
                last = box.last_chunk.get(src_rank)
                if last is None or len(box.chunks.get(src_rank, ())) != last + 1:
                    return
            try:
                self._apply()
            except Exception as exc:
                return self._fail(f"applying received KV failed: {exc}")
            self._state = KVPoll.Success

    def _apply(self) -> None:
        layout, staging = self.mgr.layout, self._staging
        for _, offset, nbytes, _, dst_heads in self._segments:
            if self._pages.numel():
                unpack(layout, self._pages, staging[offset:offset + nbytes], heads=dst_heads)
        if self._aux_offset >= 0:
            src = staging.data_ptr() + self._aux_offset
            for ptr, item_len in zip(self.mgr.kv_args.aux_data_ptrs, self.mgr.kv_args.aux_item_lens):
                ctypes.memmove(ptr + self._aux_index * item_len, src, item_len)
                src += item_len
        if layout.device.type == "cuda":
            torch.cuda.current_stream(layout.device).synchronize()
        self._release()

    def _release(self) -> None:
        if self._region is not None:
            self.mgr.engine.unregister(self._region)
            self._region, self._staging = None, None

    def _fail(self, reason: str, tell_peers: bool = True) -> None:
        if self._state in (KVPoll.Failed, KVPoll.Success):
            return
        self._failure, self._state = reason, KVPoll.Failed
        if tell_peers:
            for src_rank, *_ in self._sources:
                self.mgr.send_control(self._addresses[src_rank], "fail", room=self.room, reason=reason)

    def poll(self) -> int:
        failure = self.mgr.inbox(self.room).failure
        if failure:
            with self._done_lock:
                self._fail(failure, tell_peers=False)
        if self._state == KVPoll.Bootstrapping:
            self._try_bootstrap()
        if self._state not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() > self._deadline:
            self._fail(f"timed out in state {self._state}")
        return self._state

    def failure_exception(self) -> None:
        raise PDDTransferError(self.room, self._failure or f"state {self._state}")

    def abort(self) -> None:
        with self._done_lock:
            self._fail("aborted by the decode side")

    def clear(self) -> None:
        with self._done_lock:
            if self._state != KVPoll.Transferring:
                self._release()
        self.mgr.drop_room(self.room)


# ---- registration with SGLang ---------------------------------------------------------------------

def install() -> None:
    """Makes ``--disaggregation-transfer-backend pddcore`` select these classes.

    SGLang's ``TransferBackend`` is a closed enum and ``get_kv_class`` a fixed table, so this
    registers, through SGLang's own hook registry (``sglang.srt.plugins.hook_registry``), a
    REPLACE of the enum by one with a ``PDDCORE`` member and an AROUND hook on ``get_kv_class``
    that answers for it; every other backend is untouched. Idempotent. pddcore's
    ``sglang.srt.plugins`` entry point calls this in every SGLang process.
    """
    from enum import Enum

    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation import utils as disagg_utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND_NAME])
    current = disagg_utils.TransferBackend
    if "PDDCORE" not in current.__members__:
        extended = Enum("TransferBackend", {**{m.name: m.value for m in current}, "PDDCORE": BACKEND_NAME},
                        module=current.__module__)
        HookRegistry.register("sglang.srt.disaggregation.utils.TransferBackend", extended, HookType.REPLACE)
        classes = {"MANAGER": PDDKVManager, "SENDER": PDDKVSender, "RECEIVER": PDDKVReceiver,
                   "BOOTSTRAP_SERVER": PDDKVBootstrapServer, "KVARGS": KVArgs}

        def get_kv_class(original, transfer_backend, class_type):
            if getattr(transfer_backend, "value", transfer_backend) == BACKEND_NAME:
                return classes[class_type.name]
            return original(transfer_backend, class_type)

        HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", get_kv_class, HookType.AROUND)
    HookRegistry.apply_hooks()
