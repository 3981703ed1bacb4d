"""pddcore as SGLang's PD transfer backend, on SGLang's own KV pools: the real ``KVPoll`` state
machine, prefill and decode in two processes, pages compared byte for byte.

The KV pools are SGLang's ``MHATokenToKVPool`` / ``MLATokenToKVPool`` built on the CPU, and
``KVArgs`` are filled the way the prefill / decode queues' ``_init_kv_manager`` fills them
(``get_contiguous_buf_infos``; the decode side without ``kv_head_num``, as SGLang leaves it).

SGLang's own ``PrefillBootstrapQueue`` / ``DecodePreallocQueue`` / ``DecodeTransferQueue`` are
not driven here. Their constructors read the scheduler's process-wide runtime context
(``sglang.srt.runtime_context.get_parallel()`` -> ``attn_tp_group.cpu_group``, a torch.distributed
gloo group, and ``get_disagg()``), which only ``Scheduler`` initialises together with a model
runner (``scheduler.tp_worker.model_runner.kv_cache_dtype_str``), a radix tree and an allocator;
``DecodePreallocQueue`` then polls through ``poll_and_all_reduce`` (a gloo all-reduce). Faking
that context would test our fake, not SGLang, so the queues run only in the GPU end-to-end test
below (a real prefill and decode ``sglang.Engine``). What the queues call on the backend is
checked instead against SGLang's source (``test_backend_has_what_sglangs_queues_call``).
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

conn = pytest.importorskip("sglang.srt.disaggregation.base.conn",
                           reason="sglang not installed: pip install --no-deps -r tests/integrations/requirements-engines.txt",
                           exc_type=ImportError)
from sglang.srt.server_args import ServerArgs  # noqa: E402

from pddcore.integrations import sglang as pdd  # noqa: E402
from pddcore.transfer import TransferEngine  # noqa: E402

from transfer_peer import Connects  # noqa: E402


def _torchvision_stand_in() -> None:
    """``sglang.srt.mem_cache.memory_pool`` imports ``sglang.srt.configs``, whose ``__init__``
    imports every model config; two of them (``deepseek_ocr``, and ``nano_nemotron_vl`` through
    ``multimodal.internvl_utils``) import ``torchvision.transforms`` at module level. The PyPI
    torchvision wheels need a CUDA torch, so CPU machines have none. The KV pools never touch
    it: this registers a stand-in with just the names those modules import, after transformers
    has cached "torchvision unavailable" (so transformers never uses the stand-in)."""
    if importlib.util.find_spec("torchvision") is not None:
        return
    from transformers.utils.import_utils import is_torchvision_available

    assert not is_torchvision_available()

    def module(name: str) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules[name] = mod
        return mod

    class InterpolationMode(enum.Enum):
        NEAREST, BILINEAR, BICUBIC = "nearest", "bilinear", "bicubic"

    vision, transforms, functional = (module(n) for n in ("torchvision", "torchvision.transforms",
                                                          "torchvision.transforms.functional"))
    vision.transforms, transforms.functional = transforms, functional
    transforms.InterpolationMode = functional.InterpolationMode = InterpolationMode


_torchvision_stand_in()
try:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
except ImportError as exc:
    pytest.skip(f"SGLang's KV pools do not import ({exc}); install tests/integrations/requirements-engines.txt",
                allow_module_level=True)

KVPoll = conn.KVPoll
PAGE, HEAD_DIM, LAYERS, SLOTS, AUX_ITEM = 4, 8, 3, 44, 16
KV_LORA_RANK, ROPE_DIM = 16, 8
TERMINAL = (KVPoll.Success, KVPoll.Failed)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_args(port: int, tp: int = 1, **overrides) -> ServerArgs:
    return ServerArgs(model_path="unused-model", host="127.0.0.1", disaggregation_bootstrap_port=port, tp_size=tp,
                      **{"device": "cpu", **overrides})


@pytest.fixture(autouse=True, scope="module")
def loopback_data_address():
    """Engines listen on loopback (the decode child inherits this); the address tests below
    unset it to check SGLang's local-IP detection."""
    saved = os.environ.get(pdd.HOST_ENV)
    os.environ[pdd.HOST_ENV] = "127.0.0.1"
    yield
    os.environ.pop(pdd.HOST_ENV)
    if saved is not None:
        os.environ[pdd.HOST_ENV] = saved


class Rank:
    """One scheduler rank's KV: SGLang's own pool on the CPU (bf16), the ``KVArgs`` its queues
    build from it, and one aux (metadata) buffer. ``fill``: ``[LAYERS, planes, slots, total_heads,
    dim]`` of which this rank takes its heads (MHA) or everything (MLA); None: zeros."""

    def __init__(self, *, mla: bool, heads: int, total_heads: int, rank: int, fill: torch.Tensor | None = None,
                 publish_heads: bool = True, device: str = "cpu"):
        common = dict(size=SLOTS, page_size=PAGE, dtype=torch.bfloat16, layer_num=LAYERS, device=device,
                      enable_memory_saver=False)
        if mla:
            self.pool = MLATokenToKVPool(kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE_DIM, **common)
            self.planes = list(self.pool.kv_buffer)
        else:
            self.pool = MHATokenToKVPool(head_num=heads, head_dim=HEAD_DIM, **common)
            self.planes = list(self.pool.k_buffer) + list(self.pool.v_buffer)
        for i, plane in enumerate(self.planes):
            if fill is None:
                plane.zero_()
            else:
                layer, kind = i % LAYERS, i // LAYERS
                plane.copy_(fill[layer, kind] if mla else fill[layer, kind, :, rank * heads:(rank + 1) * heads])
        self.aux = torch.zeros(8, AUX_ITEM, dtype=torch.uint8)
        args = conn.KVArgs()
        args.engine_rank, args.page_size, args.gpu_id = rank, PAGE, torch.device(device).index or 0
        args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = self.pool.get_contiguous_buf_infos()
        if not mla and publish_heads:  # prefill queue: always; decode queue: only with its staging buffer
            args.kv_head_num, args.total_kv_head_num = heads, total_heads
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [self.aux.data_ptr()], [self.aux.numel()], [AUX_ITEM]
        self.args = args

    @property
    def num_pages(self) -> int:
        return self.planes[0].shape[0] // PAGE

    def snapshot(self) -> np.ndarray:
        """Every plane's bytes as int16 ``[planes, pages, PAGE, heads, dim]`` (numpy has no bf16)."""
        stacked = torch.stack(self.planes).cpu()
        return stacked.view(torch.int16).view(len(self.planes), self.num_pages, PAGE, *stacked.shape[2:]).numpy().copy()


def _fill(mla: bool, total_heads: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rank0 = Rank(mla=mla, heads=total_heads, total_heads=total_heads, rank=0)
    shape = (LAYERS, 1 if mla else 2, *rank0.planes[0].shape)
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def decode_side(cmd: dict, out) -> None:
    """Child process: decode ranks of TP ``d_tp`` receive one room; reports states and pages."""
    torch.set_num_threads(1)
    d_tp, total, mla = cmd["d_tp"], cmd["total_heads"], cmd["mla"]
    ranks, mgrs, receivers = [], [], []
    try:
        for r in range(d_tp):
            ranks.append(Rank(mla=mla, heads=total // d_tp, total_heads=total, rank=r, publish_heads=False))
            mgrs.append(pdd.PDDKVManager(ranks[-1].args, "decode", _server_args(cmd["port"], d_tp), mla))
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
                  "pools": [(rank.snapshot(), rank.aux.numpy().copy()) for rank in ranks]})
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
def decode_process(loopback_data_address):
    ctx = mp.get_context("spawn")  # a fresh interpreter: no threads inherited from pytest
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=decode_server, args=(child,), daemon=True)
    proc.start()
    yield parent, proc.pid
    parent.send(None)
    proc.join(30)
    if proc.is_alive():
        proc.kill()


