"""Conformance tests of pddcore.TransferEngine between two real processes on loopback.

Every test takes the `backend` fixture, so another backend joins by adding its name to
BACKENDS (the wire-level tests at the end speak the TCP data protocol and stay tcp-only).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import random
import signal
import socket
import struct
import subprocess
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from pddcore import _C
from pddcore.transfer import RegionDescriptor, TransferEngine, TransferError

from transfer_peer import RemoteEngine, digest

BACKENDS = [
    "tcp",
    # No RDMA NIC here: the rdma backend runs on the in-process verbs emulator.
    pytest.param("rdma", id="rdma-emulated", marks=pytest.mark.skipif(
        not _C.rdma_compiled(), reason="rdma backend compiled out (no ibverbs headers at build time)")),
]
TOKEN = b"conformance-token-7f3a9c2e5b8d1046"
MiB = 1 << 20


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    with pytest.MonkeyPatch.context() as env:
        if request.param == "rdma":
            env.setenv("PDDCORE_VERBS", "emulator")  # explicit: engines (and peer processes) use the emulator
        yield request.param


@pytest.fixture(scope="module")
def remote(backend):
    """One long-lived peer process per module and backend (spawning one costs a torch import)."""
    peer = RemoteEngine(backend=backend, auth_token=TOKEN, timeout_s=10.0)
    yield peer
    peer.close()


@pytest.fixture
def remote_region(remote):
    """remote_region(nbytes) -> (index, descriptor) of a fresh zeroed region on the remote
    engine; unregistered (and freed) after the test."""
    made = []

    def make(nbytes: int):
        index, desc = remote.call("region", nbytes)
        made.append(index)
        return index, desc

    yield make
    for index in made:
        remote.call("unregister", index)


@pytest.fixture
def local(backend):
    with TransferEngine(backend, auth_token=TOKEN, streams=4, chunk_bytes=256 << 10, timeout_s=10.0) as engine:
        yield engine


def random_tensor(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def sha(t: torch.Tensor, offset: int = 0, nbytes: int | None = None) -> str:
    return digest(t.numpy(), offset, nbytes)


# ---- data moves and is verified --------------------------------------------------------


def test_batches_of_mixed_sizes_land_exactly(local, remote, remote_region):
    """256 MiB as batches of writes from 1 byte to 8 MiB, scattered and permuted."""
    total = 256 * MiB
    src = random_tensor(total, 1)
    region = local.register(src)
    idx, desc = remote_region(total)
    peer = local.connect(remote.address)
    rng = random.Random(7)
    pieces, pos = [], 0
    while pos < total:
        n = min(total - pos, rng.choice([1, 3, 4096, 65536, 65537, MiB - 1, 3 * MiB, 8 * MiB]))
        pieces.append((pos, n))
        pos += n
    rng.shuffle(pieces)
    transfers = []
    for i in range(0, len(pieces), 40):
        # Source i goes to the mirrored destination so offsets differ on both sides.
        batch = [(region, off, desc, total - off - n, n) for off, n in pieces[i:i + 40]]
        transfers.append(local.write_batch(peer, batch))
    for t in transfers:
        t.wait()
        assert t.done() and t.bytes_acked == t.nbytes
    expected = torch.empty_like(src)
    for off, n in pieces:
        expected[total - off - n:total - off] = src[off:off + n]
    assert remote.call("digest", idx, 0, total) == sha(expected)
    stats = local.stats()
    assert stats["bytes_sent"] >= total
    p = stats["peers"][remote.address]
    assert p["bytes_sent"] >= total and p["seconds_busy"] > 0 and p["throughput_bps"] > 0 and p["rtt_s"] > 0
    local.unregister(region)


def test_many_concurrent_transfers_from_many_threads(local, remote, remote_region):
    nbytes = 16 * MiB
    src = random_tensor(nbytes, 2)
    region = local.register(src)
    idx, desc = remote_region(nbytes)
    peer = local.connect(remote.address)
    slices = 64
    step = nbytes // slices
    errors = []

    def submit(worker: int) -> None:
        try:
            ts = [local.write(peer, region, s * step, desc, s * step, step) for s in range(worker, slices, 8)]
            for t in ts:
                t.wait()
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=submit, args=(w,)) for w in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert remote.call("digest", idx, 0, nbytes) == sha(src)


def test_notify_arrives_only_after_all_data(local, remote, remote_region):
    nbytes = 32 * MiB
    src = random_tensor(nbytes, 3)
    region = local.register(src)
    index, desc = remote_region(nbytes)
    peer = local.connect(remote.address)
    t = local.write_batch(peer, [(region, 0, desc, 0, nbytes // 2), (region, nbytes // 2, desc, nbytes // 2, nbytes // 2)],
                          notify=b"request-17")
    # The remote digests its region the moment the notification shows up.
    arrivals = remote.call("wait_message", 20.0, index)
    t.wait()
    assert [(p, m) for p, m, _, _ in arrivals] == [(local.address, b"request-17")]
    assert arrivals[0][3] == sha(src)


def test_priority_message_not_queued_behind_bulk(local, remote, remote_region):
    nbytes = 128 * MiB
    src = random_tensor(nbytes, 4)
    region = local.register(src)
    idx, desc = remote_region(nbytes)
    peer = local.connect(remote.address)
    bulk = local.write(peer, region, 0, desc, 0, nbytes)
    while bulk.bytes_acked == 0:
        time.sleep(0.001)
    local.send(peer, b"token ids 17 18 19")
    sent_at = time.monotonic()
    arrivals = remote.call("wait_message", 20.0, None)
    bulk.wait()
    done_at = time.monotonic()
    assert [m for _, m, _, _ in arrivals] == [b"token ids 17 18 19"]
    arrived_at = arrivals[0][2]
    # Delivered while the bulk transfer was still running, not after it.
    assert sent_at <= arrived_at < done_at
    assert local.stats()["messages_sent"] >= 1


def test_cancel_stops_and_releases(local, remote, backend, remote_region):
    nbytes = 64 * MiB
    with TransferEngine(backend, auth_token=TOKEN, rate_limit_bps=200e6) as slow:
        src = random_tensor(nbytes, 5)
        region = slow.register(src)
        idx, desc = remote_region(nbytes)
        peer = slow.connect(remote.address)
        t = slow.write(peer, region, 0, desc, 0, nbytes)
        time.sleep(0.2)
        t.cancel()
        with pytest.raises(TransferError, match="cancelled"):
            t.wait()
        assert t.status == "cancelled" and t.bytes_acked < nbytes
        slow.unregister(region)  # nothing holds the source any more
        stats = slow.stats()
        assert stats["transfers_cancelled"] == 1 and stats["transfers_active"] == 0
        # The engine keeps working after a cancel.
        small = slow.register(random_tensor(MiB, 6))
        slow.write(peer, small, 0, desc, 0, MiB).wait()


def test_unregister_refused_while_a_transfer_reads_the_region(backend, remote, remote_region):
    with TransferEngine(backend, auth_token=TOKEN, rate_limit_bps=200e6) as engine:
        region = engine.register(random_tensor(16 * MiB, 17))
        _, desc = remote_region(16 * MiB)
        t = engine.write(engine.connect(remote.address), region, 0, desc, 0, 16 * MiB)
        with pytest.raises(TransferError, match="source of an active transfer"):
            engine.unregister(region)
        t.cancel()
        engine.unregister(region)
        assert engine.regions() == []


def test_close_releases_threads_and_sockets(backend, remote, remote_region):
    def counts():
        fds = os.listdir("/proc/self/fd")
        return len(os.listdir("/proc/self/task")), len(fds)

    def cycle():
        with TransferEngine(backend, auth_token=TOKEN, streams=8) as engine:
            region = engine.register(random_tensor(4 * MiB, 8))
            _, desc = remote_region(4 * MiB)
            peer = engine.connect(remote.address)
            engine.write(peer, region, 0, desc, 0, 4 * MiB).wait()

    cycle()  # first use initialises process-wide state (OpenSSL, torch)
    before = counts()
    for _ in range(3):
        cycle()
    assert counts() == before


def test_wait_releases_the_gil(backend, remote, remote_region):
    with TransferEngine(backend, auth_token=TOKEN, rate_limit_bps=400e6) as engine:
        region = engine.register(random_tensor(16 * MiB, 9))
        idx, desc = remote_region(16 * MiB)
        t = engine.write(engine.connect(remote.address), region, 0, desc, 0, 16 * MiB)
        waiter = threading.Thread(target=t.wait)
        waiter.start()
        spins = 0
        while waiter.is_alive():
            spins += 1
        assert t.done() and spins > 1000


# ---- bad input and faults --------------------------------------------------------------


def test_bad_arguments_raise_before_sending(local, remote, remote_region):
    region = local.register(random_tensor(MiB, 10))
    idx, desc = remote_region(MiB)
    peer = local.connect(remote.address)
    with pytest.raises(ValueError, match="destination range"):
        local.write(peer, region, 0, desc, 1, MiB)
    with pytest.raises(ValueError, match="source range"):
        local.write(peer, region, 1, desc, 0, MiB)
    with pytest.raises(ValueError, match="nbytes is 0"):
        local.write(peer, region, 0, desc, 0, 0)
    with pytest.raises(ValueError, match="belongs to engine"):
        local.write(peer, region, 0, region.descriptor(), 0, 16)
    with pytest.raises(ValueError, match="not a pddcore region descriptor"):
        local.write(peer, region, 0, b"x" * 40, 0, 16)
    with pytest.raises(ValueError, match="contiguous"):
        local.register(torch.zeros(4, 4, dtype=torch.uint8).t())
    with pytest.raises(ValueError, match="read-only"):
        local.register(b"immutable")
    with pytest.raises(ValueError, match="only CPU tensors"):  # device memory (GPU: tests/test_pack_cuda.py)
        local.register(torch.zeros(16, dtype=torch.uint8, device="meta"))
    assert local.stats()["transfers_done"] == 0


def test_out_of_bounds_and_unknown_region_rejected_by_receiver(local, remote, remote_region):
    """A forged descriptor passes the sender's checks; the receiver still refuses it."""
    region = local.register(random_tensor(2 * MiB, 11))
    idx, raw = remote_region(MiB)
    desc = RegionDescriptor.from_bytes(raw)
    peer = local.connect(remote.address)
    forged = RegionDescriptor(desc.address, desc.engine_id, desc.region_id, 4 * MiB)
    t = local.write(peer, region, 0, forged, MiB - 100, MiB)
    with pytest.raises(TransferError, match="out of bounds"):
        t.wait()
    unknown = RegionDescriptor(desc.address, desc.engine_id, 10**9, MiB)
    with pytest.raises(TransferError, match="unknown destination region"):
        local.write(peer, region, 0, unknown, 0, 4096).wait()
    rejected = remote.call("stats")["chunks_rejected"]
    assert rejected >= 2
    assert remote.call("digest", idx, 0, MiB) == sha(torch.zeros(MiB, dtype=torch.uint8))
    # Nothing past the region's end was touched and in-bounds writes still work.
    local.write(peer, region, 0, desc, 0, MiB).wait()
    assert remote.call("stats")["chunks_rejected"] == rejected


