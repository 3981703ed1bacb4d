"""SGLang PD-disaggregation transfer backend on pddcore (tested with sglang 0.5.23).

Implements ``sglang.srt.disaggregation.base.conn``'s ``BaseKVManager``, ``BaseKVSender``,
``BaseKVReceiver`` and ``BaseKVBootstrapServer`` over :class:`pddcore.TransferEngine` (TCP):

* the prefill side's :class:`PDDKVManager` registers its engine address with the
  :class:`PDDKVBootstrapServer` (HTTP, ``disaggregation_bootstrap_port``);
* a decode :class:`PDDKVReceiver` looks the prefill ranks up there, takes one staging buffer
  per request from a pool of registered buffers, and sends each prefill rank it needs a
  registration (its page count, ``decode_prefix_len``, head range, the staging region) on the
  priority lane;
* a prefill :class:`PDDKVSender` reports ``WaitingForInput`` once every decode rank it feeds
  has registered, then on each ``send(page_indices)`` packs those pages (``pddcore.pack``,
  head-sliced when the TP sizes differ) into a pooled buffer and writes them into the decode
  staging buffer; the last chunk also carries the aux (metadata buffer) item;
* the decode side unpacks (``pddcore.unpack``) into its pages only once every chunk from every
  prefill rank was verified and applied, so a page is never half written and a peer never
  writes a KV page directly: ``Success``.

Staging buffers are pinned host memory when the KV lives on a GPU (``server_args.device``,
``KVArgs.gpu_id``), so the CUDA pack/unpack kernels read and write them directly.

States follow ``KVPoll`` exactly: Bootstrapping -> WaitingForInput -> Transferring ->
Success | Failed; ``failure_exception()`` raises :class:`PDDTransferError` after ``Failed``.
An abort on either side fails the peer's side as well; a malformed message fails only the
request it names.

Addresses follow SGLang's ``CommonKVManager``: the engine listens on, and publishes, the
local IP that ``sglang.srt.utils.network.get_local_ip_auto`` finds (``SGLANG_HOST_IP`` /
``HOST_IP``, ``SGLANG_LOCAL_IP_NIC``, else the default route's source address), or
``PDDCORE_SGLANG_HOST`` when set; prefill ranks register at the bootstrap server on
``dist_init_addr``'s host (multi-node) or ``--host`` (0.0.0.0 meaning this machine).

SGLang picks its backend from a closed enum; :func:`install` adds ``"pddcore"`` through
SGLang's plugin hook registry (``sglang.srt.plugins``; pddcore declares the entry point, so
``--disaggregation-transfer-backend pddcore`` works once pddcore is installed).
Not covered (a request that needs them fails with a clear reason): per-request state buffers
(``state_indices``: Mamba/SWA/DSA), MLA with differing TP sizes, PD rebootstrap
(``submit_prefill_recompute``), and the mooncake-only extras (SGLang's staging handler,
HiCache host destinations).
"""

from __future__ import annotations

import contextlib
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
from typing import Any, Callable, Optional

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
from sglang.srt.utils.network import NetworkAddress, get_local_ip_auto

from ..layout import KVLayout
from ..pack import pack, unpack
from ..transfer import Message, Peer, Region, Transfer, TransferEngine
from ._heads import destinations_of, head_sources
from ._staging import StagingBuffer, StagingPool

__all__ = ["PDDKVManager", "PDDKVSender", "PDDKVReceiver", "PDDKVBootstrapServer", "PDDTransferError",
           "PrefillInfo", "install", "kv_device", "advertised_host", "bootstrap_url", "BACKEND_NAME", "HOST_ENV"]

log = logging.getLogger(__name__)

BACKEND_NAME = "pddcore"
HOST_ENV = "PDDCORE_SGLANG_HOST"
_MAGIC = b"PDDSGL1"
_PUMP_WAIT_S = 0.02
_BOOTSTRAP_RETRY_S = 0.1
# Pauses between the prefill's registration attempts: CommonKVManager makes 5, doubling from 1 s.
_REGISTER_RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0)
_TERMINAL = (KVPoll.Success, KVPoll.Failed)


class PDDTransferError(Exception):
    """A request's KV transfer failed; ``bootstrap_room`` names the request."""

    def __init__(self, bootstrap_room: int, reason: str):
        super().__init__(f"room {bootstrap_room}: {reason}")
        self.bootstrap_room = bootstrap_room
        self.reason = reason


