"""Hardware and model specifications as plain data.

Every number the cost model uses lives here, with where it comes from, so a result can
be traced back to a datasheet figure rather than to a fitted constant.

Example::

    from pddcore.sim.specs import HARDWARE, MODELS
    h200, model = HARDWARE["H200"], MODELS["moe-64k"]
    model.kv_bytes_per_token          # 49152 (48 KiB: 100 tokens ~ 4.9 MB, the report's ~4.6 MB)
    h200.hbm_bytes_per_s              # 4.8e12
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["HardwareSpec", "ModelSpec", "HARDWARE", "MODELS", "hardware", "model"]


def _positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
            raise ValueError(f"{owner}: {name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator. ``tflops``: dense BF16 tensor TFLOP/s (datasheet, no sparsity).
    ``hbm_gbps``: HBM bandwidth in GB/s. ``memory_gb``: HBM capacity in GB.
    ``price_per_hour``: rental price in dollars per accelerator-hour."""

    name: str
    tflops: float
    hbm_gbps: float
    memory_gb: float
    price_per_hour: float

    def __post_init__(self):
        _positive(f"hardware {self.name!r}", tflops=self.tflops, hbm_gbps=self.hbm_gbps,
                  memory_gb=self.memory_gb, price_per_hour=self.price_per_hour)

    @property
    def flops_per_s(self) -> float:
        return self.tflops * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gbps * 1e9

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9


# Datasheet figures (SXM parts). Prices: representative 2025 per-GPU-hour rental rates;
# only their ratios matter for a BCR comparison, and the H200:H100 ratio (1.28) is the
# one the calibration's BCR depends on (market quotes span about 1.2-1.5).
HARDWARE: dict[str, HardwareSpec] = {h.name: h for h in (
    HardwareSpec("H100", tflops=989.0, hbm_gbps=3350.0, memory_gb=80.0, price_per_hour=2.50),
    HardwareSpec("H200", tflops=989.0, hbm_gbps=4800.0, memory_gb=141.0, price_per_hour=3.20),
    HardwareSpec("H20", tflops=148.0, hbm_gbps=4000.0, memory_gb=96.0, price_per_hour=1.10),
    HardwareSpec("A100", tflops=312.0, hbm_gbps=2039.0, memory_gb=80.0, price_per_hour=1.40),
    HardwareSpec("generic", tflops=400.0, hbm_gbps=2000.0, memory_gb=64.0, price_per_hour=1.50),
)}


@dataclass(frozen=True)
class ModelSpec:
    """A transformer as the cost model sees it.

    ``total_params`` / ``active_params``: parameters stored / used per token (equal for a
    dense model). ``expert_params``: the routed-expert share of ``total_params``;
    ``num_experts`` and ``experts_per_token`` say how many experts a token touches.
    ``weight_bytes`` / ``kv_bytes``: bytes per weight / per KV element (1 for FP8, 2 for BF16).
    ``kv_bytes_per_token`` overrides the GQA formula (for MLA-style latent caches).
    """

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    total_params: float
    active_params: float
    expert_params: float = 0.0
    num_experts: int = 1
    experts_per_token: int = 1
    weight_bytes: float = 2.0
    kv_bytes: float = 2.0
    max_context: int = 131072
    kv_bytes_per_token_override: float | None = None

    def __post_init__(self):
        owner = f"model {self.name!r}"
        for name in ("layers", "q_heads", "kv_heads", "head_dim", "num_experts", "experts_per_token", "max_context"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{owner}: {name} must be an integer >= 1, got {value!r}")
        _positive(owner, total_params=self.total_params, active_params=self.active_params,
                  weight_bytes=self.weight_bytes, kv_bytes=self.kv_bytes)
        if self.active_params > self.total_params:
            raise ValueError(f"{owner}: active_params {self.active_params} exceeds total_params {self.total_params}")
        if not 0 <= self.expert_params < self.total_params:
            raise ValueError(f"{owner}: expert_params must be in [0, total_params), got {self.expert_params}")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"{owner}: experts_per_token {self.experts_per_token} > num_experts {self.num_experts}")
        if self.kv_bytes_per_token_override is not None:
            _positive(owner, kv_bytes_per_token_override=self.kv_bytes_per_token_override)

    @property
    def q_dim(self) -> int:
        return self.q_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes one token occupies, summed over layers (K and V)."""
        if self.kv_bytes_per_token_override is not None:
            return self.kv_bytes_per_token_override
        return self.layers * 2 * self.kv_heads * self.head_dim * self.kv_bytes

    @property
    def weight_bytes_total(self) -> float:
        return self.total_params * self.weight_bytes


MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    # A 64K-context MoE shaped like the PDD report's: GQA with 4 KV heads and FP8 KV, so
    # one token's KV is 48 KiB (100 tokens ~ 4.9 MB; the report quotes ~4.6 MB). 60 B
    # parameters in FP8 fill most of an 80 GB H100 -- which is why decode on H100 is
    # KV-capacity bound and the report moved MainDecode to 141 GB H200s.
    ModelSpec("moe-64k", layers=48, q_heads=40, kv_heads=4, head_dim=128, total_params=60e9, active_params=6e9,
              expert_params=54e9, num_experts=128, experts_per_token=8, weight_bytes=1.0, kv_bytes=1.0,
              max_context=65536),
    ModelSpec("llama3-70b", layers=80, q_heads=64, kv_heads=8, head_dim=128, total_params=70.6e9,
              active_params=70.6e9, weight_bytes=1.0, kv_bytes=2.0, max_context=131072),
    ModelSpec("llama3-8b", layers=32, q_heads=32, kv_heads=8, head_dim=128, total_params=8.0e9,
              active_params=8.0e9, weight_bytes=2.0, kv_bytes=2.0, max_context=131072),
)}


def hardware(name: str) -> HardwareSpec:
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}") from None


def model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
