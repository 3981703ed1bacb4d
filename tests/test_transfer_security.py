"""The transfer engine against peers that misbehave on purpose: a server that waives the
proof, trickled handshakes, connection and message floods, writes into sources, and an
engine exposed without a token. Real sockets on loopback; the wire is spoken by hand with
the independent client of test_transfer_tcp.py."""

from __future__ import annotations

import hashlib
import hmac
import os
import resource
import socket
import struct
import threading
import time

import pytest
import torch

import cpp_unit

from pddcore import _C
from pddcore.transfer import RegionDescriptor, TransferEngine, TransferError

from test_transfer_tcp import (_ACK, _CHALLENGE, _HELLO, _RESULT, HELLO_MAGIC, TOKEN, WIRE_VERSION, _recv_exact,
                               chunk_frame, python_handshake)


class FakeServer:
    """Accepts one connection, answers the hello with its own challenge (asking for
    authentication or not), refuses whatever proof comes, and records every byte the client
    sent."""

    def __init__(self, auth_required: bool):
        self.auth_required = auth_required
        self.challenge = _CHALLENGE.pack(HELLO_MAGIC, WIRE_VERSION, int(auth_required), os.urandom(16))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.received = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.settimeout(5)
            self.received = _recv_exact(conn, _HELLO.size)
            conn.sendall(self.challenge)
            try:
                if self.auth_required:
                    self.received += _recv_exact(conn, 32)
                    conn.sendall(_RESULT.pack(2, 0, b"\0" * 32, b"fake server says no".ljust(96, b"\0")))
                while chunk := conn.recv(4096):
                    self.received += chunk
            except OSError:
                pass

    def close(self) -> None:
        self.thread.join(10)
        self.listener.close()


def refused_by_client(fake: FakeServer, match: str) -> FakeServer:
    """A client with the token connects to ``fake`` and fails with ``match``; returns ``fake``."""
    try:
        with TransferEngine(auth_token=TOKEN, timeout_s=5) as client:
            with pytest.raises(TransferError, match=match):
                client.connect(fake.address)
    finally:
        fake.close()
    return fake


def test_client_with_a_token_refuses_a_server_that_waives_the_proof():
    fake = refused_by_client(FakeServer(auth_required=False), "does not require authentication")
    assert len(fake.received) == _HELLO.size  # nothing after the hello: no proof, no message, no data


def test_the_token_never_crosses_the_wire():
    """What a client sends is its hello and HMAC-SHA256(token, transcript), checked here
    with Python's hmac; a wrong token is refused by a real engine."""
    fake = refused_by_client(FakeServer(auth_required=True), "fake server says no")
    hello, proof = fake.received[:_HELLO.size], fake.received[_HELLO.size:]
    assert proof == hmac.new(TOKEN, b"pddcore client proof" + hello + fake.challenge, hashlib.sha256).digest()
    assert TOKEN not in fake.received
    with TransferEngine(auth_token=TOKEN, timeout_s=5) as server:
        with pytest.raises(PermissionError, match="authentication failed"):
            python_handshake(server.address, b"another-token")


def test_write_into_a_source_region_is_refused_and_changes_nothing():
    with TransferEngine(auth_token=TOKEN) as owner, TransferEngine(auth_token=TOKEN) as other:
        secret = bytearray(os.urandom(4096))
        before = bytes(secret)
        source = owner.register(secret)  # default: a source
        forged = RegionDescriptor(owner.address, owner.engine_id, source.id, source.nbytes)
        src = other.register(bytearray(b"x" * 4096))
        peer = other.connect(owner.address)
        with pytest.raises(TransferError, match="registered as a source"):
            other.write(peer, src, 0, forged, 0, 4096).wait(timeout=30)
        assert bytes(secret) == before
        assert owner.stats()["chunks_rejected"] >= 1
        target = owner.register(bytearray(4096), target=True)
        assert [(r[0], r[1]) for r in other.remote_regions(peer)] == [(target.id, 0)]  # no source, no address
        pointed = torch.zeros(64, dtype=torch.uint8)  # a pointer-addressed API lists its address on purpose
        by_pointer = owner.register_pointer(pointed.data_ptr(), 64, target=True, listed_address=True,
                                            keep_alive=pointed)
        assert (by_pointer.id, pointed.data_ptr(), 64) in other.remote_regions(peer)
        with pytest.raises(ValueError, match="only a write target"):
            owner.register_pointer(pointed.data_ptr(), 64, listed_address=True)


