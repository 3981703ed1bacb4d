"""How reference engines move a prompt's KV between them, in vLLM's pull style.

A prefill engine answers a request that carries ``{"do_remote_decode": true}`` with the
``kv_transfer_params`` vLLM's disaggregation connectors return (``do_remote_prefill``,
``remote_engine_id``, ``remote_host``, ``remote_port``, ``remote_request_id``,
``remote_block_ids``) and keeps the request's pages under a lease. The decode engine that
gets those params pulls only the pages its own prefix cache lacks: it registers a target
buffer, asks the producer over the priority lane (``EPUL``), and the producer packs the
pages (:func:`pddcore.pack`) and writes them with a notification (``EKVD``), which arrives
only once every byte was verified and applied. A refused pull is answered ``EERR``.
``{"do_remote_decode": true, "pdd_consumers": N}`` keeps the KV for N pulls (RLD's and MD's,
in PDD), as pddcore's vLLM connector does.

SGLang's dialect pairs the two engines up front instead (:mod:`.sglang_server`): the gateway
sends both the same request at once, and the decode engine may ask for the pages before the
prefill engine has computed them. Such a pull says ``"wait": true``; the producer then keeps
it until the lease appears (and serves it at once) or ``lease_s`` passes (and refuses it), as
SGLang's prefill side keeps a decode side's registration until its request is prefilled.

Who may do what: a pull names the target region and the address to write to; the producer
writes only to the engine that asked (the message's sender id must be the id of the engine
at that address), and the consumer believes a completion only as the write notification of
the producer it asked. A lease ends after its pulls, or after ``lease_s``.

Everything here runs on the engine's model thread, which owns the KV pool.
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
import time
from dataclasses import dataclass, field

import torch

from .. import pack, unpack
from ..model import KVPool
from ..peer_cache import PeerCache
from ..transfer import Message, Peer, Region, Transfer, TransferEngine, TransferError

__all__ = ["KvProducer", "KvConsumer", "PendingPull", "KvLinkError", "parse_message"]

PULL, SENT, FAIL = b"EPUL", b"EKVD", b"EERR"

log = logging.getLogger("pddcore.engine")


class KvLinkError(RuntimeError):
    """A pull was refused, failed or timed out; the message names why."""


def _encode(tag: bytes, body: dict) -> bytes:
    return tag + json.dumps(body).encode()


def parse_message(message: Message) -> tuple[str, dict] | None:
    """``("pull" | "sent" | "fail", body)``, or None for anything else."""
    tag = message.payload[:4]
    kind = {PULL: "pull", SENT: "sent", FAIL: "fail"}.get(tag)
    if kind is None:
        return None
    try:
        body = json.loads(message.payload[4:])
    except ValueError:
        return None
    return (kind, body) if isinstance(body, dict) else None


@dataclass
class _Lease:
    pages: list[int]
    num_tokens: int
    expires: float
    pulls_left: int


@dataclass
class _Send:
    transfer: Transfer
    region: Region
    rid: str


class KvProducer:
    """The prefill side: leases and the pulls they serve."""

    def __init__(self, engine: TransferEngine, pool: KVPool, engine_id: str, lease_s: float,
                 advertise: str | None = None):
        self.engine, self.pool, self.engine_id, self.lease_s = engine, pool, engine_id, lease_s
        self.advertise = advertise or engine.address  # what decode engines dial
        self.peers = PeerCache(engine)
        self.leases: dict[str, _Lease] = {}
        self.parked: dict[str, list[tuple[Message, dict, Peer, float]]] = {}  # rid -> pulls waiting for its lease
        self.sends: list[_Send] = []
        self.pulls_served = 0
        self.sends_failed = 0
        self.bytes_sent = 0

    def lease(self, rid: str, pages: list[int], num_tokens: int, pulls: int = 1) -> dict:
        """Holds ``pages`` (the first ``num_tokens`` tokens of ``rid``) for ``pulls`` pulls;
        returns the ``kv_transfer_params`` a decode engine needs to pull them."""
        self.pool.allocator.retain(pages)
        self._drop(rid)
        self.leases[rid] = _Lease(list(pages), num_tokens, time.monotonic() + self.lease_s, pulls)
        for message, body, _, _ in self.parked.pop(rid, ()):
            self.serve(message, body)
        host, _, port = self.advertise.rpartition(":")
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_host": host, "remote_port": int(port), "remote_request_id": rid,
                "remote_block_ids": list(pages), "remote_num_tokens": num_tokens,
                "remote_block_size": self.pool.page_size}

    def serve(self, message: Message, body: dict) -> None:
        """Answers one pull request: pack and write the asked pages, or say why not."""
        rid = body.get("rid")
        try:
            reply_to, first, count = str(body["reply_to"]), int(body["first_page"]), int(body["num_pages"])
            dst = bytes.fromhex(body["dst"])
        except (KeyError, TypeError, ValueError):
            return  # not a pull anybody could be waiting for
        try:
            peer = self.peers.get(reply_to)
        except Exception:  # noqa: BLE001 - an unreachable asker gets nothing
            return
        if peer.engine_id != message.sender_engine_id:
            return  # the asker named another engine's address: never write for it
        lease = self.leases.get(rid)
        if lease is None and body.get("wait") is True and isinstance(rid, str):
            self.parked.setdefault(rid, []).append((message, body, peer, time.monotonic() + self.lease_s))
            return
        error = None
        if lease is None:
            error = f"no KV held for request {rid!r} (never prefilled here, already pulled, or the lease ended)"
        elif not (0 <= first and 0 < count and first + count <= len(lease.pages)):
            error = f"pages [{first}, {first + count}) are outside the {len(lease.pages)} held for {rid!r}"
        if error is not None:
            self.engine.send(peer, _encode(FAIL, {"pull_id": body.get("pull_id"), "error": error}))
            return
        region = None
        try:
            buf = pack(self.pool.layout(), torch.tensor(lease.pages[first:first + count], dtype=torch.int64))
            region = self.engine.register(buf)
            transfer = self.engine.write(peer, region, 0, dst, 0, buf.numel(),
                                         notify=_encode(SENT, {"pull_id": body.get("pull_id")}))
        except Exception as e:  # noqa: BLE001 - a bad target is the asker's problem, reported to it
            if region is not None:
                self.engine.unregister(region)
            self.engine.send(peer, _encode(FAIL, {"pull_id": body.get("pull_id"), "error": str(e)}))
            return
        self.sends.append(_Send(transfer, region, rid))
        lease.pulls_left -= 1
        if lease.pulls_left == 0:
            self._drop(rid)  # the pages are packed: the lease has served its pulls
        self.pulls_served += 1
        self.bytes_sent += buf.numel()

    def poll(self) -> None:
        """Retires finished writes, also failed ones (the asker went away: its pull fails or
        times out on its side), and leases past their time."""
        for send in list(self.sends):
            try:
                if not send.transfer.done():
                    continue
            except TransferError as e:
                log.warning("%s: writing the pulled pages failed: %s", send.rid, e)
                self.sends_failed += 1
            self.sends.remove(send)
            self.engine.unregister(send.region)
        now = time.monotonic()
        for rid in [r for r, lease in self.leases.items() if lease.expires <= now]:
            self._drop(rid)
        for rid, waiting in list(self.parked.items()):
            for _, body, peer, _ in [w for w in waiting if w[3] <= now]:
                error = f"request {rid!r} was not prefilled here within {self.lease_s:g} s"
                self.engine.send(peer, _encode(FAIL, {"pull_id": body.get("pull_id"), "error": error}))
            self.parked[rid] = [w for w in waiting if w[3] > now]
            if not self.parked[rid]:
                del self.parked[rid]

    @property
    def busy(self) -> bool:
        return bool(self.sends or self.leases or self.parked)

    def _drop(self, rid: str) -> None:
        lease = self.leases.pop(rid, None)
        if lease is not None:
            self.pool.allocator.free(lease.pages)


@dataclass
class PendingPull:
    """A pull in flight for request ``rid``: ``num_pages`` pages land in ``buf``."""

    pull_id: str
    rid: str
    peer: Peer
    region: Region
    buf: torch.Tensor
    num_pages: int
    deadline: float
    outcome: str | None = None  # None (in flight), "ok", or an error message
    started: float = field(default_factory=time.monotonic)


class KvConsumer:
    """The decode side: pulls pages from a producer into a fresh target buffer."""

    def __init__(self, engine: TransferEngine, pool: KVPool, timeout_s: float, advertise: str | None = None):
        self.engine, self.pool, self.timeout_s = engine, pool, timeout_s
        self.advertise = advertise or engine.address  # what producers dial to write the pages
        self.peers = PeerCache(engine)
        self.page_nbytes = pool.layout().packed_nbytes(1)
        self.pending: dict[str, PendingPull] = {}
        self._ids = itertools.count()
        self.pulls_done = 0
        self.bytes_received = 0

    def start(self, rid: str, params: dict, first_page: int, num_pages: int) -> PendingPull:
        """Asks the producer named in ``params`` for pages ``[first_page, first_page + num_pages)``
        of its lease. Raises KvLinkError when the params are unusable or the producer is
        unreachable."""
        try:
            address = f"{params['remote_host']}:{int(params['remote_port'])}"
            remote_rid = str(params["remote_request_id"])
            block_size = int(params.get("remote_block_size", self.pool.page_size))
        except (KeyError, TypeError, ValueError) as e:
            raise KvLinkError(f"kv_transfer_params lack a usable {e}") from None
        if block_size != self.pool.page_size:
            raise KvLinkError(f"the producer's pages hold {block_size} tokens, this engine's {self.pool.page_size}")
        try:
            peer = self.peers.get(address)
        except Exception as e:  # noqa: BLE001 - the transfer engine's message names the cause
            raise KvLinkError(f"cannot reach the producer at {address}: {e}") from None
        buf = torch.empty(num_pages * self.page_nbytes, dtype=torch.uint8)
        region = self.engine.register(buf, target=True)
        pull_id = f"{secrets.token_hex(8)}-{next(self._ids)}"
        pull = PendingPull(pull_id, rid, peer, region, buf, num_pages, time.monotonic() + self.timeout_s)
        self.pending[pull_id] = pull
        self.engine.send(peer, _encode(PULL, {"rid": remote_rid, "pull_id": pull_id, "first_page": first_page,
                                              "num_pages": num_pages, "dst": region.descriptor().hex(),
                                              "reply_to": self.advertise, "wait": params.get("wait") is True}))
        return pull

    def on_message(self, message: Message, kind: str, body: dict) -> PendingPull | None:
        """Settles the pull a ``sent`` / ``fail`` message answers (None if it answers none)."""
        pull = self.pending.get(str(body.get("pull_id")))
        if pull is None or message.sender_engine_id != pull.peer.engine_id:
            return None
        if kind == "sent" and not message.notification:
            return None  # a completion counts only as the notification of the write itself
        pull.outcome = "ok" if kind == "sent" else f"the producer refused the pull: {body.get('error')}"
        return self._settle(pull)

    def expired(self) -> list[PendingPull]:
        now = time.monotonic()
        out = []
        for pull in [p for p in self.pending.values() if p.deadline <= now]:
            pull.outcome = f"no KV from the producer within {self.timeout_s:g} s"
            out.append(self._settle(pull))
        return out

    def land(self, pull: PendingPull, pages: list[int]) -> None:
        """Writes a completed pull into ``pages`` of the pool."""
        unpack(self.pool.layout(), torch.tensor(pages, dtype=torch.int64), pull.buf)
        self.pulls_done += 1
        self.bytes_received += pull.buf.numel()

    def _settle(self, pull: PendingPull) -> PendingPull:
        del self.pending[pull.pull_id]
        self.engine.unregister(pull.region)
        return pull
