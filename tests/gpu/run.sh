#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one command; about 5 minutes on one GPU (budget: 8).
#
#     bash tests/gpu/run.sh            # repository root, one CUDA GPU, a CUDA build of torch
#
# 1. builds pddcore with its CUDA kernels (PDD_WITH_CUDA=ON: a missing nvcc fails loudly);
# 2. runs every test marked `gpu` with PDDCORE_REQUIRE_GPU=1, so a GPU test that would skip
#    (no device, kernels not built, an engine's CUDA kernels missing) fails instead: the CUDA
#    pack kernel against the CPU reference (dense and strided cells, pinned buffers), a pack
#    plan on a non-default stream and replayed in a CUDA graph, a layout on GPU 1 packed
#    while GPU 0 is current (with two GPUs), a decode step (store_kv, decode, pack, unpack)
#    from plans with torch's sync debug mode on and replayed in a CUDA graph, the tcp
#    engine refusing device memory, and a vLLM and an SGLang prefill -> decode generation
#    through pddcore with a tiny model, both roles on the one GPU, compared token for token
#    with a single engine (vLLM: eager, with CUDA graphs captured, full ones included, and in
#    push mode); the vLLM connector's hooks with a second CUDA stream current, its KV from
#    allocate_kv_cache on the GPU; the SGLang backend's decode-side unpack reaching Success on
#    its own stream while a long kernel holds the default stream (SGLang's pools on the GPU),
#    and its sender returning while a forward still writes the pages it sends, then sending
#    what that forward wrote (the pack after SGLang's early-send event, the write posted from
#    the manager's thread after the pack's event); PDD through `pddcore serve` over three `vllm serve` processes (P,
#    RLD, MD with pddcore's connector) against a fourth, plain one, on the P_MD and P_RLD_MD
#    routes, tokens compared and TTFT written to $out/serve-ttft.txt;
# 3. runs the Triton kernels compiled for the GPU (not interpreted) against the torch reference;
# 4. the GPU benchmarks (Triton extend / decode vs the torch reference, same run; pack,
#    unpack, extend and decode as a fraction of a device copy_ and of the GPU's peak memory
#    bandwidth), into $PDDCORE_GPU_OUT (default: bench-results/gpu).
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${PDDCORE_GPU_OUT:-bench-results/gpu}"
mkdir -p "$out"

nvidia-smi -L
python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "torch sees no CUDA device: install a CUDA build of torch")'
python -m pip install -q scikit-build-core nanobind
python -m pip install -q --no-build-isolation --no-deps -e . -C cmake.define.PDD_WITH_CUDA=ON
pddcore info | tee "$out/info.txt"
python -c 'import sys; from pddcore import _C; r = _C.cuda_unusable_reason(); sys.exit(f"pddcore CUDA: {r}" if r else 0)'

export PDDCORE_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
python -m pytest -q -m gpu tests 2>&1 | tee "$out/gpu-tests.txt"
python -m pytest -q tests/test_kernels.py 2>&1 | tee "$out/triton-tests.txt"
python -m pytest -q -s bench/bench_kernels.py -k gpu 2>&1 | tee "$out/bench-kernels.txt"