def test_engine_reachable_from_other_hosts_needs_a_token():
    with pytest.raises(ValueError, match="needs an auth_token"):
        TransferEngine(listen="0.0.0.0:0")
    with pytest.raises(ValueError, match="at least 128 random bits"):
        TransferEngine(listen="0.0.0.0:0", auth_token=b"")
    with TransferEngine(listen="0.0.0.0:0", auth_token=TOKEN), TransferEngine(listen="0.0.0.0:0", insecure=True):
        pass
    with TransferEngine(listen="127.0.0.1:0"):  # loopback: only this machine reaches it
        pass


@pytest.mark.parametrize("weak", [b"", b"sunshine1", b"x" * 31, "conformance-token", b"password" * 4, b"ab" * 40])
def test_tokens_with_fewer_than_128_bits_are_refused(weak):
    """Shorter than 32 bytes (128 bits as hex), or fewer than 8 distinct bytes: refused
    before anything listens, with the rule and the generator named."""
    with pytest.raises(ValueError, match=r"at least 32 bytes .* of at least 8 distinct values.*pddcore token"):
        TransferEngine(auth_token=weak)


def test_pddcore_token_prints_a_new_256_bit_token_engines_accept():
    import subprocess
    import sys
    tokens = [subprocess.run([sys.executable, "-m", "pddcore.cli", "token"], capture_output=True, text=True,
                             check=True).stdout.strip() for _ in range(2)]
    assert tokens[0] != tokens[1]
    assert all(len(t) == 64 and int(t, 16) >= 0 for t in tokens)  # 32 bytes as hex
    with TransferEngine(auth_token=tokens[0]) as a, TransferEngine(auth_token=tokens[0]) as b:
        assert b.connect(a.address).connected
    with TransferEngine(auth_token=tokens[0]) as a, TransferEngine(auth_token=tokens[1], timeout_s=5) as b:
        with pytest.raises(TransferError, match="authentication failed"):
            b.connect(a.address)


def test_slow_loris_handshake_is_dropped_at_the_deadline():
    """One byte every 0.3 s keeps each receive inside a 1 s timeout; the handshake's single
    deadline still drops the connection long before the hello is complete."""
    with TransferEngine(auth_token=TOKEN, timeout_s=1.0) as engine:
        host, port = engine.address.rsplit(":", 1)
        hello = _HELLO.pack(HELLO_MAGIC, WIRE_VERSION, 1, 0, 1, os.urandom(16), b"127.0.0.1:1".ljust(64, b"\0"))
        sent = 0
        with socket.create_connection((host, int(port))) as sock:
            try:
                for byte in hello:
                    sock.sendall(bytes([byte]))
                    sent += 1
                    time.sleep(0.3)
            except OSError:  # reset / broken pipe: the engine closed the connection
                pass
        assert sent < len(hello), "the engine waited for the whole trickled hello"


def test_idle_connection_flood_is_capped_and_a_good_peer_is_served():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 12000), hard), hard))
    with TransferEngine(auth_token=TOKEN, timeout_s=30, max_connections=256,
                        max_connections_per_host=200) as engine:
        dst = bytearray(4096)
        region = engine.register(dst, target=True)
        threads_before = len(os.listdir("/proc/self/task"))
        host, port = engine.address.rsplit(":", 1)
        idle = []
        try:
            for _ in range(10_000):  # from another address than the good peer's (127.0.0.1)
                idle.append(socket.create_connection((host, int(port)), source_address=("127.0.0.3", 0)))
            # The flood comes from one host: 200 are held (idle, unauthenticated), the rest closed.
            with TransferEngine(auth_token=TOKEN) as good:
                data = os.urandom(4096)
                src = good.register(bytearray(data))
                good.write(good.connect(engine.address), src, 0, region.descriptor(), 0, 4096).wait(timeout=30)
                assert bytes(dst) == data
            threads = len(os.listdir("/proc/self/task"))
            assert threads - threads_before <= 256 + 16  # one thread per held connection, no more
            assert engine.stats()["connections_refused"] >= 10_000 - 200
        finally:
            for s in idle:
                s.close()


