"""WAN emulator: the delay line on its own (socket pairs, no root needed) and WanLink end to
end (namespaces, tbf, TUN delay line; needs root and /dev/net/tun, else skipped)."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

from pddcore import _C
from pddcore.cli import main as cli_main
from pddcore.testing import delay_line, netns, wan
from pddcore.testing.wan import WanLink

_REASON = wan.unavailable_reason()
needs_root = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
STAT_NAMES = list(_C.delay_line_stat_names())
MS = 1_000_000


# ---------------------------------------------------------------- helpers run in namespaces


def udp_receive(port: int, count: int, idle_s: float = 1.0) -> list[tuple[int, int, bytes]]:
    """(sequence number, one-way delay in ns, payload) per datagram, in arrival order."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    s.bind(("0.0.0.0", port))
    s.settimeout(idle_s)
    got = []
    while len(got) < count:
        try:
            data = s.recv(65536)
        except socket.timeout:
            break
        now = time.monotonic_ns()
        got.append((int.from_bytes(data[:4], "little"), now - int.from_bytes(data[4:12], "little"), data[12:]))
    return got


def udp_send(address: str, port: int, payloads: list[bytes], gap_s: float, burst: int = 1) -> None:
    """Sends `burst` datagrams, sleeps `gap_s`, and so on."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for seq, payload in enumerate(payloads):
        s.sendto(seq.to_bytes(4, "little") + time.monotonic_ns().to_bytes(8, "little") + payload, (address, port))
        if (seq + 1) % burst == 0:
            time.sleep(gap_s)


def udp_echo(port: int, count: int) -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    s.settimeout(5)
    for _ in range(count):
        data, peer = s.recvfrom(2048)
        s.sendto(data, peer)
    return count


def udp_ping(address: str, port: int, count: int) -> list[float]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(5)
    rtts = []
    for i in range(count):
        start = time.perf_counter()
        s.sendto(i.to_bytes(4, "little"), (address, port))
        assert s.recv(2048) == i.to_bytes(4, "little")
        rtts.append((time.perf_counter() - start) * 1e3)
    return rtts


def tcp_sink(port: int) -> str:
    ls = socket.socket()
    ls.bind(("0.0.0.0", port))
    ls.listen(1)
    conn, _ = ls.accept()
    digest = hashlib.sha256()
    while chunk := conn.recv(1 << 20):
        digest.update(chunk)
    return digest.hexdigest()


def tcp_source(address: str, port: int, data: bytes) -> None:
    with socket.create_connection((address, port), timeout=10) as s:
        s.sendall(data)


def root_links() -> set[str]:
    return {line.split(":")[1].strip().split("@")[0] for line in
            subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines()}


def assert_gone(link: WanLink, delay_line_pid: int, links_before: set[str]) -> None:
    assert not any(netns.exists(ns) for ns in link.namespaces), netns.list_namespaces()
    assert not netns.pid_alive(delay_line_pid)
    assert root_links() == links_before
    assert link.name not in wan.list_links()
    assert not os.path.exists(link.stats_path)


# ------------------------------------------------------------ delay line on socket pairs


class SocketPairLine:
    """The delay line between two AF_UNIX datagram socket pairs, in a thread of this process."""

    def __init__(self, delay_ms: float, jitter_ms: float = 0.0, loss: float = 0.0, queue_bytes: int = 4 << 20):
        self.a_app, a_line = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.b_app, b_line = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._stop_r, self._stop_w = os.pipe()
        self.stats = np.zeros(len(STAT_NAMES), dtype=np.uint64)
        self._keep = (a_line, b_line)
        self._thread = threading.Thread(target=_C.run_delay_line, args=(
            a_line.fileno(), b_line.fileno(), self._stop_r, int(delay_ms * MS), int(jitter_ms * MS), loss, 7,
            queue_bytes, self.stats))
        self._thread.start()
        while self.stats[STAT_NAMES.index("state")] != 1:  # running, or the test fails here, not hangs
            if not self._thread.is_alive():
                raise AssertionError("the delay line thread ended at start")
            time.sleep(0.001)

    def stop(self) -> dict[str, int]:
        os.write(self._stop_w, b"x")
        self._thread.join()
        for fd in (self._stop_r, self._stop_w):
            os.close(fd)
        for s in (self.a_app, self.b_app, *self._keep):
            s.close()
        return dict(zip(STAT_NAMES, self.stats.tolist()))


def test_delay_line_forwards_in_order_within_delay_bounds():
    line = SocketPairLine(delay_ms=6, jitter_ms=3)
    sent = [os.urandom(n) for n in np.random.default_rng(1).integers(1, 3000, size=200)]
    receiver = threading.Thread(target=lambda: results.extend(_recv_all(line.b_app, len(sent))))
    results: list[tuple[int, int, bytes]] = []
    receiver.start()
    for seq, payload in enumerate(sent):
        line.a_app.send(seq.to_bytes(4, "little") + time.monotonic_ns().to_bytes(8, "little") + payload)
        time.sleep(0.001)
    receiver.join()
    stats = line.stop()
    assert [r[0] for r in results] == list(range(len(sent)))
    assert [r[2] for r in results] == sent
    delays = np.array([r[1] for r in results]) / MS
    assert delays.min() >= 6 - 3 - 0.05, "a packet left before delay - jitter"
    assert np.percentile(delays, 90) - np.percentile(delays, 10) > 1.5, "jitter had no effect"
    assert stats["state"] == 2 and stats["a_to_b.forwarded_packets"] == len(sent)
    assert stats["a_to_b.received_bytes"] == sum(len(p) + 12 for p in sent)
    assert stats["b_to_a.received_packets"] == 0 and stats["a_to_b.queue_packets"] == 0


def _recv_all(sock: socket.socket, count: int, idle_s: float = 2.0) -> list[tuple[int, int, bytes]]:
    sock.settimeout(idle_s)
    out = []
    while len(out) < count:
        try:
            data = sock.recv(65536)
        except socket.timeout:
            break
        out.append((int.from_bytes(data[:4], "little"), time.monotonic_ns() - int.from_bytes(data[4:12], "little"),
                    data[12:]))
    return out


def test_delay_line_loss_rate_and_overflow_counting():
    line = SocketPairLine(delay_ms=0.2, loss=0.25)
    n = 4000
    results: list = []
    receiver = threading.Thread(target=lambda: results.extend(_recv_all(line.b_app, n, idle_s=0.3)))
    receiver.start()
    for seq in range(n):
        line.a_app.send(seq.to_bytes(4, "little") + bytes(8))  # blocks while the line lags: no loss here
    receiver.join()
    stats = line.stop()
    lost = stats["a_to_b.dropped_loss"]
    sigma = (n * 0.25 * 0.75) ** 0.5
    assert abs(lost - n * 0.25) < 5 * sigma, lost
    assert stats["a_to_b.received_packets"] == n
    assert len(results) == stats["a_to_b.forwarded_packets"] == n - lost - stats["a_to_b.dropped_overflow"]
    seqs = [r[0] for r in results]
    assert seqs == sorted(seqs)


@pytest.mark.parametrize("seed", [0, 1])
def test_delay_line_ring_wraps_without_corrupting_packets(seed):
    # A ring of ~2.5 max-size slots and packets of every size up to 60 KB: the ring wraps
    # constantly and fills now and then; what comes out must be exactly what went in, in order.
    line = SocketPairLine(delay_ms=0.5, queue_bytes=160 << 10)
    sizes = np.random.default_rng(seed).integers(1, 60_000, size=300)
    sent = [np.random.default_rng(seed + i).bytes(int(n)) for i, n in enumerate(sizes)]
    results: list = []
    receiver = threading.Thread(target=lambda: results.extend(_recv_all(line.b_app, len(sent), idle_s=0.5)))
    receiver.start()
    for seq, payload in enumerate(sent):
        line.a_app.send(seq.to_bytes(4, "little") + bytes(8) + payload)
        if seq % 4 == 3:
            time.sleep(0.002)  # lets the line drain now and then, so enough gets through to wrap the ring
    receiver.join()
    stats = line.stop()
    seqs = [r[0] for r in results]
    assert seqs == sorted(seqs) and len(seqs) == len(set(seqs))
    assert all(payload == sent[seq] for seq, _, payload in results)
    assert len(results) == stats["a_to_b.forwarded_packets"] == len(sent) - stats["a_to_b.dropped_overflow"]
    assert sum(len(r[2]) for r in results) > 3 * (160 << 10), "the ring never wrapped"


def test_delay_line_counts_overflow_when_queue_is_full():
    line = SocketPairLine(delay_ms=300, queue_bytes=140 << 10)  # room for little more than one max-size slot
    for seq in range(200):
        line.a_app.send(seq.to_bytes(4, "little") + bytes(1000))
    time.sleep(0.05)
    stats = line.stop()
    assert stats["a_to_b.received_packets"] == 200
    assert stats["a_to_b.dropped_overflow"] > 0
    assert stats["a_to_b.max_queue_packets"] + stats["a_to_b.dropped_overflow"] == 200


def test_delay_line_rejects_bad_configuration():
    stats = np.zeros(len(STAT_NAMES), dtype=np.uint64)
    r, w = os.pipe()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        ok = dict(fd_a=a.fileno(), fd_b=b.fileno(), stop_fd=r, delay_ns=MS, jitter_ns=0, loss=0.0, seed=1,
                  queue_bytes=1 << 20, stats=stats)
        for bad, message in [(dict(jitter_ns=2 * MS), "jitter"), (dict(loss=1.0), "loss"),
                             (dict(loss=-0.1), "loss"), (dict(queue_bytes=1000), "at least"),
                             (dict(fd_a=9999), "file descriptor"), (dict(fd_b=a.fileno()), "differ"),
                             (dict(stats=stats[:3]), "stats array"), (dict(cpu=-5), "cpu")]:
            with pytest.raises(ValueError, match=message):
                _C.run_delay_line(**{**ok, **bad})
        with pytest.raises(TypeError):  # counters must be written in place: no silent copy
            _C.run_delay_line(**{**ok, "stats": stats.astype(np.int64)})
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()


# --------------------------------------------------------------------- argument checking


@pytest.mark.parametrize("text, bits", [("1gbit", 10**9), ("100mbit", 10**8), ("2.5Gbit", 25 * 10**8),
                                        ("500kbit", 5 * 10**5), ("12.5MBps", 10**8), ("64000", 64000),
                                        (10**9, 10**9), (None, None)])
def test_parse_rate(text, bits):
    assert wan.parse_rate(text) == bits


@pytest.mark.parametrize("kwargs, message", [
    (dict(rate="fast"), "not understood"), (dict(rate="1gbyte"), "not understood"), (dict(rate=100), "below"),
    (dict(rate=1.5), "rate must be"), (dict(delay_ms=-1), "delay_ms"), (dict(delay_ms=5, jitter_ms=6), "exceed"),
    (dict(loss=1.0), "loss"), (dict(mtu=100), "mtu"), (dict(name="Bad_Name"), "name"),
    (dict(buffer_ms=0), "buffer_ms"), (dict(delay_line_cpu=10_000), "delay_line_cpu"),
    (dict(loss=0.1, offload=True), "offload")])
def test_bad_arguments_are_rejected(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        WanLink(**kwargs)


def test_clear_error_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in wan.unavailable_reason()
    with pytest.raises(wan.WanUnavailable, match="needs root"):
        WanLink().open()


# ------------------------------------------------------------------------ end to end


@needs_root
@pytest.mark.parametrize("offload", [True, False], ids=["offload", "per-packet"])
def test_rtt_is_twice_the_delay_and_tcp_bytes_arrive_intact(offload):
    with WanLink(rate="1gbit", delay_ms=10, offload=offload) as link:
        echo = link.b.spawn(udp_echo, 7000, 15)
        link.b.wait_port(7000, udp=True)
        rtts = sorted(link.a.call(udp_ping, link.b.address, 7000, 15, timeout=30))
        assert echo.result(10) == 15
        assert rtts[0] >= 20 - 0.1, "faster than light: the delay line released packets early"
        assert rtts[len(rtts) // 2] < 20 + 15, rtts  # generous: the machine is shared

        data = os.urandom(12 << 20)  # more than the delay queue: its ring wraps
        sink = link.b.spawn(tcp_sink, 7001)
        link.b.wait_port(7001)
        link.a.call(tcp_source, link.b.address, 7001, data, timeout=60)
        assert sink.result(30) == hashlib.sha256(data).hexdigest()
        stats = link.stats()
        assert stats.state == "running"
        assert stats.a_to_b.forwarded_bytes >= len(data)
        assert stats.a_to_b.dropped_loss == stats.a_to_b.write_errors == 0
        # Offload moves TSO batches: far fewer, larger reads than MTU-sized packets.
        per_packet = stats.a_to_b.forwarded_bytes / stats.a_to_b.forwarded_packets
        assert per_packet > 3000 if offload else per_packet <= 1500


@needs_root
def test_jitter_keeps_order_and_bounds_and_udp_payloads_intact():
    payloads = [os.urandom(n) for n in np.random.default_rng(3).integers(1, 1460, size=300)]
    with WanLink(rate="100mbit", delay_ms=6, jitter_ms=4, seed=11) as link:
        receiver = link.b.spawn(udp_receive, 7002, len(payloads))
        link.b.wait_port(7002, udp=True)
        link.a.call(udp_send, link.b.address, 7002, payloads, 0.002, timeout=30)
        got = receiver.result(30)
        stats = link.stats()
    assert [g[0] for g in got] == list(range(len(payloads))), "lost or reordered"
    assert [g[2] for g in got] == payloads
    delays = np.array([g[1] for g in got]) / MS
    assert delays.min() >= 6 - 4 - 0.05
    assert np.percentile(delays, 90) - np.percentile(delays, 10) > 2, "no jitter"
    assert stats.a_to_b.forwarded_packets >= len(payloads)


@needs_root
def test_loss_rate_within_statistical_tolerance():
    n, p = 3000, 0.2
    with WanLink(rate="1gbit", delay_ms=1, loss=p) as link:
        receiver = link.b.spawn(udp_receive, 7003, n, idle_s=0.5)
        link.b.wait_port(7003, udp=True)
        link.a.call(udp_send, link.b.address, 7003, [bytes(200)] * n, 0.001, 100, timeout=30)
        got = receiver.result(30)
        lane = link.stats().a_to_b
    assert lane.received_packets == n and lane.dropped_overflow == 0
    assert abs(lane.dropped_loss - n * p) < 5 * (n * p * (1 - p)) ** 0.5, lane
    assert len(got) == n - lane.dropped_loss, "packets lost outside the delay line"
    assert [g[0] for g in got] == sorted(g[0] for g in got)


@needs_root
def test_teardown_removes_everything_also_after_exception_and_killed_delay_line():
    before = root_links()
    with pytest.raises(RuntimeError, match="boom"):
        with WanLink(rate="10mbit", delay_ms=1) as link:
            pid = link.delay_line_pid
            sleeper = link.a.popen(["sleep", "60"])
            helper = link.b.spawn(time.sleep, 60)
            assert netns.pid_alive(pid) and set(netns.list_namespaces()) >= set(link.namespaces)
            assert "dl-ab" in link.a.run(["ip", "-n", link.middle_netns, "link"]).stdout
            raise RuntimeError("boom")
    assert_gone(link, pid, before)
    assert sleeper.wait(5) is not None and not helper.alive

    with WanLink(rate="10mbit", delay_ms=1) as link:
        pid = link.delay_line_pid
        os.kill(pid, signal.SIGKILL)
        for _ in range(500):
            if "dl-ab" not in subprocess.run(["ip", "-n", link.middle_netns, "link"], capture_output=True,
                                             text=True).stdout:
                break
            time.sleep(0.01)
        else:
            raise AssertionError("TUN device outlived the delay line")
    assert_gone(link, pid, before)


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_owner_killed_by_signal_leaves_nothing_after_next_start(sig):
    before = root_links()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_fd)
            with WanLink(rate="10mbit", delay_ms=1) as link:
                os.write(write_fd, f"{link.name} {link.delay_line_pid}\n".encode())
                time.sleep(30)
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        name, dl_pid = pipe.readline().split()
    os.kill(pid, sig)
    os.waitpid(pid, 0)
    namespaces = [f"{wan.NS_PREFIX}{name}-{s}" for s in "amb"]
    if sig == signal.SIGKILL:  # no chance to clean up: the next link must sweep it
        assert all(netns.exists(ns) for ns in namespaces)
        with WanLink(rate=None, delay_ms=0):
            pass
    assert not any(netns.exists(ns) for ns in namespaces)
    assert name not in wan.list_links()
    for _ in range(500):  # the delay line dies with its owner
        if not netns.pid_alive(int(dl_pid)):
            break
        time.sleep(0.01)
    assert not netns.pid_alive(int(dl_pid))
    assert root_links() == before


@needs_root
def test_callable_errors_come_back_with_the_remote_traceback():
    with WanLink(rate=None, delay_ms=0) as link:
        with pytest.raises(TimeoutError, match="port 7009"):
            link.a.wait_port(7009, timeout=0.05)
        assert link.a.call(lambda: socket.gethostbyname("localhost")) == "127.0.0.1"
        addresses = link.b.run(["ip", "-4", "-o", "addr"]).stdout
        assert link.b.address in addresses and link.a.address not in addresses
        with pytest.raises(netns.NamespaceCallError, match="ZeroDivisionError") as info:
            link.a.call(lambda: 1 / 0)
        assert "1 / 0" in info.value.remote_traceback
        with pytest.raises(TimeoutError):
            link.a.call(time.sleep, 10, timeout=0.2)
        victim = link.b.spawn(time.sleep, 10)
        victim.kill()
        with pytest.raises(netns.NamespaceCallError, match="SIGKILL"):
            victim.result()


@needs_root
def test_cli_up_status_down(capsys):
    name = f"cli{os.getpid()}"
    assert cli_main(["wan", "up", "--name", name, "--rate", "50mbit", "--delay-ms", "3", "--no-offload"]) == 0
    try:
        assert wan.link_alive(name)
        state = wan.read_state(name)
        out = subprocess.run(["ip", "netns", "exec", f"{wan.NS_PREFIX}{name}-a", "python", "-c",
                              "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                              f"s.sendto(b'x' * 100, ('{wan.B_ADDRESS}', 9))"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        time.sleep(0.05)
        assert cli_main(["wan", "status", "--name", name]) == 0
        text = capsys.readouterr().out
        assert f"{name}: up, 50 Mbit/s, delay 3.0 ms" in text
        assert "a_to_b: forwarded 1 pkts / 128 B" in text  # 100 B payload + UDP/IP headers
        with pytest.raises(netns.NamespaceError, match="already up"):
            WanLink(name=name).open()
    finally:
        assert cli_main(["wan", "down", "--name", name]) == 0
    assert not netns.pid_alive(state["delay_line_pid"])
    assert name not in wan.list_links()
    assert cli_main(["wan", "down", "--name", name]) == 1
