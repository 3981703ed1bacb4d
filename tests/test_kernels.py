"""pddcore.kernels against torch's scaled_dot_product_attention over the gathered KV.

Every correctness case runs on each backend: the torch reference ("torch") and the Triton
kernels ("triton"): on a CUDA device when there is one, else on CPU in Triton's
interpreter (PDDCORE_FORCE_TRITON=1). The interpreter needs TRITON_INTERPRET=1 before
triton is imported, so without it the "triton" cases skip here and
test_kernels_triton.py runs them in a subprocess that sets it. Shapes stay small: the
interpreter costs milliseconds per program instance.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch.nn.functional as F

import pddcore.kernels as K

# (atol, rtol) against a float64 oracle; half types round the output (the interpreter's
# float32 -> bfloat16 conversion truncates, so allow one bf16 ulp).
TOLERANCE = {torch.float64: (1e-10, 0.0), torch.float32: (2e-5, 1e-5), torch.float16: (1e-3, 2e-3),
             torch.bfloat16: (1e-2, 1e-2)}
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _triton_device(monkeypatch) -> torch.device:
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if not TRITON_INTERPRETED:
        pytest.skip("Triton on CPU runs in the TRITON_INTERPRET=1 subprocess of test_kernels_triton.py")
    monkeypatch.setenv("PDDCORE_FORCE_TRITON", "1")
    return torch.device("cpu")


@pytest.fixture(params=["torch", "triton"])
def device(request, monkeypatch) -> torch.device:
    """The device the case's tensors go to; the dispatch then picks the backend."""
    monkeypatch.delenv("PDDCORE_FORCE_TRITON", raising=False)
    return torch.device("cpu") if request.param == "torch" else _triton_device(monkeypatch)


@pytest.fixture
def triton_device(monkeypatch) -> torch.device:
    """For tests of the Triton kernels alone."""
    monkeypatch.delenv("PDDCORE_FORCE_TRITON", raising=False)
    return _triton_device(monkeypatch)


@dataclass
class Pool:
    k: torch.Tensor            # [slots, Hkv, D] or [pages, page_size, Hkv, D]
    v: torch.Tensor
    page_size: int
    both: torch.Tensor | None = None   # FlashInfer [pages, 2, page_size, Hkv, D] holding k and v as views

    def rows(self, slots: torch.Tensor, plane: torch.Tensor) -> torch.Tensor:
        """The oracle's gather: plain indexing of the flattened pool."""
        return plane.reshape(-1, *plane.shape[-2:])[slots.long()]

    def to(self, device) -> "Pool":
        if self.both is not None:
            both = self.both.to(device)
            return Pool(both[:, 0], both[:, 1], self.page_size, both)
        return Pool(self.k.to(device), self.v.to(device), self.page_size)


def make_pool(num_slots, hkv, dim, dtype, page_size, gen, flashinfer_view=False) -> Pool:
    """A random pool; paged pools may be the strided [:, 0] / [:, 1] views of one tensor."""
    if page_size == 1:
        k = torch.randn(num_slots, hkv, dim, generator=gen).to(dtype)
        v = torch.randn(num_slots, hkv, dim, generator=gen).to(dtype)
        return Pool(k, v, 1)
    pages = -(-num_slots // page_size)
    if flashinfer_view:
        both = torch.randn(pages, 2, page_size, hkv, dim, generator=gen).to(dtype)
        return Pool(both[:, 0], both[:, 1], page_size, both)
    k = torch.randn(pages, page_size, hkv, dim, generator=gen).to(dtype)
    v = torch.randn(pages, page_size, hkv, dim, generator=gen).to(dtype)
    return Pool(k, v, page_size)


@dataclass
class ExtendCase:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pool: Pool
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor


def make_extend_case(prefix_lens, extend_lens, heads, hkv, dim, dtype, *, page_size=1, seed=0,
                     flashinfer_view=False, index_dtype=torch.int64) -> ExtendCase:
    gen = torch.Generator().manual_seed(seed)
    total_prefix, tokens = sum(prefix_lens), sum(extend_lens)
    num_slots = total_prefix + 7                      # spare slots the batch never names
    pool = make_pool(num_slots, hkv, dim, dtype, page_size, gen, flashinfer_view)
    kv_indices = torch.randperm(num_slots, generator=gen)[:total_prefix].to(index_dtype)
    cum = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=index_dtype)
    return ExtendCase(
        q=torch.randn(tokens, heads, dim, generator=gen).to(dtype),
        k=torch.randn(tokens, hkv, dim, generator=gen).to(dtype),
        v=torch.randn(tokens, hkv, dim, generator=gen).to(dtype),
        pool=pool, qo_indptr=cum(extend_lens), kv_indptr=cum(prefix_lens), kv_indices=kv_indices)


