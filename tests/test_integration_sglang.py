"""pddcore as SGLang's PD transfer backend: the real ``KVPoll`` state machine, prefill and
decode in two processes, pages compared byte for byte against plain torch indexing."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

import numpy as np
import pytest
import torch

conn = pytest.importorskip("sglang.srt.disaggregation.base.conn",
                           reason="sglang not installed: pip install --no-deps -r tests/integrations/requirements-engines.txt",
                           exc_type=ImportError)
from sglang.srt.server_args import ServerArgs  # noqa: E402

from pddcore.integrations import sglang as pdd  # noqa: E402

KVPoll = conn.KVPoll
PAGE, HEAD_DIM, LAYERS, POOL_PAGES, AUX_ITEM = 4, 8, 3, 12, 16
TERMINAL = (KVPoll.Success, KVPoll.Failed)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_args(port: int, tp: int = 1) -> ServerArgs:
    return ServerArgs(model_path="unused-model", host="127.0.0.1", disaggregation_bootstrap_port=port, tp_size=tp)


class Pool:
    """An SGLang-shaped MHA token pool (``[slots, heads, head_dim]`` per layer) plus one aux buffer."""

    def __init__(self, heads: int, rank: int, total_heads: int, fill: torch.Tensor | None = None):
        shape = (POOL_PAGES * PAGE, heads, HEAD_DIM)
        if fill is None:
            self.k = [torch.zeros(shape) for _ in range(LAYERS)]
            self.v = [torch.zeros(shape) for _ in range(LAYERS)]
        else:  # fill: [LAYERS, 2, slots, total_heads, dim]; take this rank's heads
            sl = slice(rank * heads, (rank + 1) * heads)
            self.k = [fill[i, 0, :, sl].clone() for i in range(LAYERS)]
            self.v = [fill[i, 1, :, sl].clone() for i in range(LAYERS)]
        self.aux = torch.zeros(8, AUX_ITEM, dtype=torch.uint8)
        args = conn.KVArgs()
        planes = self.k + self.v
        args.kv_data_ptrs = [t.data_ptr() for t in planes]
        args.kv_data_lens = [t.numel() * 4 for t in planes]
        args.kv_item_lens = [PAGE * heads * HEAD_DIM * 4] * len(planes)
        args.page_size, args.kv_head_num, args.total_kv_head_num, args.engine_rank = PAGE, heads, total_heads, rank
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [self.aux.data_ptr()], [self.aux.numel()], [AUX_ITEM]
        self.args = args

    def pages(self, ids) -> torch.Tensor:
        """[LAYERS, 2, len(ids), PAGE, heads, dim] copy of the given pages."""
        return torch.stack([torch.stack([t.view(POOL_PAGES, PAGE, *t.shape[1:])[list(ids)] for t in pair])
                            for pair in zip(self.k, self.v)])


def decode_side(cmd: dict, out) -> None:
    """Child process: decode ranks of TP ``d_tp`` receive one room; reports states and pages."""
    torch.set_num_threads(1)
    d_tp, total = cmd["d_tp"], cmd["total_heads"]
    pools, mgrs, receivers = [], [], []
    try:
        for rank in range(d_tp):
            pool = Pool(total // d_tp, rank, total)
            pools.append(pool)
            mgrs.append(pdd.PDDKVManager(pool.args, "decode", _server_args(cmd["port"], d_tp)))
            receivers.append(pdd.PDDKVReceiver(mgrs[-1], f"127.0.0.1:{cmd['port']}", cmd["room"], timeout_s=60))
        seen = [[r.poll()] for r in receivers]
        while any(s[-1] == KVPoll.Bootstrapping for s in seen):
            time.sleep(0.01)
            for r, s in zip(receivers, seen):
                s.append(r.poll())
        for r in receivers:
            r.init(0)
            if cmd.get("abort_decode"):
                r.abort()
            else:
                r.send_metadata(np.array(cmd["d_pages"], dtype=np.int32), aux_index=cmd["d_aux"],
                                decode_prefix_len=cmd["prefix_len"])
        while not all(s[-1] in TERMINAL for s in seen):
            time.sleep(0.005)
            for r, s in zip(receivers, seen):
                s.append(r.poll())
        errors = []
        for r, s in zip(receivers, seen):
            if s[-1] == KVPoll.Failed:
                try:
                    r.failure_exception()
                except pdd.PDDTransferError as exc:
                    errors.append(str(exc))
        out.send({"states": [list(dict.fromkeys(s)) for s in seen], "errors": errors,
                  "pools": [(p.pages(range(POOL_PAGES)).numpy(), p.aux.numpy().copy()) for p in pools]})
    except Exception as exc:  # report instead of hanging the parent
        out.send({"crash": repr(exc)})
    finally:
        for m in mgrs:
            m.close()


def decode_server(pipe) -> None:
    """Child process: runs one decode-side scenario per command until it receives None."""
    while (cmd := pipe.recv()) is not None:
        decode_side(cmd, pipe)


@pytest.fixture(scope="module")
def decode_process():
    ctx = mp.get_context("spawn")  # a fresh interpreter: no threads inherited from pytest
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=decode_server, args=(child,), daemon=True)
    proc.start()
    yield parent
    parent.send(None)
    proc.join(30)
    if proc.is_alive():
        proc.kill()


@pytest.fixture
def run_decode(decode_process):
    def start(**cmd):
        decode_process.send(cmd)
        return decode_process

    return start


def _drive_prefill(p_tp, total, fill, port, room, p_pages, prefix_pages, chunks, abort_prefill=False):
    server = pdd.PDDKVBootstrapServer("127.0.0.1", port)
    pools = [Pool(total // p_tp, r, total, fill) for r in range(p_tp)]
    for pool in pools:
        pool.aux[5] = torch.arange(AUX_ITEM, dtype=torch.uint8) + 7
    mgrs = [pdd.PDDKVManager(pool.args, "prefill", _server_args(port, p_tp)) for pool in pools]
    senders = [pdd.PDDKVSender(m, f"127.0.0.1:{port}", room) for m in mgrs]
    seen = [[s.poll()] for s in senders]
    try:
        deadline = time.monotonic() + 60
        while any(s[-1] == KVPoll.Bootstrapping for s in seen) and time.monotonic() < deadline:
            time.sleep(0.005)
            for snd, s in zip(senders, seen):
                s.append(snd.poll())
        for snd, s in zip(senders, seen):
            if s[-1] != KVPoll.WaitingForInput:
                continue
            assert snd.pop_decode_prefix_len() == prefix_pages * PAGE
            to_send = p_pages[prefix_pages:]
            snd.init(len(to_send), aux_index=5)
            if abort_prefill:
                snd.abort()
                continue
            for part in np.array_split(np.array(to_send, dtype=np.int32), chunks):
                snd.send(part)
        while not all(s[-1] in TERMINAL for s in seen) and time.monotonic() < deadline:
            time.sleep(0.005)
            for snd, s in zip(senders, seen):
                s.append(snd.poll())
        return [list(dict.fromkeys(s)) for s in seen], senders
    finally:
        for m in mgrs:
            m.close()
        server.close()


@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (2, 1), (1, 2)])
def test_pages_and_prefix_suffix_arrive_byte_identical(run_decode, p_tp, d_tp):
    total, port, room = 4, _free_port(), 4242 + p_tp * 10 + d_tp
    gen = torch.Generator().manual_seed(p_tp * 7 + d_tp)
    fill = torch.randn(LAYERS, 2, POOL_PAGES * PAGE, total, HEAD_DIM, generator=gen)
    p_pages = [9, 3, 4, 11, 0, 6]           # the request's pages on prefill, in token order
    prefix_pages = 2                        # decode's radix cache already holds the first 2 pages
    d_pages = [7, 1, 10, 2]                 # decode pages for the suffix
    out = run_decode(d_tp=d_tp, total_heads=total, port=port, room=room, d_pages=d_pages, d_aux=3,
                     prefix_len=prefix_pages * PAGE)
    p_states, _ = _drive_prefill(p_tp, total, fill, port, room, p_pages, prefix_pages, chunks=2)
    result = out.recv()
    assert "crash" not in result, result
    assert all(states[0] == KVPoll.Bootstrapping for states in p_states), p_states
    for states in p_states + result["states"]:  # the KVPoll order, as polled
        assert states[-1] == KVPoll.Success, states
        assert states == sorted(states) and KVPoll.WaitingForInput in states, states
    full = fill.view(LAYERS, 2, POOL_PAGES, PAGE, total, HEAD_DIM)
    per = total // d_tp
    for rank, (pages, aux) in enumerate(result["pools"]):
        pages, aux = torch.from_numpy(pages), torch.from_numpy(aux)
        want = torch.zeros_like(pages)
        want[:, :, d_pages] = full[:, :, p_pages[prefix_pages:], :, rank * per:(rank + 1) * per]
        assert torch.equal(pages, want)  # suffix in place, prefix pages and the rest untouched
        assert aux[3].tolist() == list(range(7, 7 + AUX_ITEM)) and int(aux.sum()) == int(aux[3].sum())


def test_prefill_abort_fails_both_sides(run_decode):
    port, room = _free_port(), 77
    fill = torch.randn(LAYERS, 2, POOL_PAGES * PAGE, 2, HEAD_DIM)
    out = run_decode(d_tp=1, total_heads=2, port=port, room=room, d_pages=[1, 2], d_aux=0, prefix_len=0)
    p_states, senders = _drive_prefill(1, 2, fill, port, room, [4, 5], 0, chunks=1, abort_prefill=True)
    result = out.recv()
    assert p_states[0][-1] == KVPoll.Failed and result["states"][0][-1] == KVPoll.Failed
    with pytest.raises(pdd.PDDTransferError, match="aborted by the prefill side"):
        senders[0].failure_exception()
    assert "aborted by the prefill side" in result["errors"][0]
    assert np.count_nonzero(result["pools"][0][0]) == 0  # nothing was applied


def test_decode_abort_fails_prefill(run_decode):
    port, room = _free_port(), 78
    fill = torch.randn(LAYERS, 2, POOL_PAGES * PAGE, 2, HEAD_DIM)
    out = run_decode(d_tp=1, total_heads=2, port=port, room=room, d_pages=[1, 2], d_aux=0, prefix_len=0,
                     abort_decode=True)
    server = pdd.PDDKVBootstrapServer("127.0.0.1", port)
    pool = Pool(2, 0, 2, fill)
    mgr = pdd.PDDKVManager(pool.args, "prefill", _server_args(port))
    try:
        result = out.recv()
        assert result["states"][0][-1] == KVPoll.Failed and "aborted by the decode side" in result["errors"][0]
        sender = pdd.PDDKVSender(mgr, f"127.0.0.1:{port}", room)
        deadline = time.monotonic() + 30
        while sender.poll() != KVPoll.Failed and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(pdd.PDDTransferError, match="aborted by the decode side"):
            sender.failure_exception()
    finally:
        mgr.close()
        server.close()


def test_decode_times_out_without_prefill():
    pool = Pool(2, 0, 2)
    mgr = pdd.PDDKVManager(pool.args, "decode", _server_args(_free_port()))
    try:
        nobody = f"127.0.0.1:{_free_port()}"
        assert not mgr.try_ensure_parallel_info(nobody) and nobody not in mgr.prefill_info_table
        receiver = pdd.PDDKVReceiver(mgr, nobody, 5, timeout_s=0.2)
        assert receiver.poll() == KVPoll.Bootstrapping
        with pytest.raises(RuntimeError, match="need WaitingForInput"):
            receiver.send_metadata(np.array([1], dtype=np.int32))
        time.sleep(0.3)
        assert receiver.poll() == KVPoll.Failed
        with pytest.raises(pdd.PDDTransferError, match="timed out in state 1"):
            receiver.failure_exception()
    finally:
        mgr.close()


def test_failed_write_fails_both_sides():
    """The decode staging region disappears before prefill writes: the engine rejects the write,
    the sender fails and tells the receiver; neither side applies anything."""
    port = _free_port()
    server = pdd.PDDKVBootstrapServer("127.0.0.1", port)
    src = Pool(2, 0, 2, torch.randn(LAYERS, 2, POOL_PAGES * PAGE, 2, HEAD_DIM))
    dst = Pool(2, 0, 2)
    prefill = pdd.PDDKVManager(src.args, "prefill", _server_args(port))
    decode = pdd.PDDKVManager(dst.args, "decode", _server_args(_free_port()))
    try:
        sender = pdd.PDDKVSender(prefill, f"127.0.0.1:{port}", 21)
        receiver = pdd.PDDKVReceiver(decode, f"127.0.0.1:{port}", 21, timeout_s=30)
        assert receiver.poll() == KVPoll.WaitingForInput
        receiver.send_metadata(np.array([1, 2], dtype=np.int32))
        deadline = time.monotonic() + 30
        while sender.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
            time.sleep(0.005)
        decode.engine.unregister(receiver._region)  # the fault: the destination is gone
        sender.init(2)
        sender.send(np.array([3, 4], dtype=np.int32))
        while (sender.poll(), receiver.poll()) != (KVPoll.Failed, KVPoll.Failed):
            assert time.monotonic() < deadline, (sender.poll(), receiver.poll())
            time.sleep(0.005)
        with pytest.raises(pdd.PDDTransferError, match="transfer failed"):
            sender.failure_exception()
        with pytest.raises(pdd.PDDTransferError, match="transfer failed"):
            receiver.failure_exception()
        assert torch.count_nonzero(torch.stack(dst.k + dst.v)) == 0
    finally:
        decode.close()
        prefill.close()
        server.close()


def test_decode_rejects_a_prefill_pool_of_another_shape():
    port = _free_port()
    server = pdd.PDDKVBootstrapServer("127.0.0.1", port)
    prefill = pdd.PDDKVManager(Pool(2, 0, 2).args, "prefill", _server_args(port))
    decode = pdd.PDDKVManager(Pool(1, 0, 1).args, "decode", _server_args(_free_port()))  # 1 KV head, not 2
    try:
        assert decode.try_ensure_parallel_info(f"127.0.0.1:{port}")  # what SGLang's decode queue asks first
        info = decode.prefill_info_table[f"127.0.0.1:{port}"]
        assert (info.tp_size, info.total_kv_heads, info.dp_size, info.ranks) == (1, 2, 1, {0: prefill.engine.address})
        receiver = pdd.PDDKVReceiver(decode, f"127.0.0.1:{port}", 11, timeout_s=30)
        assert receiver.poll() == KVPoll.Failed
        with pytest.raises(pdd.PDDTransferError, match="prefill has 2 KV heads, decode 1"):
            receiver.failure_exception()
    finally:
        decode.close()
        prefill.close()
        server.close()


def test_sender_rejects_more_pages_than_announced_and_state_indices():
    port = _free_port()
    server = pdd.PDDKVBootstrapServer("127.0.0.1", port)
    pool = Pool(2, 0, 2)
    mgr = pdd.PDDKVManager(pool.args, "prefill", _server_args(port))
    try:
        sender = pdd.PDDKVSender(mgr, f"127.0.0.1:{port}", 9)
        with pytest.raises(RuntimeError, match="before the decode side registered"):
            sender.init(2)
        with pytest.raises(RuntimeError, match="before init"):
            sender.send(np.array([1], dtype=np.int32))
    finally:
        mgr.close()
        server.close()


def test_install_registers_backend():
    try:
        import sglang.srt.disaggregation.utils as disagg_utils
    except Exception as exc:  # noqa: BLE001 - any import failure means the CPU install cannot reach it
        pytest.skip(f"sglang.srt.disaggregation.utils does not import here ({type(exc).__name__}: {exc}); "
                    "it needs torchvision, whose PyPI build requires a CUDA torch")
    pdd.install()
    backend = disagg_utils.TransferBackend("pddcore")
    assert disagg_utils.get_kv_class(backend, disagg_utils.KVClassType.SENDER) is pdd.PDDKVSender
    assert disagg_utils.get_kv_class(disagg_utils.TransferBackend("fake"),
                                     disagg_utils.KVClassType.SENDER).__name__ == "FakeKVSender"


@pytest.mark.gpu
def test_generation_end_to_end_on_gpu(tmp_path):
    """A prefill and a decode sglang Engine (dummy weights, same seed) with the pddcore backend:
    the decode side's greedy tokens must equal a single engine's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (and sglang's CUDA kernels): runs a prefill and a decode engine")
    try:
        import sgl_kernel  # noqa: F401
        import sglang as sgl
    except ImportError as exc:
        pytest.skip(f"sglang's CUDA stack does not import ({exc}); install sglang with its CUDA torch")
    import json
    import threading

    pdd.install()
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "float16"}))
    common = dict(model_path=str(tmp_path), skip_tokenizer_init=True, load_format="dummy", random_seed=0,
                  mem_fraction_static=0.15, disable_cuda_graph=True)
    ids, params = list(range(3, 83)), {"max_new_tokens": 16, "temperature": 0}
    want = sgl.Engine(**common).generate(input_ids=ids, sampling_params=params)["output_ids"]
    port = _free_port()
    disagg = dict(disaggregation_transfer_backend=pdd.BACKEND_NAME, disaggregation_bootstrap_port=port)
    prefill = sgl.Engine(**common, **disagg, disaggregation_mode="prefill")
    decode = sgl.Engine(**common, **disagg, disaggregation_mode="decode")
    route = dict(bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=12345)
    t = threading.Thread(target=prefill.generate, kwargs=dict(input_ids=ids, sampling_params=params, **route))
    t.start()
    got = decode.generate(input_ids=ids, sampling_params=params, **route)["output_ids"]
    t.join()
    assert got == want