# ---- where things are ------------------------------------------------------------------------

def kv_device(kv_args: KVArgs, server_args: Any) -> torch.device:
    """The device of this rank's KV pool: ``server_args.device`` names the kind (SGLang resolves
    an unset one at launch; unset here means SGLang's default, CUDA) and ``kv_args.gpu_id`` the GPU."""
    kind = (getattr(server_args, "device", None) or "cuda").split(":")[0]
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        return torch.device("cuda", int(kv_args.gpu_id))
    raise ValueError(f"the pddcore backend moves KV on cpu or cuda, not on {kind!r}")


def advertised_host() -> str:
    """The address this rank's engine listens on and publishes to its peers:
    ``$PDDCORE_SGLANG_HOST``, else the local IP SGLang's own connectors publish."""
    host = os.environ.get(HOST_ENV) or get_local_ip_auto()
    if host in ("0.0.0.0", "::"):
        raise ValueError(f"{HOST_ENV}={host} is a wildcard; peers need an address of this machine they can reach")
    return host


def bootstrap_url(server_args: Any) -> str:
    """Where prefill ranks register, built as ``CommonKVManager.register_to_bootstrap`` does: the
    bootstrap server runs beside the first node, so multi-node ranks use ``dist_init_addr``'s host;
    on one node it is the HTTP server's ``host``, a wildcard meaning the loopback it also binds."""
    if server_args.dist_init_addr:
        host = NetworkAddress.parse(server_args.dist_init_addr).resolved().host
    else:
        host = server_args.host or "127.0.0.1"
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"{NetworkAddress(host, int(server_args.disaggregation_bootstrap_port)).to_url()}/route"


# ---- messages ----------------------------------------------------------------------------------

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hex(value: Any) -> bool:
    try:
        return isinstance(value, str) and bool(bytes.fromhex(value))
    except ValueError:
        return False


def _is_head_range(value: Any) -> bool:
    return value is None or (isinstance(value, list) and len(value) == 2 and all(map(_is_int, value)))


# Every message is _MAGIC + JSON {"k": kind, "room": int, **fields}; these are the fields each kind carries.
_FIELDS: dict[str, dict[str, Callable[[Any], bool]]] = {
    "reg": {"d_rank": _is_int, "d_tp": _is_int, "region": _is_hex, "offset": _is_int, "seg_bytes": _is_int,
            "num_pages": _is_int, "src_heads": _is_head_range, "aux_offset": _is_int, "aux_index": _is_int,
            "decode_prefix_len": _is_int},
    "fail": {"reason": lambda v: isinstance(v, str)},
    "chunk": {"src": _is_int, "idx": _is_int, "last": lambda v: isinstance(v, bool)},
}


class _MalformedMessage(ValueError):
    """A message that does not follow :data:`_FIELDS`; ``room`` is set when it names one."""

    def __init__(self, reason: str, room: int | None = None):
        super().__init__(reason)
        self.room = room


def _encode(kind: str, **fields: Any) -> bytes:
    return _MAGIC + json.dumps({"k": kind, **fields}).encode()


def _parse(payload: bytes) -> dict:
    """The message in ``payload``, checked against :data:`_FIELDS`; raises :class:`_MalformedMessage`."""
    if not payload.startswith(_MAGIC):
        raise _MalformedMessage("not a pddcore SGLang message")
    try:
        msg = json.loads(payload[len(_MAGIC):])
    except ValueError as exc:  # bad UTF-8 or bad JSON
        raise _MalformedMessage(f"bad JSON: {exc}") from None
    if not isinstance(msg, dict) or not _is_int(msg.get("room")):
        raise _MalformedMessage(f"no integer room in {str(msg)[:200]}")
    room, fields = msg["room"], _FIELDS.get(msg.get("k"))
    if fields is None:
        raise _MalformedMessage(f"unknown message kind {msg.get('k')!r}", room)
    bad = [name for name, valid in fields.items() if name not in msg or not valid(msg[name])]
    if bad:
        raise _MalformedMessage(f"{msg['k']!r} message with missing or mistyped {', '.join(bad)}", room)
    return msg


