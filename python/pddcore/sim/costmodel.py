"""Compute and memory cost models: how long one instance needs for a prefill, a decode
step and an extend pass, and how many KV tokens it can hold.

An *instance* is ``gpus`` accelerators of one :class:`HardwareSpec` serving one model
replica (tensor/expert parallel); FLOP/s, HBM bandwidth and memory add up over them.

* Prefill is compute-bound: ``2 * active_params`` FLOPs per new token for the matmuls,
  plus attention: a new token at position ``p`` reads ``p + 1`` keys, ``4 * q_dim``
  FLOPs per key per layer (QK^T and PV). ``n`` new tokens after ``c`` cached ones::

      flops = 2 * active * n + 4 * q_dim * layers * (n * c + n * (n + 1) / 2)

* A decode step is memory-bound: it reads the weights the batch touches (for an MoE
  only the experts some token routed to) and every running request's KV once. Its time
  is the larger of that traffic over HBM bandwidth and its FLOPs over compute.
* Efficiency factors (``mfu``, ``mbu``) turn datasheet peaks into achieved rates;
  ``step_overhead_s`` is the per-step launch / scheduling cost an engine pays.

Example::

    cost = CostModel(MODELS["moe-64k"], HARDWARE["H100"])
    cost.prefill_seconds(new_tokens=6554, cached_tokens=58982)    # ~1 s
    cost.decode_step_seconds(batch=4, context_tokens=4 * 60000)  # tens of ms
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .specs import HardwareSpec, ModelSpec

__all__ = ["CostModel", "prefill_flops", "moe_weight_bytes_touched"]


def prefill_flops(model: ModelSpec, new_tokens: int, cached_tokens: int) -> float:
    """FLOPs to compute the KV (and logits) of ``new_tokens`` after ``cached_tokens``."""
    n, c = new_tokens, cached_tokens
    if n < 0 or c < 0:
        raise ValueError(f"token counts must be >= 0, got new={n}, cached={c}")
    attention_keys = n * c + n * (n + 1) / 2
    return 2.0 * model.active_params * n + 4.0 * model.q_dim * model.layers * attention_keys


def moe_weight_bytes_touched(model: ModelSpec, batch: int) -> float:
    """Weight bytes one forward pass over ``batch`` tokens reads: all dense weights and
    the experts at least one token routed to (expected value under uniform routing)."""
    if batch <= 0:
        return 0.0
    dense = model.total_params - model.expert_params
    untouched = (1.0 - model.experts_per_token / model.num_experts) ** batch
    return (dense + model.expert_params * (1.0 - untouched)) * model.weight_bytes


def _line_sum(a: float, b: float, start: int, end: int) -> float:
    """sum of a + b * i for i in [start, end)."""
    n = end - start
    return 0.0 if n <= 0 else n * a + b * (start + end - 1) * n / 2


@dataclass(frozen=True)
class CostModel:
    """Timing of one instance: ``gpus`` x ``hardware`` running ``model``.

    * ``mfu`` (0.45): achieved fraction of peak FLOP/s in long-context prefill, the
      range SGLang / vLLM report for FlashAttention-backed prefill on Hopper.
    * ``mbu`` (0.75): achieved fraction of HBM bandwidth in decode.
    * ``step_overhead_s`` (0.004): per-step launch, sampling and scheduling cost.
    * ``prefill_overhead_s`` (0.02): per-request fixed prefill cost.
    * ``memory_reserve`` (0.10): share of HBM kept for activations and the runtime.
    """

    model: ModelSpec
    hardware: HardwareSpec
    gpus: int = 1
    mfu: float = 0.45
    mbu: float = 0.75
    step_overhead_s: float = 0.004
    prefill_overhead_s: float = 0.02
    memory_reserve: float = 0.10

    def __post_init__(self):
        if type(self.gpus) is not int or self.gpus < 1:
            raise ValueError(f"gpus must be an integer >= 1, got {self.gpus!r}")
        for name in ("mfu", "mbu"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        for name in ("step_overhead_s", "prefill_overhead_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.memory_reserve < 1:
            raise ValueError(f"memory_reserve must be in [0, 1), got {self.memory_reserve!r}")
        if self.kv_capacity_tokens() < self.model.max_context:
            raise ValueError(f"{self.model.name} on {self.gpus} x {self.hardware.name} leaves room for "
                             f"{self.kv_capacity_tokens()} KV tokens, less than one {self.model.max_context}-token "
                             f"context; use more GPUs per instance")

    @property
    def flops_per_s(self) -> float:
        return self.hardware.flops_per_s * self.gpus * self.mfu

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hardware.hbm_bytes_per_s * self.gpus * self.mbu

    @property
    def price_per_hour(self) -> float:
        return self.hardware.price_per_hour * self.gpus

    def kv_capacity_tokens(self) -> int:
        """KV tokens that fit beside the weights and the reserve."""
        free = self.hardware.memory_bytes * self.gpus * (1.0 - self.memory_reserve) - self.model.weight_bytes_total
        return max(0, math.floor(free / self.model.kv_bytes_per_token))

    def prefill_seconds(self, new_tokens: int, cached_tokens: int) -> float:
        return self.prefill_overhead_s + prefill_flops(self.model, new_tokens, cached_tokens) / self.flops_per_s

    def extend_seconds(self, new_tokens: int, cached_tokens: int) -> float:
        """The handoff's extend pass: a prefill of ``new_tokens`` over ``cached_tokens``,
        run inside a decode step (so without the per-request prefill overhead)."""
        if new_tokens == 0:
            return 0.0
        return prefill_flops(self.model, new_tokens, cached_tokens) / self.flops_per_s

    def decode_step_seconds(self, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` requests holding ``context_tokens`` KV tokens in all."""
        return self.decode_steps_seconds(batch, context_tokens, 1)

    def decode_steps_seconds(self, batch: int, context_tokens: int, steps: int) -> float:
        """``steps`` consecutive decode steps of an unchanged batch: the context grows by
        ``batch`` tokens per step. Closed form of the sum of :meth:`decode_step_seconds`."""
        if batch <= 0 or steps <= 0:
            return 0.0
        m = self.model
        attn = 4.0 * m.q_dim * m.layers
        # Step i costs max(mem0 + mem1 * i, flop0 + flop1 * i): two lines, crossing at most once.
        mem0 = (moe_weight_bytes_touched(m, batch) + context_tokens * m.kv_bytes_per_token) / self.hbm_bytes_per_s
        mem1 = batch * m.kv_bytes_per_token / self.hbm_bytes_per_s
        flop0 = (2.0 * m.active_params * batch + attn * context_tokens) / self.flops_per_s
        flop1 = attn * batch / self.flops_per_s
        head, tail = ((mem0, mem1), (flop0, flop1)) if mem0 >= flop0 else ((flop0, flop1), (mem0, mem1))
        split = steps
        if tail[1] > head[1]:  # the smaller line grows faster: it takes over after the crossing
            split = min(steps, math.ceil((head[0] - tail[0]) / (tail[1] - head[1])))
        total = steps * self.step_overhead_s + _line_sum(*head, 0, split) + _line_sum(*tail, split, steps)
        return total
