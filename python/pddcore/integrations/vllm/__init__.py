"""vLLM KV connector on pddcore (built and tested against vllm 0.33.0's ``KVConnectorBase_V1``).

The connector (:mod:`.connector`) runs as a scheduler (:mod:`.scheduler`) and as workers
(:mod:`.worker`: :mod:`.producer` on the prefill side, :mod:`.consumer` on the decode side),
which exchange the messages of :mod:`.protocol`.

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

from .config import advertised_host
from .connector import PDDConnector
from .metadata import PDDConnectorMetadata, PDDHandshakeMetadata

__all__ = ["PDDConnector", "PDDConnectorMetadata", "PDDHandshakeMetadata"]