def _mode_name(mode: Any) -> str:
    name = getattr(mode, "value", mode)
    if name not in ("prefill", "decode"):
        raise ValueError(f"disaggregation_mode must be prefill or decode, got {mode!r}")
    return name


# ---- bootstrap server --------------------------------------------------------------------------

_SHAPE_KEYS = ("tp_size", "total_kv_heads", "is_mla", "page_size", "head_page_bytes")


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
                    shape = {k: info[k] for k in _SHAPE_KEYS}
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

    @classmethod
    def from_message(cls, peer_address: str, msg: dict) -> "_Registration":
        return cls(peer_address, msg["d_rank"], msg["d_tp"], bytes.fromhex(msg["region"]), msg["offset"],
                   msg["seg_bytes"], msg["num_pages"], tuple(msg["src_heads"]) if msg["src_heads"] else None,
                   msg["aux_offset"], msg["aux_index"], msg["decode_prefix_len"])


@dataclass
class _RoomInbox:
    registrations: list[_Registration] = field(default_factory=list)
    failure: str | None = None
    chunks: dict[int, set[int]] = field(default_factory=dict)
    last_chunk: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PrefillInfo:
    """A prefill server's parallel layout as its ranks registered it at the bootstrap server;
    the entries of ``PDDKVManager.prefill_info_table`` that SGLang's decode queue reads.
    ``head_page_bytes`` is one KV head's share of a page (0 for MLA)."""

    tp_size: int
    total_kv_heads: int
    is_mla: bool
    page_size: int
    ranks: dict[int, str]
    head_page_bytes: int = 0
    dp_size: int = 1
    follow_bootstrap_room: bool = True

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size


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
        self.kv_args = args
        self.mode = _mode_name(disaggregation_mode)
        self.server_args = server_args
        self.is_mla = bool(is_mla_backend)
        self.device = kv_device(args, server_args)
        self.rank = int(args.engine_rank)
        self.layout: KVLayout | None = None
        self.tp_size = self.kv_heads = self.total_kv_heads = 0
        if self.is_mla:
            self._use_heads(1, 1, tp_size=int(getattr(server_args, "tp_size", 1)))
        elif getattr(args, "kv_head_num", None):
            self._use_heads(int(args.kv_head_num), int(args.total_kv_head_num))
        self.host = advertised_host()
        self.engine = TransferEngine(listen=f"{self.host}:0", auth_token=os.environ.get("PDDCORE_AUTH_TOKEN"),
                                     insecure=os.environ.get("PDDCORE_INSECURE") == "1")
        self.staging = StagingPool(self.engine, self.device)
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
        url = bootstrap_url(self.server_args)
        body = {"rank": self.rank, "address": self.engine.address, "tp_size": self.tp_size,
                "total_kv_heads": self.total_kv_heads, "is_mla": self.is_mla, "page_size": self.kv_args.page_size,
                "head_page_bytes": 0 if self.is_mla else int(self.kv_args.kv_item_lens[0]) // self.kv_heads}
        attempts = len(_REGISTER_RETRY_DELAYS_S) + 1
        for attempt in range(1, attempts + 1):
            try:
                _http("PUT", url, body)
                return
            except urllib.error.HTTPError as exc:
                if exc.code < 500:  # the server refuses this registration: another try cannot help
                    raise RuntimeError(f"bootstrap server {url} refused prefill rank {self.rank}: "
                                       f"{exc.read().decode(errors='replace')}") from exc
                error: Exception = exc
            except (urllib.error.URLError, OSError, ValueError) as exc:
                error = exc
            log.warning("pddcore: registration attempt %d/%d at %s failed: %s", attempt, attempts, url, error)
            if attempt < attempts:
                time.sleep(_REGISTER_RETRY_DELAYS_S[attempt - 1])
        raise RuntimeError(f"prefill rank {self.rank} could not register at the bootstrap server {url} "
                           f"after {attempts} attempts: {error}")

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
            tp_size=table["tp_size"], total_kv_heads=table["total_kv_heads"], is_mla=table["is_mla"],
            page_size=table["page_size"], ranks={int(r): a for r, a in table["ranks"].items()},
            head_page_bytes=table["head_page_bytes"])
        return True

    # -- what SGLang's queues call on their non-default paths ---------------------------------------
    def clear_deferred_abort_state(self, room: int) -> None:
        """SGLang calls this when it releases a failed request; nothing is deferred here."""
        self.drop_room(room)

    def is_abort_release_safe(self, room: int, required_acks: int = 0) -> bool:
        """Always True: peers write only into staging buffers, never into KV pages, so the pages
        of a failed request can be reused at once."""
        return True

    def submit_prefill_recompute(self, receiver: "PDDKVReceiver", payload: Any) -> None:
        """PD rebootstrap (retracted requests recomputed by the prefill) is not implemented:
        the request fails with that reason instead of waiting forever."""
        receiver.abort("the pddcore backend does not support PD rebootstrap (retract and recompute)")

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
            except Exception as exc:
                if not self._stop.is_set():
                    log.error("pddcore: message pump stopped, the engine failed: %s", exc)
                return
            for message in messages:
                room = None
                try:
                    msg = _parse(message.payload)
                    room = msg["room"]
                    self._dispatch(message, msg)
                except Exception as exc:  # one bad message must not stop every later transfer
                    room = getattr(exc, "room", room)
                    log.warning("pddcore: dropped a message from %s (room %s): %s", message.sender, room, exc)
                    if room is not None:
                        self._fail_room(room, f"bad message from {message.sender}: {exc}")

    def _sent_by(self, message: Message, address: str) -> bool:
        """Whether ``message`` comes from the engine listening at ``address``."""
        return message.sender_engine_id == self.peer(address).engine_id

    def _dispatch(self, message: Message, msg: dict) -> None:
        room, kind, sender_address = msg["room"], msg["k"], message.sender
        box = self.inbox(room)
        if kind == "reg":
            # KV is written only to the engine that registered: its address must lead back to it.
            if not self._sent_by(message, sender_address):
                raise ValueError(f"registration names {sender_address}, which is not the engine that sent it")
            box.registrations.append(_Registration.from_message(sender_address, msg))
        elif kind == "fail":
            box.failure = box.failure or f"peer {sender_address}: {msg['reason']}"
        else:  # "chunk": _parse admits no other kind
            with self._lock:
                receiver = self._receivers.get(room)
            source = receiver._addresses.get(msg["src"]) if receiver is not None else None
            if source is None or not self._sent_by(message, source):
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
            receiver._on_message()

    def close(self) -> None:
        self._stop.set()
        self._pump.join()
        self.staging.close()
        self.engine.close()