def test_corrupted_chunk_is_detected_and_resent(local, backend, remote, remote_region):
    if backend == "rdma":  # payloads are checked by the fabric (ICRC): the hook says so instead of doing nothing
        with pytest.raises(ValueError, match="does not apply to the rdma backend"):
            local._debug_corrupt_chunks(2)
        return
    nbytes = 4 * MiB
    src = random_tensor(nbytes, 12)
    region = local.register(src)
    idx, desc = remote_region(nbytes)
    peer = local.connect(remote.address)
    local._debug_corrupt_chunks(2)
    local.write(peer, region, 0, desc, 0, nbytes).wait()
    assert remote.call("digest", idx, 0, nbytes) == sha(src)
    assert local.stats()["crc_errors"] == 2


def test_persistent_corruption_fails_the_transfer(backend, remote, remote_region):
    if backend == "rdma":
        pytest.skip("RDMA payloads are checked by the fabric (ICRC); see test_corrupted_chunk_is_detected_and_resent")
    with TransferEngine(backend, auth_token=TOKEN, max_retries=2, chunk_bytes=64 << 10) as engine:
        region = engine.register(random_tensor(MiB, 13))
        idx, desc = remote_region(MiB)
        peer = engine.connect(remote.address)
        engine._debug_corrupt_chunks(1000)
        t = engine.write(peer, region, 0, desc, 0, MiB, notify=b"must not arrive")
        with pytest.raises(TransferError, match="CRC32C mismatch"):
            t.wait()
        assert t.status == "failed"
    assert all(m != b"must not arrive" for _, m, _, _ in remote.call("wait_message", 0.2, None))