@pytest.fixture
def run_decode(decode_process):
    pipe, _ = decode_process

    def start(**cmd):
        pipe.send({"mla": False, **cmd})
        return pipe

    return start


def _receive(out, deadline_s: float = 120) -> dict:
    assert out.poll(deadline_s), "the decode process sent nothing"
    result = out.recv()
    assert "crash" not in result, result
    return result


def _drive_prefill(p_tp, total, fill, port, room, p_pages, prefix_pages, chunks, abort_prefill=False, mla=False):
    server = pdd.PDDKVBootstrapServer("127.0.0.1", port)
    ranks = [Rank(mla=mla, heads=total // p_tp, total_heads=total, rank=r, fill=fill) for r in range(p_tp)]
    for rank in ranks:
        rank.aux[5] = torch.arange(AUX_ITEM, dtype=torch.uint8) + 7
    mgrs = [pdd.PDDKVManager(rank.args, "prefill", _server_args(port, p_tp), mla) for rank in ranks]
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


@pytest.mark.parametrize("mla,p_tp,d_tp", [(False, 1, 1), (False, 2, 1), (False, 1, 2), (True, 1, 1), (True, 1, 2),
                                        (True, 2, 1), (True, 4, 2)],
                         ids=["mha-tp1-1", "mha-tp2-1", "mha-tp1-2", "mla-tp1-1", "mla-tp1-2", "mla-tp2-1", "mla-tp4-2"])
def test_pages_and_prefix_suffix_arrive_byte_identical(run_decode, mla, p_tp, d_tp):
    """Every prefill rank reaches Success with the decode's prefix length, including, with MLA
    and the larger prefill TP, the ranks no decode rank reads (they are told so and send nothing)."""
    total, port, room = 4, _free_port(), 4242 + p_tp * 10 + d_tp + 100 * mla
    fill = _fill(mla, total, seed=p_tp * 7 + d_tp + mla)
    p_pages = [9, 3, 4, 11, 0, 6]           # the request's pages on prefill, in token order
    prefix_pages = 2                        # decode's radix cache already holds the first 2 pages
    d_pages = [7, 1, 10, 2]                 # decode pages for the suffix
    out = run_decode(d_tp=d_tp, total_heads=total, port=port, room=room, d_pages=d_pages, d_aux=3,
                     prefix_len=prefix_pages * PAGE, mla=mla)
    p_states, _ = _drive_prefill(p_tp, total, fill, port, room, p_pages, prefix_pages, chunks=2, mla=mla)
    result = _receive(out)
    assert all(states[0] == KVPoll.Bootstrapping for states in p_states), p_states
    for states in p_states + result["states"]:  # the KVPoll order, as polled
        assert states[-1] == KVPoll.Success, states
        assert states == sorted(states) and KVPoll.WaitingForInput in states, states
    source = Rank(mla=mla, heads=total, total_heads=total, rank=0, fill=fill).snapshot()  # all heads, one rank
    per = 1 if mla else total // d_tp
    for rank, (pages, aux) in enumerate(result["pools"]):
        want = np.zeros_like(pages)
        heads = slice(None) if mla else slice(rank * per, (rank + 1) * per)
        want[:, d_pages] = source[:, p_pages[prefix_pages:], :, heads]
        assert np.array_equal(pages, want)  # suffix in place, prefix pages and the rest untouched
        assert aux[3].tolist() == list(range(7, 7 + AUX_ITEM)) and int(aux.sum()) == int(aux[3].sum())


def test_prefill_abort_fails_both_sides(run_decode):
    port, room = _free_port(), 77
    out = run_decode(d_tp=1, total_heads=2, port=port, room=room, d_pages=[1, 2], d_aux=0, prefix_len=0)
    p_states, senders = _drive_prefill(1, 2, _fill(False, 2, 1), port, room, [4, 5], 0, chunks=1, abort_prefill=True)
    result = _receive(out)
    assert p_states[0][-1] == KVPoll.Failed and result["states"][0][-1] == KVPoll.Failed
    with pytest.raises(pdd.PDDTransferError, match="aborted by the prefill side"):
        senders[0].failure_exception()
    assert "aborted by the prefill side" in result["errors"][0]
    assert np.count_nonzero(result["pools"][0][0]) == 0  # nothing was applied


def test_decode_abort_fails_prefill(run_decode):
    port, room = _free_port(), 78
    out = run_decode(d_tp=1, total_heads=2, port=port, room=room, d_pages=[1, 2], d_aux=0, prefix_len=0,
                     abort_decode=True)
    server = pdd.PDDKVBootstrapServer("127.0.0.1", port)
    mgr = pdd.PDDKVManager(Rank(mla=False, heads=2, total_heads=2, rank=0).args, "prefill", _server_args(port))
    try:
        result = _receive(out)
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


@pytest.mark.parametrize("connection", ["open", "dropped"])
def test_a_sender_failing_while_its_peer_is_frozen_returns_at_once_and_frees_its_buffers_later(
        run_decode, decode_process, monkeypatch, connection):
    """The decode process is stopped (SIGSTOP) once it registered. With the prefill's
    connection to it open, the write goes out and its cancel waits for a fence the frozen peer
    cannot confirm; with that connection dropped, the write's post waits on a reconnect the
    frozen peer cannot answer, and so would the failure notice (each up to the engine's
    timeout_s). Either way the abort on SGLang's scheduler thread returns while the peer is
    still frozen, with the write's staging buffer still out; once the peer runs again the
    buffer goes back to the pool, with no further poll(), and the decode side is told."""
    port, room = _free_port(), 79 if connection == "open" else 80
    _, decode_pid = decode_process
    out = run_decode(d_tp=1, total_heads=2, port=port, room=room, d_pages=[1, 2, 3, 6], d_aux=0, prefix_len=0)
    server = pdd.PDDKVBootstrapServer("127.0.0.1", port)
    mgr = pdd.PDDKVManager(Rank(mla=False, heads=2, total_heads=2, rank=0, fill=_fill(False, 2, 1)).args, "prefill",
                           _server_args(port))
    acquired, released = [], []
    acquire, release = mgr.staging.acquire, mgr.staging.release
    monkeypatch.setattr(mgr.staging, "acquire", lambda *a, **k: acquired.append(acquire(*a, **k)) or acquired[-1])
    monkeypatch.setattr(mgr.staging, "release", lambda buf: released.append(buf) or release(buf))
    posted = threading.Event()
    write_batch = mgr.engine.write_batch
    monkeypatch.setattr(mgr.engine, "write_batch", lambda *a, **k: (write_batch(*a, **k), posted.set())[0])
    frozen = False
    try:
        sender = pdd.PDDKVSender(mgr, f"127.0.0.1:{port}", room)
        _wait(lambda: sender.poll() == KVPoll.WaitingForInput)  # the decode rank registered
        writing, write = threading.Event(), sender._write  # what the poster calls to post
        monkeypatch.setattr(sender, "_write", lambda *a: writing.set() or write(*a))
        os.kill(decode_pid, signal.SIGSTOP)
        frozen = True
        if connection == "dropped":
            mgr.peers.connect(mgr.inbox(room).registrations[0].peer_address).close()
        sender.init(4, aux_index=5)
        sender.send(np.array([4, 5], dtype=np.int32))  # the first of two chunks: the decode side cannot finish
        assert len(acquired) == 1
        # The poster is in the write: sending from the buffer, or reconnecting first
        _wait(posted.is_set if connection == "open" else writing.is_set)
        sender.abort()
        assert sender.poll() == KVPoll.Failed
        assert released == []  # returned while the peer is frozen: the transfer may still read the buffer
        os.kill(decode_pid, signal.SIGCONT)
        frozen = False
        _wait(lambda: released == acquired)  # handed back by the poster's threads, nobody polls
        result = _receive(out)
        assert result["states"][0][-1] == KVPoll.Failed and "aborted by the prefill side" in result["errors"][0]
    finally:
        if frozen:
            os.kill(decode_pid, signal.SIGCONT)
        mgr.close()
        server.close()


def prefill_side(cmd: dict, out) -> None:
    """Child process: a bootstrap server and one prefill rank (TP 1, two KV heads) with a sender
    for one room; reports its engine's address, then the sender's state once the decode rank
    registered, then how the sender ended."""
    torch.set_num_threads(1)
    server = pdd.PDDKVBootstrapServer("127.0.0.1", cmd["port"])
    mgr = pdd.PDDKVManager(Rank(mla=False, heads=2, total_heads=2, rank=0).args, "prefill", _server_args(cmd["port"]))
    try:
        sender = pdd.PDDKVSender(mgr, f"127.0.0.1:{cmd['port']}", cmd["room"])
        out.send({"address": mgr.engine.address})
        deadline = time.monotonic() + 120
        while sender.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
            time.sleep(0.005)
        out.send({"registered": sender.poll()})
        while sender.poll() not in TERMINAL and time.monotonic() < deadline:
            time.sleep(0.005)
        out.send({"state": sender.poll(), "failure": sender._failure})
    except Exception as exc:  # report instead of hanging the parent
        out.send({"crash": repr(exc)})
    finally:
        mgr.close()
        server.close()


@pytest.fixture
def prefill_process(loopback_data_address):
    """A function that starts :func:`prefill_side` for ``(port, room)`` in a process of its own
    and returns that process's pipe and pid."""
    ctx = mp.get_context("spawn")
    procs = []

    def start(port: int, room: int):
        parent, child = ctx.Pipe()
        procs.append(ctx.Process(target=prefill_side, args=({"port": port, "room": room}, child), daemon=True))
        procs[-1].start()
        return parent, procs[-1].pid

    yield start
    for proc in procs:
        os.kill(proc.pid, signal.SIGCONT)  # never leave it stopped, whatever a test did
        proc.join(30)
        if proc.is_alive():
            proc.kill()


class _Frozen:
    """SIGSTOPs ``pid`` on entry; SIGCONTs it by :meth:`resume` or, whatever happened, on exit."""

    def __init__(self, pid: int):
        self.pid, self.frozen = pid, False

    def __enter__(self) -> "_Frozen":
        os.kill(self.pid, signal.SIGSTOP)
        self.frozen = True
        return self

    def resume(self) -> None:
        if self.frozen:
            os.kill(self.pid, signal.SIGCONT)
            self.frozen = False

    def __exit__(self, *exc) -> None:
        self.resume()


def _registered_receiver(decode, port: int, room: int, pipe) -> "pdd.PDDKVReceiver":
    """A receiver on ``decode`` for ``room`` of the prefill process behind ``pipe``
    (:func:`prefill_side`), once that prefill reported the registration."""
    receiver = pdd.PDDKVReceiver(decode, f"127.0.0.1:{port}", room, timeout_s=60)
    _wait(lambda: receiver.poll() != KVPoll.Bootstrapping)
    receiver.send_metadata(np.array([1, 2], dtype=np.int32), aux_index=0)
    assert _receive(pipe)["registered"] == KVPoll.WaitingForInput
    return receiver


def test_a_receiver_failing_while_its_prefill_is_frozen_returns_at_once_and_tells_it_later(
        prefill_process, monkeypatch):
    """The prefill process is stopped (SIGSTOP) once the decode rank registered, and the decode
    side's connection to it dropped: the failure notice must reconnect first, which the frozen
    peer cannot answer (up to the engine's timeout_s). abort() on SGLang's scheduler thread
    returns before that connect does, with the request Failed; once the peer runs again the
    notice reaches it and its sender fails with the decode side's reason."""
    port, room = _free_port(), 81
    pipe, prefill_pid = prefill_process(port, room)
    prefill_address = _receive(pipe)["address"]
    decode = pdd.PDDKVManager(Rank(mla=False, heads=2, total_heads=2, rank=0, publish_heads=False).args, "decode",
                              _server_args(_free_port()))
    try:
        receiver = _registered_receiver(decode, port, room, pipe)
        connects = Connects(monkeypatch, decode.engine, prefill_address)
        with _Frozen(prefill_pid) as frozen:
            decode.peers.connect(prefill_address).close()
            receiver.abort()
            assert receiver.poll() == KVPoll.Failed
            assert not connects.ended.is_set()  # returned while the notice's reconnect waits on the frozen peer
            _wait(connects.started.is_set)  # the notice is on its way, from another thread
            frozen.resume()
        result = _receive(pipe)
        assert result["state"] == KVPoll.Failed and "aborted by the decode side" in result["failure"], result
    finally:
        decode.close()


def test_the_message_thread_serves_other_peers_while_a_reconnect_waits_on_a_frozen_one(
        prefill_process, monkeypatch):
    """A decode manager knows two prefill engines: one in a process that is stopped (SIGSTOP)
    after the decode rank registered with it, its connection dropped and a reconnect to it
    waiting on another thread (up to the engine's timeout_s), and one running here. The
    manager's message thread checks each chunk notice's sender (``Peers.is_from``) and must
    complete a request from the running prefill before that reconnect returns."""
    port, room = _free_port(), 82
    pipe, prefill_pid = prefill_process(port, room)
    frozen_address = _receive(pipe)["address"]
    pair = Pair()
    try:
        receiver = _registered_receiver(pair.decode, port, room, pipe)
        connects = Connects(monkeypatch, pair.decode.engine, frozen_address)
        with _Frozen(prefill_pid):
            pair.decode.peers.connect(frozen_address).close()
            reconnect = threading.Thread(target=pair.decode.peers.connect, args=(frozen_address,), daemon=True)
            reconnect.start()
            _wait(connects.started.is_set)
            assert pair.move(room + 1, [3, 4], [5, 6]) == (KVPoll.Success, KVPoll.Success)
            assert not connects.ended.is_set()  # served while the reconnect still waits on the frozen peer
        reconnect.join()
        receiver.abort()
        result = _receive(pipe)
        assert result["state"] == KVPoll.Failed and "aborted by the decode side" in result["failure"], result
    finally:
        pair.close()


def test_a_registration_from_a_rank_that_froze_before_the_first_connect_holds_up_no_other_room(
        run_decode, decode_process, monkeypatch):
    """A decode rank registers with a prefill manager that never connected to it, and is stopped
    (SIGSTOP) before the manager's message thread reads the registration: whether it comes
    from the address it names takes a connect to the frozen rank (up to the engine's
    timeout_s). Meanwhile the message thread must serve another room, with a decode rank that
    runs; once the frozen rank runs again its registration is filed and its request goes on."""
    _, decode_pid = decode_process
    pair = Pair()
    gating, arrived, release, senders = threading.Event(), threading.Event(), threading.Event(), []
    poll = pair.prefill.engine.poll_messages

    def gated(*args, **kwargs):  # holds the first messages until the test froze their sender
        gating.set()
        messages = poll(*args, **kwargs)
        if messages and not release.is_set():
            senders.extend(message.sender for message in messages)
            arrived.set()
            release.wait(60)
        return messages

    monkeypatch.setattr(pair.prefill.engine, "poll_messages", gated)
    room = 83
    try:
        _wait(gating.is_set)  # the message thread's poll under way before the patch has returned
        out = run_decode(d_tp=1, total_heads=2, port=pair.port, room=room, d_pages=[1, 2], d_aux=0, prefix_len=0)
        frozen_sender = pdd.PDDKVSender(pair.prefill, pair.addr, room)
        _wait(arrived.is_set, 120)  # the decode process starts (imports) first
        with _Frozen(decode_pid):
            connects = Connects(monkeypatch, pair.prefill.engine, senders[0])
            release.set()
            _wait(connects.started.is_set)  # the check of the registration's address waits on the frozen rank
            assert pair.move(room + 1, [3, 4], [5, 6]) == (KVPoll.Success, KVPoll.Success)
            assert not connects.ended.is_set()  # served while that connect still waits
            assert frozen_sender.poll() == KVPoll.Bootstrapping
        _wait(lambda: frozen_sender.poll() == KVPoll.WaitingForInput)  # its registration, filed
        frozen_sender.abort()
        result = _receive(out)
        assert result["states"][0][-1] == KVPoll.Failed and "aborted by the prefill side" in result["errors"][0]
    finally:
        release.set()
        pair.close()


# ---- one process: both sides' managers side by side -------------------------------------------------

class Pair:
    """A bootstrap server, one prefill and one decode manager (TP 1, two KV heads) in this
    process, their pools on ``device``."""

    def __init__(self, fill_seed: int = 3, device: str = "cpu", **server_overrides):
        self.port = _free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.server = pdd.PDDKVBootstrapServer("127.0.0.1", self.port)
        self.fill = _fill(False, 2, fill_seed)
        self.src = Rank(mla=False, heads=2, total_heads=2, rank=0, fill=self.fill, device=device)
        self.dst = Rank(mla=False, heads=2, total_heads=2, rank=0, publish_heads=False, device=device)
        kind = torch.device(device).type
        self.prefill = pdd.PDDKVManager(self.src.args, "prefill",
                                        _server_args(self.port, **{"device": kind, **server_overrides}))
        self.decode = pdd.PDDKVManager(self.dst.args, "decode", _server_args(_free_port(), device=kind))

    def start(self, room: int) -> tuple[pdd.PDDKVSender, pdd.PDDKVReceiver]:
        """A sender and a receiver for ``room``, the receiver past bootstrapping."""
        sender = pdd.PDDKVSender(self.prefill, self.addr, room)
        receiver = pdd.PDDKVReceiver(self.decode, self.addr, room, timeout_s=60)
        _wait(lambda: receiver.poll() != KVPoll.Bootstrapping)
        return sender, receiver

    def move(self, room: int, src_pages: list[int], dst_pages: list[int]) -> tuple[int, int]:
        """Moves ``src_pages`` into ``dst_pages`` for ``room``; returns both sides' final states."""
        sender, receiver = self.start(room)
        receiver.send_metadata(np.array(dst_pages, dtype=np.int32), aux_index=1)
        _wait(lambda: sender.poll() != KVPoll.Bootstrapping)
        sender.init(len(src_pages), aux_index=0)
        sender.send(np.array(src_pages, dtype=np.int32))
        _wait(lambda: sender.poll() in TERMINAL and receiver.poll() in TERMINAL)
        states = sender.poll(), receiver.poll()
        sender.clear()
        receiver.clear()
        return states

    def pages(self) -> torch.Tensor:
        """The prefill pool's content as ``[planes, pages, PAGE, heads, dim]``, planes ordered as
        SGLang lists them (all K layers, then all V layers)."""
        return self.fill.transpose(0, 1).reshape(2 * LAYERS, -1, PAGE, 2, HEAD_DIM)

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()
        self.server.close()


def _wait(condition, deadline_s: float = 30) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def test_kv_device_follows_server_args_and_gpu_id():
    args = conn.KVArgs()
    args.gpu_id = 3
    assert pdd.kv_device(args, ServerArgs(model_path="m", device="cpu")) == torch.device("cpu")
    assert pdd.kv_device(args, ServerArgs(model_path="m", device="cuda")) == torch.device("cuda", 3)
    assert pdd.kv_device(args, ServerArgs(model_path="m")) == torch.device("cuda", 3)  # unresolved: SGLang's default
    with pytest.raises(ValueError, match="cpu or cuda, not on 'npu'"):
        pdd.kv_device(args, ServerArgs(model_path="m", device="npu"))


def test_manager_layout_is_on_the_kv_device(pair):
    assert pair.prefill.layout.device == torch.device("cpu") and pair.prefill.staging.kv_device.type == "cpu"
    rank = Rank(mla=False, heads=2, total_heads=2, rank=0)
    rank.args.gpu_id = 1
    gpu_args = _server_args(_free_port(), device="cuda")
    # A layout over CUDA pointers is only described here (nothing is read without a GPU): the
    # manager must say where the pool is rather than leave it to a CPU default.
    try:
        mgr = pdd.PDDKVManager(rank.args, "decode", gpu_args)
    except (RuntimeError, ValueError) as exc:  # a CPU-only torch may refuse to describe a CUDA pool at all
        assert "cuda" in str(exc).lower(), exc
    else:
        assert mgr.layout.device == torch.device("cuda", 1)
        mgr.close()


def _thread_role(name: str) -> str:
    return {"MainThread": "scheduler", "pdd-post": "poster", "pdd-decode": "message pump"}[name.rpartition("-")[0] or name]


def test_every_cuda_path_runs_on_the_kv_gpu(pair, monkeypatch):
    """Prefill KV on GPU 3, decode KV on GPU 2 (torch.cuda stood in for, the bytes on the CPU):
    the sender packs and records an event after the pack with GPU 3 current on the scheduler
    thread, and its manager's posting thread waits on that event with GPU 3 current; the decode
    side unpacks on the manager's message thread, where no GPU is current unless the backend
    makes its own so, on the manager's own unpack stream of GPU 2 (not the default stream
    SGLang's forward runs on), and waits on an event after the unpack, never on a whole stream."""
    from fake_cuda import FakeCuda

    from pddcore.integrations.sglang import receiver as receiver_module
    from pddcore.integrations.sglang import sender as sender_module

    cuda = FakeCuda(monkeypatch)
    cuda.watch(monkeypatch, sender_module, "pack")
    cuda.watch(monkeypatch, receiver_module, "unpack")
    assert pair.move(90, [1], [1]) == (KVPoll.Success, KVPoll.Success)  # the decode side built its layout
    cuda.calls.clear()
    cuda.streams.clear()
    cuda.threads.clear()
    p_gpu, d_gpu = torch.device("cuda", 3), torch.device("cuda", 2)
    pair.prefill.device, pair.decode.device = p_gpu, d_gpu
    for room, (src, dst) in enumerate([([3, 4], [5, 6]), ([7], [8])], start=91):
        assert pair.move(room, src, dst) == (KVPoll.Success, KVPoll.Success)
        assert torch.equal(torch.from_numpy(pair.dst.snapshot()).view(torch.bfloat16)[:, dst], pair.pages()[:, src])
    seen = {(name, _thread_role(thread), device) for (name, device), (_, thread) in zip(cuda.calls, cuda.threads)}
    assert seen == {("pack", "scheduler", p_gpu), ("record", "scheduler", p_gpu), ("event synchronize", "poster", p_gpu),
                    ("unpack", "message pump", d_gpu), ("record", "message pump", d_gpu),
                    ("event synchronize", "message pump", d_gpu)}, seen
    assert [s.device for s in cuda.made_streams] == [d_gpu]  # one unpack stream, made once
    decode_side = {(name, stream) for (name, stream), (_, thread) in zip(cuda.streams, cuda.threads)
                   if _thread_role(thread) == "message pump" and name != "event synchronize"}
    assert decode_side == {("unpack", "stream 0"), ("record", "stream 0")}, cuda.streams
    pump = [name for name, thread in cuda.threads if _thread_role(thread) == "message pump"]
    assert pump[-3:] == ["unpack", "record", "event synchronize"]


def test_the_sender_never_waits_on_the_gpu_and_posts_each_write_once_its_pack_ran(pair, monkeypatch):
    """SGLang's scheduler thread calls send() with the early-send event of a forward that may
    still write the pages, while the GPU has run nothing yet (torch.cuda stood in for, KV on
    GPU 3): send() returns without waiting on the GPU (the pack's stream waits for the forward's
    event, and an event is recorded after the pack); no write is posted while that event is
    pending; the manager's posting thread waits on it and then posts the write, and the pages
    arrive."""
    from fake_cuda import FakeCuda

    from pddcore.integrations.sglang import sender as sender_module

    cuda = FakeCuda(monkeypatch)
    cuda.watch(monkeypatch, sender_module, "pack")
    cuda.watch(monkeypatch, pair.prefill.engine, "write_batch", "write")
    p_gpu = torch.device("cuda", 3)
    pair.prefill.device = p_gpu
    sender, receiver = pair.start(96)
    receiver.send_metadata(np.array([5, 6], dtype=np.int32), aux_index=1)
    _wait(lambda: sender.poll() != KVPoll.Bootstrapping)
    sender.init(2, aux_index=0)
    cuda.events_done = False  # neither the forward nor the pack runs until the end; a wait here would never end
    forward_done = torch.cuda.Event()
    forward_done.record(torch.cuda.Stream(p_gpu))  # SGLang's forward stream
    sender._early_send_wait_event = forward_done
    cuda.calls.clear()
    cuda.streams.clear()
    cuda.threads.clear()
    try:
        sender.send(np.array([3, 4], dtype=np.int32))
        scheduler = [(name, stream) for (name, stream), (_, thread) in zip(cuda.streams, cuda.threads)
                     if thread == "MainThread"]
        assert scheduler == [("stream wait event", "default"), ("pack", "default"), ("record", "default")]
        assert {device for _, device in cuda.calls} == {p_gpu}
        assert "write" not in [name for name, _ in cuda.calls]  # the posting thread waits for the pack
        assert sender.poll() == KVPoll.Transferring and receiver.poll() == KVPoll.Transferring
    finally:
        cuda.events_done = True  # else the posting thread would wait for good
    _wait(lambda: sender.poll() in TERMINAL and receiver.poll() in TERMINAL)
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
    assert torch.equal(torch.from_numpy(pair.dst.snapshot()).view(torch.bfloat16)[:, [5, 6]], pair.pages()[:, [3, 4]])
    names = [name for name, _ in cuda.threads]
    assert names == ["stream wait event", "pack", "record", "event synchronize", "write"], cuda.threads
    assert {_thread_role(thread) for _, thread in cuda.threads[3:]} == {"poster"}
    sender.clear()
    receiver.clear()


def test_staging_buffers_are_registered_once_and_reused(pair):
    registered = {"prefill": 0, "decode": 0}
    for side in registered:
        engine = getattr(pair, side).engine
        original = engine.register

        def counting(memory, _side=side, _original=original, **kwargs):
            registered[_side] += 1
            return _original(memory, **kwargs)

        engine.register = counting
    for room, (src, dst) in enumerate([([3, 4], [5, 6]), ([7, 8], [1, 2]), ([9], [10])], start=500):
        assert pair.move(room, src, dst) == (KVPoll.Success, KVPoll.Success)
    assert registered == {"prefill": 1, "decode": 1}  # three requests, one pooled buffer per side
    got, want = torch.from_numpy(pair.dst.snapshot()).view(torch.bfloat16), pair.pages()
    for src, dst in ([3, 4], [5, 6]), ([7, 8], [1, 2]), ([9], [10]):
        assert torch.equal(got[:, dst], want[:, src])


def test_malformed_messages_fail_only_the_room_they_name(pair):
    victim_sender, victim = pair.start(31)
    rogue = TransferEngine(listen="127.0.0.1:0")
    try:
        garbage = [b"not ours at all", pdd._MAGIC + b"{not json", pdd._MAGIC + b"\xff\xfe",
                   pdd._MAGIC + b"[1, 2]", pdd._encode("reg", room="31"), pdd._encode("chunk"),
                   pdd._encode("chunk", room=99, src="0", idx=0, last=True),
                   pdd._encode("what", room=31)]
        for target in (pair.decode, pair.prefill):
            peer = rogue.connect(target.engine.address)
            for payload in garbage:
                rogue.send(peer, payload)
        _wait(lambda: victim.poll() == KVPoll.Failed and victim_sender.poll() == KVPoll.Failed)
        with pytest.raises(pdd.PDDTransferError, match="unknown message kind 'what'"):
            victim.failure_exception()
        with pytest.raises(pdd.PDDTransferError, match="unknown message kind 'what'"):
            victim_sender.failure_exception()
        assert "mistyped src" in pair.decode.inbox(99).failure  # room 99 was named, so it is failed too
    finally:
        rogue.close()
    # Both pumps still run: the next request moves its pages.
    assert pair.move(32, [2, 6], [4, 8]) == (KVPoll.Success, KVPoll.Success)
    got = torch.from_numpy(pair.dst.snapshot()).view(torch.bfloat16)
    assert torch.equal(got[:, [4, 8]], pair.pages()[:, [2, 6]])


def test_an_unread_notice_to_a_rank_that_is_read_fails_its_room(pair):
    """``unread`` tells an MLA prefill rank that no decode rank reads it; sent to a rank that is
    read (here an MHA prefill), it fails that room with the reason instead of leaving the
    decode side without its KV."""
    sender = pdd.PDDKVSender(pair.prefill, pair.addr, 33)
    rogue = TransferEngine(listen="127.0.0.1:0")
    try:
        rogue.send(rogue.connect(pair.prefill.engine.address),
                   pdd._encode("unread", room=33, d_rank=0, d_tp=1, num_pages=2, decode_prefix_len=0))
        _wait(lambda: sender.poll() == KVPoll.Failed)
        with pytest.raises(pdd.PDDTransferError, match="says no decode rank reads prefill rank 0"):
            sender.failure_exception()
    finally:
        rogue.close()
        sender.clear()


def test_forged_chunk_notice_is_ignored(pair):
    """A well-formed "last chunk" notice for a live room from an engine that is not the room's
    prefill rank does not complete it: the receiver waits for the real chunk, whose bytes land."""
    sender, receiver = pair.start(41)
    receiver.send_metadata(np.array([3, 7], dtype=np.int32), aux_index=1)
    _wait(lambda: sender.poll() != KVPoll.Bootstrapping)
    before = torch.from_numpy(pair.dst.snapshot()).view(torch.bfloat16)[:, [3, 7]].clone()
    seen = pair.decode.engine.stats()["messages_received"]
    with TransferEngine(listen="127.0.0.1:0") as rogue:
        rogue.send(rogue.connect(pair.decode.engine.address), pdd._encode("chunk", room=41, src=0, idx=0, last=True))
        _wait(lambda: pair.decode.engine.stats()["messages_received"] > seen)
        time.sleep(0.2)  # the pump has acted on it
        assert receiver.poll() == KVPoll.Transferring
        assert torch.equal(torch.from_numpy(pair.dst.snapshot()).view(torch.bfloat16)[:, [3, 7]], before)
    sender.init(2, aux_index=0)
    sender.send(np.array([5, 9], dtype=np.int32))
    _wait(lambda: sender.poll() in TERMINAL and receiver.poll() in TERMINAL)
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
    got = torch.from_numpy(pair.dst.snapshot()).view(torch.bfloat16)
    assert torch.equal(got[:, [3, 7]], pair.pages()[:, [5, 9]])
    sender.clear()
    receiver.clear()


def test_state_indices_fail_the_request_instead_of_raising(pair):
    sender, receiver = pair.start(41)
    receiver.send_metadata(np.array([1], dtype=np.int32), state_indices=[[3]])  # a Mamba slot, say
    assert receiver.poll() == KVPoll.Failed
    with pytest.raises(pdd.PDDTransferError, match="state_indices"):
        receiver.failure_exception()
    sender2, receiver2 = pair.start(42)
    receiver2.send_metadata(np.array([1], dtype=np.int32))
    _wait(lambda: sender2.poll() == KVPoll.WaitingForInput)
    sender2.init(1)
    sender2.send(np.array([2], dtype=np.int32), state_indices=[None, [5, 6]])
    assert sender2.poll() == KVPoll.Failed
    with pytest.raises(pdd.PDDTransferError, match="state_indices"):
        sender2.failure_exception()
    _wait(lambda: receiver2.poll() == KVPoll.Failed)  # the decode side was told
    assert np.count_nonzero(pair.dst.snapshot()) == 0
    sender.clear()
    receiver.clear()


def test_a_request_the_staging_arena_cannot_hold_fails_both_sides(monkeypatch):
    """Each rank's staging arena is allocated when its manager starts, sized by
    PDDCORE_SGLANG_STAGING_BYTES; with the decode rank's arena held by another request, the next
    one fails on both sides naming that setting, and once the arena is free a request moves."""
    monkeypatch.setenv("PDDCORE_SGLANG_STAGING_BYTES", str(64 << 10))
    pair = Pair()
    try:
        assert pair.decode.staging.capacity_bytes == 64 << 10
        held = pair.decode.staging.acquire(1, target=True)  # the whole arena
        sender, receiver = pair.start(43)
        receiver.send_metadata(np.array([5, 6], dtype=np.int32))
        assert receiver.poll() == KVPoll.Failed
        with pytest.raises(pdd.PDDTransferError, match="PDDCORE_SGLANG_STAGING_BYTES"):
            receiver.failure_exception()
        _wait(lambda: sender.poll() == KVPoll.Failed)  # the prefill side was told
        sender.clear()
        receiver.clear()
        pair.decode.staging.release(held)
        assert pair.move(44, [3, 4], [5, 6]) == (KVPoll.Success, KVPoll.Success)
        assert torch.equal(torch.from_numpy(pair.dst.snapshot()).view(torch.bfloat16)[:, [5, 6]], pair.pages()[:, [3, 4]])
    finally:
        pair.close()


def test_failed_write_fails_both_sides(pair):
    """The decode staging region disappears before prefill writes: the engine rejects the write,
    the sender fails and tells the receiver; neither side applies anything."""
    sender, receiver = pair.start(21)
    receiver.send_metadata(np.array([1, 2], dtype=np.int32))
    _wait(lambda: sender.poll() != KVPoll.Bootstrapping)
    pair.decode.engine.unregister(receiver._staging.region)  # the fault: the destination is gone
    sender.init(2)
    sender.send(np.array([3, 4], dtype=np.int32))
    _wait(lambda: (sender.poll(), receiver.poll()) == (KVPoll.Failed, KVPoll.Failed))
    with pytest.raises(pdd.PDDTransferError, match="transfer failed"):
        sender.failure_exception()
    with pytest.raises(pdd.PDDTransferError, match="transfer failed"):
        receiver.failure_exception()
    assert np.count_nonzero(pair.dst.snapshot()) == 0


def test_decode_times_out_without_prefill():
    mgr = pdd.PDDKVManager(Rank(mla=False, heads=2, total_heads=2, rank=0).args, "decode", _server_args(_free_port()))
    try:
        nobody = f"127.0.0.1:{_free_port()}"
        assert not mgr.try_ensure_parallel_info(nobody) and nobody not in mgr.prefill_info_table
        receiver = pdd.PDDKVReceiver(mgr, nobody, 5, timeout_s=0.2)
        assert receiver.poll() == KVPoll.Bootstrapping
        with pytest.raises(RuntimeError, match="need WaitingForInput"):
            receiver.send_metadata(np.array([1], dtype=np.int32))
        _wait(lambda: receiver.poll() == KVPoll.Failed)
        with pytest.raises(pdd.PDDTransferError, match="timed out in state 1"):
            receiver.failure_exception()
    finally:
        mgr.close()


def test_decode_rejects_a_prefill_pool_of_another_shape():
    port = _free_port()
    server = pdd.PDDKVBootstrapServer("127.0.0.1", port)
    prefill = pdd.PDDKVManager(Rank(mla=False, heads=2, total_heads=2, rank=0).args, "prefill", _server_args(port))
    one_head = Rank(mla=False, heads=1, total_heads=1, rank=0)  # a decode that says it has 1 KV head in all
    decode = pdd.PDDKVManager(one_head.args, "decode", _server_args(_free_port()))
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


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_unsupported_deployments_are_refused_at_start(mode):
    """DP attention, pipeline parallelism and an EAGLE draft pool appended to kv_data_ptrs (as
    SGLang's queues append it) are refused when the manager is built, with what to use instead;
    nothing listens or registers."""
    rank = Rank(mla=False, heads=2, total_heads=2, rank=0)
    draft = Rank(mla=False, heads=2, total_heads=2, rank=0)
    with_draft = conn.KVArgs()
    for name, value in vars(rank.args).items():
        setattr(with_draft, name, value)
    ptrs, lens, items = draft.pool.get_contiguous_buf_infos()
    with_draft.kv_data_ptrs, with_draft.kv_data_lens = rank.args.kv_data_ptrs + ptrs, rank.args.kv_data_lens + lens
    with_draft.kv_item_lens, with_draft.num_draft_entries = rank.args.kv_item_lens + items, len(ptrs)
    port = _free_port()
    cases = [(rank.args, _server_args(port, 2, enable_dp_attention=True, dp_size=2), "DP attention"),
             (rank.args, _server_args(port, pp_size=2), "pipeline parallelism"),
             (with_draft, _server_args(port), "draft KV pool")]
    for args, server_args, what in cases:
        with pytest.raises(ValueError, match=f"does not support .*{what}.*mooncake or nixl"):
            pdd.PDDKVManager(args, mode, server_args)


def test_sender_refuses_calls_out_of_order(pair):
    sender = pdd.PDDKVSender(pair.prefill, pair.addr, 9)
    with pytest.raises(RuntimeError, match="before the decode side registered"):
        sender.init(2)
    with pytest.raises(RuntimeError, match="before init"):
        sender.send(np.array([1], dtype=np.int32))


def send_segments(sender: pdd.PDDKVSender, segments: list[tuple[list[int], bool]]) -> None:
    """What SGLang's prefill ``_send_kv_chunk`` does per segment: asks ``should_send_kv_chunk``
    with the segment's page count and whether it is the request's last, and sends only then."""
    for pages, last in segments:
        if sender.should_send_kv_chunk(len(pages), last):
            sender.send(np.array(pages, dtype=np.int32))


def test_an_empty_last_chunk_closes_the_stream_and_carries_the_aux_item(pair):
    """The decode side's prefix cache held every page: prefill's only segment is a last one with
    no pages. It still goes out, both sides succeed and the aux item lands; a chunk that already
    completed the pages, followed by an empty last segment, closes the stream once."""
    pair.src.aux[0] = torch.arange(AUX_ITEM, dtype=torch.uint8) + 1
    sender, receiver = pair.start(71)
    receiver.send_metadata(np.array([], dtype=np.int32), aux_index=1, decode_prefix_len=8)
    _wait(lambda: sender.poll() != KVPoll.Bootstrapping)
    assert sender.pop_decode_prefix_len() == 8
    sender.init(0, aux_index=0)
    send_segments(sender, [([], True)])
    _wait(lambda: sender.poll() in TERMINAL and receiver.poll() in TERMINAL)
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
    assert torch.equal(pair.dst.aux[1], pair.src.aux[0])
    sender.clear()
    receiver.clear()

    sender, receiver = pair.start(72)
    receiver.send_metadata(np.array([5, 6], dtype=np.int32), aux_index=2)
    _wait(lambda: sender.poll() != KVPoll.Bootstrapping)
    sender.init(2, aux_index=0)
    send_segments(sender, [([3, 4], False), ([], True)])
    _wait(lambda: sender.poll() in TERMINAL and receiver.poll() in TERMINAL)
    assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
    assert len(pair.decode.inbox(72).chunks[0]) == 1  # one chunk, which was the last
    got = torch.from_numpy(pair.dst.snapshot()).view(torch.bfloat16)
    assert torch.equal(got[:, [5, 6]], pair.pages()[:, [3, 4]]) and torch.equal(pair.dst.aux[2], pair.src.aux[0])


def test_sender_fails_once_the_bootstrap_timeout_passes(monkeypatch):
    """A prefill request whose decode side never registers fails after
    SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT seconds, as with SGLang's own senders."""
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "1")
    p = Pair()
    try:
        assert p.prefill.bootstrap_timeout_s == 1.0
        sender = pdd.PDDKVSender(p.prefill, p.addr, 81)
        assert sender.poll() == KVPoll.Bootstrapping
        _wait(lambda: sender.poll() != KVPoll.Bootstrapping)
        assert sender.poll() == KVPoll.Failed and time.monotonic() - sender._started >= 1.0
        with pytest.raises(pdd.PDDTransferError, match="SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"):
            sender.failure_exception()
    finally:
        p.close()


# ---- addresses -------------------------------------------------------------------------------------

def test_wildcard_host_advertises_the_local_ip(monkeypatch):
    from sglang.srt.utils.network import get_local_ip_auto

    monkeypatch.delenv(pdd.HOST_ENV)
    monkeypatch.setenv("PDDCORE_AUTH_TOKEN", "sglang-test-token-2f8e5b1d7a4c9063")  # an engine beyond loopback requires one
    try:
        local_ip = get_local_ip_auto()
    except ValueError as exc:
        pytest.skip(f"SGLang finds no local IP on this machine: {exc}")
    port = _free_port()
    server = pdd.PDDKVBootstrapServer("0.0.0.0", port)
    args = _server_args(port)
    args.host = "0.0.0.0"  # the HTTP server on every interface: registration goes to loopback
    prefill = pdd.PDDKVManager(Rank(mla=False, heads=2, total_heads=2, rank=0).args, "prefill", args)
    try:
        assert prefill.engine.address.rpartition(":")[0] == local_ip not in ("0.0.0.0", "127.0.0.1")
        table = pdd._http("GET", f"http://127.0.0.1:{port}/route")
        assert table["ranks"] == {"0": prefill.engine.address}
    finally:
        prefill.close()
        server.close()
    monkeypatch.setenv(pdd.HOST_ENV, "0.0.0.0")
    with pytest.raises(ValueError, match="wildcard"):
        pdd.advertised_host()


def test_bootstrap_registration_goes_to_dist_init_addr_and_retries(monkeypatch):
    port = _free_port()
    # --host names an address nobody listens on; multi-node SGLang registers at dist_init_addr's host.
    args = _server_args(port, dist_init_addr="localhost:29500")
    args.host = "192.0.2.123"
    assert pdd.bootstrap_url(args) == f"http://127.0.0.1:{port}/route"
    monkeypatch.setattr(pdd.bootstrap, "_REGISTER_RETRY_DELAYS_S", (0.3, 0.3, 0.3))
    servers = []
    starter = threading.Timer(0.15, lambda: servers.append(pdd.PDDKVBootstrapServer("127.0.0.1", port)))
    starter.start()  # the server comes up after the first attempt failed
    try:
        mgr = pdd.PDDKVManager(Rank(mla=False, heads=2, total_heads=2, rank=0).args, "prefill", args)
        try:
            assert pdd._http("GET", f"http://127.0.0.1:{port}/route")["ranks"] == {"0": mgr.engine.address}
        finally:
            mgr.close()
    finally:
        starter.join()
        for server in servers:
            server.close()
    monkeypatch.setattr(pdd.bootstrap, "_REGISTER_RETRY_DELAYS_S", (0.01, 0.01))
    with pytest.raises(RuntimeError, match="could not register at the bootstrap server .* after 3 attempts"):
        pdd.PDDKVManager(Rank(mla=False, heads=2, total_heads=2, rank=0).args, "prefill", _server_args(_free_port()))


# ---- what SGLang calls ---------------------------------------------------------------------------

SGLANG_SRT = Path(conn.__file__).resolve().parents[2]
# Read by SGLang only behind hasattr/getattr or a feature the backend does not claim
# (SGLANG_DISAGG_STAGING_BUFFER, the prefill_complete allocation policy).
_OPTIONAL = {"require_staging", "mark_prefill_complete", "transfer_infos", "enable_all_cp_ranks_for_transfer",
             "attn_cp_rank", "attn_cp_size", "_early_send_wait_event"}


def test_backend_has_what_sglangs_queues_call(pair):
    sources = "".join((SGLANG_SRT / f).read_text() for f in ("disaggregation/prefill.py", "disaggregation/decode.py",
                                                            "disaggregation/utils.py", "managers/scheduler.py"))
    sender, receiver = pair.start(61)
    for obj, pattern in [(receiver, r"kv_receiver\.(\w+)"), (sender, r"disagg_kv_sender\.(\w+)"),
                         (receiver.kv_mgr, r"kv_receiver\.kv_mgr\.(\w+)")]:
        called = set(re.findall(pattern, sources)) - _OPTIONAL
        assert called, pattern  # the source still reads like this
        missing = sorted(name for name in called if not hasattr(obj, name))
        assert not missing, f"{type(obj).__name__} lacks {missing}"
    assert receiver.kv_mgr is pair.decode and sender.kv_mgr is pair.prefill
    assert receiver.conclude_state is None and receiver.bootstrap_infos == [pair.prefill.engine.address]
    receiver.ensure_abort_notified(force_arm=True)
    assert receiver.abort_notified
    _wait(lambda: sender.poll() == KVPoll.Failed)  # the notification reached the prefill
    receiver.abort()
    assert receiver.conclude_state == KVPoll.Failed and pair.decode.is_abort_release_safe(61, 1)


@pytest.mark.parametrize("hide_torchvision", [True, False])
def test_cli_accepts_the_backend_after_load_plugins(hide_torchvision):
    """SGLang's own CLI path, in a fresh interpreter: load_plugins() runs pddcore's entry point,
    then ``--disaggregation-transfer-backend pddcore`` must parse, with or without torchvision."""
    script = f"""
import argparse, sys
if {hide_torchvision}:
    sys.modules["torchvision"] = None  # as on a machine without it
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import ServerArgs
load_plugins()
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
ns = parser.parse_args(["--model-path", "m", "--disaggregation-mode", "prefill",
                        "--disaggregation-transfer-backend", "pddcore"])
print("backend=" + ServerArgs.from_cli_args(ns).disaggregation_transfer_backend)
"""
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "backend=pddcore" in proc.stdout, proc.stderr[-3000:]


def test_install_hooks_the_backend_classes():
    import sglang.srt.disaggregation.utils as disagg_utils

    pdd.install()
    backend = disagg_utils.TransferBackend("pddcore")
    assert disagg_utils.get_kv_class(backend, disagg_utils.KVClassType.SENDER) is pdd.PDDKVSender
    assert disagg_utils.get_kv_class(backend, disagg_utils.KVClassType.RECEIVER) is pdd.PDDKVReceiver
    assert disagg_utils.get_kv_class(disagg_utils.TransferBackend("fake"),
                                     disagg_utils.KVClassType.SENDER).__name__ == "FakeKVSender"


@pytest.mark.gpu
def test_generation_end_to_end_on_gpu(tmp_path, monkeypatch):
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

    pdd.install()
    monkeypatch.setenv("PDDCORE_AUTH_TOKEN", "gpu-test-token-7c3a9e5d1b8f2046")  # the engines' scheduler processes inherit it
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


@pytest.mark.gpu
def test_the_sender_on_gpu_packs_after_the_forward_without_waiting_for_it(monkeypatch):
    """SGLang's forward stream still runs (a long kernel, then the writes of the request's
    pages) when send() gets the early-send event after it: send() returns while that forward
    runs (the scheduler thread never waits on the GPU), and the decode side receives the pages
    as the forward wrote them (the pack ran after the forward, the write after the pack)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from pddcore import _C

    if _C.cuda_unusable_reason():
        pytest.skip(f"pddcore's CUDA kernels: {_C.cuda_unusable_reason()}")
    monkeypatch.setenv("PDDCORE_SGLANG_STAGING_BYTES", str(16 << 20))
    pair = Pair(device="cuda:0")
    try:
        assert pair.move(62, [1], [1]) == (KVPoll.Success, KVPoll.Success)  # warm: plans, registrations
        sender, receiver = pair.start(63)
        receiver.send_metadata(np.array([5, 6], dtype=np.int32), aux_index=1)
        _wait(lambda: sender.poll() == KVPoll.WaitingForInput)
        sender.init(2, aux_index=0)
        written = [torch.randn(2 * PAGE, *plane.shape[1:], device=plane.device).to(plane.dtype)
                   for plane in pair.src.planes]  # what the forward writes into pages 3 and 4
        torch.cuda.synchronize()
        forward = torch.cuda.Stream(torch.device("cuda", 0))
        with torch.cuda.stream(forward):
            torch.cuda._sleep(4_000_000_000)  # about 2 s of GPU time before the writes
            for plane, values in zip(pair.src.planes, written):
                plane[3 * PAGE:5 * PAGE].copy_(values)
            forward_done = torch.cuda.Event()
            forward_done.record(forward)
        sender._early_send_wait_event = forward_done
        sender.send(np.array([3, 4], dtype=np.int32))
        returned_while_the_forward_ran = not forward_done.query()
        _wait(lambda: sender.poll() in TERMINAL and receiver.poll() in TERMINAL)
        assert (sender.poll(), receiver.poll()) == (KVPoll.Success, KVPoll.Success)
        assert returned_while_the_forward_ran
        got = torch.from_numpy(pair.dst.snapshot())[:, [5, 6]]
        want = torch.stack([values.view(torch.int16).cpu() for values in written]).view(got.shape)
        assert torch.equal(got, want)
        sender.clear()
        receiver.clear()
    finally:
        torch.cuda.synchronize()
        pair.close()


@pytest.mark.gpu
def test_the_decode_unpack_on_gpu_waits_for_itself_not_for_the_default_stream(monkeypatch):
    """GPU, SGLang's pools on cuda:0: a long kernel is queued on the default stream (where
    SGLang's scheduler queues its forward pass) and the prefill side packs on a stream of its
    own. The decode side's unpack, on the manager's message thread, runs on the backend's unpack
    stream and waits on an event after it, so the request reaches Success while that kernel
    still runs, with the pages in place (waiting on the default stream would end only after it)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from pddcore import _C

    if _C.cuda_unusable_reason():
        pytest.skip(f"pddcore's CUDA kernels: {_C.cuda_unusable_reason()}")
    monkeypatch.setenv("PDDCORE_SGLANG_STAGING_BYTES", str(16 << 20))
    pair = Pair(device="cuda:0")
    try:
        assert pair.move(60, [1], [1]) == (KVPoll.Success, KVPoll.Success)  # warm: plans, registrations
        sender, receiver = pair.start(61)
        receiver.send_metadata(np.array([5, 6], dtype=np.int32), aux_index=1)
        _wait(lambda: sender.poll() == KVPoll.WaitingForInput)
        sender.init(2, aux_index=0)
        default = torch.cuda.default_stream(torch.device("cuda", 0))
        torch.cuda._sleep(4_000_000_000)  # about 2 s of GPU time on the default stream
        with torch.cuda.stream(torch.cuda.Stream(torch.device("cuda", 0))):
            sender.send(np.array([3, 4], dtype=np.int32))
        _wait(lambda: receiver.poll() in TERMINAL)
        kernel_still_running = not default.query()
        assert receiver.poll() == KVPoll.Success and kernel_still_running
        torch.cuda.synchronize()
        _wait(lambda: sender.poll() in TERMINAL)
        assert torch.equal(torch.from_numpy(pair.dst.snapshot()).view(torch.bfloat16)[:, [5, 6]], pair.pages()[:, [3, 4]])
        sender.clear()
        receiver.clear()
    finally:
        torch.cuda.synchronize()
        pair.close()
