"""One deployment the simulator runs: its hardware pools, links, caches, SLA and policies
(:class:`ClusterConfig`), and a pool of accelerators of one kind (:class:`Pool`).
:class:`~pddcore.sim.cluster.ClusterSim` runs it.

Example::

    from pddcore.sim import HARDWARE, MODELS

    pdd = ClusterConfig("PDD", MODELS["moe-64k"], prefill=Pool(HARDWARE["H100"], 40),
                        decode=Pool(HARDWARE["H200"], 32), rld=Pool(HARDWARE["H100"], 3), wan_gbps=25.0)
    print(pdd.scenario, pdd.price_per_hour)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..handoff import HandoffPolicy
from .costmodel import CostModel
from .specs import HardwareSpec, ModelSpec

__all__ = ["Pool", "ClusterConfig"]


@dataclass(frozen=True)
class Pool:
    """``gpus`` accelerators of one kind, in instances of ``gpus_per_instance``."""

    hardware: HardwareSpec
    gpus: int
    gpus_per_instance: int = 1

    def __post_init__(self):
        if type(self.gpus) is not int or type(self.gpus_per_instance) is not int or self.gpus_per_instance < 1:
            raise ValueError(f"gpus and gpus_per_instance must be integers >= 1, got {self.gpus}, "
                             f"{self.gpus_per_instance}")
        if self.gpus < 0 or self.gpus % self.gpus_per_instance:
            raise ValueError(f"{self.gpus} {self.hardware.name} do not split into instances of "
                             f"{self.gpus_per_instance}")

    @property
    def instances(self) -> int:
        return self.gpus // self.gpus_per_instance

    @property
    def price_per_hour(self) -> float:
        return self.gpus * self.hardware.price_per_hour


@dataclass(frozen=True)
class ClusterConfig:
    """One deployment. Bandwidths in Gbit/s. ``ttft_slo_s`` / ``tpot_slo_s``: the SLA a
    request must meet to count toward goodput. ``router_ttft_slo_s``: the budget the
    router gives P_MD (MD must be ready within it). ``warm_start``: a session's prefix
    that P caches at its first request in the trace is in its home P's cache and on its
    MD too (the cluster has been running); otherwise the caches start empty. ``mfu`` /
    ``mbu`` / ``memory_reserve``: see :class:`pddcore.sim.costmodel.CostModel`.
    ``max_batch``: most running requests per decode instance. ``prefill_cache_ratio``:
    each P's prefix cache (LRU, pages of ``drc_page_tokens`` like MD's) holds this
    multiple of the KV room its HBM leaves beside one max-context prefill (1: HBM only;
    3: HBM plus a host-memory tier twice its size, SGLang HiCache's default), so a
    session's prefix is recomputed once evicted; None: an unbounded cache that hits
    whatever the trace's ``cached_tokens`` say."""

    name: str
    model: ModelSpec
    prefill: Pool
    decode: Pool
    rld: Pool | None = None
    cross_dc: bool = True
    wan_gbps: float = 100.0
    wan_rtt_s: float = 0.02
    rdma_gbps: float = 400.0
    drc: bool = True
    drc_page_tokens: int = 64
    prefill_cache_ratio: float | None = 3.0
    warm_start: bool = True
    max_batch: int = 128
    ttft_slo_s: float = 10.0
    tpot_slo_s: float = 0.1
    router_ttft_slo_s: float = 3.0
    handoff: HandoffPolicy = HandoffPolicy()
    mfu: float = 0.45
    mbu: float = 0.75
    memory_reserve: float = 0.10

    def __post_init__(self):
        for name in ("wan_gbps", "rdma_gbps", "ttft_slo_s", "tpot_slo_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.prefill_cache_ratio is not None and not self.prefill_cache_ratio >= 0:
            raise ValueError(f"prefill_cache_ratio must be None or >= 0, got {self.prefill_cache_ratio!r}")
        if self.rld is not None and not self.cross_dc:
            raise ValueError("an RLD tier only makes sense with decode across the WAN (cross_dc=True)")
        if self.prefill.instances < 1 or self.decode.instances < 1:
            raise ValueError("a cluster needs at least one prefill and one decode instance")

    @property
    def scenario(self) -> str:
        if self.rld is not None:
            return "PDD"
        return "cross-DC PD" if self.cross_dc else "same-DC PD"

    @property
    def price_per_hour(self) -> float:
        return sum(p.price_per_hour for p in (self.prefill, self.decode, self.rld) if p is not None)

    def cost_model(self, pool: Pool) -> CostModel:
        return CostModel(self.model, pool.hardware, pool.gpus_per_instance, mfu=self.mfu, mbu=self.mbu,
                         memory_reserve=self.memory_reserve)

    def with_(self, **changes: Any) -> "ClusterConfig":
        return replace(self, **changes)