def test_wrong_or_missing_token_is_refused(backend, remote):
    for token in (b"a-wrong-token-of-full-strength-0f3e9c27", None):
        with TransferEngine(backend, auth_token=token) as intruder:
            with pytest.raises(TransferError, match="authentication failed"):
                intruder.connect(remote.address)
    with TransferEngine(backend, auth_token=TOKEN) as friend:
        assert friend.connect(remote.address).connected


def test_killed_stream_socket_still_completes(backend, remote, remote_region):
    nbytes = 48 * MiB
    with TransferEngine(backend, auth_token=TOKEN, streams=4, chunk_bytes=256 << 10,
                        rate_limit_bps=800e6) as engine:
        src = random_tensor(nbytes, 14)
        region = engine.register(src)
        idx, desc = remote_region(nbytes)
        peer = engine.connect(remote.address)
        t = engine.write(peer, region, 0, desc, 0, nbytes)
        while t.bytes_acked < nbytes // 8:
            time.sleep(0.002)
        engine._debug_kill_stream(peer, 0)
        engine._debug_kill_stream(peer, 2)
        t.wait()
        assert remote.call("digest", idx, 0, nbytes) == sha(src)
        assert engine.stats()["retries"] > 0


def test_peer_killed_mid_transfer_fails_within_timeout(backend):
    victim = RemoteEngine(backend=backend, auth_token=TOKEN)
    try:
        nbytes = 64 * MiB
        with TransferEngine(backend, auth_token=TOKEN, timeout_s=2.0, rate_limit_bps=400e6) as engine:
            region = engine.register(random_tensor(nbytes, 15))
            _, desc = victim.call("region", nbytes)
            peer = engine.connect(victim.address)
            t = engine.write(peer, region, 0, desc, 0, nbytes)
            while t.bytes_acked == 0:
                time.sleep(0.002)
            victim.process.kill()
            # TimeoutError here would mean the failure went undetected.
            with pytest.raises(TransferError):
                t.wait(timeout=4 * engine.timeout_s)
            assert t.status == "failed" and t.bytes_acked < nbytes
            with pytest.raises(TransferError):
                engine.write(peer, region, 0, desc, 0, MiB).wait(timeout=4 * engine.timeout_s)
    finally:
        victim.close()


