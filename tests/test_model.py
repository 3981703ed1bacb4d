"""pddcore.model: logits against transformers' Llama / Qwen2 on the same random weights,
prefill / extend / decode consistency on the paged pool, seeded sampling across a
handoff, and clear errors on bad input."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pddcore
from pddcore.model import (KVPool, Model, ModelConfig, PageAllocator, PoolExhaustedError, SamplerState,
                           SamplingParams, generate, load_checkpoint, sample, token_agreement, uniform)

transformers = pytest.importorskip("transformers")

# Small on purpose: awkward sizes (odd vocab, page size not dividing lengths).
HF_SHAPE = dict(vocab_size=211, hidden_size=96, intermediate_size=120, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=2, head_dim=16)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The model's ops are tiny: on two shared cores OpenMP threads only spin (20x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model() -> Model:
    return Model.default(seed=0)


def _float64_rms_norm(self, hidden):
    """transformers' RMSNorm casts to float32 whatever the model dtype; this keeps float64
    so that a float64 comparison shows real agreement instead of float32 rounding."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


def _hf_checkpoint(tmp_path, kind: str, dtype: torch.dtype, **extra):
    if kind == "qwen2":
        config_cls, model_cls = transformers.Qwen2Config, transformers.Qwen2ForCausalLM
    else:
        config_cls, model_cls = transformers.LlamaConfig, transformers.LlamaForCausalLM
    torch.manual_seed(len(kind) + len(extra))
    hf = model_cls(config_cls(**HF_SHAPE, **extra)).to(dtype).eval()
    with torch.no_grad():
        for p in hf.parameters():  # every weight and bias random, norms included
            p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path)
    return hf


CHECKPOINTS = {
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-bias-llama3rope": ("llama", dict(attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3_ROPE)),
    "qwen2": ("qwen2", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_logits_match_transformers_float64(tmp_path, monkeypatch, name):
    kind, extra = CHECKPOINTS[name]
    hf_module = transformers.models.qwen2.modeling_qwen2 if kind == "qwen2" else transformers.models.llama.modeling_llama
    monkeypatch.setattr(hf_module.Qwen2RMSNorm if kind == "qwen2" else hf_module.LlamaRMSNorm, "forward",
                        _float64_rms_norm)
    hf = _hf_checkpoint(tmp_path, kind, torch.float64, **extra)
    model = Model.from_pretrained(tmp_path)
    assert model.dtype == torch.float64 and model.config.model_type == kind

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 211, (n,), generator=gen) for n in (37, 1, 12)]
    pool = model.new_pool(num_pages=20, page_size=5)
    seqs = [pool.new_sequence() for _ in prompts]
    ours = model.prefill(seqs, prompts, all_logits=True).split([len(p) for p in prompts])
    with torch.no_grad():
        for prompt, got in zip(prompts, ours):
            want = hf(prompt[None]).logits[0]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_logits_match_transformers_float32(tmp_path):
    hf = _hf_checkpoint(tmp_path, "llama", torch.float32, rope_parameters=LLAMA3_ROPE)
    model = Model.from_pretrained(tmp_path)
    assert model.dtype == torch.float32
    prompt = torch.randint(0, 211, (29,), generator=torch.Generator().manual_seed(2))
    seq = model.new_pool(8, 4).new_sequence()
    got = model.prefill([seq], [prompt], all_logits=True)
    with torch.no_grad():
        want = hf(prompt[None]).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_loader_reads_sharded_checkpoint_and_casts(tmp_path):
    hf = _hf_checkpoint(tmp_path, "llama", torch.float32)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    config, weights = load_checkpoint(tmp_path / "sharded", dtype=torch.float64)
    _, single = load_checkpoint(tmp_path)
    assert config.num_layers == 2 and weights.dtype == torch.float64
    torch.testing.assert_close(weights.layers[1].qkv, single.layers[1].qkv.double(), rtol=0, atol=0)
    torch.testing.assert_close(weights.lm_head, hf.lm_head.weight.detach().double(), rtol=0, atol=0)