def _good_peer_writes(engine: TransferEngine, region, dst: bytearray) -> bool:
    """Whether an authenticated peer's write lands whole in ``dst``."""
    with TransferEngine(auth_token=TOKEN) as good:
        data = os.urandom(len(dst))
        src = good.register(bytearray(data))
        good.write(good.connect(engine.address), src, 0, region.descriptor(), 0, len(dst)).wait(timeout=30)
        return bytes(dst) == data


def test_handshake_flood_from_four_hosts_leaves_room_for_an_authenticated_peer():
    """Four hosts open as many idle (unauthenticated) connections as their per-host cap
    allows, enough to fill every slot of max_connections. Handshakes have a budget of their
    own (a quarter), and a newcomer from a quieter address displaces the oldest handshake of
    the busiest one: the good peer gets in and writes."""
    with TransferEngine(auth_token=TOKEN, timeout_s=30, max_connections=64, max_connections_per_host=16) as engine:
        dst = bytearray(4096)
        region = engine.register(dst, target=True)
        host, port = engine.address.rsplit(":", 1)
        idle = []
        try:
            for source in ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"):
                for _ in range(16):
                    idle.append(socket.create_connection((host, int(port)), source_address=(source, 0)))
            wait_until(lambda: engine.stats()["connections_refused"] >= 64 - 16)  # 4 held per host
            assert _good_peer_writes(engine, region, dst)
        finally:
            for s in idle:
                s.close()


def test_a_control_frame_buffer_grows_with_the_bytes_that_arrive():
    """Twenty authenticated control connections each announce a 16 MiB message and send 17
    bytes of it: the receiver holds kilobytes for them, not 16 MiB each (its resident memory
    grows by far less than the 320 MiB announced)."""
    def resident_bytes() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    with TransferEngine(auth_token=TOKEN, timeout_s=30) as engine:
        before = resident_bytes()
        conns = []
        try:
            for _ in range(20):
                control = python_handshake(engine.address, TOKEN, kind=0)
                control.sendall(_CONTROL.pack(CONTROL_MAGIC, 1, 0, 0, 16 << 20, 0) + b"m" * 17)
                conns.append(control)
            # A ping on a fresh control connection answers once the engine served every frame before it.
            with python_handshake(engine.address, TOKEN, kind=0) as probe:
                probe.sendall(control_frame(3, struct.pack("<q", 1)))
                assert _CONTROL.unpack(_recv_exact(probe, _CONTROL.size))[1] == 4
            time.sleep(0.2)  # let the twenty reader threads reach their second receive
            assert resident_bytes() - before < 64 << 20
        finally:
            for c in conns:
                c.close()


def test_empty_messages_fill_the_inbox_too():
    """Each held message costs its bytes plus a fixed overhead: a flood of empty messages
    against a 64 KiB inbox stops after a few hundred (the rest wait in the connection), not
    after all 5000; polling lets every one through."""
    with TransferEngine(auth_token=TOKEN, max_inbox_bytes=64 << 10) as receiver, \
            TransferEngine(auth_token=TOKEN, timeout_s=60) as sender:
        peer = sender.connect(receiver.address)
        threading.Thread(target=lambda: [sender.send(peer, b"") for _ in range(5000)], daemon=True).start()
        wait_until(lambda: receiver.stats()["messages_received"] >= 100)
        time.sleep(0.5)  # let the flood push as far as it can
        assert receiver.stats()["messages_received"] <= (64 << 10) // 256 + 1
        got = 0
        while got < 5000:
            got += len(receiver.poll_messages(timeout=1.0))
        assert got == 5000


_FD_EXHAUSTION = """
import os, resource, socket, sys, time
from pddcore.transfer import TransferEngine
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
with TransferEngine(auth_token=sys.argv[1].encode(), timeout_s=30) as engine:
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    print(engine.address, flush=True)
    sys.stdin.readline()  # the parent has a connection waiting in the backlog
    cpu, wall = time.process_time(), time.monotonic()
    time.sleep(1.0)
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    stalls = engine.stats()["accept_stalls"]
    for fd in held:
        os.close(fd)
    print(cpu / wall, stalls, flush=True)
    sys.stdin.readline()
"""


