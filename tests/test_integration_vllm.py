"""pddcore as a vLLM KV connector: vLLM's real v1 Scheduler loads PDDConnector by module path;
worker-side connectors in two processes move blocks laid out as vLLM allocates them."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path

import pytest
import torch

_REASON = "vllm not installed: pip install --no-deps -r tests/integrations/requirements-engines.txt"
pytest.importorskip("vllm.v1.core.sched.scheduler", reason=_REASON, exc_type=ImportError)
from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from pddcore.integrations.vllm import PDDConnector, PDDConnectorMetadata, PDDHandshakeMetadata, _Load  # noqa: E402

BLOCK, HEADS, HEAD_DIM, LAYERS, NUM_BLOCKS, EOS = 16, 2, 8, 3, 24, 2
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def make_config(model_dir: Path, role: str, extra: dict | None = None) -> VllmConfig:
    """A VllmConfig for a tiny local llama-shaped model (only its config.json is read)."""
    model = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), skip_tokenizer_init=True, dtype="float32",
                        seed=0, max_model_len=512)
    return VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(kv_connector="PDDConnector", kv_connector_module_path="pddcore.integrations.vllm",
                                            kv_role=role, kv_load_failure_policy="recompute",
                                            kv_connector_extra_config=extra or {}),
        device_config=DeviceConfig("cpu"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    write_model_config(path)
    return path


def write_model_config(path: Path) -> None:
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": HEADS, "num_hidden_layers": LAYERS, "vocab_size": 1000,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float32", "eos_token_id": EOS}))


def make_scheduler(model_dir: Path, role: str) -> Scheduler:
    config = make_config(model_dir, role)
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(LAYER_NAMES, FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM,
                                                        dtype=torch.float32))])
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return Scheduler(vllm_config=config, kv_cache_config=kv_cache_config, log_stats=False,
                     structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)


_hash_ready = False


def make_request(req_id: str, prompt: list[int], max_tokens: int, params: dict | None) -> Request:
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sampling.update_from_generation_config({}, EOS)
    req = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sampling, pooling_params=None,
                  mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256))
    req.kv_transfer_params = params
    return req


def runner_output(reqs: list[Request], kv: KVConnectorOutput | None = None) -> ModelRunnerOutput:
    ids = [r.request_id for r in reqs]
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[7] for _ in ids], logprobs=None, prompt_logprobs_dict={},
                             pooler_output=None, kv_connector_output=kv)


def free_blocks(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def finished_params(outputs) -> dict:
    for engine_outputs in outputs.values():
        for out in engine_outputs.outputs:
            if out.kv_transfer_params:
                return out.kv_transfer_params
    raise AssertionError("no kv_transfer_params in the engine outputs")


def test_scheduler_producer_then_consumer(model_dir):
    prompt = list(range(100, 140))  # 40 tokens: 3 blocks
    prod = make_scheduler(model_dir, "kv_producer")
    assert isinstance(prod.connector, PDDConnector)  # loaded by kv_connector_module_path
    prod.connector.set_xfer_handshake_metadata({0: PDDHandshakeMetadata("127.0.0.1:45001", 0, 1, HEADS)})
    idle = free_blocks(prod)
    req = make_request("p-1", prompt, 1, {"do_remote_decode": True, "do_remote_prefill": False})
    prod.add_request(req)
    out = prod.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, PDDConnectorMetadata)
    blocks = prod.kv_cache_manager.get_block_ids("p-1")[0]
    assert meta.saves == {"p-1": blocks} and len(blocks) == 3
    params = finished_params(prod.update_from_output(out, runner_output([req])))
    assert params["do_remote_prefill"] and not params["do_remote_decode"]
    assert params["remote_block_ids"] == blocks and params["remote_request_id"] == "p-1"
    assert (params["remote_host"], params["remote_port"], params["tp_size"]) == ("127.0.0.1", 45001, 1)
    assert prod.connector.has_pending_push_work() and free_blocks(prod) == idle - 3  # held for the consumer
    out = prod.schedule()
    assert out.kv_connector_metadata.send_deadlines == {"p-1": prod.connector.lease_s}
    prod.update_from_output(out, runner_output([], KVConnectorOutput(finished_sending={"p-1"})))
    assert free_blocks(prod) == idle and not prod.connector.has_pending_push_work()

    cons = make_scheduler(model_dir, "kv_consumer")
    creq = make_request("d-1", prompt, 3, dict(params))
    cons.add_request(creq)
    out = cons.schedule()
    load = out.kv_connector_metadata.loads["d-1"]
    assert creq.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert load.skip_blocks == 0 and len(load.local_block_ids) == 3 and load.params["remote_block_ids"] == blocks
    cons.update_from_output(out, runner_output([], KVConnectorOutput(finished_recving={"d-1"})))
    out = cons.schedule()
    assert out.num_scheduled_tokens == {"d-1": 1}  # only the last prompt token is recomputed
    assert not out.kv_connector_metadata.loads  # pulled once


def test_scheduler_consumer_prefix_hit_pulls_only_the_suffix(model_dir):
    cons = make_scheduler(model_dir, "kv_consumer")
    shared = list(range(500, 532))  # two full blocks decode already holds
    first = make_request("local", shared + [1, 2, 3], 1, None)
    cons.add_request(first)
    out = cons.schedule()
    cons.update_from_output(out, runner_output([first]))
    params = dict(do_remote_prefill=True, do_remote_decode=False, remote_block_ids=[11, 12, 13, 14],
                  remote_engine_id="p", remote_request_id="p-9", remote_host="127.0.0.1", remote_port=1, tp_size=1)
    req = make_request("d-9", shared + list(range(900, 920)), 3, params)
    cons.add_request(req)
    load = cons.schedule().kv_connector_metadata.loads["d-9"]
    assert load.skip_blocks == 2 and len(load.local_block_ids) == 2


def test_scheduler_recomputes_blocks_a_worker_reports_failed(model_dir, tmp_path):
    """A real failed pull (the producer does not hold the request) -> the worker's
    get_block_ids_with_load_errors -> the Scheduler recomputes the prompt."""
    cons = make_scheduler(model_dir, "kv_consumer")
    producer = make_worker(model_dir, "kv_producer", torch.zeros(1))
    consumer = make_worker(model_dir, "kv_consumer", torch.zeros(1))
    try:
        params = dict(do_remote_prefill=True, do_remote_decode=False, remote_block_ids=[3, 4, 5],
                      remote_engine_id="p", remote_request_id="never-prefilled", tp_size=1,
                      remote_host="127.0.0.1", remote_port=1, pdd_addresses=[producer.engine.address])
        req = make_request("d-f", list(range(40)), 3, params)
        cons.add_request(req)
        out = cons.schedule()
        consumer.bind_connector_metadata(out.kv_connector_metadata)
        consumer.start_load_kv(None)
        results, errors = drive([producer, consumer], lambda r, e: r[1].finished_recving)
        assert results[1].failed_recving == {"d-f"}
        assert errors[1] == set(out.kv_connector_metadata.loads["d-f"].local_block_ids)
        assert consumer.get_block_ids_with_load_errors() == set()  # reported once
        cons.update_from_output(out, runner_output([], KVConnectorOutput(
            finished_recving=results[1].finished_recving, failed_recving=results[1].failed_recving,
            invalid_block_ids=errors[1])))
        out = cons.schedule()
        assert out.num_scheduled_tokens == {"d-f": 40} and req.num_computed_tokens == 40  # full local prefill
    finally:
        producer.shutdown()
        consumer.shutdown()


# ---- worker side ------------------------------------------------------------------------------

def make_worker(model_dir: Path, role: str, kv: torch.Tensor, tp_rank: int = 0, tp: int = 1,
                extra: dict | None = None) -> PDDConnector:
    config = make_config(model_dir, role, {"tp_rank": tp_rank, "load_timeout_s": 30, **(extra or {})})
    config.parallel_config.tensor_parallel_size = tp
    conn = PDDConnector(config, KVConnectorRole.WORKER, None)
    if kv.dim() == 6:
        conn.register_kv_caches({name: kv[i] for i, name in enumerate(LAYER_NAMES)})
    return conn


def drive(connectors, until, timeout=60.0):
    """Calls every connector's per-step hooks until ``until(results, errors)`` holds."""
    acc = [None] * len(connectors)
    errs = [set() for _ in connectors]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, c in enumerate(connectors):
            r = c.get_transfer_results(set())
            errs[i] |= c.get_block_ids_with_load_errors()
            if acc[i] is None:
                acc[i] = r
            else:
                acc[i].finished_sending |= r.finished_sending
                acc[i].finished_recving |= r.finished_recving
                acc[i].failed_recving |= r.failed_recving
        if until(acc, errs):
            return acc, errs
        time.sleep(0.002)
    raise AssertionError(f"timed out: {acc}")


