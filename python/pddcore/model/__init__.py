"""`pddcore.model`: a small Llama-architecture reference decoder on a paged KV pool.

It is what the reference PDD deployment (``pddcore demo``), the handoff microbenchmark
and the tests run: RMSNorm, RoPE (Hugging Face rotate-half layout, ``rope_theta``,
optional Llama 3.1 scaling), grouped-query attention through :mod:`pddcore.kernels`,
SwiGLU MLP, tied or untied embeddings and Qwen2's q/k/v biases.

Pieces (one job per file):

* :class:`ModelConfig` (``config``) — the architecture; its defaults are the embedded
  model: 4 layers, hidden 256, 4 query heads, 2 KV heads, head_dim 64, vocabulary 4096,
  intermediate 688.
* :func:`random_weights` (``weights``) and :func:`load_checkpoint` (``loader``,
  Hugging Face ``config.json`` + safetensors for ``llama`` / ``qwen2``).
* :class:`KVPool`, :class:`SequenceKV` (``kv_pool``) over a :class:`PageAllocator`
  (``allocator``).
* :class:`Model` (``decoder``) with three batched entry points.
* :func:`sample`, :class:`SamplingParams`, :class:`SamplerState` (``sampling``).
* :func:`generate` and :func:`token_agreement` (``generate``).

Shapes (B requests, T new tokens in a pass, V vocabulary, Hkv KV heads, D head_dim):

* KV pool, per layer: ``pool.k_layers[l]``, ``pool.v_layers[l]`` ``[num_pages * page_size, Hkv, D]``;
  ``pool.layout()`` is the matching :class:`pddcore.KVLayout` (``tokens_per_page = page_size``),
  so ``pddcore.pack(pool.layout(), seq.pages)`` ships a request's KV.
* ``model.prefill(seqs, token_lists)`` / ``model.extend(seqs, token_lists)`` — the same pass:
  ``token_lists[i]`` (any length >= 1) is appended after the KV ``seqs[i]`` already holds.
  Returns logits ``[B, V]`` of each last token (``all_logits=True``: ``[T, V]``).
* ``model.decode(seqs, tokens)`` — one token per request; returns ``[B, V]``.
* Logits and KV are in the model dtype. The embedded default runs in float64 on the CPU,
  where an extend over N tokens and N decode steps agree to rounding (~1e-15 relative),
  so their greedy tokens are identical; in fp16 / bf16 report :func:`token_agreement`.

Sampling state for a handoff is ``SamplerState(seed, draws)``: two integers.

On a small shared CPU call ``torch.set_num_threads(1)`` in each process that runs the
embedded model: its ops are tiny, and OpenMP threads competing for two cores made a
decode step about 20x slower in our measurement (12 ms -> 225 ms).

Example (RLD decodes three tokens, then MD recomputes them with one extend and goes on)::

    import torch
    from pddcore.model import Model, SamplerState, SamplingParams, sample, generate

    model = Model.default(seed=0)                      # float64, CPU
    prompt = [1, 17, 300, 42, 7]
    params = SamplingParams(temperature=0.8, top_k=50)

    rld_pool = model.new_pool(num_pages=64, page_size=16)
    rld = rld_pool.new_sequence()
    state = SamplerState(seed=1234)
    out = sample(model.prefill([rld], [prompt]), [params], [state])
    for _ in range(3):
        out += sample(model.decode([rld], [out[-1]]), [params], [state])

    md_pool = model.new_pool(num_pages=64, page_size=16)
    md = md_pool.new_sequence()
    model.prefill([md], [prompt])                      # stands in for the KV shipped from P
    handoff = SamplerState(state.seed, state.draws)    # what RLD sends along with `out`
    logits = model.extend([md], [out])                 # recompute RLD's tokens
    out += sample(logits, [params], [handoff])
    assert out == generate(model, prompt, 5, sampling=params, seed=1234)
"""

from .allocator import PageAllocator, PoolExhaustedError
from .config import Llama3RopeScaling, ModelConfig
from .decoder import Model, load_model
from .generate import TokenAgreement, generate, token_agreement
from .kv_pool import KVPool, SequenceKV
from .loader import load_checkpoint
from .sampling import SamplerState, SamplingParams, sample, uniform
from .weights import LayerWeights, ModelWeights, random_weights

__all__ = [
    "ModelConfig", "Llama3RopeScaling",
    "ModelWeights", "LayerWeights", "random_weights", "load_checkpoint",
    "PageAllocator", "PoolExhaustedError", "KVPool", "SequenceKV",
    "Model", "load_model",
    "SamplingParams", "SamplerState", "sample", "uniform",
    "generate", "TokenAgreement", "token_agreement",
]