def sdpa_oracle(q, k, v, first_q_pos, *, causal=True, sliding_window=-1, sm_scale=None):
    """float64 SDPA of q [E, H, D] over k, v [S, Hkv, D] with a boolean visibility mask."""
    num_q, num_k = q.shape[0], k.shape[0]
    q_pos = first_q_pos + torch.arange(num_q).unsqueeze(1)
    k_pos = torch.arange(num_k)
    visible = torch.ones(num_q, num_k, dtype=torch.bool)
    if causal:
        visible &= k_pos <= q_pos
    if sliding_window >= 0:
        visible &= q_pos - k_pos <= sliding_window
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1), k.double().transpose(0, 1),
                                         v.double().transpose(0, 1), attn_mask=visible, scale=sm_scale,
                                         enable_gqa=True)
    return out.transpose(0, 1)


def capped_oracle(q, k, v, first_q_pos, *, logit_cap, sm_scale=None, causal=True, sliding_window=-1):
    """SDPA cannot cap logits: cap * tanh(s / cap) by hand, with KV heads repeated explicitly."""
    group = q.shape[1] // k.shape[1]
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * sm_scale
    scores = logit_cap * torch.tanh(scores / logit_cap)
    q_pos = first_q_pos + torch.arange(q.shape[0]).unsqueeze(1)
    k_pos = torch.arange(k.shape[0])
    hidden = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool)
    if causal:
        hidden |= k_pos > q_pos
    if sliding_window >= 0:
        hidden |= q_pos - k_pos > sliding_window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)


def oracle(q, k, v, first_q_pos, **kw):
    return capped_oracle(q, k, v, first_q_pos, **kw) if kw.get("logit_cap") else sdpa_oracle(
        q, k, v, first_q_pos, **{n: x for n, x in kw.items() if n != "logit_cap"})


def extend_oracle(case: ExtendCase, **kw) -> torch.Tensor:
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    qo, kv = case.qo_indptr.tolist(), case.kv_indptr.tolist()
    for i in range(len(qo) - 1):
        if qo[i] == qo[i + 1]:
            continue
        prefix = case.kv_indices[kv[i]:kv[i + 1]]
        new = slice(qo[i], qo[i + 1])
        k = torch.cat([case.pool.rows(prefix, case.pool.k), case.k[new]])
        v = torch.cat([case.pool.rows(prefix, case.pool.v), case.v[new]])
        out[new] = oracle(case.q[new], k, v, len(prefix), **kw)
    return out


def on(device, *tensors):
    return [t.to(device) for t in tensors]


def run_extend(case: ExtendCase, device=torch.device("cpu"), **kw) -> torch.Tensor:
    pool = case.pool.to(device)
    q, k, v, o, qo_indptr, kv_indptr, kv_indices = on(device, case.q, case.k, case.v, torch.full_like(
        case.q, float("nan")), case.qo_indptr, case.kv_indptr, case.kv_indices)
    K.extend_attention(q, k, v, o, pool.k, pool.v, qo_indptr, kv_indptr, kv_indices, **kw)
    return o.cpu()


def assert_close(actual, expected, dtype):
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected, atol=atol, rtol=rtol)