# ---- prefill side ---------------------------------------------------------------------------------

def _state_indices_reason(state_indices: Optional[list]) -> str | None:
    """Why a request with these ``state_indices`` cannot be served, or None when it has none."""
    if state_indices is not None and any(s is not None for s in state_indices):
        return ("the pddcore backend moves KV pages and aux data only; this model's per-request state "
                "(state_indices: Mamba/SWA/DSA) needs another transfer backend")
    return None


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
        self._transfers: list[Transfer] = []
        self._buffers: list[StagingBuffer] = []
        self._decode_prefix_len: int | None = None
        self._started = time.monotonic()
        self._bytes = 0
        # SGLang's early send of a cached prefix sets this CUDA event: the forward that writes
        # those pages may still be running when send() is called.
        self._early_send_wait_event: Any = None

    def _registrations(self) -> list[_Registration] | None:
        regs = self.kv_mgr.inbox(self.room).registrations
        if not regs:
            return None
        mgr = self.kv_mgr
        expected = 1 if mgr.is_mla else destinations_of(mgr.total_kv_heads, mgr.tp_size, regs[0].d_tp, mgr.rank)
        return list(regs) if len(regs) >= expected else None

    def _fail(self, reason: str, tell_peers: bool = True) -> None:
        if self._state == KVPoll.Failed:
            return
        self._failure, self._state = reason, KVPoll.Failed
        for transfer in self._transfers:
            transfer.cancel()  # finishes it and purges its queued chunks: the engine stops reading our buffers
        self._release_buffers()
        if tell_peers:
            for reg in self.kv_mgr.inbox(self.room).registrations:
                self.kv_mgr.send_control(reg.peer_address, "fail", room=self.room, reason=reason)

    def _release_buffers(self) -> None:
        for buf in self._buffers:
            self.kv_mgr.staging.release(buf)
        self._buffers = []

    def poll(self) -> int:
        if self._state in _TERMINAL:
            return self._state
        box = self.kv_mgr.inbox(self.room)
        if box.failure:
            self._fail(box.failure, tell_peers=False)
        elif self._state == KVPoll.Bootstrapping and self._registrations() is not None:
            self._state = KVPoll.WaitingForInput
        elif self._state == KVPoll.Transferring:
            try:
                if all(t.done() for t in self._transfers) and self._sent_pages == self._num_pages:
                    self._release_buffers()
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
        reason = _state_indices_reason(state_indices)
        if reason:
            return self._fail(reason)
        pages = torch.as_tensor(np.asarray(kv_indices, dtype=np.int64))
        n = int(pages.numel())
        if self._sent_pages + n > self._num_pages:
            return self._fail(f"{self._sent_pages} + {n} pages exceeds the {self._num_pages} announced in init()")
        event, self._early_send_wait_event = self._early_send_wait_event, None
        if event is not None:
            event.synchronize()
        last = self._sent_pages + n == self._num_pages
        try:
            for reg in self._registrations() or []:
                self._send_chunk(reg, pages, last)
        except Exception as exc:
            return self._fail(f"send failed: {exc}")
        self._sent_pages += n
        self._chunk_idx += 1
        self._state = KVPoll.Transferring

    def _send_chunk(self, reg: _Registration, pages: torch.Tensor, last: bool) -> None:
        mgr, layout = self.kv_mgr, self.kv_mgr.layout
        if layout.packed_nbytes(reg.num_pages, heads=reg.src_heads) != reg.seg_bytes:
            raise ValueError(f"decode rank {reg.d_rank} staged {reg.seg_bytes} bytes for {reg.num_pages} pages, "
                             f"this prefill layout packs {layout.packed_nbytes(reg.num_pages, heads=reg.src_heads)}")
        ops = []
        n = int(pages.numel())
        if n:
            buf = mgr.staging.acquire(layout.packed_nbytes(n, heads=reg.src_heads))
            self._buffers.append(buf)
            pack(layout, pages, heads=reg.src_heads, out=buf.tensor)
            if layout.device.type == "cuda":  # the engine reads the buffer from its own threads
                torch.cuda.current_stream(layout.device).synchronize()
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
        if not ops:  # nothing to move (an empty last chunk): the notice alone closes the stream
            mgr.send_control(reg.peer_address, "chunk", **notice)
            return
        self._transfers.append(mgr.engine.write_batch(mgr.peer(reg.peer_address), ops,
                                                      notify=_encode("chunk", **notice)))
        self._bytes += sum(op[4] for op in ops)

    def get_transfer_metric(self) -> KVTransferMetric:
        return KVTransferMetric(transfer_latency_s=time.monotonic() - self._started, transfer_total_bytes=self._bytes)

    def failure_exception(self) -> None:
        raise PDDTransferError(self.room, self._failure or f"state {self._state}")

    def abort(self) -> None:
        self._fail("aborted by the prefill side")

    def clear(self) -> None:
        if self._state not in _TERMINAL:
            self._fail("cleared before the transfer finished")
        self.kv_mgr.drop_room(self.room)


