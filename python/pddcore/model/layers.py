"""The decoder's building blocks as plain functions over tensors: RMSNorm, rotary
position embedding (RoPE) and the SwiGLU MLP.

Shapes: activations are token-major, ``x[T, hidden]``; q/k are ``[T, heads, head_dim]``.
Numerics follow ``transformers`` so checkpoints behave as they were trained: RMSNorm
runs in at least float32, and RoPE angles are computed in float32 and then cast to the
model dtype (a float64 model uses the same float32-rounded angles everywhere, so prefill,
extend and decode still agree exactly on them).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .config import Llama3RopeScaling, ModelConfig
from .weights import LayerWeights

__all__ = ["rms_norm", "RotaryEmbedding", "swiglu_mlp"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, computed in at least float32."""
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute_dtype)
    normed = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class RotaryEmbedding:
    """RoPE in the rotate-half layout used by Hugging Face Llama and Qwen2 checkpoints
    (dims ``i`` and ``i + head_dim/2`` form one rotating pair), with optional Llama 3.1
    frequency scaling."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu"):
        dim = config.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float32) / dim
        inv_freq = 1.0 / (config.rope_theta ** exponents)
        if config.rope_scaling is not None:
            inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[T, head_dim]`` for integer ``positions[T]``."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates ``x[T, heads, head_dim]`` by the per-token angles."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]


def _llama3_scale(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def swiglu_mlp(x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` with the fused ``gate_up`` projection."""
    gate, up = F.linear(x, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, layer.down, layer.down_bias)
