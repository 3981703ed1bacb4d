"""What every worker of :class:`~pddcore.integrations.vllm.PDDConnector` shares, whichever
half it plays: the transfer engine, the :class:`KVLayout` over vLLM's KV caches, the staging
pool, the handshake, and the message pump.

The halves derive from :class:`WorkerBase`, so dependencies run one way::

    WorkerBase <- ProducerWorker <- PushProducer  \\
    WorkerBase <- ConsumerWorker <- PushConsumer  -> WorkerSide (both roles, :mod:`.worker`)

Each half adds its state in :meth:`WorkerBase._init_worker`, its message kinds in
:meth:`~WorkerBase._message_handlers` and its per-step work in :meth:`~WorkerBase._progress`,
each an override that calls ``super()``; the base calls only methods it defines itself.

vLLM's caches, per layer (``pages_per_block`` kernel blocks per vLLM block)::

    [blocks * pages_per_block, heads, block_size / pages_per_block, head_size + head_size_v]
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, KVConnectorTransferResults

from ...layout import KVLayout
from ...transfer import Message, TransferEngine
from .._device import on_kv_device
from .._messages import MalformedMessage
from .._peers import HeldMessages, Peers
from .._staging import StagingPool
from .metadata import PDDHandshakeMetadata
from .protocol import MESSAGES

__all__ = ["WorkerBase", "Handler", "DEFAULT_STAGING_BYTES"]

log = logging.getLogger(__name__)

Handler = Callable[[Message, dict], None]

DEFAULT_STAGING_BYTES = 4 << 30


class WorkerBase:
    """The worker-role state and plumbing; :class:`PDDConnector` sets ``listen_host``,
    ``host``, ``base_port``, ``tp_size``, ``lease_s``, ``load_timeout_s`` and
    ``attention_spec`` before :meth:`_init_worker`."""

    def _init_worker(self, extra: dict) -> None:
        if "tp_rank" in extra:
            self.tp_rank = int(extra["tp_rank"])
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.tp_rank = get_tensor_model_parallel_rank()
        port = 0 if self.base_port is None else int(self.base_port) + self.tp_rank
        backend = extra.get("backend", "tcp")
        self.staging_bytes = int(extra.get("staging_bytes", DEFAULT_STAGING_BYTES))
        if self.staging_bytes <= 0:
            raise ValueError(f"PDDConnector: staging_bytes must be positive, got {self.staging_bytes}")
        self.engine = TransferEngine(backend, listen=f"{self.listen_host}:{port}", auth_token=extra.get("auth_token"),
                                     insecure=bool(extra.get("insecure", False)),
                                     tls_cert=extra.get("tls_cert"), tls_key=extra.get("tls_key"),
                                     tls_ca=extra.get("tls_ca"),
                                     **({"device": extra["rdma_device"]} if "rdma_device" in extra else {}))
        self.gpudirect = bool(extra.get("gpudirect", False))
        self.address = f"{self.host}:{self.engine.address.rpartition(':')[2]}"
        self.layout: KVLayout | None = None
        self.kv_device = torch.device("cpu")  # the KV caches' device, once registered
        self.staging: StagingPool | None = None
        self.pages_per_block = 1
        self._layer_index: dict[str, int] = {}
        self._peers = Peers(self.engine, MESSAGES, log)
        self._held = HeldMessages(log)   # messages waiting to learn who sent them (Peers.is_from)
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._handlers = self._message_handlers()

    def _message_handlers(self) -> dict[str, Handler]:
        """The handler of each message kind this worker takes (every kind of :data:`MESSAGES`
        once all halves added theirs)."""
        return {}

    def _on_notification(self, message: Message) -> bool:
        """Takes a write notification that is not a control message; False: it is one."""
        return False

    def _on_malformed(self, key: Any, reason: str) -> None:
        """A malformed message named request ``key`` (None: it named none)."""

    def _progress(self) -> None:
        """Each step's work beyond the messages: transfers that completed, leases that ended."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Builds the :class:`KVLayout` over the caches vLLM's ``allocate_kv_cache`` made, and
        allocates the staging pool (``staging_bytes``, pinned for GPU KV) once, here.

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
        self.kv_device = self.layout.device
        self.staging = StagingPool(self.engine, self.layout.device, self.staging_bytes, gpudirect=self.gpudirect,
                                   name="PDDConnector staging (kv_connector_extra_config 'staging_bytes')")

    def _pages(self, block_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Layout page ids of vLLM blocks (a block spans ``pages_per_block`` kernel blocks)."""
        blocks = torch.as_tensor(block_ids, dtype=torch.int64)
        r = self.pages_per_block
        return (blocks[:, None] * r + torch.arange(r)).reshape(-1) if r > 1 else blocks

    def get_handshake_metadata(self) -> PDDHandshakeMetadata:
        return PDDHandshakeMetadata(self.address, self.tp_rank, self.tp_size, getattr(self, "total_kv_heads", 0))

    def _pump(self) -> None:
        """Acts on every message received; a bad one fails only the request it names."""
        self._held.handle(self.engine.poll_messages(), self._handle)

    def _handle(self, message: Message) -> None:
        """Acts on one message; raises NotKnownYet (the message is held) while its sender is learned."""
        if self._on_notification(message):
            return
        try:
            msg = MESSAGES.decode(message.payload)
            self._handlers[msg["k"]](message, msg)  # MESSAGES admits no other kind
        except MalformedMessage as exc:
            log.warning("PDDConnector: dropped a message from %s: %s", message.sender, exc)
            self._on_malformed(exc.key, f"malformed message from {message.sender}: {exc}")

    @on_kv_device
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._pump()
        self._progress()
        # Nothing in finished_sending: a producer's blocks went back when its request finished.
        results = KVConnectorTransferResults(set(), self._finished_recving, self._failed_recving)
        self._finished_recving, self._failed_recving = set(), set()
        return results

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def _close_worker(self) -> None:
        self._peers.close()
        self.engine.close()

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            self._close_worker()
