"""vLLM KV connector on pddcore (built and tested against vllm 0.33.0's ``KVConnectorBase_V1``).

Load it the standard way::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "PDDConnector",
        "kv_connector_module_path": "pddcore.integrations.vllm", "kv_role": "kv_producer"}'

It speaks the ``kv_transfer_params`` of vLLM's own disaggregation connectors
(``do_remote_prefill``, ``do_remote_decode``, ``remote_block_ids``, ``remote_engine_id``,
``remote_request_id``, ``remote_host``, ``remote_port``, ``tp_size``), so vLLM's
disaggregation proxy works unchanged: the prefill (producer) answers with those keys, the
proxy hands them to the decode (consumer).

Data path (push over :class:`pddcore.TransferEngine`, TCP):

* producer workers: ``save_kv_layer`` packs each layer of a request whose prefill completes
  this step into a staging buffer (``pddcore.pack``, layer-major) as the forward proceeds;
  ``request_finished`` keeps the blocks until the consumer has the KV (or the lease ends);
* consumer workers: ``start_load_kv`` registers a staging buffer and sends each producer rank
  it needs a pull request (blocks to skip: the decode side's own prefix-cache hit; head range
  when the TP sizes differ); the producer packs, head-sliced, and writes it with a notify;
* the consumer unpacks into its blocks only once every producer rank's write was verified
  and applied, then reports the request in ``finished_recving``; a failure reports its blocks
  through ``get_block_ids_with_load_errors`` (and the request in ``failed_recving``), so vLLM
  recomputes them rather than read a half-written block.

KV caches: whatever vLLM's ``allocate_kv_cache`` gives, in any ``VLLM_KV_CACHE_LAYOUT``
(per layer a ``[blocks, heads, block_size, head_size + head_size_v]`` view with K and V
side by side in each row; MLA: one latent of ``head_size``), kernel-block splitting
included. The bytes on the wire are pddcore's canonical packed order, so the two sides
may use different layouts, block splits and TP sizes. Staging buffers come from a
:class:`~pddcore.integrations._staging.StagingPool`: pinned host memory when the KV is on a
GPU, registered once and reused.

``kv_connector_extra_config`` keys: ``host`` (listen address; default: this host's IP as
vLLM's ``get_ip()`` finds it, which honours ``VLLM_HOST_IP``), ``advertise_host`` (the
address peers connect to, when it differs from ``host``; ``0.0.0.0`` is never
advertised), ``port`` (base port; rank r listens on port + r; default: any free port,
published through the handshake metadata), ``lease_s`` (producer keeps unsent KV this
long, default 60), ``load_timeout_s`` (consumer gives up, default 60), ``auth_token`` (the
same on every producer and consumer; required unless ``host`` is a loopback address or
``insecure`` is true: without it anybody who reaches the port could write into staging
buffers),
``backend`` (``"tcp"``, default, or ``"rdma"``), ``rdma_device`` (e.g. ``"mlx5_0"``),
``gpudirect`` (rdma with KV on a GPU: stage in registered device memory, which the NIC reads
and writes directly, instead of pinned host memory), ``tp_rank`` (override for tests or
out-of-engine use). Attention layers only: one KV-cache
group (a hybrid model, which needs vLLM's hybrid allocator, is refused with a clear error).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from ..layout import KVLayout
from ..pack import pack, unpack
from ..transfer import Message, Peer, Transfer, TransferEngine
from ._heads import destinations_of, head_sources
from ._staging import StagingBuffer, StagingPool

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["PDDConnector", "PDDConnectorMetadata", "PDDHandshakeMetadata"]

log = logging.getLogger(__name__)
_MAGIC = b"PDDVLLM1"


def _encode(kind: str, **fields: Any) -> bytes:
    return _MAGIC + json.dumps({"k": kind, **fields}).encode()


class _BadMessage(ValueError):
    """A control message that is not what its kind promises."""


# Fields each control message must carry, with their types.
_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "pull": {"req": str, "d_req": str, "skip_blocks": int, "num_blocks": int, "d_tp": int,
             "src_heads": (list, type(None)), "region": str, "offset": int, "seg_bytes": int, "reply": str},
    "done": {"req": str, "src": int},
    "fail": {"req": str, "reason": str},
    "drop": {"req": str},
}


def _decode(payload: bytes) -> dict:
    """The message in ``payload``; raises :class:`_BadMessage` naming what is wrong."""
    if not payload.startswith(_MAGIC):
        raise _BadMessage("not a PDDConnector message")
    try:
        msg = json.loads(payload[len(_MAGIC):])
    except (ValueError, UnicodeDecodeError) as exc:
        raise _BadMessage(f"undecodable: {exc}") from None
    if not isinstance(msg, dict) or msg.get("k") not in _FIELDS:
        raise _BadMessage(f"unknown kind {msg.get('k') if isinstance(msg, dict) else msg!r}")
    for name, kind in _FIELDS[msg["k"]].items():
        if not isinstance(msg.get(name), kind) or isinstance(msg.get(name), bool):
            raise _BadMessage(f"{msg['k']}: field {name!r} is {msg.get(name)!r}")
    return msg


def _single_attention_group(kv_cache_config: "KVCacheConfig | None") -> Any:
    """The one attention KV-cache group's spec; a clear error for hybrid models."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    if kv_cache_config is None:
        return None
    groups = kv_cache_config.kv_cache_groups
    specs = [g.kv_cache_spec for g in groups]
    if len(groups) != 1 or not isinstance(specs[0], AttentionSpec):
        raise ValueError("PDDConnector moves one attention KV-cache group; this model has "
                         f"{[type(spec).__name__ for spec in specs]} (a hybrid model, e.g. sliding-window or "
                         "Mamba layers under vLLM's hybrid KV-cache manager). Serve it with "
                         "--disable-hybrid-kv-cache-manager if its layers allow, or use another connector.")
    spec = specs[0]
    if getattr(spec, "state_content_bytes", None) is not None or getattr(spec, "num_head_slots", None) is not None:
        raise ValueError(f"PDDConnector: {type(spec).__name__} packs its pages itself (state_content_bytes / "
                         "num_head_slots); only dense K/V or MLA latent pages are supported")
    return spec