def consumer_process(model_dir: str, jobs: list[dict], pipe) -> None:
    """Child process: one consumer worker per job pulls blocks; sends back its whole KV cache."""
    torch.set_num_threads(1)
    try:
        for job in jobs:
            kv = torch.zeros(LAYERS, 2, NUM_BLOCKS, BLOCK, HEADS * job["p_tp"] // job["d_tp"], HEAD_DIM)
            conns = [make_worker(Path(model_dir), "kv_consumer", kv.clone(), r, job["d_tp"]) for r in range(job["d_tp"])]
            pipe.send("ready")
            addresses = pipe.recv()
            kvs = []
            for rank, conn in enumerate(conns):
                params = dict(remote_request_id="p-req", pdd_addresses=addresses, tp_size=job["p_tp"],
                              remote_block_ids=job["p_blocks"], remote_host="127.0.0.1", remote_port=1)
                meta = PDDConnectorMetadata(loads={"d-req": _Load(job["d_blocks"], job["skip"], params)})
                conn.bind_connector_metadata(meta)
                conn.start_load_kv(None)
                conn.clear_connector_metadata()
            results, errors = drive(conns, lambda r, e: all(x.finished_recving for x in r))
            for conn in conns:
                kvs.append(torch.stack([t for t in conn.layout._keepalive]).numpy())
                conn.shutdown()
            pipe.send({"failed": [sorted(r.failed_recving) for r in results], "errors": [sorted(e) for e in errors],
                       "kv": kvs})
    except Exception as exc:
        pipe.send({"crash": repr(exc)})


@pytest.mark.parametrize("jobs", [[dict(p_tp=1, d_tp=1, skip=0), dict(p_tp=2, d_tp=1, skip=1),
                                   dict(p_tp=1, d_tp=2, skip=0)]], ids=["tp1-1,tp2-1+prefix,tp1-2"])
def test_workers_in_two_processes_move_blocks_byte_identical(model_dir, jobs):
    p_blocks = [5, 2, 9, 14]
    for job in jobs:
        job.update(p_blocks=p_blocks, d_blocks=[1, 7, 3, 20][job["skip"]:])
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=consumer_process, args=(str(model_dir), jobs, child), daemon=True)
    proc.start()
    try:
        for n, job in enumerate(jobs):
            total = HEADS * job["p_tp"]  # the model's KV heads, split over the producer's TP ranks
            gen = torch.Generator().manual_seed(n)
            full = torch.randn(LAYERS, 2, NUM_BLOCKS, BLOCK, total, HEAD_DIM, generator=gen)
            per = total // job["p_tp"]
            producers = [make_worker(model_dir, "kv_producer", full[..., r * per:(r + 1) * per, :].clone(), r,
                                     job["p_tp"]) for r in range(job["p_tp"])]
            for conn in producers:  # prefill step: save layer by layer, then the request finishes
                conn.bind_connector_metadata(PDDConnectorMetadata(saves={"p-req": p_blocks}))
                for i, name in enumerate(LAYER_NAMES):
                    conn.save_kv_layer(name, conn.layout._keepalive[2 * i], None)
                conn.wait_for_save()
                conn.bind_connector_metadata(PDDConnectorMetadata(send_deadlines={"p-req": 60.0}))
                conn.wait_for_save()
            msg = parent.recv()
            assert msg == "ready", msg
            parent.send([c.engine.address for c in producers])
            sent, _ = drive(producers, lambda r, e: all(x.finished_sending for x in r))
            assert all(r.finished_sending == {"p-req"} for r in sent)
            result = parent.recv()
            assert "crash" not in result, result
            assert result["failed"] == [[]] * job["d_tp"] and result["errors"] == [[]] * job["d_tp"]
            d_per = total // job["d_tp"]
            for rank, got in enumerate(result["kv"]):
                want = torch.zeros(LAYERS, 2, NUM_BLOCKS, BLOCK, d_per, HEAD_DIM)
                want[:, :, job["d_blocks"]] = full[:, :, p_blocks[job["skip"]:], :, rank * d_per:(rank + 1) * d_per]
                assert torch.equal(torch.from_numpy(got).view_as(want), want)
            for conn in producers:
                assert not conn._staged and not conn.engine.regions()  # staging released
                conn.shutdown()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def test_consumer_load_times_out_and_reports_blocks(model_dir):
    consumer = make_worker(model_dir, "kv_consumer", torch.zeros(LAYERS, 2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM),
                           extra={"load_timeout_s": 0.2})
    try:
        params = dict(remote_request_id="r", pdd_addresses=["127.0.0.1:1"], tp_size=1, remote_block_ids=[0, 1],
                      remote_host="127.0.0.1", remote_port=1)  # nobody listens there: no answer ever comes
        consumer.bind_connector_metadata(PDDConnectorMetadata(loads={"d": _Load([4, 6], 0, params)}))
        consumer.start_load_kv(None)
        results, errors = drive([consumer], lambda r, e: r[0].finished_recving, timeout=30)
        assert results[0].failed_recving == {"d"} and errors[0] == {4, 6}
        assert not consumer.engine.regions()  # staging released
    finally:
        consumer.shutdown()


