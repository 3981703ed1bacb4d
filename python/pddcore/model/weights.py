"""Weight containers for the decoder and the seeded random initialisation of the
embedded default model.

Projections are stored fused the way serving engines keep them (one matmul each):
``qkv`` is ``[q_size + 2 * kv_size, hidden]`` (rows: q, then k, then v) and
``gate_up`` is ``[2 * intermediate, hidden]`` (rows: gate, then up). Every matrix is
``[out_features, in_features]``, as ``torch.nn.functional.linear`` takes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import ModelConfig

__all__ = ["LayerWeights", "ModelWeights", "random_weights"]


@dataclass
class LayerWeights:
    """One decoder layer. Bias fields are ``None`` when the config has no such bias."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_attention_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


@dataclass
class ModelWeights:
    """All weights; with tied embeddings ``lm_head`` is the same tensor as ``embed``."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def check(self, config: ModelConfig) -> None:
        """Raises ValueError naming the first tensor whose shape, dtype or device disagrees
        with ``config`` or with the embedding."""
        h, i, qkv = config.hidden_size, config.intermediate_size, config.q_size + 2 * config.kv_size
        expected: list[tuple[str, torch.Tensor | None, tuple[int, ...] | None]] = [
            ("embed", self.embed, (config.vocab_size, h)),
            ("final_norm", self.final_norm, (h,)),
            ("lm_head", self.lm_head, (config.vocab_size, h)),
        ]
        if len(self.layers) != config.num_layers:
            raise ValueError(f"weights hold {len(self.layers)} layers but the config has {config.num_layers}")
        for n, layer in enumerate(self.layers):
            expected += [
                (f"layers[{n}].input_norm", layer.input_norm, (h,)),
                (f"layers[{n}].qkv", layer.qkv, (qkv, h)),
                (f"layers[{n}].qkv_bias", layer.qkv_bias, (qkv,) if config.qkv_bias else None),
                (f"layers[{n}].o", layer.o, (h, config.q_size)),
                (f"layers[{n}].o_bias", layer.o_bias, (h,) if config.o_bias else None),
                (f"layers[{n}].post_attention_norm", layer.post_attention_norm, (h,)),
                (f"layers[{n}].gate_up", layer.gate_up, (2 * i, h)),
                (f"layers[{n}].gate_up_bias", layer.gate_up_bias, (2 * i,) if config.mlp_bias else None),
                (f"layers[{n}].down", layer.down, (h, i)),
                (f"layers[{n}].down_bias", layer.down_bias, (h,) if config.mlp_bias else None),
            ]
        for name, tensor, shape in expected:
            if shape is None:
                if tensor is not None:
                    raise ValueError(f"{name} is set but the config has no such bias")
                continue
            if tensor is None:
                raise ValueError(f"{name} is missing; expected shape {shape}")
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
            if tensor.dtype != self.dtype or tensor.device != self.device:
                raise ValueError(f"{name} is {tensor.dtype} on {tensor.device}; the embedding is "
                                 f"{self.dtype} on {self.device}")


def random_weights(config: ModelConfig, seed: int = 0, *, dtype: torch.dtype = torch.float64,
                   device: torch.device | str = "cpu") -> ModelWeights:
    """Seeded random weights. They are drawn in float64 on the CPU and then cast, so the
    same seed gives the same model (up to rounding) in every dtype and on every device.

    Matrices are N(0, 1/fan_in) so activations keep unit scale through the layers and
    the logits are spread out (few near-ties); norm weights are N(1, 0.1).
    """
    gen = torch.Generator(device="cpu").manual_seed(int(seed))

    def normal(*shape: int, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, dtype=torch.float64) * std + mean
        return t.to(device=device, dtype=dtype)

    def matrix(out_features: int, in_features: int) -> torch.Tensor:
        return normal(out_features, in_features, std=1.0 / math.sqrt(in_features))

    def bias(size: int, present: bool) -> torch.Tensor | None:
        return normal(size, std=0.1) if present else None

    h, i, qkv = config.hidden_size, config.intermediate_size, config.q_size + 2 * config.kv_size
    embed = normal(config.vocab_size, h)
    layers = [
        LayerWeights(
            input_norm=normal(h, mean=1.0, std=0.1),
            qkv=matrix(qkv, h),
            qkv_bias=bias(qkv, config.qkv_bias),
            o=matrix(h, config.q_size),
            o_bias=bias(h, config.o_bias),
            post_attention_norm=normal(h, mean=1.0, std=0.1),
            gate_up=matrix(2 * i, h),
            gate_up_bias=bias(2 * i, config.mlp_bias),
            down=matrix(h, i),
            down_bias=bias(h, config.mlp_bias),
        )
        for _ in range(config.num_layers)
    ]
    final_norm = normal(h, mean=1.0, std=0.1)
    lm_head = embed if config.tie_word_embeddings else matrix(config.vocab_size, h)
    weights = ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)
    weights.check(config)
    return weights