def test_accept_loop_backs_off_when_file_descriptors_run_out():
    """A real process whose every file descriptor is taken, with a connection waiting: its
    accept loop fails with EMFILE and backs off (it used to retry at once, a core at 100 %);
    the process uses a small fraction of one core meanwhile, and once descriptors are free
    the waiting connection is served."""
    import subprocess
    import sys
    child = subprocess.Popen([sys.executable, "-c", _FD_EXHAUSTION, TOKEN.decode()], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        address = child.stdout.readline().split()[0]
        waiting = socket.create_connection(tuple(address.rsplit(":", 1)[0:1]) + (int(address.rsplit(":", 1)[1]),))
        child.stdin.write("go\n")
        child.stdin.flush()
        share, stalls = child.stdout.readline().split()
        assert float(stalls) >= 1  # it did run out
        assert float(share) < 0.2, f"the process used {float(share):.0%} of a core while out of descriptors"
        with python_handshake(address, TOKEN, kind=0):
            pass  # served now
        waiting.close()
        child.stdin.write("done\n")
        child.stdin.flush()
        assert child.wait(60) == 0
    finally:
        child.kill()


def test_message_flood_is_held_back_not_dropped():
    with TransferEngine(auth_token=TOKEN, max_inbox_bytes=4 << 20) as receiver, \
            TransferEngine(auth_token=TOKEN, timeout_s=60) as sender:
        peer = sender.connect(receiver.address)
        count, size = 48, 1 << 20
        done = threading.Event()

        def flood():
            for i in range(count):
                sender.send(peer, struct.pack("<I", i) + b"m" * (size - 4))
            done.set()

        threading.Thread(target=flood, daemon=True).start()
        deadline = time.monotonic() + 60
        while receiver.stats()["messages_received"] < 3 and time.monotonic() < deadline:  # 3 and overhead fit
            time.sleep(0.05)
        time.sleep(0.5)  # let the flood push as far as it can
        held = receiver.stats()["messages_received"]
        assert 1 <= held <= 4 and not done.is_set()  # the inbox is full: the sender waits
        got = []
        while len(got) < count:
            assert time.monotonic() < deadline
            got += [struct.unpack_from("<I", m.payload)[0] for m in receiver.poll_messages(timeout=1.0)]
        assert got == list(range(count))  # every message, in order: held back, none dropped


_CONTROL = struct.Struct("<IBBHII")  # magic, type, 0, 0, length, payload CRC
CONTROL_MAGIC, FENCE, FENCE_ACK, FENCE_BUSY = 0x4D444450, 7, 8, 9
FENCED = 7  # ack status of a chunk of a fenced (cancelled) transfer


def wait_until(condition) -> None:
    """Polls ``condition`` until true (or fails after a minute: a hang, not a speed limit)."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def control_frame(kind: int, payload: bytes) -> bytes:
    return _CONTROL.pack(CONTROL_MAGIC, kind, 0, 0, len(payload), _C.crc32c(payload)) + payload


def fence_reply(control: socket.socket, tag: int) -> int:
    """Sends a fence for ``tag`` and returns the reply's type (FENCE_ACK or FENCE_BUSY)."""
    control.sendall(control_frame(FENCE, struct.pack("<I", tag)))
    magic, kind, _, _, length, _ = _CONTROL.unpack(_recv_exact(control, _CONTROL.size))
    assert (magic, _recv_exact(control, length)) == (CONTROL_MAGIC, struct.pack("<I", tag))
    return kind


class ThrottledProxy:
    """A TCP proxy on loopback that forwards what clients send at ``rate`` bytes per second
    (each connection on its own) until release(), and the answers at once: a path on which
    one chunk takes seconds to arrive."""

    def __init__(self, target: str, rate: int):
        self.target, self.piece = target, 4096
        self.pause = self.piece / rate
        self.released = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        host, port = self.target.rsplit(":", 1)
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection((host, int(port)))
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, throttled: bool) -> None:
        try:
            while data := source.recv(self.piece):
                sink.sendall(data)
                if throttled and not self.released.is_set():
                    self.released.wait(self.pause)
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.released.set()
        self.listener.close()


