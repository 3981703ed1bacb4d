"""pddcore as a vLLM KV connector: vLLM's real v1 Scheduler loads PDDConnector by module path;
worker-side connectors move blocks that vLLM's own allocate_kv_cache laid out (every
VLLM_KV_CACHE_LAYOUT, kernel-block splitting, MLA), across two processes and TP sizes."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

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
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from pddcore import TransferEngine  # noqa: E402
from pddcore.integrations.vllm import PDDConnector, PDDConnectorMetadata, PDDHandshakeMetadata  # noqa: E402
from pddcore.integrations.vllm.metadata import _Load  # noqa: E402
from pddcore.integrations.vllm.protocol import MAGIC as _MAGIC, MESSAGES  # noqa: E402
from pddcore.streaming import LayerStreamSender  # noqa: E402
from pddcore.transfer import RegionDescriptor, TransferError  # noqa: E402

from transfer_peer import Connects, RemoteEngine  # noqa: E402

BLOCK, HEADS, HEAD_DIM, LAYERS, NUM_BLOCKS, EOS = 16, 2, 8, 3, 24, 2
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def make_config(model_dir: Path, role: str, extra: dict | None = None, *, prefix_caching: bool = True,
                engine_id: str | None = None) -> VllmConfig:
    """``engine_id``: vLLM gives every rank of one engine the same (a fresh uuid when None)."""
    """A VllmConfig for a tiny local llama-shaped model (only its config.json is read)."""
    model = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), skip_tokenizer_init=True, dtype="float32",
                        seed=0, max_model_len=512)
    return VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=prefix_caching),
        kv_transfer_config=KVTransferConfig(kv_connector="PDDConnector", kv_connector_module_path="pddcore.integrations.vllm",
                                            kv_role=role, kv_load_failure_policy="recompute", engine_id=engine_id,
                                            kv_connector_extra_config={"host": "127.0.0.1", **(extra or {})}),
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


def attention_spec(heads: int = HEADS, mla: bool = False):
    if mla:  # one latent per token: kv_lora_rank + rope dims, no V
        return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=3 * HEAD_DIM, dtype=torch.bfloat16)
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD_DIM, dtype=torch.float32)


def make_kv_cache_config(config: VllmConfig, spec, layout: str = "LBNHC") -> KVCacheConfig:
    """vLLM's own planner: the KVCacheTensors (offsets, layer and block strides) of ``layout``."""
    config.cache_config.kv_cache_layout = layout
    return get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(LAYER_NAMES, spec)],
                                           NUM_BLOCKS * spec.page_size_bytes * LAYERS)


def make_scheduler(model_dir: Path, role: str, *, prefix_caching: bool = True) -> Scheduler:
    config = make_config(model_dir, role, prefix_caching=prefix_caching)
    kv_cache_config = make_kv_cache_config(config, attention_spec())
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
    assert not meta.pushes and "pdd_pushed" not in params  # no pdd_push_to: pulled, as ever
    assert free_blocks(prod) == idle  # freed at once: the workers serve the consumer from their staged copy
    out = prod.schedule()
    assert out.kv_connector_metadata.send_deadlines == {"p-1": prod.connector.lease_s}  # the copy's lease
    assert out.kv_connector_metadata.lease_keys == {"p-1": params["pdd_lease_key"]}  # what heartbeats must bear
    assert len(bytes.fromhex(params["pdd_lease_key"])) == 16

    cons = make_scheduler(model_dir, "kv_consumer")
    creq = make_request("d-1", prompt, 3, dict(params))
    cons.add_request(creq)
    out = cons.schedule()
    assert out.kv_connector_metadata.heartbeats["p-1"].lease_key == params["pdd_lease_key"]
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
    producer = make_worker(model_dir, "kv_producer").conn
    consumer = make_worker(model_dir, "kv_consumer").conn
    try:
        params = dict(do_remote_prefill=True, do_remote_decode=False, remote_block_ids=[3, 4, 5],
                      remote_engine_id="p", remote_request_id="never-prefilled", tp_size=1,
                      remote_host="127.0.0.1", remote_port=1, pdd_addresses=[producer.address])
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

@dataclass
class Worker:
    """A worker-side connector over KV caches from vLLM's allocate_kv_cache (random contents)."""

    conn: PDDConnector
    kv: dict[str, torch.Tensor]
    spec: object

    def blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """K and V (MLA: the latent) of every layer at ``block_ids`` as [blocks, tokens, heads, dim]."""
        out = []
        for name in LAYER_NAMES:
            t = self.kv[name]
            r = t.shape[0] // NUM_BLOCKS  # kernel blocks per block
            cells = t.unflatten(0, (NUM_BLOCKS, r)).permute(0, 1, 3, 2, 4).flatten(1, 2)[block_ids]
            halves = [cells[..., :HEAD_DIM], cells[..., HEAD_DIM:]] if self.spec.head_size_v else [cells]
            out += [h.contiguous() for h in halves]
        return out


def make_worker(model_dir: Path, role: str, tp_rank: int = 0, tp: int = 1, heads: int = HEADS, *,
                layout: str = "LBNHC", kernel_block: int | None = None, mla: bool = False, seed: int = 0,
                extra: dict | None = None, engine_id: str | None = None, device: str = "cpu") -> Worker:
    config = make_config(model_dir, role, {"tp_rank": tp_rank, "load_timeout_s": 30, "staging_bytes": 16 << 20,
                                           **(extra or {})},
                         engine_id=engine_id)
    config.parallel_config.tensor_parallel_size = tp
    spec = attention_spec(heads, mla)
    kv_cache_config = make_kv_cache_config(config, spec, layout)
    kv = allocate_kv_cache(kv_cache_config, torch.device(device), config.cache_config.get_resolved_kv_cache_layout(),
                           None if kernel_block is None else [kernel_block])
    gen = torch.Generator().manual_seed(seed)
    for t in kv.values():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    conn = PDDConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    conn.register_kv_caches(kv)
    return Worker(conn, kv, spec)


def worker_step(worker: Worker, meta: PDDConnectorMetadata, *, forward: bool = False) -> KVConnectorOutput:
    """One model-runner step around the connector, in the order vLLM 0.33's
    KVConnectorModelRunnerMixin calls it."""
    conn = worker.conn
    conn.handle_preemptions(meta)
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)
    if forward:
        for name in LAYER_NAMES:
            conn.save_kv_layer(name, worker.kv[name], None)
    conn.wait_for_save()
    results = conn.get_transfer_results(set())
    out = KVConnectorOutput(finished_sending=results.finished_sending, finished_recving=results.finished_recving,
                            failed_recving=results.failed_recving,
                            invalid_block_ids=conn.get_block_ids_with_load_errors())
    conn.clear_connector_metadata()
    return out


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


def as_bytes(tensors: list[torch.Tensor]) -> list[bytes]:
    return [t.contiguous().view(torch.uint8).cpu().numpy().tobytes() for t in tensors]


def consumer_process(model_dir: str, jobs: list[dict], pipe) -> None:
    """Child process: one consumer worker per rank pulls a job's blocks; sends back their contents."""
    torch.set_num_threads(1)
    try:
        for job in jobs:
            workers = [make_worker(Path(model_dir), "kv_consumer", r, job["d_tp"], rank_heads(job, job["d_tp"]),
                                   layout=job["d_layout"], kernel_block=job["d_kernel"], mla=job["mla"], seed=50 + r,
                                   engine_id="consumer")
                       for r in range(job["d_tp"])]
            pipe.send("ready")
            addresses = pipe.recv()
            results, errors = [], []
            for rank, w in enumerate(workers):  # one rank after the other: a later one finds the KV still there
                params = dict(remote_request_id="p-req", pdd_addresses=addresses, tp_size=job["p_tp"],
                              remote_block_ids=job["p_blocks"], remote_host="127.0.0.1", remote_port=1)
                w.conn.bind_connector_metadata(PDDConnectorMetadata(loads={"d-req": _Load(job["d_blocks"], job["skip"],
                                                                                          params)}))
                w.conn.start_load_kv(None)
                w.conn.clear_connector_metadata()
                (result,), (error,) = drive([w.conn], lambda r, e: r[0].finished_recving)
                results.append(result)
                errors.append(error)
            pipe.send({"failed": [sorted(r.failed_recving) for r in results], "errors": [sorted(e) for e in errors],
                       "kv": [as_bytes(w.blocks(job["d_blocks"])) for w in workers]})
            for w in workers:
                w.conn.shutdown()
    except Exception as exc:
        pipe.send({"crash": repr(exc)})


JOBS = [  # producer and consumer layouts differ on purpose: the wire format is canonical
    dict(p_tp=1, d_tp=1, skip=0, p_layout="LBNHC", d_layout="LBHNC", p_kernel=None, d_kernel=None, mla=False),
    dict(p_tp=2, d_tp=1, skip=1, p_layout="BLNHC", d_layout="LBNHC", p_kernel=None, d_kernel=8, mla=False),
    dict(p_tp=1, d_tp=2, skip=0, p_layout="LBNHC", d_layout="BHLNC", p_kernel=4, d_kernel=None, mla=False),
    dict(p_tp=1, d_tp=1, skip=0, p_layout="LHBNC", d_layout="LBNHC", p_kernel=None, d_kernel=None, mla=True),
    # MLA across TP sizes: both consumer ranks read the one latent of producer rank 0; then producer
    # rank 1 is read by no consumer rank, is told so, and frees its copy without waiting for its lease.
    dict(p_tp=1, d_tp=2, skip=0, p_layout="LBNHC", d_layout="LBNHC", p_kernel=None, d_kernel=None, mla=True),
    dict(p_tp=2, d_tp=1, skip=1, p_layout="LBNHC", d_layout="LHBNC", p_kernel=None, d_kernel=None, mla=True),
]


