"""What the connector's halves pass each other through vLLM: a worker's handshake to its
scheduler, and the scheduler's per-step instructions to its workers.

Example::

    meta = PDDConnectorMetadata(saves={"p-1": [3, 8]})              # producer: stage blocks 3, 8
    meta = PDDConnectorMetadata(saves={"p-1": [3, 8]}, pushes={"p-1": ["10.0.0.2:7000"]})   # ... and push them
    meta = PDDConnectorMetadata(loads={"d-1": _Load([10, 12], 0, kv_transfer_params)})   # consumer
    meta = PDDConnectorMetadata(heartbeats={"p-1": Heartbeat(["10.0.0.1:7000"], "9f1c...")})  # consumer: keep p-1's KV
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

__all__ = ["PDDConnectorMetadata", "PDDHandshakeMetadata", "Heartbeat", "producer_addresses"]


@dataclass
class PDDHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What a worker publishes to its scheduler: its engine address and KV geometry."""

    address: str
    tp_rank: int
    tp_size: int
    total_kv_heads: int


def producer_addresses(params: dict) -> list[str]:
    """The engine address of every producer rank of a request's ``kv_transfer_params``: the
    workers' own (``pdd_addresses``), else ``remote_host:remote_port + rank``."""
    if params.get("pdd_addresses"):
        return list(params["pdd_addresses"])
    return [f"{params['remote_host']}:{int(params['remote_port']) + r}" for r in range(int(params.get("tp_size", 1)))]


@dataclass(frozen=True)
class Heartbeat:
    """Where a consumer's heartbeats for one producer request go (every producer rank) and the
    request's lease key, which the producer handed out with its KV (``pdd_lease_key``): only a
    heartbeat bearing it starts the lease again."""

    addresses: list[str]
    lease_key: str


@dataclass
class _Load:
    """A consumer's pull: its fresh ``local_block_ids``, after ``skip_blocks`` blocks its own
    prefix cache already held, filled from the producer named in ``params`` (the request's
    ``kv_transfer_params``)."""

    local_block_ids: list[int]
    skip_blocks: int
    params: dict


@dataclass
class PDDConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    saves: dict[str, list[int]] = field(default_factory=dict)        # producer: req -> all its block ids
    pushes: dict[str, list[str]] = field(default_factory=dict)       # producer: req -> consumer rank addresses
    consumers: dict[str, int] = field(default_factory=dict)          # producer: req -> consumers to serve, if not 1
    send_deadlines: dict[str, float] = field(default_factory=dict)   # producer: finished req -> lease (s)
    lease_keys: dict[str, str] = field(default_factory=dict)         # producer: finished req -> its lease key
    dropped_sends: set[str] = field(default_factory=set)             # producer: finished without a consumer
    preempted: set[str] = field(default_factory=set)                 # producer: staged copies gone stale
    loads: dict[str, _Load] = field(default_factory=dict)            # consumer: req -> what to pull
    cancelled_loads: dict[str, dict] = field(default_factory=dict)   # consumer: aborted before the pull
    heartbeats: dict[str, Heartbeat] = field(default_factory=dict)   # consumer: producer req -> its ranks, key