def test_receiver_drops_chunks_of_a_fenced_transfer():
    """Wire level: after a fence for tag 5 (and its ack), chunks tagged 5 from that sender are
    dropped unwritten; other tags, and other senders, still land."""
    engine = TransferEngine(auth_token=TOKEN)
    try:
        buf = bytearray(4096)
        region = engine.register(buf, target=True)
        with python_handshake(engine.address, TOKEN, kind=0) as control, \
                python_handshake(engine.address, TOKEN, kind=1) as data:
            assert fence_reply(control, 5) == FENCE_ACK
            data.sendall(chunk_frame(1, region.id, 0, b"s" * 64, tag=5))
            assert _ACK.unpack(_recv_exact(data, _ACK.size))[1] == FENCED
            assert bytes(buf[:64]) == b"\0" * 64
            data.sendall(chunk_frame(2, region.id, 0, b"n" * 64, tag=6))
            assert _ACK.unpack(_recv_exact(data, _ACK.size))[1] == 0
            assert bytes(buf[:64]) == b"n" * 64
    finally:
        engine.close()


test_wire_flags = cpp_unit.case_test("wire_flags_test", ["tests/cpp/wire_flags_test.cpp"],
                                     ["challenge_auth_required_is_a_flag", "qp_has_gid_is_a_flag"])


def test_client_refuses_a_challenge_whose_flag_byte_is_not_0_or_1():
    fake = FakeServer(auth_required=False)
    fake.challenge = _CHALLENGE.pack(HELLO_MAGIC, WIRE_VERSION, 2, os.urandom(16))
    refused_by_client(fake, "bad challenge magic or flag")
    assert len(fake.received) == _HELLO.size  # no proof went to it


test_fence_table = cpp_unit.case_test(
    "fence_table_test", ["tests/cpp/fence_table_test.cpp", "csrc/transport/fence_table.cpp"],
    ["quiet_transfer_is_confirmed", "chunk_in_flight_past_the_timeout_is_not_confirmed",
     "install_waits_for_the_chunk_to_end", "close_ends_the_wait_unconfirmed"])
test_transfer_tags = cpp_unit.case_test("transfer_tags_test", ["tests/cpp/transfer_tags_test.cpp"],
                                        ["distinct_tags", "neighbours_look_random", "keys_decide_every_tag"])


def test_fence_is_not_confirmed_while_a_chunk_of_it_is_still_being_written():
    """Wire level, a receiver with a 1 s timeout: a chunk of tag 9 arrives slowly (its first
    bytes are already in the destination). A fence for tag 9 is answered busy, not confirmed,
    for as long as the chunk is being written; once the chunk is done, the fence is confirmed
    and a later chunk of tag 9 is dropped."""
    with TransferEngine(auth_token=TOKEN, timeout_s=1.0) as engine:
        buf = bytearray(64 << 10)
        region = engine.register(buf, target=True)
        payload = b"\xa5" * len(buf)
        frame = chunk_frame(1, region.id, 0, payload, tag=9)
        with python_handshake(engine.address, TOKEN, kind=0) as control, \
                python_handshake(engine.address, TOKEN, kind=1) as data:
            head = len(frame) - len(payload)
            data.sendall(frame[:head + 256])
            wait_until(lambda: buf[255] == 0xA5)  # the receiver is writing the chunk into the destination
            replied, sent = threading.Event(), [head + 256]

            def trickle():  # keeps every receive within the receiver's timeout
                while not replied.wait(0.1):
                    data.sendall(frame[sent[0]:sent[0] + 256])
                    sent[0] += 256

            trickler = threading.Thread(target=trickle)
            trickler.start()
            try:
                assert fence_reply(control, 9) == FENCE_BUSY
            finally:
                replied.set()
                trickler.join()
            data.sendall(frame[sent[0]:])
            assert _ACK.unpack(_recv_exact(data, _ACK.size))[1] == 0  # begun before the fence: written whole
            assert bytes(buf) == payload
            assert fence_reply(control, 9) == FENCE_ACK
            data.sendall(chunk_frame(2, region.id, 0, b"n" * 64, tag=9))
            assert _ACK.unpack(_recv_exact(data, _ACK.size))[1] == FENCED
            assert bytes(buf) == payload