def rank_heads(job: dict, tp: int) -> int:
    """KV heads per rank at TP ``tp`` (MLA: the one latent on every rank)."""
    return 1 if job["mla"] else job["heads"] // tp


def test_workers_in_two_processes_move_vllm_allocated_blocks_byte_identical(model_dir):
    p_blocks = [5, 2, 9, 14]
    for job in JOBS:
        job.update(p_blocks=p_blocks, d_blocks=[1, 7, 3, 20][job["skip"]:], heads=1 if job["mla"] else 2 * HEADS)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=consumer_process, args=(str(model_dir), JOBS, child), daemon=True)
    proc.start()
    try:
        for n, job in enumerate(JOBS):
            producers = [make_worker(model_dir, "kv_producer", r, job["p_tp"], rank_heads(job, job["p_tp"]),
                                     layout=job["p_layout"], kernel_block=job["p_kernel"], mla=job["mla"], seed=n * 10 + r)
                         for r in range(job["p_tp"])]
            for w in producers:  # the prefill step saves layer by layer, then the request finishes
                worker_step(w, PDDConnectorMetadata(saves={"p-req": p_blocks}), forward=True)
                worker_step(w, PDDConnectorMetadata(send_deadlines={"p-req": 3600.0}))  # held until served
            msg = parent.recv()
            assert msg == "ready", msg
            parent.send([w.conn.address for w in producers])
            drive([w.conn for w in producers], lambda r, e: not any(w.conn._staged for w in producers))
            result = parent.recv()
            assert "crash" not in result, result
            assert result["failed"] == [[]] * job["d_tp"] and result["errors"] == [[]] * job["d_tp"], job
            # The model's heads, each producer rank holding a contiguous share; the consumer ranks split them anew.
            # MLA: consumer rank r holds the latent of producer rank r % p_tp.
            planes = [torch.cat(parts, dim=2) for parts in zip(*(w.blocks(p_blocks[job["skip"]:]) for w in producers))]
            d_per = job["heads"] // job["d_tp"]
            for rank, got in enumerate(result["kv"]):
                if job["mla"]:
                    want = as_bytes(producers[rank % job["p_tp"]].blocks(p_blocks[job["skip"]:]))
                else:
                    want = as_bytes([p[:, :, rank * d_per:(rank + 1) * d_per] for p in planes])
                assert got == want, (job, rank)
            for w in producers:
                assert not w.conn._staged and not w.conn._serving  # staging released to the pool
                w.conn.shutdown()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def engine_step(sched: Scheduler, worker: Worker, *, forward: bool = False) -> tuple[dict, KVConnectorOutput]:
    """One engine step: schedule, run the worker's connector hooks, feed the outputs back."""
    out = sched.schedule()
    kv_out = worker_step(worker, out.kv_connector_metadata, forward=forward)
    reqs = [sched.requests[r] for r in out.num_scheduled_tokens]
    sched.update_from_output(out, runner_output(reqs, kv_out))
    return dict(out.num_scheduled_tokens), kv_out


def model_value(req_id: str, pos: int, layer: int) -> float:
    """What the stand-in model writes into every K/V cell of token ``pos`` of ``req_id`` in ``layer``."""
    return float(int(req_id[-1], 36) * 10000 + pos + layer / 4)


