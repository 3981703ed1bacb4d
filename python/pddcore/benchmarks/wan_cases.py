"""WAN emulator benchmarks.

- Delay-line capacity: MTU-sized UDP datagrams blasted from a to b through an uncapped
  link whose delay line is pinned to one CPU; packets forwarded per CPU-second of the
  delay-line process (user + system time, so the kernel work its reads and writes cause
  is included), as a ratio to the packet rate 1 and 10 Gbit/s need at that MTU.
- Bulk TCP: one plain-socket stream a -> b through a rate-capped link, goodput over the
  steady-state second half of the run as a ratio to the line rate; the same stream through
  an uncapped, zero-delay link is the in-run ceiling of this machine, with TSO batches
  crossing the delay line whole (offload, the default) and with every packet on its own.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass

from ..testing.wan import WanLink
from .results import Result

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime + stime


def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


_UDP_SEGMENT = 103  # linux/udp.h: one send() becomes many MTU-sized datagrams (UDP GSO)


def _udp_blast(address: str, port: int, payload: int, seconds: float, cpu: int | None) -> None:
    # UDP GSO keeps a Python sender ahead of the delay line: the kernel cuts every 64 KiB send
    # into MTU-sized datagrams before they reach the TUN device (which takes no UDP offload).
    _pin(cpu)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_UDP, _UDP_SEGMENT, payload)
    s.connect((address, port))
    data = bytes(payload * min(64, 65000 // payload))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(64):
            try:
                s.send(data)
            except OSError:  # ENOBUFS: the local queue is full, the delay line saturated
                pass


def _udp_hold(port: int, seconds: float) -> None:
    # A bound socket that never reads: b's kernel drops the overflow without ICMP replies.
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("0.0.0.0", port))
    time.sleep(seconds)


@dataclass
class DelayLineResult(Result):
    mtu: int
    forwarded_packets: int
    cpu_seconds: float
    wall_seconds: float
    pps_per_core: float
    pps_needed_1g: float
    pps_needed_10g: float

    @property
    def ratio_1g(self) -> float:
        return self.pps_per_core / self.pps_needed_1g

    @property
    def ratio_10g(self) -> float:
        return self.pps_per_core / self.pps_needed_10g


def delay_line_capacity(mtu: int, seconds: float = 3.0) -> DelayLineResult:
    cpus = sorted(os.sched_getaffinity(0))
    line_cpu, sender_cpu = cpus[0], (cpus[1] if len(cpus) > 1 else None)
    with WanLink(rate=None, delay_ms=1, mtu=mtu, delay_line_cpu=line_cpu) as link:
        hold = link.b.spawn(_udp_hold, 9100, seconds + 2)
        link.b.wait_port(9100, udp=True)
        before = link.stats().a_to_b.forwarded_packets, _cpu_seconds(link.delay_line_pid), time.monotonic()
        link.a.call(_udp_blast, link.b.address, 9100, mtu - 28, seconds, sender_cpu)
        time.sleep(0.05)  # let the last delayed packets out
        after = link.stats().a_to_b.forwarded_packets, _cpu_seconds(link.delay_line_pid), time.monotonic()
        hold.kill()
    packets, cpu, wall = (after[i] - before[i] for i in range(3))
    wire_bits = mtu * 8
    return DelayLineResult(mtu, packets, cpu, wall, packets / max(cpu, 1e-9), 1e9 / wire_bits, 1e10 / wire_bits)


def _tcp_receive(port: int, streams: int = 1) -> list[tuple[float, int]]:
    """Accepts ``streams`` connections and drains them; (seconds, bytes so far, all
    connections together) every 50 ms from the first accept."""
    ls = socket.socket()
    ls.bind(("0.0.0.0", port))
    ls.listen(streams)
    conns = [ls.accept()[0] for _ in range(streams)]
    received = [0] * streams

    def drain(i: int) -> None:
        buf = bytearray(4 << 20)
        while n := conns[i].recv_into(buf):
            received[i] += n

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(streams)]
    start = time.monotonic()
    for t in threads:
        t.start()
    samples = []
    while any(t.is_alive() for t in threads):
        time.sleep(0.05)
        samples.append((time.monotonic() - start, sum(received)))
    samples.append((time.monotonic() - start, sum(received)))
    return samples


def _tcp_send(address: str, port: int, seconds: float, streams: int = 1) -> None:
    # No SO_SNDBUF/SO_RCVBUF: autotuning (tcp_wmem/tcp_rmem up to 64 MiB in the namespaces)
    # grows the windows to the bandwidth-delay product; setting them would cap at rmem_max.
    socks = [socket.create_connection((address, port)) for _ in range(streams)]
    data = bytes(4 << 20)
    end = time.monotonic() + seconds

    def send(s: socket.socket) -> None:
        while time.monotonic() < end:
            s.sendall(data)
        s.close()

    threads = [threading.Thread(target=send, args=(s,)) for s in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@dataclass
class TcpResult(Result):
    offload: bool
    streams: int
    rate_bps: int | None
    rtt_ms: float
    seconds: float
    avg_gbps: float  # whole run, slow start included
    steady_gbps: float  # second half of the run

    @property
    def ratio(self) -> float:
        return self.steady_gbps * 1e9 / self.rate_bps if self.rate_bps else float("nan")


def bulk_tcp(rate: str | None, delay_ms: float, seconds: float = 6.0, offload: bool = True,
             mtu: int = 1500, streams: int = 1) -> TcpResult:
    """Plain TCP bulk through a WanLink over ``streams`` connections: what raw sockets reach."""
    with WanLink(rate=rate, delay_ms=delay_ms, offload=offload, mtu=mtu) as link:
        receiver = link.b.spawn(_tcp_receive, 9200, streams)
        link.b.wait_port(9200)
        link.a.call(_tcp_send, link.b.address, 9200, seconds, streams)
        samples = receiver.result(60)
        rate_bps = link.rate_bps
    end_t, total = samples[-1]
    mid_t, mid_total = next(s for s in samples if s[0] >= end_t / 2)
    return TcpResult(offload, streams, rate_bps, 2 * delay_ms, end_t, total * 8 / end_t / 1e9,
                     (total - mid_total) * 8 / (end_t - mid_t) / 1e9)