def test_cancel_waits_out_a_slow_chunk_when_the_receiver_times_out_first():
    """Real engines through a throttled path: one 256 KiB chunk takes about 2 s, and the
    receiver's timeout_s (1 s) is shorter than the sender's (30 s). The receiver answers
    busy until the chunk is written, so cancel() returns only once no byte can land: the
    destination, zeroed right after, stays zero. A later write on the same stream (so behind
    everything the cancelled transfer sent) shows nothing more arrived."""
    chunk = 256 << 10
    with TransferEngine(auth_token=TOKEN, timeout_s=1.0) as receiver, \
            TransferEngine(auth_token=TOKEN, streams=1, chunk_bytes=chunk, timeout_s=30) as sender:
        proxy = ThrottledProxy(receiver.address, rate=128 << 10)
        try:
            dst = torch.zeros(4 * chunk, dtype=torch.uint8)
            region = receiver.register(dst, target=True)
            src = sender.register(torch.full((4 * chunk,), 0xAB, dtype=torch.uint8))
            peer = sender.connect(proxy.address)
            t = sender.write(peer, src, 0, region.descriptor(), 0, 4 * chunk)
            wait_until(lambda: int(dst[:chunk].count_nonzero()) > 0)  # the first chunk is being written
            t.cancel()
            assert t.status == "cancelled"
            dst.zero_()  # reuse at once
            proxy.released.set()
            sender.write(peer, src, 0, region.descriptor(), 3 * chunk, 4096).wait(timeout=60)
            assert int(dst[:3 * chunk].count_nonzero()) == 0
            assert int(dst[3 * chunk + 4096:].count_nonzero()) == 0
        finally:
            proxy.close()


def test_an_unconfirmed_cancel_keeps_the_destination_quarantined():
    """The chunk outlasts the sender's timeout too: cancel() raises, and writes through that
    peer into the cancelled transfer's destination are refused (elsewhere they go on) until a
    retried cancel() is confirmed, which it is once the chunk has landed."""
    chunk = 256 << 10
    with TransferEngine(auth_token=TOKEN, timeout_s=1.0) as receiver, \
            TransferEngine(auth_token=TOKEN, streams=1, chunk_bytes=chunk, timeout_s=2.0) as sender:
        proxy = ThrottledProxy(receiver.address, rate=32 << 10)  # the chunk takes 8 s
        try:
            dst = torch.zeros(2 * chunk, dtype=torch.uint8)
            region = receiver.register(dst, target=True)
            src = sender.register(torch.full((2 * chunk,), 0xAB, dtype=torch.uint8))
            peer = sender.connect(proxy.address)
            t = sender.write(peer, src, 0, region.descriptor(), 0, chunk)
            wait_until(lambda: int(dst[:chunk].count_nonzero()) > 0)
            with pytest.raises(TransferError, match="stay quarantined"):
                t.cancel()
            with pytest.raises(TransferError, match="quarantined"):
                sender.write(peer, src, 0, region.descriptor(), chunk - 1, 2)
            proxy.released.set()
            elsewhere = sender.write(peer, src, 0, region.descriptor(), chunk, 4096)
            t.cancel()  # the chunk is written by now, or soon: confirmed
            elsewhere.wait(timeout=60)
            sender.write(peer, src, 0, region.descriptor(), 0, chunk).wait(timeout=60)
            assert int(dst[:chunk + 4096].eq(0xAB).sum()) == chunk + 4096
        finally:
            proxy.close()


def test_unregister_that_times_out_leaves_the_region_registered_and_a_retry_works():
    """A chunk is still being written into the receiver's region when unregister() gives up
    (timeout_s 1 s, the chunk takes 8 s): it raises, and the region stays registered
    (listed, its memory kept) though no new chunk reaches it; retried while the chunk goes
    on it raises the same way, and once the chunk is done a retry unregisters it."""
    chunk = 256 << 10
    with TransferEngine(auth_token=TOKEN, timeout_s=1.0) as receiver, \
            TransferEngine(auth_token=TOKEN, streams=1, chunk_bytes=chunk, timeout_s=30) as sender:
        proxy = ThrottledProxy(receiver.address, rate=32 << 10)
        try:
            dst = torch.zeros(chunk, dtype=torch.uint8)
            region = receiver.register(dst, target=True)
            src = sender.register(torch.full((chunk,), 0xAB, dtype=torch.uint8))
            peer = sender.connect(proxy.address)
            t = sender.write(peer, src, 0, region.descriptor(), 0, chunk)
            wait_until(lambda: int(dst.count_nonzero()) > 0)
            for _ in range(2):
                with pytest.raises(TransferError, match="still in use by a chunk .* call unregister again"):
                    receiver.unregister(region)
                assert region in receiver.regions()
            proxy.released.set()
            t.wait(timeout=60)  # that chunk began before the unregister: it completes
            receiver.unregister(region)
            assert region not in receiver.regions()
            with pytest.raises(ValueError, match="not registered"):
                receiver.unregister(region)
            with pytest.raises(TransferError, match="unknown destination region"):
                sender.write(peer, src, 0, region.descriptor(), 0, 64).wait(timeout=60)
        finally:
            proxy.close()


