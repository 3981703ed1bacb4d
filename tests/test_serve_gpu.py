"""PDD over real vLLM servers on one GPU (tests/gpu/run.sh): P, RLD and MD are `vllm serve`
processes with pddcore's connector and a tiny dummy-weight model, `pddcore serve` in front;
the gateway's greedy tokens must equal a fourth, plain vLLM server's, on every route. Prints
the TTFT through the gateway beside the plain server's."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import pytest
import requests
import torch

from serve_cluster import gateway

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16
pytestmark = pytest.mark.gpu


def _vllm(model: str, port: int, role: str | None, log) -> subprocess.Popen:
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--port", str(port), "--host",
            "127.0.0.1", "--skip-tokenizer-init", "--load-format", "dummy", "--seed", "0", "--enforce-eager",
            "--max-model-len", "1024", "--gpu-memory-utilization", "0.12", "--enable-scale-out"]
    if role is not None:
        argv += ["--kv-transfer-config", json.dumps({
            "kv_connector": "PDDConnector", "kv_connector_module_path": "pddcore.integrations.vllm", "kv_role": role,
            "kv_load_failure_policy": "fail",
            # The tiny model's KV: a 64 MiB arena per engine instead of the default 4 GiB of pinned memory.
            "kv_connector_extra_config": {"host": "127.0.0.1", "staging_bytes": 64 << 20}})]
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def _ready(url: str, proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve at {url} exited with {proc.returncode}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(1)
    raise RuntimeError(f"vllm serve at {url} did not come up")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU and vllm's CUDA build")
    try:
        import vllm._C  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"vllm's CUDA kernels do not import ({exc})")
    model = tmp_path_factory.mktemp("tiny-llama")
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": KV_HEADS, "num_hidden_layers": LAYERS,
        "vocab_size": 1000, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}))
    logs = open(model / "vllm.log", "w")
    roles = {"plain": None, "p": "kv_producer", "rld": "kv_consumer", "md": "kv_consumer"}
    procs = {name: _vllm(str(model), 8400 + i, role, logs) for i, (name, role) in enumerate(roles.items())}
    urls = {name: f"http://127.0.0.1:{8400 + i}" for i, name in enumerate(roles)}
    try:
        deadline = time.monotonic() + 420
        for name, proc in procs.items():
            _ready(urls[name], proc, deadline)
        yield urls
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(60)


@pytest.mark.parametrize("route, args", [("P_MD", ["--ttft-slo-s", "1000"]),
                                         ("P_RLD_MD", ["--ttft-slo-s", "0.0001", "--catch-up-threshold", "8"])])
def test_vllm_pdd_tokens_equal_one_vllm(servers, route, args):
    kv_bytes = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
    gw = gateway([servers["p"]], [servers["rld"]], [servers["md"]], "--kv-bytes-per-token", str(kv_bytes),
                 "--page-size", "16", *args, dialect="vllm")
    gw_ttft, plain_ttft = [], []
    try:
        for trial in range(4):
            prompt = [3 + (17 * i + trial) % 990 for i in range(200 + 37 * trial)]
            sampling = {"max_tokens": 64, "temperature": 0, "ignore_eos": True}
            start = time.monotonic()
            plain = requests.post(servers["plain"] + "/inference/v1/generate", timeout=120, json={
                "token_ids": prompt, "sampling_params": sampling}).json()["choices"][0]["token_ids"]
            plain_ttft.append(time.monotonic() - start)  # whole answer; the stream below times its first token
            ids, first_at, start, rid = [], None, time.monotonic(), None
            with requests.post(gw.url + "/v1/completions", stream=True, timeout=300, json={
                    "prompt": prompt, "stream": True, "return_token_ids": True, **sampling}) as r:
                for line in r.iter_lines():
                    if line.startswith(b"data: {"):
                        chunk = json.loads(line[6:])
                        rid = chunk["id"]
                        new = chunk["choices"][0].get("token_ids") or []
                        if new and first_at is None:
                            first_at = time.monotonic()
                        ids += new
            gw_ttft.append(first_at - start)
            trace = gw.get(f"/pdd/requests/{rid}")
            assert trace["pipeline"] == route, trace["reason"]
            assert ids == plain, trace
    finally:
        print(gw.stop()[-2000:])
    line = (f"{route}: TTFT through the gateway median {statistics.median(gw_ttft) * 1e3:.1f} ms; "
            f"a plain vLLM's whole 64-token answer median {statistics.median(plain_ttft) * 1e3:.1f} ms\n")
    out = os.environ.get("PDDCORE_GPU_OUT", "bench-results/gpu")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "serve-ttft.txt"), "a") as f:
        f.write(line)