def test_frozen_peer_fails_after_timeout(backend):
    victim = RemoteEngine(backend=backend, auth_token=TOKEN)
    try:
        with TransferEngine(backend, auth_token=TOKEN, timeout_s=1.0) as engine:
            region = engine.register(random_tensor(64 * MiB, 16))
            _, desc = victim.call("region", 64 * MiB)
            peer = engine.connect(victim.address)
            os.kill(victim.process.pid, signal.SIGSTOP)
            try:
                t = engine.write(peer, region, 0, desc, 0, 64 * MiB)
                with pytest.raises(TransferError, match="no progress"):
                    t.wait(timeout=10 * engine.timeout_s)
            finally:
                os.kill(victim.process.pid, signal.SIGCONT)
    finally:
        victim.close()


def _tcp_rows() -> list[list[str]]:
    with open("/proc/net/tcp") as f:
        return [line.split() for line in f.readlines()[1:]]


def _syn_sent_to(port: int) -> bool:
    """Whether a socket of this host waits in SYN_SENT for an answer from 127.0.0.1:``port``."""
    return any(row[2] == f"0100007F:{port:04X}" and row[3] == "02" for row in _tcp_rows())


def _accept_queue_full(port: int) -> bool:
    """Whether the listener on ``port`` holds more connections than its backlog: the kernel then
    drops every new SYN. (``ss`` shows a listener's waiting connections as Recv-Q, its backlog
    as Send-Q.)"""
    listing = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True)
    _, queued, backlog, *_ = listing.stdout.split()
    return int(queued) > int(backlog)


