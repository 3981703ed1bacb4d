"""vLLM KV connector on pddcore (built and tested against vllm 0.33.0's ``KVConnectorBase_V1``).

The connector (:mod:`.connector`) runs as a scheduler (:mod:`.scheduler`) and as workers
(:mod:`.worker`), which exchange the messages of :mod:`.protocol`. A worker's halves derive
from one base (:mod:`.base_worker`): :mod:`.producer` on the prefill side and :mod:`.consumer`
on the decode side, each extended by push mode (:mod:`.push_producer`, :mod:`.push_consumer`).

Load it the standard way::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "PDDConnector",
        "kv_connector_module_path": "pddcore.integrations.vllm", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"auth_token": "'$PDDCORE_AUTH_TOKEN'"}}'

(``PDDCORE_AUTH_TOKEN``: one ``pddcore token``, the same on every producer and consumer; an
engine listening beyond loopback refuses to start without it).

It speaks the ``kv_transfer_params`` of vLLM's own disaggregation connectors
(``do_remote_prefill``, ``do_remote_decode``, ``remote_block_ids``, ``remote_engine_id``,
``remote_request_id``, ``remote_host``, ``remote_port``, ``tp_size``), so vLLM's
disaggregation proxy works unchanged: the prefill (producer) answers with those keys, the
proxy hands them to the decode (consumer).

Data path (one-sided writes over :class:`pddcore.TransferEngine`, TCP or RDMA), pull mode,
the default:

* producer workers: ``save_kv_layer`` packs each layer of a request whose prefill completes
  this step into a staging buffer (``pddcore.pack``, layer-major) as the forward proceeds;
  ``wait_for_save`` packs the layers no ``save_kv_layer`` saw (a full CUDA graph replay);
  ``request_finished`` hands the blocks back to vLLM at once, and the staged copy serves the
  consumers (``"pdd_consumers": N`` in the request's params: N of them; default 1) until
  each was served or the lease ends; a consumer heartbeats (``alive``) every quarter of the
  lease from its request's arrival until its load finished, and each heartbeat bearing the
  request's lease key (``pdd_lease_key`` in the producer's answer) starts the lease again;
* consumer workers: ``start_load_kv`` registers a staging buffer and sends each producer rank
  it needs a pull request (blocks to skip: the decode side's own prefix-cache hit; head range
  when the TP sizes differ); the producer packs, head-sliced, and writes it with a notify;
* the consumer unpacks into its blocks only once every producer rank's write was verified
  and applied, then reports the request in ``finished_recving``; a failure reports its blocks
  through ``get_block_ids_with_load_errors`` (and the request in ``failed_recving``), so vLLM
  never reads a half-written block: it recomputes the request with
  ``kv_load_failure_policy="recompute"`` and fails it with its default, ``"fail"``.

Push mode streams the KV layer by layer during the prefill, so the transfer overlaps the
forward instead of starting after it (the proxy knows both sides, as for vLLM's
P2pNcclConnector). The proxy adds the consumer's worker addresses, one per consumer rank (the
handshake addresses, or ``remote_host:remote_port + rank``), to the producer request's
params::

    {"do_remote_decode": True, "pdd_push_to": ["10.0.0.2:7100"]}

* the producer rank asks its consumer rank for a push buffer (``reserve``) at the request's
  first layer, without waiting for the answer; from the answer on, every layer is posted
  from ``save_kv_layer`` as soon as it is packed (:mod:`pddcore.streaming`: one write per
  layer, its notify naming the layer), and the layers packed before the answer follow at the
  next hook (``save_kv_layer``, ``wait_for_save`` or the message pump);
* the producer's answer adds ``"pdd_pushed": True`` to the usual keys; the consumer's
  ``start_load_kv`` then takes the push buffer of the producer rank named there (stream key:
  ``remote_request_id``) instead of pulling, and completes the load once every layer landed,
  at once when they all landed before the consumer's scheduler saw the request;
* only the engine that reserved a buffer is told where it is, and its stream is believed
  only from that engine (the notification's sender engine id); a buffer nobody claims within
  ``lease_s`` is freed; after a refused, failed or incomplete stream the consumer pulls the
  KV instead, from the staged copy the producer keeps for that;
* equal TP sizes only (MLA: any, every rank holds the same latent); a request whose
  ``pdd_push_to`` does not list one address per producer rank, or is malformed, is pulled.

KV caches: whatever vLLM's ``allocate_kv_cache`` gives, in any ``VLLM_KV_CACHE_LAYOUT``
(per layer a ``[blocks, heads, block_size, head_size + head_size_v]`` view with K and V
side by side in each row; MLA: one latent of ``head_size``), kernel-block splitting
included. The bytes on the wire are pddcore's canonical packed order, so the two sides
may use different layouts, block splits and TP sizes. Staging buffers come from a
:class:`~pddcore.integrations._staging.StagingPool`: one arena of ``staging_bytes``, allocated
when the KV caches are registered (pinned host memory when the KV is on a GPU), never while a
forward runs; its buffers are registered once and reused. A request the arena has no room for
is not staged: its consumers' loads fail with the reason (vLLM then applies its
``kv_load_failure_policy``), and a push buffer the consumer has no room for is refused, so the
KV is pulled.

``kv_connector_extra_config`` keys: ``host`` (listen address; default: this host's IP as
vLLM's ``get_ip()`` finds it, which honours ``VLLM_HOST_IP``), ``advertise_host`` (the
address peers connect to, when it differs from ``host``; ``0.0.0.0`` is never
advertised), ``port`` (base port; TP rank r of data-parallel rank d, d counted on this host, listens on
port + d * tp_size + r; default: any free port, published through the handshake metadata), ``lease_s`` (producer keeps unsent KV, and a
consumer an unclaimed push buffer, this long; default 60), ``load_timeout_s`` (consumer
gives up, default 60), ``staging_bytes`` (the staging arena of each worker, default 4 GiB:
on a producer it holds the staged copy of every request not yet pulled, on a consumer every
load and push buffer in flight), ``auth_token`` (the same on every producer and consumer; required
unless ``host`` is a loopback address or ``insecure`` is true: without it anybody who
reaches the port could write into staging buffers),
``backend`` (``"tcp"``, default, or ``"rdma"``), ``rdma_device`` (e.g. ``"mlx5_0"``),
``gpudirect`` (rdma with KV on a GPU: stage in registered device memory, which the NIC reads
and writes directly, instead of pinned host memory), ``tp_rank`` (override for tests or
out-of-engine use). Attention layers only: one KV-cache
group (a hybrid model, which needs vLLM's hybrid allocator, is refused with a clear error).
"""

from .config import advertised_host
from .connector import PDDConnector
from .metadata import PDDConnectorMetadata, PDDHandshakeMetadata

__all__ = ["PDDConnector", "PDDConnectorMetadata", "PDDHandshakeMetadata"]
