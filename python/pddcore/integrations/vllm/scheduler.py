"""The scheduler side of :class:`~pddcore.integrations.vllm.PDDConnector`: which requests
pull KV from a producer (consumer) or stage theirs for a consumer (producer), told to the
workers through :class:`PDDConnectorMetadata` once per step.

A producer's finished request answers with the ``kv_transfer_params`` a consumer needs::

    {"do_remote_prefill": True, "remote_block_ids": [3, 8], "remote_request_id": "p-1",
     "remote_host": "10.0.0.1", "remote_port": 7000, "tp_size": 1, "pdd_addresses": ["10.0.0.1:7000"], ...}

Push mode: a producer request that arrives with ``"pdd_push_to": ["10.0.0.2:7100"]`` (the
consumer's worker addresses, one per rank) is streamed there during its forward, and its
answer adds ``"pdd_pushed": True``.

A consumer's request heartbeats its producer from the moment it arrives until its KV is
loaded (it may wait in the queue far longer than the producer's lease): every quarter of the
lease its producer named (``pdd_lease_s``), the step's metadata lists it in ``heartbeats``
and the workers send ``alive``, as vLLM's NixlConnector does. A heartbeat bears the lease key
the producer put in its answer (``pdd_lease_key``, 128 random bits per request): the producer
starts the lease again only for a heartbeat bearing it, so no engine but one handed the
request keeps its KV held.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from .metadata import Heartbeat, PDDConnectorMetadata, _Load, producer_addresses

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

log = logging.getLogger(__name__)


def _first_group(block_ids: Any) -> list[int]:
    return list(block_ids[0]) if isinstance(block_ids, tuple) else list(block_ids)


@dataclass
class _Awaited:
    """A consumer request whose KV a producer keeps for it: heartbeat it every ``interval_s``."""

    remote_req: str
    heartbeat: Heartbeat
    interval_s: float
    next_s: float = 0.0


class SchedulerSide:
    """The connector's scheduler-role methods; :class:`PDDConnector` sets ``engine_id``,
    ``host``, ``base_port``, ``tp_size``, ``lease_s`` and ``attention_spec`` before
    :meth:`_init_scheduler`."""

    def _init_scheduler(self) -> None:
        self._producing: dict[str, "Request"] = {}
        self._push_to: dict[str, list[str]] = {}
        self._consumers: dict[str, int] = {}
        self._loads: dict[str, _Load] = {}
        self._meta = PDDConnectorMetadata()
        self._addresses: dict[int, str] = {}
        self._awaited: dict[str, _Awaited] = {}   # consumer req -> its producer, until its KV is loaded

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._addresses = {int(rank): m.address for rank, m in metadata.items()}

    def _producer_address(self) -> tuple[str, int]:
        if 0 in self._addresses:
            host, _, port = self._addresses[0].rpartition(":")
            return host, int(port)
        if self.base_port is None:
            raise RuntimeError("PDDConnector: no worker handshake yet and no 'port' in kv_connector_extra_config")
        return self.host, int(self.base_port)

    def on_new_request(self, request: "Request") -> None:
        """A consumer request starts heartbeating its producer (see the module docstring)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or params.get("remote_request_id") is None:
            return
        try:
            addresses = producer_addresses(params)
            lease_s = float(params.get("pdd_lease_s", self.lease_s))
            lease_key = params["pdd_lease_key"]
            bytes.fromhex(lease_key)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("PDDConnector: %s: no producer to heartbeat in its kv_transfer_params (%s)",
                        request.request_id, exc)
            return
        if lease_s > 0:
            self._awaited[request.request_id] = _Awaited(str(params["remote_request_id"]),
                                                         Heartbeat(addresses, lease_key), lease_s / 4)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """A load that finished (or failed) needs its producer no more."""
        for req_id in connector_output.finished_recving or ():
            self._awaited.pop(req_id, None)

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
            push_to = self._push_targets(request.request_id, params)
            if push_to:
                self._push_to[request.request_id] = push_to
            consumers = self._consumer_count(request.request_id, params)
            if consumers != 1:
                self._consumers[request.request_id] = consumers
        if params.get("do_remote_prefill") and num_external_tokens == 0:
            self._awaited.pop(request.request_id, None)  # its own prefix cache holds it all: nothing to load
        if params.get("do_remote_prefill") and num_external_tokens > 0:
            all_ids = _first_group(blocks.get_block_ids())
            fresh = blocks.get_unhashed_block_ids()
            self._loads[request.request_id] = _Load(fresh, len(all_ids) - len(fresh), dict(params))
            params["do_remote_prefill"] = False  # a re-entry after preemption must not pull twice

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta, self._meta = self._meta, PDDConnectorMetadata()
        meta.loads, self._loads = self._loads, {}
        now = time.monotonic()
        for awaited in self._awaited.values():
            if now >= awaited.next_s:
                meta.heartbeats[awaited.remote_req] = awaited.heartbeat
                awaited.next_s = now + awaited.interval_s
        # A preempted request lost its blocks; resumed, it is saved again from its new ones.
        meta.preempted = set(scheduler_output.preempted_req_ids or ())
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self._producing.get(req_id)
            if request is not None and request.num_computed_tokens + num_tokens >= request.num_prompt_tokens:
                meta.saves[req_id] = _first_group(self._kv_cache_manager.get_block_ids(req_id))
                if req_id in self._push_to:
                    meta.pushes[req_id] = self._push_to[req_id]
                if req_id in self._consumers:
                    meta.consumers[req_id] = self._consumers[req_id]
                del self._producing[req_id]
        return meta

    def request_finished(self, request: "Request", block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        self._producing.pop(request.request_id, None)
        self._consumers.pop(request.request_id, None)
        self._awaited.pop(request.request_id, None)
        pushed = self._push_to.pop(request.request_id, None) is not None
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
        self._meta.send_deadlines[request.request_id] = self.lease_s
        lease_key = self._meta.lease_keys[request.request_id] = secrets.token_hex(16)
        host, port = self._producer_address()
        # False: vLLM frees the blocks at once. The workers staged a copy of them when the
        # prefill completed (wait_for_save of that step), and serve every consumer from it.
        return False, dict(do_remote_prefill=True, do_remote_decode=False, remote_block_ids=block_ids,
                          remote_engine_id=self.engine_id, remote_request_id=request.request_id,
                          remote_host=host, remote_port=port, tp_size=self.tp_size,
                          remote_num_tokens=request.num_computed_tokens, pdd_lease_s=self.lease_s,
                          pdd_lease_key=lease_key,
                          pdd_addresses=[self._addresses[r] for r in sorted(self._addresses)] or None,
                          **({"pdd_pushed": True} if pushed else {}))

    def _push_targets(self, req_id: str, params: dict) -> list[str] | None:
        """The consumer ranks to push ``req_id``'s KV to, or None to leave it to be pulled."""
        push_to = params.get("pdd_push_to")
        if push_to is None:
            return None
        if not (isinstance(push_to, list) and push_to and all(isinstance(a, str) and a for a in push_to)):
            log.warning("PDDConnector: %s: pdd_push_to must list the consumer's worker addresses, got %r; "
                        "it will be pulled", req_id, push_to)
            return None
        mla = self.attention_spec is not None and not self.attention_spec.head_size_v
        if len(push_to) != self.tp_size and not mla:
            log.info("PDDConnector: %s: consumer TP %d differs from this TP %d; it will be pulled", req_id,
                     len(push_to), self.tp_size)
            return None
        return list(push_to)

    @staticmethod
    def _consumer_count(req_id: str, params: dict) -> int:
        """``pdd_consumers``: how many consumers pull this request's KV (the producer keeps it
        until each was served, or its lease ends); 1 when absent or not a positive int."""
        count = params.get("pdd_consumers", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            log.warning("PDDConnector: %s: pdd_consumers must be a positive int, got %r; serving one consumer",
                        req_id, count)
            return 1
        return count
