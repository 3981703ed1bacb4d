"""Loading Hugging Face Llama / Qwen2 checkpoints: ``config.json`` plus
``model.safetensors`` or sharded ``model-*.safetensors`` with ``model.safetensors.index.json``.

Tensor names are the ``transformers`` ones (``model.layers.N.self_attn.q_proj.weight`` ...);
q/k/v and gate/up are fused on load (see :mod:`pddcore.model.weights`). Nothing is
downloaded: ``path`` is a local folder.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import torch

from .config import ModelConfig
from .weights import LayerWeights, ModelWeights

__all__ = ["load_checkpoint"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters write that carry no weights.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_checkpoint(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                    device: torch.device | str = "cpu") -> tuple[ModelConfig, ModelWeights]:
    """Reads a checkpoint folder. ``dtype=None`` keeps the stored dtype of the embedding.

    Raises FileNotFoundError when the folder has no config.json or safetensors files and
    ValueError naming any missing, unexpected or wrongly shaped tensor.
    """
    folder = os.fspath(path)
    config = ModelConfig.from_pretrained(folder)
    tensors = _read_safetensors(folder)
    unexpected = sorted(n for n in tensors if not n.endswith(IGNORED_SUFFIXES) and n not in _expected_names(config))
    if unexpected:
        raise ValueError(f"checkpoint {folder!r} has tensors this architecture does not use: {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"checkpoint {folder!r} lacks tensor 'model.embed_tokens.weight'")
    target_dtype = dtype if dtype is not None else tensors["model.embed_tokens.weight"].dtype

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"checkpoint {folder!r} lacks tensor {name!r}")
        return tensors[name].to(device=device, dtype=target_dtype)

    def take_optional(name: str, present: bool) -> torch.Tensor | None:
        return take(name) if present else None

    layers = [_layer(config, f"model.layers.{n}.", take, take_optional) for n in range(config.num_layers)]
    embed = take("model.embed_tokens.weight")
    # Tied checkpoints usually omit lm_head; when present it is the same matrix anyway.
    lm_head = embed if config.tie_word_embeddings else take("lm_head.weight")
    weights = ModelWeights(embed=embed, layers=layers, final_norm=take("model.norm.weight"), lm_head=lm_head)
    weights.check(config)
    return config, weights


def _layer(config: ModelConfig, prefix: str, take: Callable[[str], torch.Tensor],
           take_optional: Callable[[str, bool], torch.Tensor | None]) -> LayerWeights:
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    qkv_bias = None
    if config.qkv_bias:
        qkv_bias = torch.cat([take(attn + f"{p}_proj.bias") for p in "qkv"])
    gate_up_bias = None
    if config.mlp_bias:
        gate_up_bias = torch.cat([take(mlp + "gate_proj.bias"), take(mlp + "up_proj.bias")])
    return LayerWeights(
        input_norm=take(prefix + "input_layernorm.weight"),
        qkv=torch.cat([take(attn + f"{p}_proj.weight") for p in "qkv"]),
        qkv_bias=qkv_bias,
        o=take(attn + "o_proj.weight"),
        o_bias=take_optional(attn + "o_proj.bias", config.o_bias),
        post_attention_norm=take(prefix + "post_attention_layernorm.weight"),
        gate_up=torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]),
        gate_up_bias=gate_up_bias,
        down=take(mlp + "down_proj.weight"),
        down_bias=take_optional(mlp + "down_proj.bias", config.mlp_bias),
    )


def _expected_names(config: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        if config.qkv_bias:
            names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
        if config.o_bias:
            names.add(p + "self_attn.o_proj.bias")
        if config.mlp_bias:
            names |= {p + f"mlp.{x}_proj.bias" for x in ("gate", "up", "down")}
    return names


def _read_safetensors(folder: str) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError as e:  # optional dependency: only checkpoint loading needs it
        raise ImportError("loading a checkpoint needs the 'safetensors' package (pip install safetensors)") from e
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            shard_names = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, SINGLE_FILE)):
        shard_names = [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"checkpoint folder {folder!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shard_names:
        shard_path = os.path.join(folder, shard)
        if not os.path.isfile(shard_path):
            raise FileNotFoundError(f"shard {shard!r} named in {INDEX_FILE} is missing from {folder!r}")
        tensors.update(load_file(shard_path, device="cpu"))
    return tensors