def advertised_host(extra: Mapping[str, Any]) -> tuple[str, str]:
    """``(listen host, advertised host)`` from ``kv_connector_extra_config``: a wildcard or
    missing ``host`` is advertised as vLLM's ``get_ip()`` (``VLLM_HOST_IP`` when set), never as
    ``0.0.0.0``; ``advertise_host`` overrides the advertised one."""
    from vllm.utils.network_utils import get_ip

    listen = extra.get("host") or get_ip()
    advertise = extra.get("advertise_host") or listen
    if advertise in ("0.0.0.0", "::", ""):
        advertise = get_ip()
    return listen, advertise


@dataclass
class PDDHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What a worker publishes to its scheduler: its engine address and KV geometry."""

    address: str
    tp_rank: int
    tp_size: int
    total_kv_heads: int


@dataclass
class _Load:
    local_block_ids: list[int]
    skip_blocks: int
    params: dict


@dataclass
class PDDConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    saves: dict[str, list[int]] = field(default_factory=dict)        # producer: req -> all its block ids
    send_deadlines: dict[str, float] = field(default_factory=dict)   # producer: finished req -> lease (s)
    dropped_sends: set[str] = field(default_factory=set)             # producer: finished without a consumer
    loads: dict[str, _Load] = field(default_factory=dict)            # consumer: req -> what to pull
    cancelled_loads: dict[str, dict] = field(default_factory=dict)   # consumer: aborted before the pull


def _first_group(block_ids: Any) -> list[int]:
    return list(block_ids[0]) if isinstance(block_ids, tuple) else list(block_ids)


class PDDConnector(KVConnectorBase_V1):
    """A vLLM v1 KV connector that moves KV through pddcore; see the module docstring."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.engine_id = self._kv_transfer_config.engine_id
        self.attention_spec = _single_attention_group(kv_cache_config)
        self.listen_host, self.host = advertised_host(extra)
        self.base_port = extra.get("port")
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.block_size = vllm_config.cache_config.block_size
        self.lease_s = float(extra.get("lease_s", 60.0))
        self.load_timeout_s = float(extra.get("load_timeout_s", 60.0))
        self._extra = extra
        if role == KVConnectorRole.SCHEDULER:
            self._producing: dict[str, "Request"] = {}
            self._loads: dict[str, _Load] = {}
            self._meta = PDDConnectorMetadata()
            self._sending: set[str] = set()
            self._addresses: dict[int, str] = {}
        else:
            self._init_worker(extra)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        return None  # KVLayout takes any cell strides vLLM allocates

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer runs between layers: it cannot live inside a captured graph

    # ============================== scheduler side ==============================
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._addresses = {int(rank): m.address for rank, m in metadata.items()}

    def _producer_address(self) -> tuple[str, int]:
        if 0 in self._addresses:
            host, _, port = self._addresses[0].rpartition(":")
            return host, int(port)
        if self.base_port is None:
            raise RuntimeError("PDDConnector: no worker handshake yet and no 'port' in kv_connector_extra_config")
        return self.host, int(self.base_port)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode"):
            self._producing[request.request_id] = request
        if params.get("do_remote_prefill") and num_external_tokens > 0:
            all_ids = _first_group(blocks.get_block_ids())
            fresh = blocks.get_unhashed_block_ids()
            self._loads[request.request_id] = _Load(fresh, len(all_ids) - len(fresh), dict(params))
            params["do_remote_prefill"] = False  # a re-entry after preemption must not pull twice

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta, self._meta = self._meta, PDDConnectorMetadata()
        meta.loads, self._loads = self._loads, {}
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self._producing.get(req_id)
            if request is not None and request.num_computed_tokens + num_tokens >= request.num_prompt_tokens:
                meta.saves[req_id] = _first_group(self._kv_cache_manager.get_block_ids(req_id))
                del self._producing[req_id]
        return meta

    def request_finished(self, request: "Request", block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        self._producing.pop(request.request_id, None)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # consumer aborted before its pull: let the producer free
            self._meta.cancelled_loads[request.request_id] = dict(params)
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            self._meta.dropped_sends.add(request.request_id)
            return False, None
        block_ids = _first_group(block_ids)
        if not block_ids:
            return False, None
        self._sending.add(request.request_id)
        self._meta.send_deadlines[request.request_id] = self.lease_s
        host, port = self._producer_address()
        return True, dict(do_remote_prefill=True, do_remote_decode=False, remote_block_ids=block_ids,
                          remote_engine_id=self.engine_id, remote_request_id=request.request_id,
                          remote_host=host, remote_port=port, tp_size=self.tp_size,
                          remote_num_tokens=request.num_computed_tokens,
                          pdd_addresses=[self._addresses[r] for r in sorted(self._addresses)] or None)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        for req_id in connector_output.finished_sending or ():
            self._sending.discard(req_id)

    def has_pending_push_work(self) -> bool:
        return bool(self._sending)

    # ============================== worker side ==============================
    def _init_worker(self, extra: dict) -> None:
        if "tp_rank" in extra:
            self.tp_rank = int(extra["tp_rank"])
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.tp_rank = get_tensor_model_parallel_rank()
        port = 0 if self.base_port is None else int(self.base_port) + self.tp_rank
        backend = extra.get("backend", "tcp")
        self.engine = TransferEngine(backend, listen=f"{self.listen_host}:{port}", auth_token=extra.get("auth_token"),
                                     insecure=bool(extra.get("insecure", False)),
                                     **({"device": extra["rdma_device"]} if "rdma_device" in extra else {}))
        self.gpudirect = bool(extra.get("gpudirect", False))
        self.address = f"{self.host}:{self.engine.address.rpartition(':')[2]}"
        self.layout: KVLayout | None = None
        self.staging: StagingPool | None = None
        self.pages_per_block = 1
        self._layer_index: dict[str, int] = {}
        self._peers: dict[str, Peer] = {}
        self._staged: dict[str, _Staged] = {}          # producer: req -> packed KV
        self._pulls: dict[str, list[tuple[str, dict]]] = {}   # producer: req -> pull requests received
        self._serving: dict[str, list[tuple[Transfer, StagingBuffer | None, dict]]] = {}
        self._served: dict[str, int] = {}
        self._pending_loads: dict[str, _PendingLoad] = {}   # consumer
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._load_errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Builds the :class:`KVLayout` over the caches vLLM's ``allocate_kv_cache`` made.

        Each layer is a ``[blocks * pages_per_block, heads, block_size / pages_per_block,
        head_size + head_size_v]`` view (any strides: the layout decides them); K is the first
        ``head_size`` elements of every row, V the rest; MLA has no V.
        """
        spec = self.attention_spec
        if spec is None:
            raise ValueError("PDDConnector.register_kv_caches needs the KVCacheConfig vLLM passes to the connector")
        head_k, head_v = spec.head_size, spec.head_size_v
        k, v, seen = [], [], set()
        for name in self._kv_cache_config.kv_cache_groups[0].layer_names:
            t = kv_caches.get(name)
            if t is None:
                raise ValueError(f"layer {name}: no KV cache registered for it")
            if t.dim() != 4 or t.shape[-1] != head_k + head_v:
                raise ValueError(f"layer {name}: KV cache of shape {tuple(t.shape)} is not vLLM's [blocks, heads, "
                                 f"block_size, head_size + head_size_v = {head_k + head_v}] view")
            if (t.data_ptr(), t.stride()) in seen:  # a layer that reuses another's cache (KV sharing)
                continue
            seen.add((t.data_ptr(), t.stride()))
            self._layer_index[name] = len(k)
            cells = t.permute(0, 2, 1, 3)  # [pages, tokens, heads, row]
            k.append(cells[..., :head_k])
            if head_v:
                v.append(cells[..., head_k:])
        self.layout = KVLayout.from_tensors(k, v or None)
        num_blocks = self._kv_cache_config.num_blocks
        if self.layout.num_pages % num_blocks:
            raise ValueError(f"{self.layout.num_pages} kernel blocks do not split evenly into {num_blocks} blocks")
        self.pages_per_block = self.layout.num_pages // num_blocks
        self.total_kv_heads = 1 if self.layout.is_mla else self.layout.planes[0].num_heads * self.tp_size
        self.staging = StagingPool(self.engine, self.layout.device, gpudirect=self.gpudirect)

    def _pages(self, block_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Layout page ids of vLLM blocks (a block spans ``pages_per_block`` kernel blocks)."""
        blocks = torch.as_tensor(block_ids, dtype=torch.int64)
        r = self.pages_per_block
        return (blocks[:, None] * r + torch.arange(r)).reshape(-1) if r > 1 else blocks

    def get_handshake_metadata(self) -> PDDHandshakeMetadata:
        return PDDHandshakeMetadata(self.address, self.tp_rank, self.tp_size, getattr(self, "total_kv_heads", 0))

    def _peer(self, address: str) -> Peer:
        if address not in self._peers or not self._peers[address].connected:
            self._peers[address] = self.engine.connect(address)
        return self._peers[address]

    def _send_control(self, address: str, kind: str, **fields: Any) -> None:
        try:
            self.engine.send(self._peer(address), _encode(kind, **fields))
        except Exception as exc:  # the peer's own timeout covers a lost message
            log.warning("PDDConnector: could not send %s to %s: %s", kind, address, exc)

    # -- producer --------------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, PDDConnectorMetadata) or not meta.saves or layer_name not in self._layer_index:
            return
        layer = self._layer_index[layer_name]
        for req_id, block_ids in meta.saves.items():
            staged = self._staged.get(req_id)
            if staged is None:
                staged = self._staged[req_id] = _Staged.allocate(self.layout, self._pages(block_ids), self.staging)
            lo, hi = staged.layer_range(layer)
            pack(self.layout, staged.pages, layers=[layer], out=staged.buffer.tensor[lo:hi])

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, PDDConnectorMetadata):
            return
        if meta.saves and self.layout.device.type == "cuda":
            torch.cuda.current_stream(self.layout.device).synchronize()
        for req_id in meta.saves:
            self._staged[req_id].ready = True
            self._serve(req_id)
        for req_id, lease in meta.send_deadlines.items():
            if req_id in self._staged:
                self._staged[req_id].deadline = time.monotonic() + lease
            else:  # nothing was staged here (e.g. a prefill that never ran on this rank)
                self._finished_sending.add(req_id)
        for req_id in meta.dropped_sends:
            self._drop_send(req_id)

    def _serve(self, req_id: str) -> None:
        staged = self._staged.get(req_id)
        if staged is None or not staged.ready:
            return
        for address, pull in self._pulls.pop(req_id, []):
            try:
                self._serve_one(req_id, staged, address, pull)
            except Exception as exc:
                self._send_control(address, "fail", req=pull["d_req"], reason=f"producer could not send: {exc}")
                self._served[req_id] = self._served.get(req_id, 0) + 1

    def _serve_one(self, req_id: str, staged: "_Staged", address: str, pull: dict) -> None:
        heads = tuple(pull["src_heads"]) if pull["src_heads"] else None
        skip, n = pull["skip_blocks"], pull["num_blocks"]
        blocks = staged.num_pages // self.pages_per_block
        if skip < 0 or n <= 0 or skip + n > blocks:
            raise ValueError(f"pull for blocks [{skip}, {skip + n}) but the request has {blocks}")
        nbytes = self.layout.packed_nbytes(n * self.pages_per_block, heads=heads)
        if nbytes != pull["seg_bytes"]:
            raise ValueError(f"consumer staged {pull['seg_bytes']} bytes, this layout packs {nbytes} "
                             "(block geometry differs)")
        if heads is None and skip == 0 and n == blocks:
            src, own = staged.buffer, None
        else:
            src = own = self.staging.acquire(nbytes)
            first = skip * self.pages_per_block
            pack(staged.layout, torch.arange(first, first + n * self.pages_per_block), heads=heads, out=own.tensor)
        transfer = self.engine.write(self._peer(address), src.region, 0, bytes.fromhex(pull["region"]), pull["offset"],
                                     nbytes, notify=_encode("done", req=pull["d_req"], src=self.tp_rank))
        self._serving.setdefault(req_id, []).append((transfer, own, pull))

    def _drop_send(self, req_id: str) -> None:
        staged = self._staged.pop(req_id, None)
        if staged is not None:
            self.staging.release(staged.buffer)
        self._pulls.pop(req_id, None)
        self._served.pop(req_id, None)

    def _progress_sends(self) -> None:
        now = time.monotonic()
        for req_id in list(self._serving):
            remaining = []
            for transfer, own, pull in self._serving[req_id]:
                if transfer.status == "pending":
                    remaining.append((transfer, own, pull))
                    continue
                if transfer.status != "done":
                    self._send_control(pull["reply"], "fail", req=pull["d_req"], reason=f"transfer {transfer.error}")
                if own is not None:
                    self.staging.release(own)
                self._served[req_id] = self._served.get(req_id, 0) + 1
            self._serving[req_id] = remaining
            staged = self._staged.get(req_id)
            if not remaining and staged is not None and self._served.get(req_id, 0) >= staged.expected_pulls:
                del self._serving[req_id]
                self._drop_send(req_id)
                self._finished_sending.add(req_id)
        for req_id, staged in list(self._staged.items()):
            if staged.deadline is not None and now > staged.deadline and req_id not in self._serving:
                log.warning("PDDConnector: lease of %s expired before a consumer pulled it", req_id)
                self._drop_send(req_id)
                self._finished_sending.add(req_id)

    # -- consumer --------------------------------------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, PDDConnectorMetadata):
            return
        for req_id, params in meta.cancelled_loads.items():
            for address in self._producer_addresses(params):
                self._send_control(address, "drop", req=params.get("remote_request_id"))
        for req_id, load in meta.loads.items():
            try:
                self._start_load(req_id, load)
            except Exception as exc:
                log.warning("PDDConnector: load of %s failed to start: %s", req_id, exc)
                self._fail_load(req_id, load.local_block_ids)

    def _producer_addresses(self, params: dict) -> list[str]:
        if params.get("pdd_addresses"):
            return list(params["pdd_addresses"])
        return [f"{params['remote_host']}:{int(params['remote_port']) + r}" for r in range(int(params.get("tp_size", 1)))]

    def _start_load(self, req_id: str, load: _Load) -> None:
        params, n = load.params, len(load.local_block_ids)
        remote_blocks = len(params.get("remote_block_ids") or ())
        if load.skip_blocks + n > remote_blocks:
            raise ValueError(f"needs blocks [{load.skip_blocks}, {load.skip_blocks + n}) but the producer holds "
                             f"{remote_blocks}")
        addresses = self._producer_addresses(params)
        if self.layout.is_mla:
            sources = [(self.tp_rank % len(addresses), None, None)]
        else:
            per_src = self.total_kv_heads // len(addresses)
            full = (0, self.layout.planes[0].num_heads)
            sources = [(s.src_rank, None if s.src_heads == (0, per_src) else s.src_heads,
                        None if s.dst_heads == full else s.dst_heads)
                       for s in head_sources(self.total_kv_heads, len(addresses), self.tp_size, self.tp_rank)]
        pending = _PendingLoad(req_id, load.local_block_ids, self._pages(load.local_block_ids), time.monotonic())
        offset = 0
        for src_rank, src_heads, dst_heads in sources:
            nbytes = self.layout.packed_nbytes(len(pending.pages), heads=dst_heads)
            pending.segments.append(_Segment(src_rank, addresses[src_rank], offset, nbytes, src_heads, dst_heads))
            offset += nbytes
        pending.staging = self.staging.acquire(offset, target=True)
        self._pending_loads[req_id] = pending
        for seg in pending.segments:
            self._send_control(seg.address, "pull", req=params["remote_request_id"], d_req=req_id,
                               skip_blocks=load.skip_blocks, num_blocks=n, d_tp=self.tp_size,
                               src_heads=list(seg.src_heads) if seg.src_heads else None,
                               region=pending.staging.region.descriptor().hex(), offset=seg.offset,
                               seg_bytes=seg.nbytes, reply=self.address)

    def _fail_load(self, req_id: str, block_ids: list[int]) -> None:
        pending = self._pending_loads.pop(req_id, None)
        if pending is not None:
            self._release_staging(pending)
        self._load_errors.update(block_ids)
        self._failed_recving.add(req_id)
        self._finished_recving.add(req_id)

    def _finish_load(self, pending: "_PendingLoad") -> None:
        staging = pending.staging.tensor
        for seg in pending.segments:
            unpack(self.layout, pending.pages, staging[seg.offset:seg.offset + seg.nbytes], heads=seg.dst_heads)
        if self.layout.device.type == "cuda":
            torch.cuda.current_stream(self.layout.device).synchronize()
        self._release_staging(pending)
        del self._pending_loads[pending.req_id]
        self._finished_recving.add(pending.req_id)

    def _release_staging(self, pending: "_PendingLoad") -> None:
        if pending.staging is not None:
            self.staging.release(pending.staging)
            pending.staging = None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete between steps: a block is handed to vLLM only once whole

    # -- both ------------------------------------------------------------------------
    def _pump(self) -> None:
        """Acts on every message received; a bad one fails only the request it names."""
        for message in self.engine.poll_messages():
            try:
                self._on_message(message, _decode(message.payload))
            except _BadMessage as exc:
                log.warning("PDDConnector: dropped a message from %s: %s", message.sender, exc)
                self._fail_named_load(message.payload, f"malformed message from {message.sender}: {exc}")

    def _on_message(self, message: Message, msg: dict) -> None:
        kind, req = msg["k"], msg["req"]
        if kind == "pull":
            self._on_pull(message, msg)
        elif kind == "drop" and req in self._staged and req not in self._serving:
            self._drop_send(req)
            self._finished_sending.add(req)
        elif kind == "done" and req in self._pending_loads:
            self._on_done(message, msg)
        elif kind == "fail" and req in self._pending_loads:
            pending = self._pending_loads[req]
            if not any(self._sent_by(message, seg) for seg in pending.segments):
                log.warning("PDDConnector: ignored a 'fail' for %s from %s, which it did not pull from", req,
                            message.sender)
                return
            log.warning("PDDConnector: load of %s failed: %s", req, msg["reason"])
            self._fail_load(req, pending.block_ids)

    def _sent_by(self, message: Message, seg: "_Segment") -> bool:
        """Whether ``message`` comes from the producer engine that ``seg`` is pulled from."""
        return message.sender_engine_id == self._peer(seg.address).engine_id

    def _on_done(self, message: Message, msg: dict) -> None:
        """Data applied: believed only as the write notification of the producer rank asked."""
        req = msg["req"]
        pending = self._pending_loads[req]
        seg = next((s for s in pending.segments if s.src_rank == msg["src"]), None)
        if seg is None:
            raise _BadMessage(f"done for {req} from rank {msg['src']}, which was not asked")
        if not message.notification or not self._sent_by(message, seg):
            log.warning("PDDConnector: ignored a 'done' for %s from %s: not the write notification of rank %d",
                        req, message.sender, seg.src_rank)
            return
        pending.done_sources.add(seg.src_rank)
        if len(pending.done_sources) == len(pending.segments):
            self._finish_load(pending)

    def _on_pull(self, message: Message, msg: dict) -> None:
        # Answers and KV go only to the engine that sent the pull: its reply address must lead
        # there, and the write into its staging region is checked against that engine's id.
        if self._peer(msg["reply"]).engine_id != message.sender_engine_id:
            raise _BadMessage(f"pull from {message.sender} names another engine ({msg['reply']}) to answer")
        req = msg["req"]
        staged = self._staged.get(req)
        if staged is None:
            self._send_control(msg["reply"], "fail", req=msg["d_req"], reason=f"producer has no KV for {req}")
            return
        if msg["d_tp"] <= 0 or (msg["src_heads"] is not None and len(msg["src_heads"]) != 2):
            raise _BadMessage(f"pull for {req}: d_tp={msg['d_tp']}, src_heads={msg['src_heads']}")
        self._pulls.setdefault(req, []).append((msg["reply"], msg))
        staged.expected_pulls = (1 if self.layout.is_mla else
                                 destinations_of(self.total_kv_heads, self.tp_size, msg["d_tp"], self.tp_rank))
        self._serve(req)

    def _fail_named_load(self, payload: bytes, reason: str) -> None:
        """Fails the pending load a malformed message names, if its name can be read."""
        try:
            req = json.loads(payload[len(_MAGIC):]).get("req") if payload.startswith(_MAGIC) else None
        except (ValueError, UnicodeDecodeError, AttributeError):
            return
        if isinstance(req, str) and req in self._pending_loads:
            log.warning("PDDConnector: load of %s failed: %s", req, reason)
            self._fail_load(req, self._pending_loads[req].block_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._pump()
        self._progress_sends()
        now = time.monotonic()
        for req_id, pending in list(self._pending_loads.items()):
            if now - pending.started > self.load_timeout_s:
                log.warning("PDDConnector: load of %s timed out", req_id)
                self._fail_load(req_id, pending.block_ids)
        results = KVConnectorTransferResults(self._finished_sending, self._finished_recving, self._failed_recving)
        self._finished_sending, self._finished_recving, self._failed_recving = set(), set(), set()
        return results

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            self.engine.close()


@dataclass
class _Staged:
    """A producer's packed copy of one request's KV, and a KVLayout over that copy
    (same cells as the pool, pages ``0..num_pages`` in request order)."""

    pages: torch.Tensor
    buffer: StagingBuffer
    layout: KVLayout
    layer_offsets: list[int]
    ready: bool = False
    deadline: float | None = None
    expected_pulls: int = 1

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @classmethod
    def allocate(cls, src: KVLayout, pages: torch.Tensor, pool: StagingPool) -> "_Staged":
        n = len(pages)
        offsets = [0]
        for layer in range(src.num_layers):
            offsets.append(offsets[-1] + src.packed_nbytes(n, layers=[layer]))
        buffer = pool.acquire(offsets[-1])
        ppl, planes = src.planes_per_layer, src.planes
        ptrs = [buffer.tensor.data_ptr() + offsets[layer] + p * n * planes[layer * ppl + p].page_bytes
                for layer in range(src.num_layers) for p in range(ppl)]
        first = planes[0]
        layout = KVLayout.from_pointers(ptrs[::ppl], [planes[i * ppl].page_bytes for i in range(src.num_layers)], n,
                                        v_ptrs=ptrs[1::ppl] if ppl == 2 else None, device=pool.buffer_device,
                                        tokens_per_page=first.tokens_per_page, num_kv_heads=first.num_heads)
        return cls(pages, buffer, layout, offsets)

    def layer_range(self, layer: int) -> tuple[int, int]:
        return self.layer_offsets[layer], self.layer_offsets[layer + 1]


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
    segments: list[_Segment] = field(default_factory=list)
    staging: StagingBuffer | None = None
    done_sources: set[int] = field(default_factory=set)