def model_forward(sched: Scheduler, worker: Worker, out) -> None:
    """The stand-in model's forward: writes the KV of every token scheduled in ``out`` into the
    request's blocks (the LBNHC caches of ``worker``: [blocks, heads, block_size, row])."""
    for req_id, n in out.num_scheduled_tokens.items():
        blocks = sched.kv_cache_manager.get_block_ids(req_id)[0]
        end = sched.requests[req_id].num_computed_tokens  # advanced by schedule()
        for pos in range(end - n, end):
            for layer, name in enumerate(LAYER_NAMES):
                worker.kv[name][blocks[pos // BLOCK], :, pos % BLOCK, :] = model_value(req_id, pos, layer)


def test_preempted_producer_request_ships_the_kv_of_its_last_save(model_dir):
    """The real Scheduler preempts a producer request under KV pressure after its prefill was
    saved; it resumes in other blocks and is saved again. The consumer gets the KV the model
    wrote into the new blocks, not the old blocks' bytes (which another request reused), and
    the preemption freed the first staged copy at once."""
    prod = make_scheduler(model_dir, "kv_producer", prefix_caching=False)  # the resumed prefill gets fresh blocks
    pw = make_worker(model_dir, "kv_producer", seed=7)
    cw = make_worker(model_dir, "kv_consumer", seed=8)
    try:
        prod.connector.set_xfer_handshake_metadata({0: pw.conn.get_handshake_metadata()})
        # 10 blocks each of 23: A (no transfer) and B decode until the pool runs dry; B is preempted,
        # A decodes on into B's freed blocks and finishes, B is prefilled again and finishes.
        prod.add_request(make_request("p-A", list(range(100, 260)), 60, None))
        prod.add_request(make_request("p-B", list(range(300, 460)), 30, {"do_remote_decode": True}))
        saves, params, deadline = [], None, time.monotonic() + 60
        while params is None:
            assert time.monotonic() < deadline
            out = prod.schedule()
            model_forward(prod, pw, out)
            if "p-B" in out.kv_connector_metadata.saves:
                saves.append(list(out.kv_connector_metadata.saves["p-B"]))
            kv_out = worker_step(pw, out.kv_connector_metadata, forward=True)
            if "p-B" in (out.preempted_req_ids or ()):
                assert "p-B" not in pw.conn._staged  # the preemption dropped its staged copy
            reqs = [prod.requests[r] for r in out.num_scheduled_tokens]
            outputs = prod.update_from_output(out, ModelRunnerOutput(
                req_ids=[r.request_id for r in reqs], req_id_to_index={r.request_id: i for i, r in enumerate(reqs)},
                sampled_token_ids=[[] if r.is_prefill_chunk else [7] for r in reqs], logprobs=None,
                prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kv_out))
            params = next((o.kv_transfer_params for eo in outputs.values() for o in eo.outputs
                           if o.request_id == "p-B" and o.kv_transfer_params), None)
        assert len(saves) == 2 and saves[1][:len(saves[0])] != saves[0]  # saved again, elsewhere
        d_blocks = list(range(1, 11))
        cw.conn.bind_connector_metadata(PDDConnectorMetadata(loads={"d-B": _Load(d_blocks, 0, dict(params))}))
        cw.conn.start_load_kv(None)
        results, errors = drive([pw.conn, cw.conn], lambda r, e: r[1].finished_recving)
        assert not results[1].failed_recving and not errors[1]
        want = [torch.tensor([[model_value("p-B", b * BLOCK + s, layer)] * HEADS for s in range(BLOCK)])
                for b in range(10) for layer in range(LAYERS)]
        got = cw.blocks(d_blocks)  # per layer K then V, each [blocks, tokens, heads, dim]
        for layer in range(LAYERS):
            for plane in got[2 * layer:2 * layer + 2]:
                for b in range(10):
                    assert torch.equal(plane[b], want[b * LAYERS + layer][..., None].expand(BLOCK, HEADS, HEAD_DIM)), \
                        (layer, b)
    finally:
        pw.conn.shutdown()
        cw.conn.shutdown()


def test_scheduler_and_workers_end_to_end_a_malformed_message_fails_one_request(model_dir):
    """The real Schedulers on both sides and their workers, step by step; a forged, malformed
    "done" for one request fails that request (vLLM recomputes it), the other lands intact."""
    prod, cons = make_scheduler(model_dir, "kv_producer"), make_scheduler(model_dir, "kv_consumer")
    pw = make_worker(model_dir, "kv_producer", seed=1)
    cw = make_worker(model_dir, "kv_consumer", seed=2)
    rogue = TransferEngine()
    try:
        prod.connector.set_xfer_handshake_metadata({0: pw.conn.get_handshake_metadata()})
        prompts = {"A": list(range(100, 140)), "B": list(range(300, 340))}
        reqs = [make_request(f"p-{k}", p, 1, {"do_remote_decode": True}) for k, p in prompts.items()]
        for r in reqs:
            prod.add_request(r)
        out = prod.schedule()
        prod_blocks = {r.request_id: prod.kv_cache_manager.get_block_ids(r.request_id)[0] for r in reqs}
        outputs = prod.update_from_output(out, runner_output(reqs, worker_step(pw, out.kv_connector_metadata,
                                                                               forward=True)))
        params = {o.request_id: o.kv_transfer_params for eo in outputs.values() for o in eo.outputs}
        assert params["p-A"]["pdd_addresses"] == [pw.conn.address]

        for k in prompts:
            cons.add_request(make_request(f"d-{k}", prompts[k], 3, dict(params[f"p-{k}"])))
        out = cons.schedule()
        loads = out.kv_connector_metadata.loads
        cons.update_from_output(out, runner_output([], worker_step(cw, out.kv_connector_metadata)))
        rogue.send(rogue.connect(cw.conn.address), _MAGIC + json.dumps({"k": "done", "req": "d-A", "src": "0"}).encode())

        deadline, first_scheduled, failed, finished = time.monotonic() + 60, {}, set(), set()
        while "d-A" not in failed:  # the consumer acts on the forged message before the producer serves
            assert time.monotonic() < deadline
            _, kv_out = engine_step(cons, cw)
            failed |= kv_out.failed_recving
            if kv_out.failed_recving:
                assert kv_out.invalid_block_ids == set(loads["d-A"].local_block_ids)
        while "d-B" not in finished:  # both engines step until B's pull was served and applied
            assert time.monotonic() < deadline
            engine_step(prod, pw)
            scheduled, kv_out = engine_step(cons, cw)
            for req, n in scheduled.items():
                first_scheduled.setdefault(req, n)
            assert not kv_out.failed_recving and not kv_out.invalid_block_ids
            finished |= kv_out.finished_recving
        scheduled, _ = engine_step(cons, cw)
        for req, n in scheduled.items():
            first_scheduled.setdefault(req, n)
        assert first_scheduled == {"d-A": 40, "d-B": 1}  # A recomputed in full, B only its last prompt token
        d_blocks = cons.kv_cache_manager.get_block_ids("d-B")[0]
        assert as_bytes(cw.blocks(d_blocks)) == as_bytes(pw.blocks(prod_blocks["p-B"]))
    finally:
        rogue.close()
        pw.conn.shutdown()
        cw.conn.shutdown()


def test_forged_done_is_ignored_and_the_real_one_completes_the_load(model_dir):
    """A well-formed "done" from an engine the consumer did not pull from (as a plain message,
    not a write notification) changes nothing; the producer's real notification completes it."""
    pw = make_worker(model_dir, "kv_producer", seed=5)
    cw = make_worker(model_dir, "kv_consumer", seed=6)
    rogue = TransferEngine()
    try:
        worker_step(pw, PDDConnectorMetadata(saves={"p-req": [3, 8]}), forward=True)
        params = dict(remote_request_id="p-req", pdd_addresses=[pw.conn.address], tp_size=1, remote_block_ids=[3, 8],
                      remote_host="127.0.0.1", remote_port=1)
        before = as_bytes(cw.blocks([10, 12]))
        worker_step(cw, PDDConnectorMetadata(loads={"d-req": _Load([10, 12], 0, params)}))
        rogue.send(rogue.connect(cw.conn.address), _MAGIC + json.dumps({"k": "done", "req": "d-req", "src": 0}).encode())
        deadline = time.monotonic() + 60
        while cw.conn.engine.stats()["messages_received"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        out = worker_step(cw, PDDConnectorMetadata())
        assert not out.finished_recving and not out.failed_recving  # neither completed nor failed by it
        assert as_bytes(cw.blocks([10, 12])) == before
        results, errors = drive([pw.conn, cw.conn], lambda r, e: r[1].finished_recving)
        assert not results[1].failed_recving and not errors[1]
        assert as_bytes(cw.blocks([10, 12])) == as_bytes(pw.blocks([3, 8]))
    finally:
        rogue.close()
        pw.conn.shutdown()
        cw.conn.shutdown()


def pull(consumer: Worker, d_req: str, params: dict, d_blocks: list[int]) -> None:
    """The consumer's scheduler hands its worker a load of ``params``' KV into ``d_blocks``."""
    consumer.conn.bind_connector_metadata(PDDConnectorMetadata(loads={d_req: _Load(d_blocks, 0, dict(params))}))
    consumer.conn.start_load_kv(None)
    consumer.conn.clear_connector_metadata()


def test_pdd_consumers_keeps_the_kv_until_every_consumer_pulled(model_dir):
    """A prefill whose kv_transfer_params say "pdd_consumers": 2 (a relay and a main decode)
    keeps its staged copy after the first consumer's pull and frees it after the second's; a
    third consumer then finds nothing. vLLM got the blocks back when the request finished."""
    prod = make_scheduler(model_dir, "kv_producer")
    pw = make_worker(model_dir, "kv_producer", seed=11)
    consumers = [make_worker(model_dir, "kv_consumer", seed=12 + i) for i in range(3)]
    try:
        prod.connector.set_xfer_handshake_metadata({0: pw.conn.get_handshake_metadata()})
        idle = free_blocks(prod)
        req = make_request("p-2", list(range(100, 140)), 1, {"do_remote_decode": True, "pdd_consumers": 2})
        prod.add_request(req)
        out = prod.schedule()
        assert out.kv_connector_metadata.consumers == {"p-2": 2}
        params = finished_params(prod.update_from_output(out, runner_output([req], worker_step(
            pw, out.kv_connector_metadata, forward=True))))
        p_blocks = params["remote_block_ids"]
        assert free_blocks(prod) == idle
        engine_step(prod, pw)  # the scheduler tells the worker the request finished (its lease)
        for i, consumer in enumerate(consumers[:2]):
            pull(consumer, f"d-{i}", params, [1, 4, 6])
            results, errors = drive([pw.conn, consumer.conn], lambda r, e: r[1].finished_recving)
            assert not results[1].failed_recving and not errors[1]
            assert as_bytes(consumer.blocks([1, 4, 6])) == as_bytes(pw.blocks(p_blocks))
            if i == 0:
                assert "p-2" in pw.conn._staged  # kept for the second
        drive([pw.conn], lambda r, e: not pw.conn._staged)
        pull(consumers[2], "d-2", params, [1, 4, 6])
        results, errors = drive([pw.conn, consumers[2].conn], lambda r, e: r[1].finished_recving)
        assert results[1].failed_recving == {"d-2"} and errors[1] == {1, 4, 6}  # the third finds no KV
    finally:
        pw.conn.shutdown()
        for consumer in consumers:
            consumer.conn.shutdown()


def test_staging_is_allocated_at_start_never_in_the_save_path(model_dir, monkeypatch):
    """Both workers allocate their staging arena when vLLM registers the KV caches; a save
    (per-layer hooks and wait_for_save), a head-sliced pull with a prefix skipped (the producer's
    scratch buffer) and the consumer's load then allocate no staging memory at all."""
    pws = [make_worker(model_dir, "kv_producer", r, 2, HEADS // 2, seed=41 + r) for r in range(2)]
    cw = make_worker(model_dir, "kv_consumer", seed=43)
    real_empty, allocations = torch.empty, []

    def recording_empty(*size, **kwargs):
        t = real_empty(*size, **kwargs)
        if t.dtype == torch.uint8 and t.numel() >= 64 << 10:  # a staging buffer's smallest size
            allocations.append(t.numel())
        return t

    monkeypatch.setattr(torch, "empty", recording_empty)
    try:
        p_blocks, d_blocks = [3, 8, 5], [12, 14]
        for w in pws:
            worker_step(w, PDDConnectorMetadata(saves={"p-req": p_blocks}), forward=True)
            worker_step(w, PDDConnectorMetadata(send_deadlines={"p-req": 60.0}))
        params = dict(pushed_params(pws[0], "p-req", p_blocks), pdd_addresses=[w.conn.address for w in pws], tp_size=2,
                      pdd_pushed=False)
        cw.conn.bind_connector_metadata(PDDConnectorMetadata(loads={"d-req": _Load(d_blocks, 1, params)}))
        cw.conn.start_load_kv(None)
        cw.conn.clear_connector_metadata()
        results, errors = drive([w.conn for w in pws + [cw]], lambda r, e: r[2].finished_recving)
        assert not results[2].failed_recving and not errors[2]
        want = [torch.cat(parts, dim=2) for parts in zip(*(w.blocks(p_blocks[1:]) for w in pws))]
        assert as_bytes(cw.blocks(d_blocks)) == as_bytes(want)
        assert allocations == []
    finally:
        for w in pws + [cw]:
            w.conn.shutdown()


def test_a_request_the_staging_arena_cannot_hold_fails_its_load_with_the_reason(model_dir, caplog):
    """A producer whose arena (staging_bytes: 64 KiB) cannot hold a 12-block request saves it
    without raising into the forward, and the consumer's load fails saying why; a request that
    fits is served by the same producer afterwards."""
    pw = make_worker(model_dir, "kv_producer", seed=44, extra={"staging_bytes": 64 << 10})
    cw = make_worker(model_dir, "kv_consumer", seed=45)
    try:
        big, small = list(range(12)), [3, 8]
        assert pw.conn.layout.packed_nbytes(len(big)) > 64 << 10 >= pw.conn.layout.packed_nbytes(len(small))
        worker_step(pw, PDDConnectorMetadata(saves={"p-big": big}), forward=True)
        worker_step(pw, PDDConnectorMetadata(send_deadlines={"p-big": 60.0}))
        pull(cw, "d-big", dict(pushed_params(pw, "p-big", big), pdd_pushed=False), list(range(12, 24)))
        results, errors = drive([pw.conn, cw.conn], lambda r, e: r[1].finished_recving)
        assert results[1].failed_recving == {"d-big"} and errors[1] == set(range(12, 24))
        assert any("staging_bytes" in r.getMessage() and "d-big" in r.getMessage() for r in caplog.records)
        worker_step(pw, PDDConnectorMetadata(saves={"p-small": small}), forward=True)
        worker_step(pw, PDDConnectorMetadata(send_deadlines={"p-small": 60.0}))
        pull(cw, "d-small", dict(pushed_params(pw, "p-small", small), pdd_pushed=False), [20, 22])
        results, errors = drive([pw.conn, cw.conn], lambda r, e: r[1].finished_recving)
        assert not results[1].failed_recving and as_bytes(cw.blocks([20, 22])) == as_bytes(pw.blocks(small))
    finally:
        pw.conn.shutdown()
        cw.conn.shutdown()


class FakeClock:
    """Stands in for the ``time`` module where a connector reads ``time.monotonic()``."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


LEASE_KEY = "5e" * 16


def test_a_heartbeat_without_the_lease_key_does_not_keep_the_kv(model_dir, monkeypatch):
    """A third engine (authenticated like any other, but never handed the request) heartbeats a
    producer request it names, with no key or a guessed one: the lease does not start again and
    ends on time. A heartbeat bearing the key the producer handed out does start it again."""
    from pddcore.integrations.vllm import producer

    clock = FakeClock()
    monkeypatch.setattr(producer, "time", clock)
    pw = make_worker(model_dir, "kv_producer", seed=48, extra={"lease_s": 1.0})
    third = TransferEngine()
    try:
        worker_step(pw, PDDConnectorMetadata(saves={"p-req": [3, 8]}), forward=True)
        worker_step(pw, PDDConnectorMetadata(send_deadlines={"p-req": 1.0}, lease_keys={"p-req": LEASE_KEY}))
        deadline = pw.conn._staged["p-req"].deadline
        peer = third.connect(pw.conn.address)
        sent = 0
        for payload in [MESSAGES.encode("alive", req="p-req", key="ab" * 16),
                        _MAGIC + json.dumps({"k": "alive", "req": "p-req"}).encode()]:
            clock.now += 0.5
            third.send(peer, payload)
            sent += 1
            drive([pw.conn], lambda r, e: pw.conn.engine.stats()["messages_received"] >= sent)
            assert pw.conn._staged["p-req"].deadline == deadline  # not started again
        clock.now += 0.5  # past the lease
        drive([pw.conn], lambda r, e: True)
        assert "p-req" not in pw.conn._staged  # the lease ended on time
        worker_step(pw, PDDConnectorMetadata(saves={"p-2": [4, 9]}), forward=True)
        worker_step(pw, PDDConnectorMetadata(send_deadlines={"p-2": 1.0}, lease_keys={"p-2": LEASE_KEY}))
        clock.now += 0.5
        third.send(peer, MESSAGES.encode("alive", req="p-2", key=LEASE_KEY))  # what a consumer handed it sends
        drive([pw.conn], lambda r, e: pw.conn._staged["p-2"].deadline == clock.now + 1.0)
    finally:
        third.close()
        pw.conn.shutdown()


def test_heartbeats_keep_the_kv_for_a_consumer_that_waits_past_the_lease(model_dir, monkeypatch):
    """The producer's lease is 1 s; the consumer's request waits 4.2 s (a fake clock) in its
    scheduler before the load starts. From its arrival its scheduler heartbeats the producer
    every quarter of that lease, which keeps the staged copy, and the pull then gets the KV;
    once the load finished the heartbeats stop. Without them the lease ends at 1 s."""
    from pddcore.integrations.vllm import producer, scheduler

    clock = FakeClock()
    monkeypatch.setattr(producer, "time", clock)
    monkeypatch.setattr(scheduler, "time", clock)
    pw = make_worker(model_dir, "kv_producer", seed=46, extra={"lease_s": 1.0})
    cw = make_worker(model_dir, "kv_consumer", seed=47)
    cs = make_scheduler(model_dir, "kv_consumer")
    idle_step = SimpleNamespace(preempted_req_ids=set(), num_scheduled_tokens={})
    try:
        p_blocks, d_blocks = [3, 8], [10, 12]
        worker_step(pw, PDDConnectorMetadata(saves={"p-req": p_blocks}), forward=True)
        worker_step(pw, PDDConnectorMetadata(send_deadlines={"p-req": 1.0}, lease_keys={"p-req": LEASE_KEY}))
        params = dict(pushed_params(pw, "p-req", p_blocks), pdd_pushed=False, pdd_lease_s=1.0,
                      pdd_lease_key=LEASE_KEY)
        cs.add_request(make_request("d-req", list(range(100, 132)), 1, params))  # waits in the queue
        for _ in range(12):
            clock.now += 0.35
            meta = cs.connector.build_connector_meta(idle_step)
            assert list(meta.heartbeats) == ["p-req"]  # 0.35 s > 1 s / 4: one each step
            worker_step(cw, meta)
            drive([pw.conn, cw.conn], lambda r, e: "p-req" not in pw.conn._staged
                  or pw.conn._staged["p-req"].deadline >= clock.now + 1.0)  # this heartbeat arrived
        pull(cw, "d-req", params, d_blocks)
        results, errors = drive([pw.conn, cw.conn], lambda r, e: r[1].finished_recving)
        assert not results[1].failed_recving and not errors[1]
        assert as_bytes(cw.blocks(d_blocks)) == as_bytes(pw.blocks(p_blocks))
        cs.connector.update_connector_output(KVConnectorOutput(finished_recving={"d-req"}))
        clock.now += 1.0
        assert cs.connector.build_connector_meta(idle_step).heartbeats == {}
    finally:
        pw.conn.shutdown()
        cw.conn.shutdown()


def test_consumer_load_times_out_and_reports_blocks(model_dir):
    consumer = make_worker(model_dir, "kv_consumer", extra={"load_timeout_s": 0.2}).conn
    try:
        params = dict(remote_request_id="r", pdd_addresses=["127.0.0.1:1"], tp_size=1, remote_block_ids=[0, 1],
                      remote_host="127.0.0.1", remote_port=1)  # nobody listens there: no answer ever comes
        consumer.bind_connector_metadata(PDDConnectorMetadata(loads={"d": _Load([4, 6], 0, params)}))
        consumer.start_load_kv(None)
        results, errors = drive([consumer], lambda r, e: r[0].finished_recving, timeout=30)
        assert results[0].failed_recving == {"d"} and errors[0] == {4, 6}
        assert all(r.nbytes >= 64 << 10 for r in consumer.engine.regions())  # only the pool's idle buffer is left
        assert consumer.staging._idle_bytes == sum(r.nbytes for r in consumer.engine.regions())
    finally:
        consumer.shutdown()


def test_register_kv_caches_rejects_shapes_vllm_does_not_allocate(model_dir):
    w = make_worker(model_dir, "kv_producer")
    try:
        with pytest.raises(ValueError, match="is not vLLM's"):  # the pre-0.33 [2, blocks, ...] shape
            w.conn.register_kv_caches({name: torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM) for name in LAYER_NAMES})
        with pytest.raises(ValueError, match="no KV cache"):
            w.conn.register_kv_caches({})
    finally:
        w.conn.shutdown()


def test_pipeline_parallelism_gets_a_clear_error(model_dir):
    config = make_config(model_dir, "kv_producer")
    config.parallel_config.pipeline_parallel_size = 2
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="does not support pipeline parallelism"):
            PDDConnector(config, role, make_kv_cache_config(config, attention_spec()))


def test_hybrid_model_gets_a_clear_error(model_dir):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    config = make_config(model_dir, "kv_producer")
    hybrid = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(LAYER_NAMES[:1], attention_spec()),
        KVCacheGroupSpec(LAYER_NAMES[1:], SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM,
                                                            dtype=torch.float32, sliding_window=32))])
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="hybrid"):
            PDDConnector(config, role, hybrid)


@pytest.mark.parametrize("push", [False, True])
def test_a_step_replayed_as_a_full_cuda_graph_ships_its_kv(model_dir, push):
    """A full CUDA graph replays the forward without the per-layer hooks: no save_kv_layer runs.
    wait_for_save packs every layer itself, so the consumer still gets the blocks (pulled or
    pushed), and the connector leaves vLLM's full CUDA graphs on for every role."""
    pw = make_worker(model_dir, "kv_producer", seed=71)
    cw = make_worker(model_dir, "kv_consumer", seed=72)
    try:
        assert PDDConnector.requires_piecewise_for_cudagraph({}) is False
        p_blocks, d_blocks = [3, 8, 5], [10, 12, 14]
        meta = PDDConnectorMetadata(saves={"p-req": p_blocks}, pushes={"p-req": [cw.conn.address]} if push else {})
        worker_step(pw, meta, forward=False)  # the step's forward was a graph replay
        worker_step(pw, PDDConnectorMetadata(send_deadlines={"p-req": 60.0}))
        params = pushed_params(pw, "p-req", p_blocks) if push else dict(pushed_params(pw, "p-req", p_blocks),
                                                                         pdd_pushed=False)
        pull(cw, "d-req", params, d_blocks)
        results, errors = drive([pw.conn, cw.conn], lambda r, e: r[1].finished_recving and not pw.conn._staged)
        assert not results[1].failed_recving and not errors[1]
        assert as_bytes(cw.blocks(d_blocks)) == as_bytes(pw.blocks(p_blocks))
    finally:
        pw.conn.shutdown()
        cw.conn.shutdown()


@pytest.mark.parametrize("push", [False, True])
def test_every_cuda_path_runs_on_the_kv_gpu(model_dir, monkeypatch, push):
    """KV on GPU 3 of the producer and GPU 2 of the consumer (torch.cuda stood in for, the bytes
    on the CPU): every pack, unpack, stream wait and event runs with that GPU current, on every
    path (per-layer saves, the wait after them, pulls served from the message pump, head-sliced
    unpacks at load completion, push events)."""
    from fake_cuda import FakeCuda

    from pddcore.integrations.vllm import consumer, producer, push_consumer

    cuda = FakeCuda(monkeypatch)
    p_gpu, d_gpu = torch.device("cuda", 3), torch.device("cuda", 2)
    gpu = {"producer pack": p_gpu, "consumer unpack": d_gpu, "push buffer pack": d_gpu, "push buffer unpack": d_gpu}
    for module, name, label in [(producer, "pack", "producer pack"), (consumer, "unpack", "consumer unpack"),
                                (push_consumer, "pack", "push buffer pack"), (push_consumer, "unpack", "push buffer unpack")]:
        cuda.watch(monkeypatch, module, name, label)
    tp = 1 if push else 2  # push: equal TP sizes; pull: TP 2 -> 1, head-sliced on both ends
    pws = [make_worker(model_dir, "kv_producer", r, tp, HEADS // tp, seed=81 + r) for r in range(tp)]
    cws = [make_worker(model_dir, "kv_consumer", seed=83)]
    for w in pws:
        w.conn.kv_device = p_gpu
    for w in cws:
        w.conn.kv_device = d_gpu
    try:
        p_blocks, d_blocks = [3, 8], [10, 12]
        for w in pws:
            meta = PDDConnectorMetadata(saves={"p-req": p_blocks}, pushes={"p-req": [cws[0].conn.address]} if push else {})
            worker_step(w, meta, forward=True)
            worker_step(w, PDDConnectorMetadata(send_deadlines={"p-req": 60.0}))
        params = dict(pushed_params(pws[0], "p-req", p_blocks), pdd_addresses=[w.conn.address for w in pws],
                      tp_size=len(pws), pdd_pushed=push)
        for w in cws:
            pull(w, "d-req", params, d_blocks)
        results, errors = drive([w.conn for w in pws + cws], lambda r, e: all(
            x.finished_recving for x in r[len(pws):]) and not any(w.conn._staged for w in pws))
        assert not any(x.failed_recving for x in results) and not any(errors)
        want = [torch.cat(parts, dim=2) for parts in zip(*(w.blocks(p_blocks) for w in pws))]  # all heads
        assert as_bytes(cws[0].blocks(d_blocks)) == as_bytes(want)
        kinds = {name for name, _ in cuda.calls}
        used = {"producer pack", "record", "push buffer unpack" if push else "consumer unpack"}
        assert used <= kinds and not kinds & {"synchronize", "event synchronize"}, kinds  # nothing waits on the GPU
        wrong = [(name, device) for name, device in cuda.calls if device != gpu.get(name, device)
                 or device not in (p_gpu, d_gpu)]  # also: a stream of another device, or none current
        assert not wrong, wrong
    finally:
        for w in pws + cws:
            w.conn.shutdown()


def test_the_producer_serves_a_pull_only_once_its_packs_ran_without_waiting_for_them(model_dir, monkeypatch):
    """KV on GPU 3 (torch.cuda stood in for): wait_for_save queues the packs and returns without
    waiting on the stream; a pull that comes while the packs' event is pending waits in the
    producer, and is served by the message pump once the event completed."""
    from fake_cuda import FakeCuda

    cuda = FakeCuda(monkeypatch)
    pw = make_worker(model_dir, "kv_producer", seed=93)
    cw = make_worker(model_dir, "kv_consumer", seed=94)
    pw.conn.kv_device = torch.device("cuda", 3)
    try:
        cuda.events_done = False  # the GPU has not run the packs yet
        p_blocks, d_blocks = [3, 8], [10, 12]
        worker_step(pw, PDDConnectorMetadata(saves={"p-req": p_blocks}), forward=True)
        worker_step(pw, PDDConnectorMetadata(send_deadlines={"p-req": 60.0}))
        assert ("synchronize", torch.device("cuda", 3)) not in cuda.calls  # the step did not wait
        pull(cw, "d-req", dict(pushed_params(pw, "p-req", p_blocks), pdd_pushed=False), d_blocks)
        drive([pw.conn, cw.conn], lambda r, e: pw.conn._pulls)  # the pull arrived and waits
        results, _ = drive([pw.conn, cw.conn], lambda r, e: True)  # another pump: still nothing is sent
        assert not results[1].finished_recving and pw.conn._pulls and not pw.conn._serving
        cuda.events_done = True
        results, errors = drive([pw.conn, cw.conn], lambda r, e: r[1].finished_recving)
        assert not results[1].failed_recving and not errors[1]
        assert as_bytes(cw.blocks(d_blocks)) == as_bytes(pw.blocks(p_blocks))
    finally:
        pw.conn.shutdown()
        cw.conn.shutdown()


def test_the_consumer_reports_a_load_without_waiting_and_keeps_its_buffer_until_the_unpack_ran(model_dir,
                                                                                                monkeypatch):
    """KV on GPU 2 of the consumer (torch.cuda stood in for): the load is reported finished as
    soon as its unpack is queued (vLLM's next forward queues after it on the same stream), and
    its staging buffer goes back to the pool only once the unpack's event completed."""
    from fake_cuda import FakeCuda

    cuda = FakeCuda(monkeypatch)
    pw = make_worker(model_dir, "kv_producer", seed=95)
    cw = make_worker(model_dir, "kv_consumer", seed=96)
    cw.conn.kv_device = torch.device("cuda", 2)
    try:
        worker_step(pw, PDDConnectorMetadata(saves={"p-req": [3, 8]}), forward=True)
        worker_step(pw, PDDConnectorMetadata(send_deadlines={"p-req": 60.0}))
        cuda.events_done = False  # the GPU has not run the unpack yet
        pull(cw, "d-req", dict(pushed_params(pw, "p-req", [3, 8]), pdd_pushed=False), [10, 12])
        results, errors = drive([pw.conn, cw.conn], lambda r, e: r[1].finished_recving)
        assert results[1].finished_recving == {"d-req"} and not results[1].failed_recving and not errors[1]
        assert ("synchronize", torch.device("cuda", 2)) not in cuda.calls
        assert cw.conn.staging._idle_bytes == 0 and len(cw.conn._unpacking) == 1  # the unpack may still read it
        cuda.events_done = True
        cw.conn.get_transfer_results(set())
        assert not cw.conn._unpacking and cw.conn.staging._idle_bytes == sum(r.nbytes for r in cw.conn.engine.regions())
        assert as_bytes(cw.blocks([10, 12])) == as_bytes(pw.blocks([3, 8]))
    finally:
        pw.conn.shutdown()
        cw.conn.shutdown()


def test_a_partial_pull_out_of_gpudirect_staging_is_posted_once_its_pack_ran(model_dir, monkeypatch):
    """GPUDirect staging (the staged copy on the producer's GPU 3; torch.cuda stood in for, the
    bytes on the CPU): a pull of the blocks after the consumer's cached prefix is packed into a
    buffer of its own on the GPU. The producer's step records an event after that pack and
    never waits on the GPU; the producer's posting thread waits on the event and posts the write
    only then, and the consumer gets the blocks."""
    from fake_cuda import FakeCuda

    from pddcore.integrations.vllm import layer_major, producer

    cuda = FakeCuda(monkeypatch)
    cuda.watch(monkeypatch, producer, "pack")
    pw = make_worker(model_dir, "kv_producer", seed=97)
    cw = make_worker(model_dir, "kv_consumer", seed=98)
    cuda.watch(monkeypatch, pw.conn.engine, "write")
    p_gpu = torch.device("cuda", 3)
    pw.conn.kv_device = pw.conn.staging.kv_device = p_gpu
    pw.conn.staging.gpudirect = True  # buffers count as the GPU's (their bytes stay in host memory here)
    monkeypatch.setattr(producer, "layer_major_layout",  # the staged copy's pages, read on the CPU
                        lambda src, n, buffer, device: layer_major.layer_major_layout(src, n, buffer, "cpu"))
    try:
        p_blocks, d_blocks = [3, 8, 5], [10, 12]
        worker_step(pw, PDDConnectorMetadata(saves={"p-req": p_blocks}), forward=True)
        worker_step(pw, PDDConnectorMetadata(send_deadlines={"p-req": 60.0}))
        cuda.calls.clear()
        cuda.threads.clear()
        cuda.events_done = False  # the GPU runs nothing queued from here on; a wait here would never end
        try:
            params = dict(pushed_params(pw, "p-req", p_blocks), pdd_pushed=False)
            cw.conn.bind_connector_metadata(PDDConnectorMetadata(loads={"d-req": _Load(d_blocks, 1, params)}))
            cw.conn.start_load_kv(None)  # its prefix cache holds the first block: blocks 1, 2 are pulled
            cw.conn.clear_connector_metadata()
            results, _ = drive([pw.conn, cw.conn],  # the pull was answered, or failed
                               lambda r, e: pw.conn._serving.get("p-req") or r[1].finished_recving)
            assert not results[1].finished_recving
            results, _ = drive([pw.conn, cw.conn], lambda r, e: True)  # another step: still nothing is sent
            assert not results[1].finished_recving
            main = [name for name, thread in cuda.threads if thread == "MainThread"]
            assert main == ["pack", "record"], cuda.threads  # queued, never waited for
            assert "write" not in [name for name, _ in cuda.calls]
        finally:
            cuda.events_done = True  # else the posting thread would wait for good
        results, errors = drive([pw.conn, cw.conn], lambda r, e: r[1].finished_recving)
        assert not results[1].failed_recving and not errors[1]
        assert as_bytes(cw.blocks(d_blocks)) == as_bytes(pw.blocks(p_blocks[1:]))
        posting = [(name, thread) for name, thread in cuda.threads if thread != "MainThread"]
        assert [name for name, _ in posting] == ["event synchronize", "write"], cuda.threads
        assert {device for name, device in cuda.calls} == {p_gpu}
    finally:
        pw.conn.shutdown()
        cw.conn.shutdown()


def test_rdma_backend_moves_blocks(model_dir):
    """backend="rdma" (the verbs emulator here: no NIC) moves the same blocks; gpudirect needs
    KV on a GPU and says so."""
    rdma = {"backend": "rdma", "rdma_device": "emulator"}
    p, d = make_worker(model_dir, "kv_producer", seed=3, extra=rdma), make_worker(model_dir, "kv_consumer", extra=rdma)
    try:
        assert p.conn.engine.backend == "rdma"
        worker_step(p, PDDConnectorMetadata(saves={"p-req": [4, 9]}), forward=True)
        params = dict(remote_request_id="p-req", pdd_addresses=[p.conn.address], tp_size=1, remote_block_ids=[4, 9],
                      remote_host="127.0.0.1", remote_port=1)
        worker_step(d, PDDConnectorMetadata(loads={"d-req": _Load([0, 11], 0, params)}))
        results, errors = drive([p.conn, d.conn], lambda r, e: r[1].finished_recving)
        assert not results[1].failed_recving and not errors[1]
        assert as_bytes(d.blocks([0, 11])) == as_bytes(p.blocks([4, 9]))
        with pytest.raises(ValueError, match="gpudirect needs the rdma backend and CUDA KV"):
            make_worker(model_dir, "kv_consumer", extra={**rdma, "gpudirect": True})
    finally:
        p.conn.shutdown()
        d.conn.shutdown()


def _free_ports_below_the_ephemeral_range(count: int) -> int:
    """The first of ``count`` consecutive loopback ports that are free, all below the range
    the kernel hands out for port 0: a process running beside the tests (CI runs the
    sanitized tests beside the suite) cannot be given one of them meanwhile."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    rng = random.Random()
    while True:
        base = rng.randrange(10000, ephemeral_low - count)
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return base


def test_data_parallel_ranks_of_one_host_take_their_own_ports(model_dir):
    """TP 2 x DP 2 on one host with one base port: every worker listens (no collision), on
    port + dp_rank * tp_size + tp_rank, and the scheduler publishes its DP rank's first port."""
    base = _free_ports_below_the_ephemeral_range(4)
    workers = []
    try:
        for dp in range(2):
            for rank in range(2):
                config = make_config(model_dir, "kv_producer", {"tp_rank": rank, "port": base})
                config.parallel_config.tensor_parallel_size, config.parallel_config.data_parallel_rank_local = 2, dp
                workers.append(PDDConnector(config, KVConnectorRole.WORKER, make_kv_cache_config(config, attention_spec())))
        assert [int(w.address.rpartition(":")[2]) for w in workers] == [base, base + 1, base + 2, base + 3]
        config = make_config(model_dir, "kv_producer", {"port": base})
        config.parallel_config.tensor_parallel_size, config.parallel_config.data_parallel_rank_local = 2, 1
        assert PDDConnector(config, KVConnectorRole.SCHEDULER, make_kv_cache_config(
            config, attention_spec()))._producer_address() == ("127.0.0.1", base + 2)
    finally:
        for w in workers:
            w.shutdown()


def test_wildcard_host_is_advertised_as_the_routable_address(model_dir, monkeypatch):
    """Listening on 0.0.0.0 advertises vLLM's get_ip() (VLLM_HOST_IP), never 0.0.0.0, and a peer
    reaches the worker at the advertised address; without a token it would not start."""
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.9")
    with pytest.raises(ValueError, match="needs an auth_token"):
        make_worker(model_dir, "kv_producer", extra={"host": "0.0.0.0"})
    w = make_worker(model_dir, "kv_producer", extra={"host": "0.0.0.0", "auth_token": "vllm-test-token-3e7b1d9a5c2f8046"})
    try:
        host, _, port = w.conn.get_handshake_metadata().address.rpartition(":")
        assert host == "127.0.0.9" and int(port) > 0
        with TransferEngine(auth_token="vllm-test-token-3e7b1d9a5c2f8046") as peer:
            assert peer.connect(w.conn.address).connected
    finally:
        w.conn.shutdown()


# ---- push mode ---------------------------------------------------------------------------------

def test_scheduler_pushes_only_to_a_consumer_of_its_own_tp_size(model_dir):
    """pdd_push_to with one address per rank of this (TP 1) producer: pushed, and the answer
    says so; another TP size, a malformed value or none: pulled, the answer as without push."""
    prod = make_scheduler(model_dir, "kv_producer")
    prod.connector.set_xfer_handshake_metadata({0: PDDHandshakeMetadata("127.0.0.1:45001", 0, 1, HEADS)})
    cases = {"p-eq": ["127.0.0.1:46000"], "p-tp2": ["127.0.0.1:46000", "127.0.0.1:46001"], "p-bad": "127.0.0.1:46000",
             "p-none": None}
    reqs = [make_request(rid, list(range(100 + 50 * i, 140 + 50 * i)), 1,
                         {"do_remote_decode": True, **({} if push_to is None else {"pdd_push_to": push_to})})
            for i, (rid, push_to) in enumerate(cases.items())]
    for r in reqs:
        prod.add_request(r)
    out = prod.schedule()
    assert set(out.kv_connector_metadata.saves) == set(cases)
    assert out.kv_connector_metadata.pushes == {"p-eq": ["127.0.0.1:46000"]}
    outputs = prod.update_from_output(out, runner_output(reqs))
    params = {o.request_id: o.kv_transfer_params for eo in outputs.values() for o in eo.outputs}
    assert params["p-eq"]["pdd_pushed"] is True
    assert all("pdd_pushed" not in params[rid] for rid in ("p-tp2", "p-bad", "p-none"))
    assert all(params[rid]["remote_request_id"] == rid and params[rid]["do_remote_prefill"] for rid in cases)


def pushed_params(producer: Worker, p_req: str, p_blocks: list[int]) -> dict:
    """What a pushed request's finished producer answers (the keys the consumer worker reads)."""
    return dict(do_remote_prefill=True, remote_request_id=p_req, pdd_addresses=[producer.conn.address], tp_size=1,
                remote_block_ids=p_blocks, remote_host="127.0.0.1", remote_port=1, pdd_pushed=True)


def forward(worker: Worker, meta: PDDConnectorMetadata, layers: range = range(LAYERS)) -> None:
    """The model runner's forward up to (not including) wait_for_save: save_kv_layer per layer."""
    worker.conn.bind_connector_metadata(meta)
    worker.conn.start_load_kv(None)
    for layer in layers:
        worker.conn.save_kv_layer(LAYER_NAMES[layer], worker.kv[LAYER_NAMES[layer]], None)


def end_forward(worker: Worker) -> KVConnectorOutput:
    """The rest of the step after ``forward``: wait_for_save and the step's transfer results."""
    conn = worker.conn
    conn.wait_for_save()
    results = conn.get_transfer_results(set())
    conn.clear_connector_metadata()
    return KVConnectorOutput(finished_sending=results.finished_sending, finished_recving=results.finished_recving,
                             failed_recving=results.failed_recving,
                             invalid_block_ids=conn.get_block_ids_with_load_errors())


@pytest.mark.parametrize("p_layout, d_layout, d_kernel", [("LBNHC", "LBHNC", None), ("BLNHC", "LBNHC", 8)])
def test_push_mode_end_to_end_through_both_schedulers(model_dir, p_layout, d_layout, d_kernel):
    """The proxy names the consumer's worker in pdd_push_to: the real producer Scheduler asks its
    worker to push, answers pdd_pushed, the consumer Scheduler's load completes from the stream
    (no pull) and its blocks hold the producer's bytes, in other layouts and block splits."""
    prod, cons = make_scheduler(model_dir, "kv_producer"), make_scheduler(model_dir, "kv_consumer")
    pw = make_worker(model_dir, "kv_producer", layout=p_layout, seed=11)
    cw = make_worker(model_dir, "kv_consumer", layout=d_layout, kernel_block=d_kernel, seed=12)
    try:
        prod.connector.set_xfer_handshake_metadata({0: pw.conn.get_handshake_metadata()})
        prompt, idle = list(range(200, 240)), free_blocks(prod)
        req = make_request("p-A", prompt, 1, {"do_remote_decode": True, "pdd_push_to": [cw.conn.address]})
        prod.add_request(req)
        out = prod.schedule()
        p_blocks = prod.kv_cache_manager.get_block_ids("p-A")[0]
        assert out.kv_connector_metadata.pushes == {"p-A": [cw.conn.address]}
        params = finished_params(prod.update_from_output(out, runner_output([req], worker_step(
            pw, out.kv_connector_metadata, forward=True))))
        assert params["pdd_pushed"] is True and params["remote_block_ids"] == p_blocks
        assert params["pdd_addresses"] == [pw.conn.address]  # the pull keys stay

        cons.add_request(make_request("d-A", prompt, 3, dict(params)))
        deadline, first_scheduled, recving = time.monotonic() + 60, {}, set()
        while "d-A" not in first_scheduled or pw.conn._staged:
            assert time.monotonic() < deadline
            engine_step(prod, pw)
            scheduled, kv_out = engine_step(cons, cw)
            assert not kv_out.failed_recving and not kv_out.invalid_block_ids
            recving |= kv_out.finished_recving
            for r, n in scheduled.items():
                first_scheduled.setdefault(r, n)
        assert recving == {"d-A"} and first_scheduled == {"d-A": 1}  # only the last prompt token is computed
        assert as_bytes(cw.blocks(cons.kv_cache_manager.get_block_ids("d-A")[0])) == as_bytes(pw.blocks(p_blocks))
        assert not pw.conn._serving and not pw.conn._staged and free_blocks(prod) == idle  # nothing was pulled
        assert not cw.conn._reservations and not cw.conn._pending_loads
    finally:
        pw.conn.shutdown()
        cw.conn.shutdown()


def test_push_posts_each_layer_from_save_kv_layer_while_the_forward_runs(model_dir):
    """Layer 0 is packed before the consumer answered; once the answer is in, the next
    save_kv_layer posts layers 0 and 1, and the consumer sees them land while the producer's
    forward is still short of its last layer."""
    pw = make_worker(model_dir, "kv_producer", seed=21)
    cw = make_worker(model_dir, "kv_consumer", seed=22)
    try:
        meta = PDDConnectorMetadata(saves={"p-req": [3, 8, 5]}, pushes={"p-req": [cw.conn.address]})
        forward(pw, meta, range(1))
        target = pw.conn._pushes["p-req"].targets[0]
        assert target.stream is None and not target.posted  # no answer yet: layer 0 waits, the forward goes on
        drive([cw.conn], lambda r, e: pw.conn.engine.stats()["messages_received"] >= 1)  # the consumer answered
        forward(pw, meta, range(1, 2))
        assert target.posted == {0, 1}
        reservation = cw.conn._reservations[(pw.conn.engine.engine_id, b"p-req")]

        def landed() -> list[bool]:
            progress = reservation.receiver.progress(pw.conn.engine.engine_id, b"p-req")
            return progress.layers_landed if progress else [False] * LAYERS

        drive([cw.conn], lambda r, e: landed()[:2] == [True, True])
        assert landed() == [True, True, False] and not reservation.complete
        forward(pw, meta, range(2, LAYERS))
        assert target.posted == set(range(LAYERS))  # every layer left before wait_for_save
        end_forward(pw)
        worker_step(pw, PDDConnectorMetadata(send_deadlines={"p-req": 60.0}))
        out = worker_step(cw, PDDConnectorMetadata(loads={"d-req": _Load([10, 12, 14], 0,
                                                                         pushed_params(pw, "p-req", [3, 8, 5]))}))
        results, errors = drive([pw.conn, cw.conn], lambda r, e: (out.finished_recving | r[1].finished_recving)
                                and not pw.conn._staged)
        assert out.finished_recving | results[1].finished_recving == {"d-req"}
        assert not out.failed_recving and not results[1].failed_recving and not out.invalid_block_ids and not errors[1]
        assert as_bytes(cw.blocks([10, 12, 14])) == as_bytes(pw.blocks([3, 8, 5]))
    finally:
        pw.conn.shutdown()
        cw.conn.shutdown()


@pytest.mark.parametrize("mla, d_tp, skip", [(False, 1, 1), (True, 1, 0), (True, 2, 0)])
def test_layers_pushed_before_the_consumer_saw_the_request_are_kept_and_used(model_dir, mla, d_tp, skip):
    """The whole stream lands before the consumer's scheduler knows the request; its load then
    completes within its first step, without a message to the producer, taking only the blocks
    past its own prefix hit (skip). MLA: one producer rank pushes to every consumer rank."""
    heads = 1 if mla else HEADS
    pw = make_worker(model_dir, "kv_producer", heads=heads, layout="LHBNC", mla=mla, seed=31)
    cws = [make_worker(model_dir, "kv_consumer", r, d_tp, heads, mla=mla, seed=32 + r, engine_id="consumer")
           for r in range(d_tp)]
    p_blocks, d_blocks = [3, 8, 5], [10, 12, 14][skip:]
    try:
        consumers = [w.conn.address for w in cws]
        worker_step(pw, PDDConnectorMetadata(saves={"p-req": p_blocks}, pushes={"p-req": consumers}), forward=True)
        assert len(pw.conn._pushes["p-req"].targets) == d_tp
        worker_step(pw, PDDConnectorMetadata(send_deadlines={"p-req": 60.0}))
        stream = (pw.conn.engine.engine_id, b"p-req")
        drive([pw.conn] + [w.conn for w in cws], lambda r, e: not pw.conn._staged and all(
            stream in w.conn._reservations and w.conn._reservations[stream].complete for w in cws))
        assert all(list(w.conn._reservations) == [stream] for w in cws)  # every layer landed, nobody loaded yet
        messages_at_producer = pw.conn.engine.stats()["messages_received"]
        for w in cws:
            out = worker_step(w, PDDConnectorMetadata(loads={"d-req": _Load(d_blocks, skip,
                                                                            pushed_params(pw, "p-req", p_blocks))}))
            assert out.finished_recving == {"d-req"} and not out.failed_recving and not out.invalid_block_ids
            assert as_bytes(w.blocks(d_blocks)) == as_bytes(pw.blocks(p_blocks[skip:]))
            assert not w.conn._reservations and not w.conn._pending_loads
            assert w.conn.staging._idle_bytes == sum(r.nbytes for r in w.conn.engine.regions())  # back in the pool
        pw.conn.get_transfer_results(set())
        assert pw.conn.engine.stats()["messages_received"] == messages_at_producer  # no pull was sent
    finally:
        pw.conn.shutdown()
        for w in cws:
            w.conn.shutdown()


def fake_reserve(fake: TransferEngine, consumer: PDDConnector, key: str, nbytes: int) -> dict:
    """Sends the consumer a reserve from a bare engine, as a producer would; returns the answer."""
    fake.send(fake.connect(consumer.address), MESSAGES.encode("reserve", req=key, nbytes=nbytes, num_layers=LAYERS,
                                                              reply=fake.address))
    answers = []
    drive([consumer], lambda r, e: answers.extend(MESSAGES.decode(m.payload) for m in fake.poll_messages()) or answers)
    return answers[0]


def fake_stream(fake: TransferEngine, consumer: PDDConnector, key: str, descriptor: bytes, nbytes: int,
                layers: range = range(LAYERS)) -> None:
    """Writes random bytes into ``descriptor`` as ``layers`` of a layer stream named ``key``."""
    per_layer = nbytes // LAYERS
    src = fake.register(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    stream = LayerStreamSender(fake, fake.connect(consumer.address), key.encode(), LAYERS)
    for layer in layers:
        stream.post(layer, [(src, layer * per_layer, descriptor, layer * per_layer, per_layer)]).wait(timeout=60)


def test_unclaimed_push_buffers_are_freed_after_the_lease(model_dir):
    """Nobody claims two push buffers: the complete one goes back to the pool, the incomplete one
    is unregistered (its producer could still write), and a load that comes too late fails
    (vLLM recomputes) instead of reading freed memory."""
    pw = make_worker(model_dir, "kv_producer", seed=41)
    cw = make_worker(model_dir, "kv_consumer", extra={"lease_s": 2.0, "load_timeout_s": 0.5})
    fake = TransferEngine()
    try:
        worker_step(pw, PDDConnectorMetadata(saves={"p-req": [3, 8]}, pushes={"p-req": [cw.conn.address]}),
                    forward=True)
        worker_step(pw, PDDConnectorMetadata(send_deadlines={"p-req": 60.0}))
        stream = (pw.conn.engine.engine_id, b"p-req")
        drive([pw.conn, cw.conn], lambda r, e: stream in cw.conn._reservations
              and cw.conn._reservations[stream].complete)
        nbytes = cw.conn.layout.packed_nbytes(2)
        answer = fake_reserve(fake, cw.conn, "f-req", nbytes)
        fake_stream(fake, cw.conn, "f-req", bytes.fromhex(answer["region"]), nbytes, range(1))  # one layer of three
        complete = cw.conn._reservations[stream]
        assert not cw.conn._reservations[(fake.engine_id, b"f-req")].complete
        complete_region = complete.buffer.region.id
        incomplete_region = RegionDescriptor.from_bytes(bytes.fromhex(answer["region"])).region_id

        drive([cw.conn], lambda r, e: not cw.conn._reservations)  # both leases run out
        regions = {r.id for r in cw.conn.engine.regions()}
        assert complete_region in regions and incomplete_region not in regions
        assert cw.conn.staging._idle_bytes == sum(r.nbytes for r in cw.conn.engine.regions())  # only the pool's
        with pytest.raises(TransferError, match="unknown destination region"):  # it takes no more writes
            fake_stream(fake, cw.conn, "f-req", bytes.fromhex(answer["region"]), nbytes, range(1, 2))

        worker_step(cw, PDDConnectorMetadata(loads={"d-req": _Load([10, 12], 0, pushed_params(pw, "p-req", [3, 8]))}))
        results, errors = drive([cw.conn], lambda r, e: r[0].finished_recving)
        assert results[0].failed_recving == {"d-req"} and errors[0] == {10, 12}
    finally:
        fake.close()
        pw.conn.shutdown()
        cw.conn.shutdown()


def test_a_reserve_from_a_producer_that_froze_before_the_first_connect_holds_up_no_step(model_dir, monkeypatch):
    """A producer engine in a process of its own asks a consumer for a push buffer and is stopped
    (SIGSTOP) before the consumer's step reads the request: whether it comes from the engine at
    the reply address it names takes a connect to the frozen process (up to the engine's
    timeout_s). The consumer's steps go on meanwhile and answer another producer; once the
    frozen one runs again, its request is answered too."""
    cw = make_worker(model_dir, "kv_consumer")
    frozen, live = RemoteEngine(listen="127.0.0.1:0"), TransferEngine()
    nbytes = cw.conn.layout.packed_nbytes(2)
    connects = Connects(monkeypatch, cw.conn.engine, frozen.address)
    stopped = False
    try:
        received = cw.conn.engine.stats()["messages_received"]
        frozen.call("send", cw.conn.address, MESSAGES.encode("reserve", req="f-req", nbytes=nbytes, num_layers=LAYERS,
                                                             reply=frozen.address))
        deadline = time.monotonic() + 60
        while cw.conn.engine.stats()["messages_received"] == received:  # arrived; no step has read it
            assert time.monotonic() < deadline, "the reserve never arrived"
            time.sleep(0.005)
        os.kill(frozen.process.pid, signal.SIGSTOP)
        stopped = True
        assert fake_reserve(live, cw.conn, "l-req", nbytes)["k"] == "reserved"
        assert connects.started.is_set() and not connects.ended.is_set()  # answered while the connect waits on the frozen one
        assert not any(key == b"f-req" for _, key in cw.conn._reservations)
        os.kill(frozen.process.pid, signal.SIGCONT)
        stopped = False
        drive([cw.conn], lambda r, e: any(key == b"f-req" for _, key in cw.conn._reservations))
        answers = frozen.call("wait_message", 60, None)
        assert [MESSAGES.decode(payload)["k"] for _, payload, _, _ in answers] == ["reserved"]
    finally:
        if stopped:
            os.kill(frozen.process.pid, signal.SIGCONT)
        live.close()
        frozen.close()
        cw.conn.shutdown()


def test_another_engines_stream_of_the_same_key_is_ignored(model_dir):
    """A rogue engine writes a whole stream named like the producer's into the producer's push
    buffer, and completes one of the same name into a buffer it reserved itself: neither
    completes the load, which takes the producer's stream when it comes."""
    pw = make_worker(model_dir, "kv_producer", seed=51)
    cw = make_worker(model_dir, "kv_consumer", seed=52)
    rogue = TransferEngine()
    p_blocks, d_blocks = [3, 8, 5], [10, 12, 14]
    try:
        worker_step(cw, PDDConnectorMetadata(loads={"d-req": _Load(d_blocks, 0, pushed_params(pw, "p-req", p_blocks))}))
        worker_step(pw, PDDConnectorMetadata(saves={"p-req": p_blocks}, pushes={"p-req": [cw.conn.address]}),
                    forward=True)  # its reserve is out, the consumer has not answered yet
        drive([cw.conn], lambda r, e: cw.conn._reservations)
        real = cw.conn._reservations[(pw.conn.engine.engine_id, b"p-req")]
        assert real.load == "d-req"  # claimed by the load that was waiting for it
        nbytes = real.nbytes
        fake_stream(rogue, cw.conn, "p-req", real.buffer.region.descriptor(), nbytes)  # into the producer's buffer
        answer = fake_reserve(rogue, cw.conn, "p-req", nbytes)  # a buffer of its own, same key
        fake_stream(rogue, cw.conn, "p-req", bytes.fromhex(answer["region"]), nbytes)
        results, errors = drive([cw.conn], lambda r, e: cw.conn._reservations[(rogue.engine_id, b"p-req")].complete)
        assert not results[0].finished_recving and not errors[0]  # neither completed nor failed
        assert real.receiver.progress(pw.conn.engine.engine_id, b"p-req") is None and not real.complete

        results, errors = drive([pw.conn, cw.conn], lambda r, e: r[1].finished_recving)  # the producer posts now
        assert not results[1].failed_recving and not errors[1]
        assert as_bytes(cw.blocks(d_blocks)) == as_bytes(pw.blocks(p_blocks))
    finally:
        rogue.close()
        pw.conn.shutdown()
        cw.conn.shutdown()


def test_a_refused_push_falls_back_to_a_pull(model_dir):
    """The consumer has no push buffer to give (its staging arena is held by a load in flight):
    it refuses the push, and its load pulls the KV from the producer, which kept its staged copy
    for that pull."""
    pw = make_worker(model_dir, "kv_producer", seed=63)
    cw = make_worker(model_dir, "kv_consumer", seed=64, extra={"staging_bytes": 64 << 10})
    held = cw.conn.staging.acquire(1, target=True)  # the whole arena: one 64 KiB buffer
    try:
        p_blocks, d_blocks = [3, 8, 5], [10, 12, 14]
        worker_step(pw, PDDConnectorMetadata(saves={"p-req": p_blocks}, pushes={"p-req": [cw.conn.address]}),
                    forward=True)
        drive([pw.conn, cw.conn], lambda r, e: pw.conn._pushes["p-req"].targets[0].ended)  # refused
        assert cw.conn._reservations[(pw.conn.engine.engine_id, b"p-req")].failure.startswith("no push buffer: ")
        cw.conn.staging.release(held)  # that load ended
        worker_step(pw, PDDConnectorMetadata(send_deadlines={"p-req": 60.0}))
        assert "p-req" in pw.conn._staged  # kept for the pull the consumer falls back to
        worker_step(cw, PDDConnectorMetadata(loads={"d-req": _Load(d_blocks, 0, pushed_params(pw, "p-req", p_blocks))}))
        results, errors = drive([pw.conn, cw.conn], lambda r, e: r[1].finished_recving and not pw.conn._staged)
        assert results[1].finished_recving == {"d-req"} and not results[1].failed_recving and not errors[1]
        assert as_bytes(cw.blocks(d_blocks)) == as_bytes(pw.blocks(p_blocks))
    finally:
        pw.conn.shutdown()
        cw.conn.shutdown()


def test_a_push_the_producer_drops_fails_the_load(model_dir):
    """The producer drops the request while its stream is incomplete: the consumer hears of it
    and fails the load like a failed pull (vLLM recomputes), its push buffer unregistered."""
    pw = make_worker(model_dir, "kv_producer", seed=61)
    cw = make_worker(model_dir, "kv_consumer", seed=62)
    try:
        worker_step(pw, PDDConnectorMetadata(saves={"p-req": [3, 8]}, pushes={"p-req": [cw.conn.address]}),
                    forward=True)
        worker_step(cw, PDDConnectorMetadata(loads={"d-req": _Load([10, 12], 0, pushed_params(pw, "p-req", [3, 8]))}))
        drive([cw.conn], lambda r, e: cw.conn._reservations)
        region = cw.conn._reservations[(pw.conn.engine.engine_id, b"p-req")].buffer.region.id
        worker_step(pw, PDDConnectorMetadata(dropped_sends={"p-req"}))  # before it took the consumer's answer
        assert not pw.conn._staged
        results, errors = drive([pw.conn, cw.conn], lambda r, e: r[1].finished_recving)
        assert results[1].failed_recving == {"d-req"} and errors[1] == {10, 12}
        assert not cw.conn._reservations and region not in {r.id for r in cw.conn.engine.regions()}
    finally:
        pw.conn.shutdown()
        cw.conn.shutdown()


@pytest.mark.gpu
def test_workers_move_cuda_blocks_on_a_second_stream(model_dir):
    """KV caches on the GPU, every connector hook called with a second CUDA stream current (as a
    model runner may): the packs, the waits before the engine reads a buffer, and the unpacks
    all follow that stream, so the consumer's blocks equal the producer's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from pddcore import _C

    if _C.cuda_unusable_reason():
        pytest.skip(f"pddcore's CUDA kernels: {_C.cuda_unusable_reason()}")
    pw = make_worker(model_dir, "kv_producer", seed=91, device="cuda")
    cw = make_worker(model_dir, "kv_consumer", seed=92, device="cuda")
    side = torch.cuda.Stream()
    try:
        torch.cuda.synchronize()  # the random fill ran on the default stream
        p_blocks, d_blocks = [3, 8, 5], [10, 12, 14]
        with torch.cuda.stream(side):
            worker_step(pw, PDDConnectorMetadata(saves={"p-req": p_blocks}), forward=True)
            worker_step(pw, PDDConnectorMetadata(send_deadlines={"p-req": 60.0}))
            pull(cw, "d-req", dict(pushed_params(pw, "p-req", p_blocks), pdd_pushed=False), d_blocks)
            results, errors = drive([pw.conn, cw.conn], lambda r, e: r[1].finished_recving)
        assert not results[1].failed_recving and not errors[1]
        assert as_bytes(cw.blocks(d_blocks)) == as_bytes(pw.blocks(p_blocks))
    finally:
        pw.conn.shutdown()
        cw.conn.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager, push", [(True, False), (False, False), (True, True)],
                         ids=["eager-pull", "cudagraphs-pull", "eager-push"])
def test_generation_end_to_end_on_gpu(tmp_path, enforce_eager, push):
    """Producer and consumer vLLM engines (dummy weights, same seed) hand a prompt's KV over through
    PDDConnector; the consumer's greedy tokens must equal a single engine's. kv_load_failure_policy
    is "fail", so a transfer that did not happen fails the request instead of recomputing it.
    enforce_eager=False captures vLLM's CUDA graphs (full ones included: the connector asks for
    no piecewise mode); push names the consumer's worker (its fixed port) in pdd_push_to."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (and vllm's CUDA kernels): runs a producer and a consumer engine")
    try:
        import vllm._C  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"vllm's CUDA kernels do not import ({exc}); install vllm with its CUDA torch")
    from vllm import LLM

    write_model_config(tmp_path)
    common = dict(model=str(tmp_path), skip_tokenizer_init=True, load_format="dummy", seed=0,
                  enforce_eager=enforce_eager, max_model_len=512, gpu_memory_utilization=0.15)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        consumer_port = sock.getsockname()[1]
    extra = {"auth_token": "gpu-test-token-7c3a9e5d1b8f20461", "host": "127.0.0.1", "staging_bytes": 64 << 20}
    transfer = dict(kv_connector="PDDConnector", kv_connector_module_path="pddcore.integrations.vllm")
    prompt = {"prompt_token_ids": list(range(3, 83))}
    baseline = LLM(**common).generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    producer = LLM(**common, kv_transfer_config={**transfer, "kv_role": "kv_producer", "kv_connector_extra_config": extra})
    consumer = LLM(**common, kv_transfer_config={**transfer, "kv_role": "kv_consumer",
                                                 "kv_connector_extra_config": {**extra, "port": consumer_port}})
    params = {"do_remote_decode": True, **({"pdd_push_to": [f"127.0.0.1:{consumer_port}"]} if push else {})}
    first = producer.generate([prompt], SamplingParams(max_tokens=1, temperature=0,
                                                       extra_args={"kv_transfer_params": params}))[0]
    assert first.kv_transfer_params["do_remote_prefill"] and first.kv_transfer_params.get("pdd_pushed", False) == push
    out = consumer.generate([prompt], SamplingParams(max_tokens=16, temperature=0,
                                                     extra_args={"kv_transfer_params": first.kv_transfer_params}))[0]
    assert out.outputs[0].token_ids == baseline.outputs[0].token_ids