def test_loader_rejects_bad_checkpoints(tmp_path):
    from safetensors.torch import load_file, save_file

    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)
    _hf_checkpoint(tmp_path, "llama", torch.float32)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        ModelConfig.from_hf_dict({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModelConfig.from_hf_dict({"model_type": "llama", **HF_SHAPE, "rope_parameters": {"rope_type": "yarn"}})


def test_prefill_then_decode_equals_full_forward(model):
    rng = random.Random(3)
    lengths = [(11, 9), (1, 6), (16, 4)]  # (prefill part, decode part)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(a + b)] for a, b in lengths]
    pool = model.new_pool(num_pages=32, page_size=4)
    full = [model.prefill([pool.new_sequence()], [p], all_logits=True) for p in prompts]

    seqs = [pool.new_sequence() for _ in prompts]
    last = model.prefill(seqs, [p[:a] for p, (a, _) in zip(prompts, lengths)])
    for i, (a, _) in enumerate(lengths):
        torch.testing.assert_close(last[i], full[i][a - 1], rtol=0, atol=1e-10)
    for step in range(max(b for _, b in lengths)):
        active = [i for i, (_, b) in enumerate(lengths) if step < b]  # requests drop out of the batch
        logits = model.decode([seqs[i] for i in active], [prompts[i][lengths[i][0] + step] for i in active])
        for row, i in enumerate(active):
            torch.testing.assert_close(logits[row], full[i][lengths[i][0] + step], rtol=0, atol=1e-10)
    assert [s.num_tokens for s in seqs] == [a + b for a, b in lengths]


TINY = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=40, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, tie_word_embeddings=True)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(page_size=st.integers(1, 7), data=st.data(),
       shape=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), min_size=1, max_size=4))