def test_register_kv_caches_rejects_unknown_shapes(model_dir):
    conn = make_worker(model_dir, "kv_producer", torch.zeros(1))
    try:
        with pytest.raises(ValueError, match="unsupported KV cache shape"):
            conn.register_kv_caches({"l0": torch.zeros(4, 4, 4, 4)})
    finally:
        conn.shutdown()


@pytest.mark.gpu
def test_generation_end_to_end_on_gpu(tmp_path):
    """Producer and consumer vLLM engines (dummy weights, same seed) hand a prompt's KV over through
    PDDConnector; the consumer's greedy tokens must equal a single engine's. kv_load_failure_policy
    is "fail", so a transfer that did not happen fails the request instead of recomputing it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (and vllm's CUDA kernels): runs a producer and a consumer engine")
    try:
        import vllm._C  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"vllm's CUDA kernels do not import ({exc}); install vllm with its CUDA torch")
    from vllm import LLM

    write_model_config(tmp_path)
    common = dict(model=str(tmp_path), skip_tokenizer_init=True, load_format="dummy", seed=0, enforce_eager=True,
                  max_model_len=512, gpu_memory_utilization=0.15)
    transfer = dict(kv_connector="PDDConnector", kv_connector_module_path="pddcore.integrations.vllm")
    prompt = {"prompt_token_ids": list(range(3, 83))}
    baseline = LLM(**common).generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    producer = LLM(**common, kv_transfer_config={**transfer, "kv_role": "kv_producer"})
    consumer = LLM(**common, kv_transfer_config={**transfer, "kv_role": "kv_consumer"})
    first = producer.generate([prompt], SamplingParams(max_tokens=1, temperature=0,
                                                       extra_args={"kv_transfer_params": {"do_remote_decode": True}}))[0]
    assert first.kv_transfer_params["do_remote_prefill"]
    out = consumer.generate([prompt], SamplingParams(max_tokens=16, temperature=0,
                                                     extra_args={"kv_transfer_params": first.kv_transfer_params}))[0]
    assert out.outputs[0].token_ids == baseline.outputs[0].token_ids
