"""RDMA backend tests beyond the shared conformance suite (tests/test_transfer_tcp.py runs
that suite with backend "rdma-emulated" too).

No RDMA NIC exists here, so everything runs on the in-process verbs emulator, selected
explicitly with device="emulator". The emulator's own semantics (QP state machine, lkey /
rkey and range checks, selective signaling, flush on error, retry timeouts) are unit
tested in C++ (tests/cpp/verbs_emulator_test.cpp), built and run from here. Tests that
need a real NIC skip with the reason ibverbs gives.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from pddcore import _C
from pddcore.info import collect
from pddcore.transfer import Message, TransferEngine, TransferError

import cpp_unit
from test_transfer_tcp import python_handshake

pytestmark = pytest.mark.skipif(not _C.rdma_compiled(), reason="rdma backend compiled out (no ibverbs headers)")
if _C.rdma_compiled():
    from pddcore import _verbs_emulator

MiB = 1 << 20
TOKEN = b"rdma-test-token-8a1f3e6c2d9b5074"


def emulated(**kwargs) -> TransferEngine:
    kwargs.setdefault("auth_token", TOKEN)
    kwargs.setdefault("timeout_s", 5.0)
    return TransferEngine("rdma", device="emulator", **kwargs)


def random_tensor(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def live_objects() -> dict:
    c = _verbs_emulator.counters()
    return {k: c[k] for k in ("contexts", "pds", "mrs", "cqs", "qps", "wire_connections")}


# ---- the emulator's verbs semantics (C++ unit tests) --------------------------------------

EMULATOR_CASES = ["state_machine", "write_chain", "bad_rkey", "out_of_range", "before_start", "no_remote_write",
                  "bad_lkey", "selective_signaling", "signaled_frees_slots", "vanished_peer", "psn_mismatch", "rnr",
                  "teardown"]


test_verbs_emulator = cpp_unit.case_test(
    "verbs_emulator_test", ["tests/cpp/verbs_emulator_test.cpp",
                            *(f"csrc/transport/rdma/emulator/{name}.cpp"
                              for name in ("objects", "qp_state", "wire", "verbs_emulator")),
                            "csrc/transport/socket.cpp", "csrc/transport/tls.cpp"], EMULATOR_CASES,
    libs=("-lssl", "-lcrypto"))


# ---- device selection and errors -----------------------------------------------------------


def test_no_device_error_lists_usable_backends(monkeypatch):
    loaded, devices, detail = _C.probe_verbs()
    if devices > 0:
        pytest.skip("this machine has an RDMA device")
    monkeypatch.delenv("PDDCORE_VERBS", raising=False)
    # Never silently emulated: without device="emulator" (or PDDCORE_VERBS) it is an error.
    with pytest.raises(TransferError, match="no usable RDMA device") as err:
        TransferEngine("rdma")
    assert "'tcp'" in str(err.value) and "device='emulator'" in str(err.value)
    if loaded:
        assert "ibv_get_device_list" in str(err.value)


def test_environment_selects_the_emulator(monkeypatch):
    monkeypatch.setenv("PDDCORE_VERBS", "emulator")
    before = _verbs_emulator.counters()["contexts"]
    with TransferEngine("rdma") as engine:
        assert engine.backend == "rdma"
        assert _verbs_emulator.counters()["contexts"] == before + 1


def test_rdma_options_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="apply to the rdma backend"):
        TransferEngine("tcp", device="emulator")
    with pytest.raises(ValueError, match="GID index"):
        TransferEngine("rdma", device="emulator", gid_index=-2)
    with pytest.raises(TransferError, match="port 2"):
        TransferEngine("rdma", device="emulator", ib_port=2)  # the emulated HCA has one port
    monkeypatch.setenv("PDDCORE_VERBS", "hardware-please")
    with pytest.raises(ValueError, match="PDDCORE_VERBS"):
        TransferEngine("rdma")


def test_info_reports_the_backend():
    assert collect()["rdma_backend_compiled"] is True


@pytest.mark.skipif(_C.probe_verbs()[1] == 0,
                    reason=f"needs an RDMA NIC; here: {_C.probe_verbs()[2] or 'no devices'}")
def test_real_nic_loopback_roundtrip():
    with TransferEngine("rdma", auth_token=TOKEN) as a, TransferEngine("rdma", auth_token=TOKEN) as b:
        src, dst = random_tensor(64 * MiB, 1), torch.zeros(64 * MiB, dtype=torch.uint8)
        rs, rd = a.register(src), b.register(dst, target=True)
        a.write(a.connect(b.address), rs, 0, rd.descriptor(), 0, 64 * MiB).wait(30)
        assert torch.equal(src, dst)


# ---- data path ------------------------------------------------------------------------------


def test_write_longer_than_the_send_queue_completes():
    """1500 chunks on one QP of 512 slots: only selective signaling retires the slots."""
    n = 1500 * 4096
    with emulated(streams=1, chunk_bytes=4096) as a, emulated() as b:
        src, dst = random_tensor(n, 2), torch.zeros(n, dtype=torch.uint8)
        rs, rd = a.register(src), b.register(dst, target=True)
        placed = _verbs_emulator.counters()["writes_placed"]
        a.write(a.connect(b.address), rs, 0, rd.descriptor(), 0, n, notify=b"all").wait(30)
        assert torch.equal(src, dst)
        assert _verbs_emulator.counters()["writes_placed"] - placed == 1500
        deadline = time.monotonic() + 5
        got = []
        while not got and time.monotonic() < deadline:
            got = b.poll_messages()
        assert got == [Message(a.address, a.engine_id, b"all", notification=True)]
        # The immediates told the target every byte (its receive completions). The target's
        # poller counts them on its own thread, possibly after the initiator saw its completion.
        while b.stats()["bytes_received"] < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b.stats()["bytes_received"] == n


def test_scattered_batch_lands_exactly():
    rng = torch.Generator().manual_seed(3)
    total = 8 * MiB
    with emulated(chunk_bytes=64 << 10) as a, emulated() as b:
        src, dst = random_tensor(total, 4), torch.zeros(total, dtype=torch.uint8)
        rs, rd = a.register(src), b.register(dst, target=True)
        peer = a.connect(b.address)
        cuts = sorted(set(torch.randint(1, total, (300,), generator=rng).tolist()))
        pieces = list(zip([0] + cuts, cuts + [total]))
        order = torch.randperm(len(pieces), generator=rng).tolist()
        batch = [(rs, s, rd.descriptor(), total - e, e - s) for s, e in (pieces[i] for i in order)]
        a.write_batch(peer, batch).wait(30)
        expected = torch.empty_like(src)
        for s, e in pieces:
            expected[total - e:total - s] = src[s:e]
        assert torch.equal(dst, expected)


def test_one_engine_speaks_rdma_and_tcp_to_different_peers():
    with emulated() as a, emulated() as b, TransferEngine("tcp", auth_token=TOKEN) as c:
        src = random_tensor(4 * MiB, 5)
        rs = a.register(src)
        db, dc = torch.zeros(4 * MiB, dtype=torch.uint8), torch.zeros(4 * MiB, dtype=torch.uint8)
        rb, rc = b.register(db, target=True), c.register(dc, target=True)
        placed = _verbs_emulator.counters()["bytes_placed"]
        to_b = a.connect(b.address)                  # rdma: the engine's backend
        to_c = a.connect(c.address, backend="tcp")   # c has no RDMA at all
        a.write(to_b, rs, 0, rb.descriptor(), 0, 4 * MiB).wait(30)
        a.write(to_c, rs, 0, rc.descriptor(), 0, 4 * MiB).wait(30)
        assert torch.equal(db, src) and torch.equal(dc, src)
        assert _verbs_emulator.counters()["bytes_placed"] - placed == 4 * MiB  # only b's copy went by RDMA
        # An rdma engine serves tcp peers too.
        b2 = a.connect(b.address, backend="tcp")
        db.zero_()
        a.write(b2, rs, 0, rb.descriptor(), 0, 4 * MiB).wait(30)
        assert torch.equal(db, src)
        assert _verbs_emulator.counters()["bytes_placed"] - placed == 4 * MiB
        with pytest.raises(TransferError):
            a.connect(c.address, backend="rdma")  # c refuses the RDMA setup connection
        with pytest.raises(ValueError, match="not available"):
            c.connect(a.address, backend="rdma")  # a tcp engine has no rdma backend
        with pytest.raises(ValueError, match="not available"):
            a.connect(b.address, backend="carrier-pigeon")


def test_completion_error_fails_with_the_status_text_and_the_qp_recovers():
    """A stale rkey (the target deregistered its region) is caught by the NIC: remote access
    error. The QP is replaced and the next write to a live region goes through."""
    with emulated() as a, emulated() as b:
        src = random_tensor(MiB, 6)
        rs = a.register(src)
        gone, live = torch.zeros(MiB, dtype=torch.uint8), torch.zeros(MiB, dtype=torch.uint8)
        rg, rl = b.register(gone, target=True), b.register(live, target=True)
        peer = a.connect(b.address)
        a.write(peer, rs, 0, rg.descriptor(), 0, MiB).wait(30)  # caches the (address, rkey)
        rejected = _verbs_emulator.counters()["writes_rejected"]
        b.unregister(rg)
        gone.zero_()
        with pytest.raises(TransferError, match="remote access error"):
            a.write(peer, rs, 0, rg.descriptor(), 0, MiB).wait(30)
        assert _verbs_emulator.counters()["writes_rejected"] > rejected
        assert torch.count_nonzero(gone) == 0  # nothing landed in the deregistered memory
        a.write(peer, rs, 0, rl.descriptor(), 0, MiB).wait(30)
        assert torch.equal(live, src)


def test_concurrent_writers_over_several_qps():
    n, slices = 16 * MiB, 32
    with emulated(streams=4, chunk_bytes=128 << 10) as a, emulated() as b:
        src, dst = random_tensor(n, 7), torch.zeros(n, dtype=torch.uint8)
        rs, rd = a.register(src), b.register(dst, target=True)
        peer = a.connect(b.address)
        step, errors = n // slices, []

        def worker(w: int) -> None:
            try:
                for t in [a.write(peer, rs, s * step, rd.descriptor(), s * step, step) for s in range(w, slices, 4)]:
                    t.wait(30)
            except Exception as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors and torch.equal(src, dst)


# ---- teardown ------------------------------------------------------------------------------


def test_repeated_open_close_leaks_no_verbs_objects_or_threads():
    def cycle() -> None:
        with emulated(streams=3) as a, emulated() as b:
            src, dst = random_tensor(MiB, 8), torch.zeros(MiB, dtype=torch.uint8)
            rs, rd = a.register(src), b.register(dst, target=True)
            a.write(a.connect(b.address), rs, 0, rd.descriptor(), 0, MiB).wait(30)
            objects = live_objects()
            assert objects["contexts"] == 2 and objects["qps"] == 6 and objects["mrs"] == 2
            a.unregister(rs)
            assert live_objects()["mrs"] == 1

    cycle()
    threads = len(os.listdir("/proc/self/task"))
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(4):
        cycle()
        assert all(v == 0 for v in live_objects().values()), live_objects()
    assert len(os.listdir("/proc/self/task")) == threads
    assert len(os.listdir("/proc/self/fd")) == fds


# ---- the setup protocol under garbage -------------------------------------------------------

_SETUP = struct.Struct("<IBBHI")  # magic "PDDR", type, 0, 0, payload length
_QP_ATTRS = struct.Struct("<HBBII16s")  # lid, mtu, has_gid, qpn, psn, gid
RDMA_SETUP_KIND = 2


def setup_frame(kind: int, payload: bytes) -> bytes:
    return _SETUP.pack(0x52444450, kind, 0, 0, len(payload)) + payload


qp_request = st.builds(
    lambda attrs: setup_frame(1, struct.pack("<I", len(attrs)) + b"".join(_QP_ATTRS.pack(*a) for a in attrs)),
    st.lists(st.tuples(st.integers(0, 65535), st.integers(0, 7), st.integers(0, 1), st.integers(0, 2**32 - 1),
                       st.integers(0, 2**32 - 1), st.binary(min_size=16, max_size=16)), max_size=20))
setup_garbage = st.lists(st.one_of(
    st.binary(max_size=120),
    qp_request,
    st.builds(lambda rid, off, n: setup_frame(3, struct.pack("<QQQ", rid, off, n)),
              st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    st.builds(lambda qpns: setup_frame(6, struct.pack(f"<I{len(qpns)}I", len(qpns), *qpns)),
              st.lists(st.integers(0, 2**32 - 1), max_size=5)),
    st.builds(lambda kind, n: _SETUP.pack(0x52444450, kind, 0, 0, n), st.integers(0, 255), st.integers(0, 2**32 - 1)),
), max_size=4)


@pytest.fixture(scope="module")
def rdma_target():
    with emulated() as engine:
        buf = torch.zeros(4096, dtype=torch.uint8)
        yield engine, engine.register(buf, target=True), buf


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=setup_garbage)
def test_garbage_on_setup_connections_does_not_disturb_a_good_peer(rdma_target, frames):
    engine, region, buf = rdma_target
    try:
        with python_handshake(engine.address, TOKEN, kind=RDMA_SETUP_KIND) as sock:
            sock.settimeout(2)
            for frame in frames:
                sock.sendall(frame)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(4096):  # replies until the engine closes its side
                pass
    except OSError:
        pass  # the engine may close on us first
    assert eventually_no_qps()  # QPs made for the intruder went with its connection
    with emulated() as good:
        data = random_tensor(1024, 9)
        src = good.register(data)
        good.write(good.connect(engine.address), src, 0, region.descriptor(), 2048, 1024).wait(30)
        assert torch.equal(buf[2048:3072], data)
    assert eventually_no_qps()


def eventually_no_qps(within_s: float = 10.0) -> bool:
    """The target destroys a connection's QPs when it sees the connection close."""
    deadline = time.monotonic() + within_s
    while _verbs_emulator.counters()["qps"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return _verbs_emulator.counters()["qps"] == 0