# ---- decode side -----------------------------------------------------------------------------------

class PDDKVReceiver(BaseKVReceiver):
    """Decode side of one request: bootstraps against ``bootstrap_addr`` ("host:port")."""

    def __init__(self, mgr: PDDKVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None,
                 timeout_s: float = float(os.environ.get("PDDCORE_SGLANG_TIMEOUT_S", 300))):
        self.kv_mgr, self.bootstrap_addr, self.room = mgr, bootstrap_addr, int(bootstrap_room or 0)
        self._state = KVPoll.Bootstrapping
        self._failure: str | None = None
        self._sources: list = []
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
        with mgr._lock:
            mgr._receivers[self.room] = self
        self._try_bootstrap()

    # -- what SGLang's decode queues read --------------------------------------------------------
    @property
    def supports_host_destination(self) -> bool:
        return False

    @property
    def conclude_state(self) -> int | None:
        """``Success`` or ``Failed`` once the request has ended, else None."""
        return self._state if self._state in _TERMINAL else None

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
        reason = _state_indices_reason(state_indices)
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
        self._staging = mgr.staging.acquire(max(offset + aux_bytes, 1), target=True)
        self._pages, self._aux_index = pages, aux_index
        self._state = KVPoll.Transferring
        region = self._staging.region.descriptor().hex()
        for i, (src_rank, seg_off, nbytes, src_heads, _) in enumerate(self._segments):
            mgr.send_control(self._addresses[src_rank], "reg", room=self.room, d_rank=mgr.rank, d_tp=mgr.tp_size,
                             region=region, offset=seg_off, seg_bytes=nbytes, num_pages=n,
                             src_heads=list(src_heads) if src_heads else None,
                             aux_offset=self._aux_offset if i == 0 else -1,
                             aux_index=-1 if aux_index is None else int(aux_index),
                             decode_prefix_len=int(decode_prefix_len or 0))
        self._on_message()

    def _on_message(self) -> None:
        """Called by the manager's thread: completes the request once every chunk landed."""
        with self._done_lock:
            if self._state in _TERMINAL:
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
                self._apply()
            except Exception as exc:
                return self._fail(f"applying received KV failed: {exc}")
            self._state = KVPoll.Success

    def _apply(self) -> None:
        layout, staging = self.kv_mgr.layout, self._staging.tensor
        for _, offset, nbytes, _, dst_heads in self._segments:
            if self._pages.numel():
                unpack(layout, self._pages, staging[offset:offset + nbytes], heads=dst_heads)
        if self._aux_offset >= 0:
            src = staging.data_ptr() + self._aux_offset
            for ptr, item_len in zip(self.kv_mgr.kv_args.aux_data_ptrs, self.kv_mgr.kv_args.aux_item_lens):
                ctypes.memmove(ptr + self._aux_index * item_len, src, item_len)
                src += item_len
        if layout.device.type == "cuda":
            torch.cuda.current_stream(layout.device).synchronize()
        self.kv_mgr.staging.release(self._staging)
        self._staging = None

    def _fail(self, reason: str, tell_peers: bool = True) -> None:
        """Ends the request as Failed; callers hold ``_done_lock`` once the pump may be involved."""
        if self._state in _TERMINAL:
            return
        self._failure, self._state = reason, KVPoll.Failed
        if self._staging is not None:
            # A prefill write may still be on its way: unregistering makes the engine reject it,
            # and the buffer does not go back to the pool, where another request would get it.
            # Its memory stays referenced until clear(), past any write already being applied.
            with contextlib.suppress(ValueError):  # the region is gone already
                self.kv_mgr.engine.unregister(self._staging.region)
        if tell_peers:
            self._tell_peers(reason)

    def _tell_peers(self, reason: str) -> None:
        self._peers_told = True
        for address in self.bootstrap_infos:
            self.kv_mgr.send_control(address, "fail", room=self.room, reason=reason)

    def poll(self) -> int:
        failure = self.kv_mgr.inbox(self.room).failure
        if failure:
            with self._done_lock:
                self._fail(failure, tell_peers=False)
        if self._state == KVPoll.Bootstrapping:
            self._try_bootstrap()
        if self._state not in _TERMINAL and time.monotonic() > self._deadline:
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


# ---- registration with SGLang ---------------------------------------------------------------------

def install() -> None:
    """Makes ``--disaggregation-transfer-backend pddcore`` select these classes.

    Adds ``pddcore`` to the CLI's choices, then, since SGLang's ``TransferBackend`` is a closed
    enum and ``get_kv_class`` a fixed table, registers through SGLang's own hook registry
    (``sglang.srt.plugins.hook_registry``) a REPLACE of the enum by one with a ``PDDCORE``
    member and an AROUND hook on ``get_kv_class`` that answers for it; every other backend is
    untouched. Idempotent. pddcore's ``sglang.srt.plugins`` entry point calls this in every
    SGLang process. Where ``sglang.srt.disaggregation.utils`` does not import (it pulls in
    every model config, some of which need torchvision), the choice is still added: the
    scheduler processes, which cannot run without that module, hook the classes.
    """
    from enum import Enum

    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices

    if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND_NAME])
    try:
        from sglang.srt.disaggregation import utils as disagg_utils
    except ImportError as exc:
        log.info("pddcore: SGLang's disaggregation code does not import in this process (%s); the "
                 "backend's classes are hooked in the processes that import it", exc)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

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