@pytest.mark.parametrize("unanswered", ["handshake", "connect"])
def test_closing_a_peer_ends_a_redial_that_gets_no_answer(unanswered):
    """A data connection redialled to a peer that does not answer waits up to timeout_s: in the
    handshake for a frozen process, in connect for a host that is down (here: a frozen process
    whose accept queue is full, so the kernel drops the SYN). Closing that peer ends the dial at
    once instead of waiting it out (tcp: the rdma backend's data path dials no connection per
    stream)."""
    victim = RemoteEngine(auth_token=TOKEN)
    port = int(victim.address.rsplit(":", 1)[1])
    queued: list[socket.socket] = []
    try:
        with TransferEngine(auth_token=TOKEN, streams=1, timeout_s=120.0) as engine:
            region = engine.register(random_tensor(MiB, 21))
            _, desc = victim.call("region", MiB)
            peer = engine.connect(victim.address)
            engine.write(peer, region, 0, desc, 0, MiB).wait(timeout=60)  # the data connection is up
            os.kill(victim.process.pid, signal.SIGSTOP)
            try:
                while unanswered == "connect" and not _accept_queue_full(port):  # nobody accepts now
                    queued.append(socket.create_connection(("127.0.0.1", port), timeout=60))
                engine._debug_kill_stream(peer, 0)
                engine.write(peer, region, 0, desc, 0, MiB)  # dials again, and gets no answer
                if unanswered == "connect":
                    deadline = time.monotonic() + 60
                    while not _syn_sent_to(port):
                        assert time.monotonic() < deadline, "the redial never reached connect"
                        time.sleep(0.005)
                else:
                    time.sleep(0.5)  # the stream's thread is inside the handshake by now
                closed = threading.Event()
                threading.Thread(target=lambda: (peer.close(), closed.set()), daemon=True).start()
                # 120 s is the dial's own deadline: a close that waits for it fails here
                assert closed.wait(60), f"closing the peer waited on a {unanswered} nobody answers"
            finally:
                os.kill(victim.process.pid, signal.SIGCONT)
    finally:
        for connection in queued:
            connection.close()
        victim.close()


# ---- wire level (tcp data protocol) ----------------------------------------------------

_HELLO = struct.Struct("<IHBBQ16s64s")
_CHALLENGE = struct.Struct("<IHB16s")  # magic, version, auth required, nonce: no engine id before the proof
_RESULT = struct.Struct("<BQ32s96s")  # status, the server's engine id, its proof, why refused
_CHUNK = struct.Struct("<IHHQQQIII")  # ... length, payload CRC, transfer tag; then the header CRC
_ACK = struct.Struct("<IBBHQ")
HELLO_MAGIC, CHUNK_MAGIC, ACK_MAGIC = 0x48444450, 0x43444450, 0x41444450
WIRE_VERSION = 4


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError("closed")
        data += part
    return data


