"""The Triton kernels compile for sm_80 and sm_90 without a GPU.

The interpreter runs the kernels' logic but not Triton's compiler, which is stricter
(types, tl.dot shapes, shared memory). `triton.compile` with an explicit target builds
the GPU code with the ptxas that ships with triton, so CI catches what only a GPU run
would otherwise show. One configuration with every feature on per kernel keeps it quick.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - older or newer triton layouts
    pytest.skip("this triton has no ASTSource / GPUTarget", allow_module_level=True)

attention = importlib.import_module("pddcore.triton_kernels.attention")
store_kv = importlib.import_module("pddcore.triton_kernels.store_kv")

# sm_80's limit per block; sm_90 allows more.
SHARED_MEMORY_LIMIT = 163 * 1024


def compile_for(kernel, capability, pointers, constexprs, floats=()):
    signature = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name, "fp32" if name in floats else "i32")
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    try:
        return triton.compile(source, target=GPUTarget("cuda", capability, 32))
    except FileNotFoundError as exc:  # no bundled ptxas in this triton build
        pytest.skip(f"cannot compile for CUDA here: {exc}")


# bf16 extend is the production case; float32 IEEE dots need the most shared memory,
# checked against sm_80, the smaller of the two targets.
@pytest.mark.parametrize("capability,dtype,extend", [(90, "bf16", True), (80, "fp32", False)])
def test_attention_compiles(capability, dtype, extend):
    group, head_dim = 4, 96
    block_d = triton.next_power_of_2(head_dim)
    rows, block_n = attention._tile(False, dtype == "fp32", block_d)
    block_m = max(16, rows if extend else group)
    pointers = {name: f"*{dtype}" for name in ("Q", "K_new", "V_new", "K_pool", "V_pool", "O")}
    pointers.update(Part_out="*fp32", Part_lse="*fp32", qo_indptr="*i32", kv_indptr="*i32", kv_indices="*i64")
    constexprs = dict(GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=16, BLOCK_M=block_m, BLOCK_G=group,
                      BLOCK_N=block_n, BLOCK_D=block_d, EXTEND=extend, CAUSAL=True, USE_WINDOW=True, USE_CAP=True,
                      SPLIT=True, DOT_FP32=dtype == "fp32")
    kernel = compile_for(attention._attention_fwd, capability, pointers, constexprs, floats=("sm_scale", "logit_cap"))
    assert 0 < kernel.metadata.shared <= SHARED_MEMORY_LIMIT


def test_merge_and_store_compile():
    merge = compile_for(attention._merge_splits, 90, {"Part_out": "*fp32", "Part_lse": "*fp32", "O": "*bf16"},
                        dict(HEAD_DIM=96, BLOCK_H=32, BLOCK_D=128))
    store = compile_for(store_kv._store_kv, 90,
                        {**{name: "*bf16" for name in ("K", "V", "K_pool", "V_pool")}, "slot_mapping": "*i64"},
                        dict(HEAD_DIM=96, ROW=768, PAGE_SIZE=16, BLOCK_T=8, BLOCK_C=1024))
    assert merge.asm["ptx"] and store.asm["ptx"]