# Ragged batches: empty prefixes, one-token extends, a request with no new tokens, lengths
# that are not multiples of any block size.
RAGGED = [([0, 37, 5], [9, 1, 17]), ([70], [1]), ([3, 0, 0, 41], [2, 0, 33, 5])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("heads,hkv", [(2, 2), (8, 2), (8, 1)])
def test_extend_matches_sdpa_gqa_and_dtypes(device, dtype, heads, hkv):
    if dtype == torch.float64 and os.environ.get("PDDCORE_FORCE_TRITON") == "1":
        pytest.skip("the Triton kernels take fp16/bf16/fp32; float64 always runs the torch reference")
    case = make_extend_case(*RAGGED[0], heads, hkv, 64, dtype, seed=hkv)
    assert_close(run_extend(case, device), extend_oracle(case), dtype)


@pytest.mark.parametrize("lens,dim", [(RAGGED[1], 96), (RAGGED[2], 128), (RAGGED[1], 256), (RAGGED[2], 8)])
def test_extend_ragged_and_head_dims(device, lens, dim):
    case = make_extend_case(*lens, 4, 2, dim, torch.float32, seed=dim)
    assert_close(run_extend(case, device), extend_oracle(case), torch.float32)


@pytest.mark.parametrize("page_size,flashinfer_view", [(16, False), (4, True)])
def test_extend_paged_pool(device, page_size, flashinfer_view):
    case = make_extend_case([21, 0, 6], [3, 5, 1], 4, 2, 64, torch.float32, page_size=page_size,
                            flashinfer_view=flashinfer_view, index_dtype=torch.int32)
    assert_close(run_extend(case, device), extend_oracle(case), torch.float32)


@pytest.mark.parametrize("window", [0, 6, 40])
def test_extend_sliding_window(device, window):
    case = make_extend_case([50, 2], [11, 7], 4, 2, 64, torch.float32, seed=window)
    assert_close(run_extend(case, device, sliding_window=window), extend_oracle(case, sliding_window=window),
                 torch.float32)


def test_extend_non_causal_and_custom_scale(device):
    case = make_extend_case([9, 0], [6, 4], 4, 4, 64, torch.float32, seed=3)
    kw = dict(causal=False, sm_scale=0.3)
    assert_close(run_extend(case, device, **kw), extend_oracle(case, **kw), torch.float32)


def test_extend_logit_cap(device):
    case = make_extend_case([12, 0], [5, 8], 8, 2, 64, torch.float32, seed=4)
    # A scale large enough that the cap changes the result noticeably.
    got = run_extend(case, device, logit_cap=5.0, sm_scale=1.0)
    assert_close(got, extend_oracle(case, logit_cap=5.0, sm_scale=1.0), torch.float32)
    assert (got.double() - extend_oracle(case, sm_scale=1.0)).abs().max() > 1e-2


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_extend_random_shapes_and_options(device, data):
    """Any consistent batch and option mix agrees with the oracle."""
    num_req = data.draw(st.integers(1, 4), "requests")
    prefix_lens = data.draw(st.lists(st.integers(0, 40), min_size=num_req, max_size=num_req), "prefix_lens")
    extend_lens = data.draw(st.lists(st.integers(0, 12), min_size=num_req, max_size=num_req), "extend_lens")
    hkv, group = data.draw(st.sampled_from([1, 2, 3])), data.draw(st.sampled_from([1, 2, 3, 4]))
    dim = data.draw(st.sampled_from([8, 24, 64]), "dim")
    page_size = data.draw(st.sampled_from([1, 3, 8]), "page_size")
    kw = dict(causal=data.draw(st.booleans(), "causal"), sliding_window=data.draw(st.integers(-1, 20), "window"),
              logit_cap=data.draw(st.sampled_from([0.0, 2.5]), "logit_cap"),
              sm_scale=data.draw(st.sampled_from([None, 0.7]), "sm_scale"))
    case = make_extend_case(prefix_lens, extend_lens, hkv * group, hkv, dim, torch.float32, page_size=page_size,
                            seed=data.draw(st.integers(0, 2**16), "seed"))
    assert_close(run_extend(case, device, **kw), extend_oracle(case, **kw), torch.float32)


def make_decode_case(kv_lens, heads, hkv, dim, dtype, *, page_size=1, seed=0):
    """Reuse the extend case builder: each request's slots are its whole context."""
    case = make_extend_case(kv_lens, [1] * len(kv_lens), heads, hkv, dim, dtype, page_size=page_size, seed=seed)
    return case.q, case.pool, case.kv_indptr, case.kv_indices


def decode_oracle(q, pool, kv_indptr, kv_indices, **kw):
    kv = kv_indptr.tolist()
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        slots = kv_indices[kv[i]:kv[i + 1]]
        k, v = pool.rows(slots, pool.k), pool.rows(slots, pool.v)
        out[i] = oracle(q[i:i + 1], k, v, len(slots) - 1, **kw)[0]
    return out


def run_decode(q, pool, kv_indptr, kv_indices, device=torch.device("cpu"), **kw) -> torch.Tensor:
    pool = pool.to(device)
    q, o, kv_indptr, kv_indices = on(device, q, torch.full_like(q, float("nan")), kv_indptr, kv_indices)
    K.decode_attention(q, pool.k, pool.v, o, kv_indptr, kv_indices, **kw)
    return o.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,hkv,page_size", [(4, 4, 1), (8, 2, 8), (8, 1, 1)])
def test_decode_matches_sdpa(device, dtype, heads, hkv, page_size):
    case = make_decode_case([1, 45, 130], heads, hkv, 64, dtype, page_size=page_size)
    assert_close(run_decode(*case, device), decode_oracle(*case), dtype)


@pytest.mark.parametrize("kw", [dict(sliding_window=9), dict(logit_cap=4.0, sm_scale=1.0)])
def test_decode_window_and_cap(device, kw):
    case = make_decode_case([3, 50], 4, 2, 96, torch.float32, seed=7)
    assert_close(run_decode(*case, device, **kw), decode_oracle(*case, **kw), torch.float32)


@pytest.mark.parametrize("page_size", [1, 4])
def test_store_kv_writes_slots_and_skips_negative(device, page_size):
    gen = torch.Generator().manual_seed(1)
    pool = make_pool(24, 2, 64, torch.bfloat16, page_size, gen, flashinfer_view=page_size > 1)
    k = torch.randn(5, 2, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(5, 2, 64, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([17, -1, 0, 23, 5])
    expect_k, expect_v = pool.k.reshape(-1, 2, 64).clone(), pool.v.reshape(-1, 2, 64).clone()
    keep = slots >= 0
    expect_k[slots[keep]], expect_v[slots[keep]] = k[keep], v[keep]
    pool = pool.to(device)
    K.store_kv(*on(device, k, v), pool.k, pool.v, slots.to(device))
    assert torch.equal(pool.k.cpu().reshape(-1, 2, 64), expect_k)
    assert torch.equal(pool.v.cpu().reshape(-1, 2, 64), expect_v)


def test_extend_then_decode_equals_step_by_step_float64():
    """The recompute path: an extend over the prefix gives the outputs that decoding the
    same tokens one by one gives, to float64 rounding (the reference model relies on it)."""
    heads, hkv, dim, prefix, new = 4, 2, 32, 13, 6
    case = make_extend_case([prefix], [new], heads, hkv, dim, torch.float64, seed=11)
    extended = run_extend(case)
    pool_k, pool_v = case.pool.k.clone(), case.pool.v.clone()
    free = [s for s in range(pool_k.shape[0]) if s not in set(case.kv_indices.tolist())]
    slots = case.kv_indices.tolist()
    for t in range(new):
        slots.append(free[t])
        K.store_kv(case.k[t:t + 1], case.v[t:t + 1], pool_k, pool_v, torch.tensor([free[t]]))
        o = torch.empty(1, heads, dim, dtype=torch.float64)
        K.decode_attention(case.q[t:t + 1], pool_k, pool_v, o, torch.tensor([0, len(slots)]), torch.tensor(slots))
        assert (o[0] - extended[t]).abs().max() < 1e-13


def test_slots_from_page_table():
    table = torch.tensor([[7, 2, 0], [1, 5, 9]])
    slots = K.slots_from_page_table(table, torch.tensor([6, 9]), 4)
    assert slots.tolist() == [28, 29, 30, 31, 8, 9] + [4, 5, 6, 7, 20, 21, 22, 23, 36]
    with pytest.raises(ValueError, match="seq_lens"):
        K.slots_from_page_table(table, torch.tensor([6, 13]), 4)


# ---------------------------------------------------------------- Triton only


@pytest.mark.parametrize("splits", [2, 5])
def test_triton_split_kv_ranges_extend_and_decode(triton_device, splits):
    """Forced flash-decoding splits, including ranges a request's keys never reach."""
    device = triton_device
    from pddcore import triton_kernels
    from pddcore.kernels._checks import check_decode, check_extend

    case = make_extend_case([150, 0, 20], [4, 9, 1], 8, 2, 64, torch.float32, page_size=8, seed=splits)
    pool = case.pool.to(device)
    q, k, v, o, qo_indptr, kv_indptr, kv_indices = on(device, case.q, case.k, case.v, torch.full_like(
        case.q, float("nan")), case.qo_indptr, case.kv_indptr, case.kv_indices)
    args = (q, k, v, o, pool.k, pool.v, qo_indptr, kv_indptr, kv_indices)
    batch = check_extend(*args, None, 40, 0.0)
    triton_kernels.extend_attention(*args, batch, causal=True, sliding_window=40, logit_cap=0.0,
                                    num_kv_splits=splits)
    assert_close(o, extend_oracle(case, sliding_window=40), torch.float32)

    q, pool, kv_indptr, kv_indices = make_decode_case([150, 1, 33], 8, 2, 64, torch.float32, seed=splits)
    expected = decode_oracle(q, pool, kv_indptr, kv_indices)
    pool = pool.to(device)
    q, o, kv_indptr, kv_indices = on(device, q, torch.full_like(q, float("nan")), kv_indptr, kv_indices)
    args = (q, pool.k, pool.v, o, kv_indptr, kv_indices)
    batch = check_decode(*args, None, -1, 0.0)
    triton_kernels.decode_attention(*args, batch, sliding_window=-1, logit_cap=0.0, num_kv_splits=splits)
    assert_close(o, expected, torch.float32)


@pytest.mark.parametrize("prefix_lens,extend_lens", [([5, 0], [0, 0]), ([], [])])
def test_empty_batches_write_nothing(device, prefix_lens, extend_lens):
    case = make_extend_case(prefix_lens, extend_lens, 4, 2, 64, torch.float32)
    pool = case.pool.to(device)
    k_before, v_before = pool.k.clone(), pool.v.clone()
    q, k, v, qo_indptr, kv_indptr, kv_indices = on(device, case.q, case.k, case.v, case.qo_indptr, case.kv_indptr,
                                                   case.kv_indices)
    o = torch.empty_like(q)
    K.extend_attention(q, k, v, o, pool.k, pool.v, qo_indptr, kv_indptr, kv_indices)
    K.store_kv(k, v, pool.k, pool.v, torch.empty(0, dtype=torch.int64, device=device))
    assert o.shape == (0, 4, 64)
    assert torch.equal(pool.k, k_before) and torch.equal(pool.v, v_before), "an empty batch changed the pool"


def test_triton_rejects_head_dim_over_256(triton_device):
    case = make_extend_case([3], [2], 2, 2, 320, torch.float32)
    with pytest.raises(ValueError, match="head_dim <= 256"):
        run_extend(case, triton_device)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    if TRITON_INTERPRETED:
        pytest.skip("this process runs Triton interpreted")
    pytest.importorskip("triton")
    monkeypatch.setenv("PDDCORE_FORCE_TRITON", "1")
    case = make_extend_case([4], [2], 2, 2, 64, torch.float32)
    o = torch.zeros_like(case.q)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        K.extend_attention(*_extend_args(case, o))
    assert not o.any()


# ---------------------------------------------------------------- bad input


def _extend_args(case: ExtendCase, o):
    return [case.q, case.k, case.v, o, case.pool.k, case.pool.v, case.qo_indptr, case.kv_indptr, case.kv_indices]


BAD_EXTEND = {
    "qo_indptr.*equal the number of tokens": lambda a: a.__setitem__(6, torch.tensor([0, 9, 10, 26])),
    "kv_indptr must be non-decreasing": lambda a: a.__setitem__(7, torch.tensor([0, 37, 30, 42])),
    "kv_indptr\\[0\\] must be 0": lambda a: a.__setitem__(7, torch.tensor([1, 37, 42, 42])),
    "exceeds the 42 entries": lambda a: a.__setitem__(7, torch.tensor([0, 37, 42, 43])),
    "outside the pool": lambda a: a[8].__setitem__(3, 10_000),
    "multiple of KV heads": lambda a: [a.__setitem__(i, a[i][:, :3]) for i in (0, 3)],
    "one dtype": lambda a: a.__setitem__(1, a[1].half()),
    "one device": lambda a: a.__setitem__(6, a[6].to("meta")),
    "int32 or int64": lambda a: a.__setitem__(8, a[8].float()),
    "B\\+1 offsets": lambda a: a.__setitem__(7, torch.tensor([0, 37, 42])),
    "k_extend has shape": lambda a: a.__setitem__(1, a[1][:, :, :32]),
    "o_extend .* must match": lambda a: a.__setitem__(3, a[3][:5]),
    "differ in shape": lambda a: a.__setitem__(5, a[5][:10]),
}


@pytest.mark.parametrize("pattern", list(BAD_EXTEND))
def test_extend_rejects_inconsistent_input(device, pattern):
    case = make_extend_case(*RAGGED[0], 4, 2, 64, torch.float32)
    args = on(device, *_extend_args(case, torch.zeros_like(case.q)))
    BAD_EXTEND[pattern](args)
    sentinel = args[3].clone()
    with pytest.raises(ValueError, match=pattern):
        K.extend_attention(*args)
    assert torch.equal(args[3], sentinel), "nothing may be written on bad input"


@pytest.mark.parametrize("kw,pattern", [(dict(sliding_window=-2), "sliding_window"), (dict(logit_cap=-1.0), "logit_cap"),
                                        (dict(sm_scale=float("nan")), "sm_scale")])
def test_extend_rejects_bad_scalars(kw, pattern):
    case = make_extend_case([4], [2], 2, 2, 64, torch.float32)
    with pytest.raises(ValueError, match=pattern):
        run_extend(case, **kw)


def test_decode_rejects_request_without_its_token(device):
    q, pool, _, kv_indices = make_decode_case([4, 5], 2, 2, 64, torch.float32)
    pool = pool.to(device)
    q, o, kv_indices = on(device, q, torch.zeros_like(q), kv_indices)
    with pytest.raises(ValueError, match="requests \\[1\\] have no KV slots"):
        K.decode_attention(q, pool.k, pool.v, o, torch.tensor([0, 9, 9], device=device), kv_indices)
    with pytest.raises(ValueError, match="B\\+1 = 3"):
        K.decode_attention(q, pool.k, pool.v, o, torch.tensor([0, 9], device=device), kv_indices)
    assert not o.any()


@pytest.mark.parametrize("slots,pattern", [([0, 24], "outside the pool"), ([3, 3], "one slot twice"),
                                           ([0], "2 tokens")])
def test_store_kv_rejects_bad_slots(device, slots, pattern):
    k_pool, v_pool, k, v = on(device, torch.zeros(24, 2, 64), torch.zeros(24, 2, 64), torch.ones(2, 2, 64),
                              torch.ones(2, 2, 64))
    with pytest.raises(ValueError, match=pattern):
        K.store_kv(k, v, k_pool, v_pool, torch.tensor(slots, device=device))
    assert not k_pool.any() and not v_pool.any()


def test_forcing_triton_with_float64_is_an_error(monkeypatch):
    monkeypatch.setenv("PDDCORE_FORCE_TRITON", "1")
    case = make_extend_case([4], [2], 2, 2, 64, torch.float64)
    with pytest.raises(ValueError, match="float64"):
        run_extend(case)
