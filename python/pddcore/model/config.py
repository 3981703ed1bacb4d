"""`ModelConfig`: the shape of a Llama-architecture decoder, and its reading from a
Hugging Face ``config.json`` (model types ``llama`` and ``qwen2``).

The defaults are the embedded reference model: small enough to run on two CPU cores.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["ModelConfig", "Llama3RopeScaling"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent RoPE rescaling (``rope_type: "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.low_freq_factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError(f"llama3 rope scaling needs positive parameters, got {self}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got {self}")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama / Qwen2 decoder.

    ``qkv_bias`` is Qwen2's bias on the q/k/v projections (Llama's ``attention_bias``
    sets it together with ``o_bias``); ``mlp_bias`` is Llama's optional MLP bias.
    """

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError(f"rope_theta and rms_norm_eps must be positive, got {self.rope_theta}, {self.rms_norm_eps}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        bad_eos = [t for t in self.eos_token_ids if not 0 <= t < self.vocab_size]
        if bad_eos:
            raise ValueError(f"eos_token_ids {bad_eos} are outside the vocabulary [0, {self.vocab_size})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    # ---- Hugging Face config.json -----------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> "ModelConfig":
        """Reads a Hugging Face ``LlamaConfig`` / ``Qwen2Config`` dictionary (old style
        ``rope_theta``/``rope_scaling`` keys or new style ``rope_parameters``)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json model_type {model_type!r} is not supported; need one of {SUPPORTED_MODEL_TYPES}")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; the SwiGLU MLP needs 'silu'")
        if model_type == "qwen2" and hf.get("use_sliding_window", False):
            raise ValueError("Qwen2 checkpoints with use_sliding_window=true are not supported")
        if int(hf.get("pretraining_tp", 1)) != 1:
            raise ValueError(f"pretraining_tp={hf['pretraining_tp']} is not supported")
        num_heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // num_heads
        rope_theta, rope_scaling = _read_rope(hf)
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(int(t) for t in eos)
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            mlp_bias=model_type == "llama" and bool(hf.get("mlp_bias", False)),
            model_type=model_type,
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        """Reads ``<path>/config.json``."""
        config_path = os.path.join(os.fspath(path), "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"no config.json in checkpoint folder {os.fspath(path)!r}")
        with open(config_path, encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f))


def _read_rope(hf: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        return theta, Llama3RopeScaling(
            factor=float(merged["factor"]),
            low_freq_factor=float(merged["low_freq_factor"]),
            high_freq_factor=float(merged["high_freq_factor"]),
            original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
        )
    raise ValueError(f"rope_type {rope_type!r} is not supported; only 'default' and 'llama3'")