def test_cancel_then_immediate_reuse_sees_no_stale_byte():
    """A transfer cancelled mid-flight: once cancel() returns, the destination is reused and
    no byte of the cancelled transfer lands in it afterwards."""
    nbytes = 32 << 20
    with TransferEngine(auth_token=TOKEN) as receiver, \
            TransferEngine(auth_token=TOKEN, streams=4, chunk_bytes=256 << 10, rate_limit_bps=400e6) as sender:
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        region = receiver.register(dst, target=True)
        src = sender.register(torch.full((nbytes,), 0xAB, dtype=torch.uint8))
        peer = sender.connect(receiver.address)
        t = sender.write(peer, src, 0, region.descriptor(), 0, nbytes)
        deadline = time.monotonic() + 60
        while t.bytes_acked < nbytes // 8:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        t.cancel()
        assert t.status == "cancelled"
        dst.zero_()  # reuse at once
        before = receiver.stats()["chunks_received"]
        time.sleep(0.5)  # what was still on the wire arrives (and is dropped) meanwhile
        assert int(dst.count_nonzero()) == 0
        assert receiver.stats()["chunks_received"] >= before  # the stream kept serving
        # The engines go on: a new transfer into the same region lands whole.
        sender.write(peer, src, 0, region.descriptor(), 0, 1 << 20).wait(timeout=60)
        assert int(dst[: 1 << 20].eq(0xAB).sum()) == 1 << 20


def test_notifications_are_told_apart_from_messages_and_name_their_engine():
    """A peer can send messages, but only a write it made can produce a notification; both
    carry the sender engine's id from its authenticated hello."""
    with TransferEngine(auth_token=TOKEN) as receiver, TransferEngine(auth_token=TOKEN) as sender:
        region = receiver.register(bytearray(64), target=True)
        peer = sender.connect(receiver.address)
        sender.send(peer, b"looks like a notification")
        sender.write(peer, sender.register(bytearray(b"k" * 64)), 0, region.descriptor(), 0, 64,
                     notify=b"applied").wait(timeout=30)
        got, deadline = [], time.monotonic() + 30
        while len(got) < 2:
            assert time.monotonic() < deadline
            got += receiver.poll_messages(timeout=1.0)
        assert [(m.payload, m.notification, m.sender_engine_id) for m in got] == [
            (b"looks like a notification", False, sender.engine_id), (b"applied", True, sender.engine_id)]


def test_idle_data_connections_are_closed_and_redialled_on_demand():
    """The receiver closes data connections idle for idle_timeout_s; the sender neither
    fails nor gives the link up, and dials again for its next write."""
    with TransferEngine(auth_token=TOKEN, idle_timeout_s=0.5) as receiver, \
            TransferEngine(auth_token=TOKEN, streams=2) as sender:
        dst, data = bytearray(1 << 20), os.urandom(1 << 20)
        region = receiver.register(dst, target=True)
        src = sender.register(bytearray(data))
        peer = sender.connect(receiver.address)
        sender.write(peer, src, 0, region.descriptor(), 0, 1 << 20).wait(timeout=30)
        deadline = time.monotonic() + 30
        while receiver.stats()["connections_idled"] < 2:  # both streams, after half a second of nothing
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for _ in range(3):  # again and again: an idle close is no failure
            dst[:] = bytes(len(dst))
            sender.write(peer, src, 0, region.descriptor(), 0, 1 << 20).wait(timeout=30)
            assert bytes(dst) == data
            time.sleep(0.7)
        assert sender.stats()["transfers_failed"] == 0 and peer.connected
        with python_handshake(receiver.address, TOKEN, kind=1) as idle:  # authenticated, then silent
            idle.settimeout(30)
            assert idle.recv(1) == b""  # closed by the receiver
