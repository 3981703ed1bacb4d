""":class:`PDDConnector`, the class vLLM loads: one object per role, whose methods come from
the scheduler side (:mod:`.scheduler`) or the worker side (:mod:`.worker`, with its
:mod:`.producer` and :mod:`.consumer` halves).

Example (what vLLM does with ``kv_connector_module_path="pddcore.integrations.vllm"``)::

    scheduler_connector = PDDConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    worker_connector = PDDConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    worker_connector.register_kv_caches(kv_caches)    # {layer name: [blocks, heads, block_size, row]}
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from .config import advertised_host, attention_spec
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["PDDConnector"]


class PDDConnector(SchedulerSide, WorkerSide, KVConnectorBase_V1):
    """A vLLM v1 KV connector that moves KV through pddcore; see :mod:`pddcore.integrations.vllm`."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config, role, kv_cache_config)
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("PDDConnector does not support pipeline parallelism (each stage holds only its "
                             "layers, and the stages' workers would share ports); serve with "
                             "--pipeline-parallel-size 1 or use another connector")
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.engine_id = self._kv_transfer_config.engine_id
        self.attention_spec = attention_spec(kv_cache_config)
        self.listen_host, self.host = advertised_host(extra)
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.base_port = None if extra.get("port") is None else int(extra["port"]) + self._dp_port_offset(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        self.lease_s = float(extra.get("lease_s", 60.0))
        self.load_timeout_s = float(extra.get("load_timeout_s", 60.0))
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker(extra)

    def _dp_port_offset(self, vllm_config: "VllmConfig") -> int:
        """Data-parallel rank ``d`` (its index on this host) takes ports ``port + d * tp_size + r``,
        so the DP ranks of one host do not collide."""
        parallel = vllm_config.parallel_config
        local = parallel.data_parallel_rank_local
        return (parallel.data_parallel_rank if local is None else local) * self.tp_size

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        return None  # KVLayout takes any cell strides vLLM allocates
