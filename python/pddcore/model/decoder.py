"""`Model`: the Llama-architecture decoder with batched prefill / extend / decode entry
points over a :class:`~pddcore.model.kv_pool.KVPool`.

All attention goes through :mod:`pddcore.kernels` (torch reference on CPU, Triton on
CUDA): an extend pass stores the new tokens' KV with ``store_kv`` and runs
``extend_attention`` over each request's cached prefix; a decode step stores the new
token first and runs ``decode_attention`` over all of the request's slots.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .. import kernels
from .config import ModelConfig
from .kv_pool import KVPool, SequenceKV
from .layers import RotaryEmbedding, rms_norm, swiglu_mlp
from .loader import load_checkpoint
from .weights import ModelWeights, random_weights

__all__ = ["Model"]

TokenIds = Sequence[int] | torch.Tensor


@dataclass(frozen=True)
class _Batch:
    """Device-side description of one forward pass over T new tokens of B requests."""

    input_ids: torch.Tensor   # [T]
    positions: torch.Tensor   # [T]
    new_slots: torch.Tensor   # [T] where the new tokens' KV goes
    qo_indptr: torch.Tensor   # [B+1]
    kv_indptr: torch.Tensor   # [B+1] over kv_indices
    kv_indices: torch.Tensor  # extend: prefix slots; decode: all slots incl. the new token
    last_rows: torch.Tensor   # [B] row of each request's last new token
    is_decode: bool


class Model:
    """A decoder (weights + RoPE tables) that runs batches of requests on a KV pool.

    Build it with :meth:`default` (the embedded seeded random model) or
    :meth:`from_pretrained` (a Hugging Face Llama / Qwen2 folder); see the package
    docstring of :mod:`pddcore.model` for an example.
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights):
        weights.check(config)
        self.config = config
        self.weights = weights
        self.rope = RotaryEmbedding(config, weights.device)
        self.sm_scale = config.head_dim ** -0.5

    @classmethod
    def default(cls, seed: int = 0, *, config: ModelConfig | None = None, dtype: torch.dtype = torch.float64,
                device: torch.device | str = "cpu") -> "Model":
        """The embedded reference model: ``ModelConfig()`` with seeded random weights."""
        config = config or ModelConfig()
        return cls(config, random_weights(config, seed, dtype=dtype, device=device))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                        device: torch.device | str = "cpu") -> "Model":
        """Loads a Hugging Face Llama / Qwen2 checkpoint folder (config.json + safetensors)."""
        return cls(*load_checkpoint(path, dtype=dtype, device=device))

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.dtype

    @property
    def device(self) -> torch.device:
        return self.weights.device

    def new_pool(self, num_pages: int, page_size: int = 16) -> KVPool:
        """An empty KV pool shaped, typed and placed for this model."""
        return KVPool(self.config, num_pages, page_size, dtype=self.dtype, device=self.device)

    # ---- entry points -----------------------------------------------------------------------
    def prefill(self, seqs: Sequence[SequenceKV], token_ids: Sequence[TokenIds], *,
                all_logits: bool = False, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Prompt processing; a sequence that already holds a cached prefix is extended
        past it. Identical to :meth:`extend` (the same pass, named for the P role)."""
        return self.extend(seqs, token_ids, all_logits=all_logits, on_layer=on_layer)

    def extend(self, seqs: Sequence[SequenceKV], token_ids: Sequence[TokenIds], *,
               all_logits: bool = False, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Appends ``token_ids[i]`` (at least one token) to ``seqs[i]`` in one batched pass:
        the new tokens attend to the request's cached KV and causally to each other, and
        their KV is stored in the pool.

        Returns logits ``[B, vocab]`` of each request's last new token, or with
        ``all_logits=True`` ``[T, vocab]`` for every new token (requests concatenated).
        ``on_layer(i)`` is called once layer ``i``'s KV of the new tokens is in the pool
        (layers in order), so a sender can stream it while later layers still compute
        (:mod:`pddcore.streaming`); the sequences' token counts advance only after the pass.

        Raises ValueError on a bad token id or sequence and PoolExhaustedError when the
        pool cannot hold the new tokens; in both cases nothing is changed.
        """
        lists = self._check_request(seqs, token_ids)
        empty = [i for i, ids in enumerate(lists) if not ids]
        if empty:
            raise ValueError(f"requests {empty[:8]} have no tokens to extend with")
        return self._run(seqs, lists, is_decode=False, all_logits=all_logits, on_layer=on_layer)

    def decode(self, seqs: Sequence[SequenceKV], token_ids: TokenIds) -> torch.Tensor:
        """One step: appends ``token_ids[i]`` (a single token) to ``seqs[i]``, which must
        already hold at least one token. Returns logits ``[B, vocab]``."""
        lists = self._check_request(seqs, [[t] for t in _token_list(None, token_ids)])
        fresh = [i for i, s in enumerate(seqs) if s.num_tokens == 0]
        if fresh:
            raise ValueError(f"requests {fresh[:8]} hold no tokens yet; prefill them before decoding")
        return self._run(seqs, lists, is_decode=True, all_logits=False)

    # ---- internals ------------------------------------------------------------------------
    def _check_request(self, seqs: Sequence[SequenceKV], token_ids: Sequence[TokenIds]) -> list[list[int]]:
        if len(seqs) == 0:
            raise ValueError("a batch needs at least one request")
        if len(seqs) != len(token_ids):
            raise ValueError(f"{len(seqs)} sequences but {len(token_ids)} token lists")
        if len({id(s) for s in seqs}) != len(seqs):
            raise ValueError("the same sequence appears twice in one batch")
        pool = seqs[0].pool
        if any(s.pool is not pool for s in seqs):
            raise ValueError("all sequences of a batch must live in one KVPool")
        c, pc = self.config, pool.config
        if (pc.num_layers, pc.num_kv_heads, pc.head_dim) != (c.num_layers, c.num_kv_heads, c.head_dim):
            raise ValueError(f"KV pool is shaped for {pc.num_layers} layers x {pc.num_kv_heads} KV heads x "
                             f"{pc.head_dim} dims; the model has {c.num_layers} x {c.num_kv_heads} x {c.head_dim}")
        if pool.dtype != self.dtype or pool.device != self.device:
            raise ValueError(f"KV pool is {pool.dtype} on {pool.device}; the model is {self.dtype} on {self.device}")
        released = [i for i, s in enumerate(seqs) if s.released]
        if released:
            raise ValueError(f"requests {released[:8]} use sequences that were already released")
        lists = []
        for i, ids in enumerate(token_ids):
            ids = _token_list(i, ids)
            bad = [(j, t) for j, t in enumerate(ids) if not 0 <= t < c.vocab_size]
            if bad:
                j, t = bad[0]
                raise ValueError(f"request {i}: token id {t} at index {j} is outside the vocabulary [0, {c.vocab_size})")
            lists.append(ids)
        return lists

    def _plan(self, seqs: Sequence[SequenceKV], lists: list[list[int]], is_decode: bool) -> _Batch:
        dev = self.device
        starts = [s.num_tokens for s in seqs]
        counts = [len(ids) for ids in lists]
        visible = [n + c if is_decode else n for n, c in zip(starts, counts)]
        qo = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0)
        return _Batch(
            input_ids=torch.tensor([t for ids in lists for t in ids], dtype=torch.int64, device=dev),
            positions=torch.cat([torch.arange(n, n + c, dtype=torch.int64) for n, c in zip(starts, counts)]).to(dev),
            new_slots=torch.cat([s.slots(n, n + c) for s, n, c in zip(seqs, starts, counts)]),
            qo_indptr=qo.to(dev),
            kv_indptr=torch.tensor([0] + visible, dtype=torch.int64).cumsum(0).to(dev),
            kv_indices=torch.cat([s.slots(0, v) for s, v in zip(seqs, visible)]),
            last_rows=(qo[1:] - 1).to(dev),
            is_decode=is_decode,
        )

    def _run(self, seqs: Sequence[SequenceKV], lists: list[list[int]], *, is_decode: bool,
             all_logits: bool, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        pool = seqs[0].pool
        pool.reserve(seqs, [len(ids) for ids in lists])
        batch = self._plan(seqs, lists, is_decode)
        with torch.inference_mode():
            hidden = self._forward(pool, batch, on_layer)
            rows = hidden if all_logits else hidden[batch.last_rows]
            logits = F.linear(rms_norm(rows, self.weights.final_norm, self.config.rms_norm_eps), self.weights.lm_head)
        for seq, ids in zip(seqs, lists):
            seq.num_tokens += len(ids)
        return logits

    def _forward(self, pool: KVPool, batch: _Batch, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        c, w = self.config, self.weights
        num_tokens = batch.input_ids.numel()
        hidden = F.embedding(batch.input_ids, w.embed)
        cos, sin = self.rope.cos_sin(batch.positions, self.dtype)
        for index, (layer, k_pool, v_pool) in enumerate(zip(w.layers, pool.k_layers, pool.v_layers)):
            x = rms_norm(hidden, layer.input_norm, c.rms_norm_eps)
            q, k, v = F.linear(x, layer.qkv, layer.qkv_bias).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = self.rope.apply(q.view(num_tokens, c.num_heads, c.head_dim), cos, sin)
            k = self.rope.apply(k.view(num_tokens, c.num_kv_heads, c.head_dim), cos, sin)
            v = v.reshape(num_tokens, c.num_kv_heads, c.head_dim)
            out = torch.empty_like(q)
            kernels.store_kv(k, v, k_pool, v_pool, batch.new_slots)
            if on_layer is not None:
                on_layer(index)
            if batch.is_decode:
                kernels.decode_attention(q, k_pool, v_pool, out, batch.kv_indptr, batch.kv_indices,
                                         sm_scale=self.sm_scale)
            else:
                kernels.extend_attention(q, k, v, out, k_pool, v_pool, batch.qo_indptr, batch.kv_indptr,
                                         batch.kv_indices, sm_scale=self.sm_scale)
            hidden = hidden + F.linear(out.view(num_tokens, c.q_size), layer.o, layer.o_bias)
            hidden = hidden + swiglu_mlp(rms_norm(hidden, layer.post_attention_norm, c.rms_norm_eps), layer)
        return hidden


def _token_list(request: int | None, ids: TokenIds) -> list[int]:
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    try:
        return [operator.index(t) for t in values]
    except TypeError:
        where = "decode tokens" if request is None else f"request {request}"
        raise ValueError(f"{where}: token ids must be integers, got {values[:8]}") from None


def load_model(spec: dict) -> Model:
    """The model a process spec names: ``{"path": folder}`` (Hugging Face Llama / Qwen2) or
    the embedded one, ``{"seed": 0}``; float64 on CPU unless ``spec["dtype"]`` says otherwise."""
    dtype = getattr(torch, spec.get("dtype") or "float64")
    if spec.get("path"):
        return Model.from_pretrained(spec["path"], dtype=dtype)
    return Model.default(seed=spec.get("seed") or 0, dtype=dtype)