def test_ragged_extend_batch_equals_separate_prefills(page_size, data, shape):
    """A batch of requests with random cached-prefix and new-token counts, on a random page
    size, gives every token the logits of a one-request prefill of the whole sequence."""
    model = Model.default(seed=5, config=TINY)
    seqs_tokens = [data.draw(st.lists(st.integers(0, 96), min_size=a + b, max_size=a + b)) for a, b in shape]
    pool = model.new_pool(num_pages=sum(-(-(a + b) // page_size) for a, b in shape) * 2 + 4, page_size=page_size)
    seqs = [pool.new_sequence() for _ in shape]
    for seq, tokens, (a, _) in zip(seqs, seqs_tokens, shape):
        if a:
            model.prefill([seq], [tokens[:a]])
    got = model.extend(seqs, [t[a:] for t, (a, _) in zip(seqs_tokens, shape)], all_logits=True)
    want = torch.cat([model.prefill([pool.new_sequence()], [t], all_logits=True)[a:]
                      for t, (a, _) in zip(seqs_tokens, shape)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_module_docstring_example_runs():
    import textwrap

    import pddcore.model

    example = pddcore.model.__doc__.split("Example (")[1].split("::\n", 1)[1]
    namespace: dict = {}
    exec(compile(textwrap.dedent(example), "pddcore.model docstring", "exec"), namespace)
    assert len(namespace["out"]) == 5  # the example itself asserts MD continued exactly as RLD


def test_generate_greedy_equals_argmax_of_full_forwards(model):
    prompt = [5, 900, 77, 4000, 12, 3]
    out = generate(model, prompt, 6)
    tokens = list(prompt)
    for _ in range(6):
        seq = model.new_pool(4, 16).new_sequence()
        tokens.append(int(model.prefill([seq], [tokens]).argmax()))
    assert out == tokens[len(prompt):]
    assert len(set(out)) > 1
    assert generate(model, prompt, 6, stop_token_ids=[out[2]]) == out[:out.index(out[2]) + 1]
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [], 3)


def _kv_rows(pool: KVPool, seq, start: int, end: int) -> torch.Tensor:
    slots = seq.slots(start, end)
    return torch.stack([torch.stack([k[slots], v[slots]]) for k, v in zip(pool.k_layers, pool.v_layers)])


def test_extend_recompute_equals_decode_steps(model):
    """RLD decodes N tokens step by step; MD gets the prompt's KV as packed pages, then
    recomputes those N tokens with one extend. Same KV, same greedy continuation."""
    rng = random.Random(4)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(n)] for n in (21, 8)]
    handoff_after = [13, 40]
    rld_pool, md_pool = model.new_pool(32, page_size=8), model.new_pool(32, page_size=8)
    rld = [rld_pool.new_sequence() for _ in prompts]
    generated = [[int(t)] for t in model.prefill(rld, prompts).argmax(-1)]

    # P -> MD: ship the prompt KV as pages, exactly what the deployment does.
    md = [md_pool.allocate_sequence(len(p)) for p in prompts]
    for src, dst in zip(rld, md):
        buf = pddcore.pack(rld_pool.layout(), torch.tensor(src.pages))
        pddcore.unpack(md_pool.layout(), torch.tensor(dst.pages), buf)

    for step in range(max(handoff_after) - 1):
        active = [i for i in range(2) if step < handoff_after[i] - 1]
        logits = model.decode([rld[i] for i in active], [generated[i][-1] for i in active])
        for row, i in enumerate(active):
            generated[i].append(int(logits[row].argmax()))

    md_next = model.extend(md, generated).argmax(-1).tolist()
    rld_next = model.decode(rld, [g[-1] for g in generated]).argmax(-1).tolist()
    assert md_next == rld_next
    for i, p in enumerate(prompts):
        n = len(p) + handoff_after[i]
        torch.testing.assert_close(_kv_rows(md_pool, md[i], 0, n), _kv_rows(rld_pool, rld[i], 0, n),
                                   rtol=1e-12, atol=1e-12)

    rld_tail, md_tail = [rld_next], [md_next]
    for _ in range(12):
        rld_tail.append(model.decode(rld, rld_tail[-1]).argmax(-1).tolist())
        md_tail.append(model.decode(md, md_tail[-1]).argmax(-1).tolist())
    assert rld_tail == md_tail


def test_md_assembles_cached_prefix_and_shipped_suffix(model):
    """Decode-side prefix cache: MD holds the first 16 tokens from an earlier turn, P ships
    only the pages of the suffix; MD's next logits equal P's."""
    prompt = [(7 * i + 3) % model.config.vocab_size for i in range(27)]
    p_pool, md_pool = model.new_pool(8, page_size=8), model.new_pool(8, page_size=8)
    p_seq = p_pool.new_sequence()
    model.prefill([p_seq], [prompt])
    cached = md_pool.new_sequence()
    model.prefill([cached], [prompt[:19]])               # an earlier turn, longer than the hit

    md_seq = md_pool.fork(cached, 16)                     # page-aligned hit: shares two pages
    new_pages = md_pool.append_external(md_seq, len(prompt) - 16)
    assert len(new_pages) == 2 and md_seq.num_tokens == 27
    suffix = torch.tensor(p_seq.pages[2:])
    pddcore.unpack(md_pool.layout(), torch.tensor(new_pages), pddcore.pack(p_pool.layout(), suffix))

    torch.testing.assert_close(model.decode([md_seq], [11]), model.decode([p_seq], [11]), rtol=0, atol=1e-12)


def test_seeded_sampling_continues_identically_after_handoff(model):
    prompt = [17, 4, 1024, 33, 2048, 9, 9]
    params = SamplingParams(temperature=0.9, top_k=200, top_p=0.95)
    reference = generate(model, prompt, 12, sampling=params, seed=77)
    assert reference != generate(model, prompt, 12, sampling=params, seed=78)
    assert reference != generate(model, prompt, 12)

    for handoff_at in (1, 7, 11):
        rld = model.new_pool(8).new_sequence()
        state = SamplerState(seed=77)
        out = sample(model.prefill([rld], [prompt]), [params], [state])
        while len(out) < handoff_at:
            out += sample(model.decode([rld], [out[-1]]), [params], [state])
        handoff = (state.seed, state.draws)  # all the random state that crosses the WAN
        assert handoff == (77, handoff_at)

        md = model.new_pool(8).new_sequence()
        model.prefill([md], [prompt])
        md_state = SamplerState(*handoff)
        out += sample(model.extend([md], [out]), [params], [md_state])
        while len(out) < 12:
            out += sample(model.decode([md], [out[-1]]), [params], [md_state])
        assert out == reference


def test_sampling_filters_and_frequencies():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 2.0]], dtype=torch.float64)
    greedy = SamplingParams()
    assert sample(logits, [greedy], [SamplerState()]) == [0]  # the first maximum wins a tie
    top1 = SamplingParams(temperature=1.5, top_k=1)
    assert {sample(logits, [top1], [SamplerState(seed=s)])[0] for s in range(20)} == {0, 4}  # tie kept by top-k
    nucleus = SamplingParams(temperature=1.0, top_p=0.5)
    assert {sample(logits, [nucleus], [SamplerState(seed=s)])[0] for s in range(50)} <= {0, 4}

    state, counts = SamplerState(seed=5), torch.zeros(5)
    for _ in range(4000):
        counts[sample(logits, [SamplingParams(temperature=1.0)], [state])[0]] += 1
    assert state.draws == 4000
    torch.testing.assert_close(counts / 4000, torch.softmax(logits[0], -1).float(), rtol=0, atol=0.025)
    assert uniform(5, 3) == uniform(5, 3) != uniform(5, 4)