def python_handshake(address: str, token: bytes | None, kind: int = 1, version: int = WIRE_VERSION,
                     engine_id: int = 42, secure=None) -> socket.socket:
    """An independent client of the handshake, with Python's hmac: HMAC-SHA256(token,
    label + hello + challenge), the server's also over the engine id its result states.
    ``engine_id`` is the id the hello claims; ``secure`` wraps the socket first (TLS)."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    if secure is not None:  # e.g. an ssl.SSLContext's wrap_socket: the handshake then runs over TLS
        sock = secure(sock)
    hello = _HELLO.pack(HELLO_MAGIC, version, kind, 0, engine_id, os.urandom(16), b"127.0.0.1:1".ljust(64, b"\0"))
    sock.sendall(hello)
    challenge = _recv_exact(sock, _CHALLENGE.size)
    mac = b"\0" * 32 if token is None else hmac.new(token, b"pddcore client proof" + hello + challenge,
                                                      hashlib.sha256).digest()
    sock.sendall(mac)
    status, server_id, server_mac, reason = _RESULT.unpack(_recv_exact(sock, _RESULT.size))
    if status != 0:
        sock.close()
        raise PermissionError(reason.rstrip(b"\0").decode())
    if token is None:
        return sock
    expected = hmac.new(token, b"pddcore server proof" + hello + challenge + struct.pack("<Q", server_id),
                        hashlib.sha256).digest()
    assert hmac.compare_digest(server_mac, expected), "server did not prove the token"
    return sock


def chunk_frame(seq: int, region: int, offset: int, payload: bytes, crc: int | None = None, tag: int = 0) -> bytes:
    head = _CHUNK.pack(CHUNK_MAGIC, WIRE_VERSION, 0, seq, region, offset, len(payload),
                       _C.crc32c(payload) if crc is None else crc, tag)
    return head + struct.pack("<I", _C.crc32c(head)) + payload


@pytest.fixture(scope="module")
def target():
    """An in-process engine with one region, as the target of hand-made frames."""
    with TransferEngine("tcp", auth_token=TOKEN, timeout_s=2.0) as engine:
        buf = bytearray(4096)
        region = engine.register(buf, target=True)
        yield engine, region, buf


def test_python_client_speaks_the_wire_format(target):
    engine, region, buf = target
    with pytest.raises(PermissionError, match="authentication failed"):
        python_handshake(engine.address, b"not the token")
    with pytest.raises(PermissionError, match=f"protocol version {WIRE_VERSION + 1}"):
        python_handshake(engine.address, TOKEN, version=WIRE_VERSION + 1)
    with python_handshake(engine.address, TOKEN) as sock:
        payload = os.urandom(100)
        sock.sendall(chunk_frame(7, region.id, 10, payload))
        assert _ACK.unpack(_recv_exact(sock, _ACK.size)) == (ACK_MAGIC, 0, 0, 0, 7)
        assert bytes(buf[10:110]) == payload
        before = bytes(buf)
        sock.sendall(chunk_frame(8, region.id, 4000, b"x" * 200))  # past the end
        assert _ACK.unpack(_recv_exact(sock, _ACK.size))[1] == 3
        sock.sendall(chunk_frame(9, region.id + 99, 0, b"y" * 16))  # no such region
        assert _ACK.unpack(_recv_exact(sock, _ACK.size))[1] == 2
        sock.sendall(chunk_frame(10, region.id, 0, b"z" * 64, crc=1234))  # bad CRC
        assert _ACK.unpack(_recv_exact(sock, _ACK.size))[1] == 1
        assert bytes(buf[64:]) == before[64:]  # rejected frames wrote nothing, the bad-CRC one stayed in range
        sock.sendall(b"\x00" * 48)  # bad magic: refused, connection closed
        assert _ACK.unpack(_recv_exact(sock, _ACK.size))[1] == 4
        assert sock.recv(1) == b""


def _good_peer_still_served(engine: TransferEngine, region, buf: bytearray) -> None:
    with TransferEngine("tcp", auth_token=TOKEN) as good:
        data = os.urandom(1024)
        src = good.register(bytearray(data))
        good.write(good.connect(engine.address), src, 0, region.descriptor(), 2048, 1024).wait(timeout=30)
        assert bytes(buf[2048:3072]) == data


frames = st.one_of(
    st.binary(max_size=300),  # garbage before any handshake
    st.builds(lambda cut, tail: _HELLO.pack(HELLO_MAGIC, WIRE_VERSION, 1, 0, 1, b"\0" * 16, b"\0" * 64)[:cut] + tail,
              st.integers(0, _HELLO.size), st.binary(max_size=64)),  # truncated or trailing-garbage hello
)
after_handshake = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda off, n, cut: chunk_frame(1, 1, off, b"p" * n)[:cut],
              st.integers(0, 1 << 40), st.integers(0, 5000), st.integers(0, 6000)),  # truncated chunks
    st.builds(lambda length: _CHUNK.pack(CHUNK_MAGIC, WIRE_VERSION, 0, 1, 1, 0, length, 0, 0),
              st.integers(0, 2**32 - 1)),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=frames, authed=after_handshake)
def test_garbage_on_the_port_does_not_disturb_a_good_peer(target, raw, authed):
    engine, region, buf = target
    host, port = engine.address.rsplit(":", 1)
    for payload, handshake in ((raw, False), (authed, True)):
        try:
            sock = (python_handshake(engine.address, TOKEN) if handshake
                    else socket.create_connection((host, int(port)), timeout=5))
            with sock:
                sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the engine may close on us first
    _good_peer_still_served(engine, region, buf)
    assert engine.stats()["transfers_failed"] == 0