def test_bad_inputs_raise_and_change_nothing(model):
    pool = model.new_pool(num_pages=3, page_size=4)
    seq = pool.new_sequence()
    model.prefill([seq], [[1, 2, 3]])
    kv_before = _kv_rows(pool, seq, 0, 3).clone()
    free_before = pool.allocator.num_free
    other = pool.new_sequence()

    with pytest.raises(ValueError, match=r"request 1: token id 4096 at index 2 is outside the vocabulary"):
        model.extend([seq, other], [[5], [1, 2, 4096]])
    with pytest.raises(ValueError, match="token id -1"):
        model.decode([seq], [-1])
    with pytest.raises(ValueError, match="must be integers"):
        model.extend([seq], [torch.tensor([1.0, 2.5])])
    with pytest.raises(PoolExhaustedError, match="need 3 pages, 2 of 3 are free"):
        model.extend([seq, other], [[7, 7], [1] * 8])
    assert (seq.num_tokens, other.num_tokens, other.pages) == (3, 0, [])
    assert pool.allocator.num_free == free_before
    torch.testing.assert_close(_kv_rows(pool, seq, 0, 3), kv_before, rtol=0, atol=0)

    with pytest.raises(ValueError, match="hold no tokens yet"):
        model.decode([other], [1])
    with pytest.raises(ValueError, match="twice"):
        model.decode([seq, seq], [1, 1])
    with pytest.raises(ValueError, match="no tokens to extend"):
        model.extend([seq], [[]])
    with pytest.raises(ValueError, match="another KVPool|one KVPool"):
        model.decode([seq, model.new_pool(1).new_sequence()], [1, 1])
    with pytest.raises(ValueError, match="float32"):
        model.prefill([KVPool(model.config, 2, dtype=torch.float32).new_sequence()], [[1]])
    pool.release(seq)
    with pytest.raises(ValueError, match="released"):
        model.decode([seq], [1])
    assert pool.allocator.num_free == 3


def test_allocator_refcounts_and_fork(model):
    alloc = PageAllocator(4)
    a = alloc.alloc(3)
    assert a == [0, 1, 2]
    alloc.retain(a[:1])
    alloc.free(a)
    assert alloc.refcount(0) == 1 and alloc.num_free == 3
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([1])
    with pytest.raises(ValueError, match="freed more often"):
        alloc.free([0, 0])
    with pytest.raises(PoolExhaustedError):
        alloc.alloc(4)

    prompt = list(range(100, 111))                       # 11 tokens: 2 full pages of 4 + 3
    pool = model.new_pool(num_pages=12, page_size=4)
    parent = pool.new_sequence()
    model.prefill([parent], [prompt])
    parent_kv = _kv_rows(pool, parent, 0, 11).clone()
    child = pool.fork(parent, 10)                        # shares 2 pages, copies the partial third
    assert child.pages[:2] == parent.pages[:2] and child.pages[2] != parent.pages[2]
    assert pool.allocator.refcount(parent.pages[0]) == 2
    logits = model.extend([child], [[7, 8, 9]])
    fresh = pool.new_sequence()
    torch.testing.assert_close(logits, model.prefill([fresh], [prompt[:10] + [7, 8, 9]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(_kv_rows(pool, parent, 0, 11), parent_kv, rtol=0, atol=0)


def test_pool_layout_describes_the_pages(model):
    pool = model.new_pool(num_pages=6, page_size=4)
    layout = pool.layout()
    assert (layout.num_layers, layout.num_pages, layout.tokens_per_page) == (4, 6, 4)
    assert layout.bytes_per_token() == 4 * 2 * 2 * 64 * 8
    seq = pool.allocate_sequence(9)
    assert seq.pages == [0, 1, 2] and seq.slots(7, 9).tolist() == [7, 8]


def test_token_agreement():
    same = token_agreement([1, 2, 3], [1, 2, 3])
    assert same.identical and same.rate == 1.0
    diverged = token_agreement([1, 2, 3, 4], [1, 9, 3, 4])
    assert (diverged.first_divergence, diverged.rate) == (1, 0.75)
    shorter = token_agreement([1, 2, 3, 4], [1, 2])
    assert (shorter.first_divergence, shorter.rate) == (2, 0.5)
