"""A WAN link on one machine: two network namespaces joined through a bandwidth cap
(`tc tbf`) and a propagation delay (a C++ delay line between two TUN devices), so that
kernel TCP between them sees a real bottleneck and a real round-trip time (slow start,
window growth, queueing, retransmits).

Topology (``<tag>`` is unique per link)::

    pddwan-<tag>-a              pddwan-<tag>-m                           pddwan-<tag>-b
    wan0 10.201.1.1 --veth-- to-a -> [tbf] dl-ab ==delay line==> dl-ba -> to-b --veth-- wan0 10.201.2.1
                                to-a <- dl-ab <==delay line== [tbf] dl-ba <- to-b

In the middle namespace, policy routing sends whatever arrives from ``to-a`` into the
TUN device ``dl-ab`` (whose tbf qdisc is the a->b bottleneck with its queue); the delay
line reads it there and, once the packet is due, writes it into ``dl-ba``, from where the
kernel forwards it to ``b``. The b->a direction is the mirror image. Both directions get
the same rate, delay, jitter and loss.

Example::

    from pddcore.testing.wan import WanLink

    with WanLink(rate="1gbit", delay_ms=25) as link:          # RTT 50 ms, 1 Gbit/s each way
        server = link.b.spawn(my_server, port=9000)           # Python callable inside b
        link.b.wait_port(9000)                                # until it listens
        link.a.call(my_client, link.b.address, 9000)          # ... and inside a
        link.a.run(["ip", "addr"])                            # a command inside a
        print(link.stats().a_to_b.forwarded_packets)

API in short:

- ``WanLink(rate="1gbit", delay_ms=25, jitter_ms=0, loss=0.0, *, mtu=1500, buffer_ms=None,
  seed=None, name=None, delay_line_cpu=None, offload=None)``; ``rate`` is a tc-style string
  ("100mbit", "10gbit", "500kbit"; "Mbps"-style means bytes/s as in tc), an int in bit/s,
  or None for no cap. ``delay_ms`` is the one-way delay (RTT = 2 x delay_ms). ``jitter_ms``
  (<= delay_ms) spreads each packet's one-way delay uniformly over
  [delay - jitter, delay + jitter] without ever reordering packets (a packet is never
  released before the one ahead of it, so at high packet rates delays cluster near the
  upper bound). ``loss`` drops each packet independently with that probability.
  ``buffer_ms`` sizes the bottleneck queue as time at line rate (default
  max(2 x (delay + jitter), 10) ms, about one bandwidth-delay product, what loss-based TCP
  needs for full rate). ``seed`` makes jitter/loss draws reproducible. ``offload``
  (default: on when loss == 0) lets TCP segmentation-offload batches of up to 64 KiB cross
  the delay line whole, as they cross a veth: the path then costs a fraction of the CPU
  per byte (a batch shares one delay; segments stay MTU-sized on the wire and in tbf's
  accounting). Off, every MTU-sized packet is read and written on its own, as loss
  needs. ``delay_line_cpu`` pins the delay line to one CPU.
- Entering (or ``open()``) builds everything and returns the link; leaving (or
  ``close()``) tears everything down, also after an exception, Ctrl-C, or SIGTERM (a
  SIGTERM handler is installed while the link is open if the program has none). A link
  left behind by a killed process is removed by the next WanLink that starts on the
  machine (or by ``pddcore wan down``).
- ``link.a`` / ``link.b`` (:class:`Endpoint`): ``netns``, ``address``, ``interface``,
  ``run(cmd)`` (``ip netns exec``; returns CompletedProcess), ``popen(cmd)``,
  ``call(fn, *args)`` (runs a Python callable in a forked child inside the namespace and
  returns its result), ``spawn(fn, *args)`` (same, in the background: a
  :class:`~pddcore.testing.netns.NamespaceProcess` with ``result(timeout)``/``kill()``),
  ``wait_port(port, udp=False)`` (until a server there listens: start the server with
  ``spawn``, wait, then connect from the other side). Anything started in a namespace is
  killed at teardown.
- ``link.stats()`` -> :class:`~pddcore.testing.delay_line.DelayLineStats` (per direction:
  received / forwarded / dropped_loss / dropped_overflow packets, queue depth);
  ``link.delay_line_pid``; ``link.rtt_ms``; ``link.rate_bps``.
- Several links can be up at once (each in its own namespaces, all with the same addresses).
- Module functions: ``unavailable_reason()`` (None, or why links cannot be built here: use
  it in ``pytest.mark.skipif``), ``parse_rate(rate)``, and from the registry of the links up
  on this machine (:mod:`pddcore.testing.wan_registry`): ``list_links()``,
  ``read_state(name)``, ``teardown(name)``, ``cleanup_stale()``.

Inside a and b, tcp_rmem/tcp_wmem allow 64 MiB so TCP autotuning can fill a 10 Gbit/s x
50 ms pipe: let autotuning work (don't set SO_RCVBUF/SO_SNDBUF, which net.core.rmem_max
caps). The congestion control is the host's default (net.ipv4.tcp_congestion_control);
change it per namespace with ``netns.write_sysctls(link.a.netns, {...})``.

Needs root with CAP_NET_ADMIN and CAP_SYS_ADMIN, `ip`/`tc` (iproute2) and /dev/net/tun;
otherwise WanUnavailable says what is missing. Callables run in forked children, so
closures work and nothing is pickled on the way in, but create sockets, engines and
threads inside the callable, not before. Forked helpers and the delay line die when the
thread that started them exits: open links from a thread that outlives them (the main
thread, normally). Setup takes about 0.2 s, teardown about 0.1 s.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import threading
from typing import Any, Callable, Sequence

from . import delay_line, netns
from .delay_line import DelayLineStats
from .netns import NamespaceCallError, NamespaceError, NamespaceProcess
# The registry's functions are part of this module's API (scripts import only wan).
from .wan_registry import (NS_PREFIX, cleanup_stale, link_alive, list_links, namespace, read_state, state_lock,
                           state_path, stats_path, teardown, write_state)

__all__ = ["WanLink", "Endpoint", "WanUnavailable", "NamespaceError", "NamespaceCallError", "NamespaceProcess",
           "DelayLineStats", "parse_rate", "tbf_burst_bytes", "unavailable_reason", "cleanup_stale", "teardown", "list_links",
           "link_alive", "read_state", "stats_path", "A_ADDRESS", "B_ADDRESS"]

A_ADDRESS, B_ADDRESS = "10.201.1.1", "10.201.2.1"
_A_GATEWAY, _B_GATEWAY = "10.201.1.254", "10.201.2.254"
_TCP_BUFFER_MAX = 64 << 20
_NAME_RE = re.compile(r"^[a-z0-9]{1,20}$")
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*$", re.IGNORECASE)
_RATE_UNITS = {"": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
_counter = iter(range(1 << 62))
_counter_lock = threading.Lock()


class WanUnavailable(RuntimeError):
    """This machine or process cannot build a WAN link (not root, no /dev/net/tun, no iproute2)."""


def unavailable_reason() -> str | None:
    """Why a WanLink cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "the WAN emulator needs root (network namespaces, TUN devices, tc)"
    if not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        return "the WAN emulator needs /dev/net/tun (TUN driver)"
    missing = [name for name, bit in (("CAP_NET_ADMIN", 12), ("CAP_SYS_ADMIN", 21)) if not _effective_caps() >> bit & 1]
    if missing:
        return f"the WAN emulator needs {' and '.join(missing)} (an unprivileged container has root without them)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the WAN emulator needs the `{tool}` tool (iproute2)"
    return None


def _effective_caps() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))


def parse_rate(rate: str | int | None) -> int | None:
    """Bits per second from a tc-style rate ("1gbit", "100mbit", "12.5MBps" = bytes/s),
    an int (bit/s), or None (no cap)."""
    if rate is None:
        return None
    if isinstance(rate, bool) or not isinstance(rate, (int, str)):
        raise TypeError(f"rate must be a string like '1gbit', an int in bit/s or None, not {type(rate).__name__}")
    if isinstance(rate, int):
        bits = rate
    else:
        match = _RATE_RE.match(rate)
        unit = match.group(2).lower() if match else None
        if unit not in _RATE_UNITS:
            raise ValueError(f"rate {rate!r} not understood: use a number with bit, kbit, mbit, gbit, tbit "
                             "(or bps, kbps, mbps, gbps for bytes/s)")
        bits = int(float(match.group(1)) * _RATE_UNITS[unit])
    if bits < 8000:
        raise ValueError(f"rate {rate!r} is below 8 kbit/s")
    return bits


def tbf_burst_bytes(rate_bps: int, mtu: int = 1500) -> int:
    """The token bucket a capped link's shaper holds: 1 ms of tokens, so timer slack costs no
    rate. After an idle moment this many bytes leave at once, so a short stretch of traffic
    can read above the rate by up to this much."""
    return max(int(rate_bps / 8 * 1e-3), 4 * mtu)


class Endpoint:
    """One end of a WanLink: its namespace, address, and ways to run things in it."""

    def __init__(self, link: "WanLink", side: str, netns_name: str, address: str, peer_address: str):
        self._link = link
        self.side = side
        self.netns = netns_name
        self.address = address
        self.peer_address = peer_address
        self.interface = "wan0"

    def __repr__(self) -> str:
        return f"Endpoint({self.side}: {self.address} in {self.netns})"

    def _argv(self, cmd: str | Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *(["sh", "-c", cmd] if isinstance(cmd, str) else cmd)]

    def run(self, cmd: str | Sequence[str], *, check: bool = True, capture_output: bool = True, text: bool = True,
            **kwargs: Any) -> subprocess.CompletedProcess:
        """Runs a command (argv list, or a string for `sh -c`) inside this namespace and waits."""
        return subprocess.run(self._argv(cmd), check=check, capture_output=capture_output, text=text, **kwargs)

    def popen(self, cmd: str | Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Starts a command inside this namespace (killed at teardown if still running)."""
        return subprocess.Popen(self._argv(cmd), **kwargs)

    def spawn(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> NamespaceProcess:
        """Runs `fn(*args, **kwargs)` in a forked child inside this namespace; returns at once."""
        return self._link._track(netns.spawn_in(self.netns, fn, *args, **kwargs))

    def wait_port(self, port: int, *, udp: bool = False, timeout: float = 10.0) -> None:
        """Waits until a server in this namespace listens on TCP `port` (or has bound UDP `port`),
        so a client in the other namespace can connect without racing it."""
        netns.wait_port(self.netns, port, udp=udp, timeout=timeout)

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Runs `fn(*args, **kwargs)` inside this namespace and returns its (picklable) result.
        On timeout the child is killed and TimeoutError raised."""
        proc = self.spawn(fn, *args, **kwargs)
        try:
            return proc.result(timeout)
        except TimeoutError:
            proc.kill()
            raise


class WanLink:
    """Two namespaces joined by an emulated WAN link; see the module docstring."""

    def __init__(self, rate: str | int | None = "1gbit", delay_ms: float = 25.0, jitter_ms: float = 0.0,
                 loss: float = 0.0, *, mtu: int = 1500, buffer_ms: float | None = None, seed: int | None = None,
                 name: str | None = None, delay_line_cpu: int | None = None, offload: bool | None = None):
        self.rate_bps = parse_rate(rate)
        for label, value in (("delay_ms", delay_ms), ("jitter_ms", jitter_ms)):
            if not 0 <= float(value) <= 60_000:
                raise ValueError(f"{label} must be within [0, 60000], got {value!r}")
        if jitter_ms > delay_ms:
            raise ValueError(f"jitter_ms ({jitter_ms}) must not exceed delay_ms ({delay_ms}): delays stay >= 0")
        if not 0.0 <= float(loss) < 1.0:
            raise ValueError(f"loss must be a probability in [0, 1), got {loss!r}")
        if not 576 <= int(mtu) <= 65000:
            raise ValueError(f"mtu must be within [576, 65000], got {mtu!r}")
        if buffer_ms is not None and not float(buffer_ms) > 0:
            raise ValueError(f"buffer_ms must be positive, got {buffer_ms!r}")
        if name is not None and not _NAME_RE.match(name):
            raise ValueError(f"name must be 1-20 characters of [a-z0-9], got {name!r}")
        if offload and loss:
            raise ValueError("offload=True cannot go with loss > 0: loss is drawn per packet, and with offload "
                             "a packet is a batch of up to 44 TCP segments")
        if delay_line_cpu is not None and not 0 <= delay_line_cpu < (os.cpu_count() or 1):
            raise ValueError(f"delay_line_cpu must name one of the {os.cpu_count()} CPUs, got {delay_line_cpu!r}")
        self.delay_ms = float(delay_ms)
        self.jitter_ms = float(jitter_ms)
        self.loss = float(loss)
        self.mtu = int(mtu)
        self.buffer_ms = float(buffer_ms) if buffer_ms is not None else max(2 * (self.delay_ms + self.jitter_ms), 10.0)
        self.seed = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed)
        self.delay_line_cpu = delay_line_cpu
        self.offload = (self.loss == 0) if offload is None else bool(offload)
        if name is None:
            with _counter_lock:
                name = f"{os.getpid()}x{next(_counter)}"
        self.name = name
        self.a = Endpoint(self, "a", namespace(name, "a"), A_ADDRESS, B_ADDRESS)
        self.b = Endpoint(self, "b", namespace(name, "b"), B_ADDRESS, A_ADDRESS)
        self.middle_netns = namespace(name, "m")
        self.delay_line_pid: int | None = None
        self._children: list[NamespaceProcess] = []
        self._open = False
        self._previous_sigterm: Any = None

    # -- public --------------------------------------------------------------------------

    @property
    def rtt_ms(self) -> float:
        """Configured round-trip propagation time (without queueing)."""
        return 2 * self.delay_ms

    @property
    def namespaces(self) -> tuple[str, str, str]:
        """(a, middle, b) namespace names."""
        return self.a.netns, self.middle_netns, self.b.netns

    @property
    def stats_path(self) -> str:
        return stats_path(self.name)

    def stats(self) -> DelayLineStats:
        """The delay line's counters (readable also after the delay line died)."""
        return delay_line.read_stats(self.stats_path)

    def __enter__(self) -> "WanLink":
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        rate = f"{self.rate_bps / 1e6:g} Mbit/s" if self.rate_bps else "uncapped"
        return (f"WanLink({self.name}: {rate}, delay {self.delay_ms:g} ms, jitter {self.jitter_ms:g} ms, "
                f"loss {self.loss:g}, {'open' if self._open else 'closed'})")

    def open(self, *, detach: bool = False) -> "WanLink":
        """Builds the link. `detach=True` leaves it up after this process exits (the delay line
        then owns it; `teardown(name)` or `pddcore wan down` removes it)."""
        if self._open:
            raise RuntimeError(f"{self!r} is already open")
        reason = unavailable_reason()
        if reason:
            raise WanUnavailable(reason)
        cleanup_stale()
        with state_lock():
            if any(netns.exists(ns) for ns in self.namespaces) or os.path.exists(state_path(self.name)):
                raise NamespaceError(f"a WAN link named {self.name!r} is already up (pddcore wan down --name {self.name})")
            self._write_state(owner=os.getpid())
        self._open = True
        if not detach:
            atexit.register(self.close)
            self._install_sigterm_handler()
        try:
            self._build(detach)
        except BaseException:
            self.close()
            raise
        if detach:
            self._write_state(owner=self.delay_line_pid)
            self._open = False  # this object no longer owns it
        return self

    def close(self) -> None:
        """Tears everything down: processes in the namespaces, the namespaces (and with them
        the veth pairs and TUN devices), the state files. Safe to call twice."""
        if not self._open:
            return
        self._open = False
        atexit.unregister(self.close)
        try:
            for child in self._children:
                child.kill()
            self._children.clear()
            if self.delay_line_pid is not None:
                # A delay line that already left its namespace while exiting is no longer
                # found through it; wait for it by pid so close() returns only once it is gone.
                netns.kill_processes([self.delay_line_pid])
            teardown(self.name)
        finally:
            self._restore_sigterm_handler()

    # -- building ------------------------------------------------------------------------

    def _build(self, detach: bool) -> None:
        ns_a, ns_m, ns_b = self.namespaces
        netns.ip_batch([f"netns add {ns}" for ns in self.namespaces])
        # No IPv6: link-local chatter would cross the delay line and muddle its counters.
        no_ipv6 = {"net.ipv6.conf.all.disable_ipv6": 1, "net.ipv6.conf.default.disable_ipv6": 1}
        # The TUN devices arrive later and must inherit rp_filter 0: delayed packets come back
        # in on a device that is not the route to their source.
        netns.write_sysctls(ns_m, {**no_ipv6, "net.ipv4.ip_forward": 1, "net.ipv4.conf.all.rp_filter": 0,
                                   "net.ipv4.conf.default.rp_filter": 0})
        tcp_buffers = {"net.ipv4.tcp_rmem": f"4096 131072 {_TCP_BUFFER_MAX}",
                       "net.ipv4.tcp_wmem": f"4096 16384 {_TCP_BUFFER_MAX}"}
        netns.write_sysctls(ns_a, {**no_ipv6, **tcp_buffers})
        netns.write_sysctls(ns_b, {**no_ipv6, **tcp_buffers})
        netns.ip_batch([
            "link set lo up",
            f"link add to-a mtu {self.mtu} type veth peer name wan0 mtu {self.mtu} netns {ns_a}",
            f"link add to-b mtu {self.mtu} type veth peer name wan0 mtu {self.mtu} netns {ns_b}",
            f"addr add {_A_GATEWAY}/24 dev to-a",
            f"addr add {_B_GATEWAY}/24 dev to-b",
            "link set to-a up",
            "link set to-b up",
        ], ns_m)
        for ep, gateway in ((self.a, _A_GATEWAY), (self.b, _B_GATEWAY)):
            netns.ip_batch(["link set lo up", f"addr add {ep.address}/24 dev wan0", "link set wan0 up",
                            f"route add default via {gateway}"], ep.netns)

        delay_line.create_stats_file(self.stats_path)
        self.delay_line_pid = delay_line.start(delay_line.DelayLineConfig(
            netns=ns_m, tun_a="dl-ab", tun_b="dl-ba", delay_ns=round(self.delay_ms * 1e6),
            jitter_ns=round(self.jitter_ms * 1e6), loss=self.loss, seed=self.seed,
            queue_bytes=self._delay_queue_bytes(), stats_path=self.stats_path,
            cpu=-1 if self.delay_line_cpu is None else self.delay_line_cpu, offload=self.offload), detach=detach)
        self._write_state(owner=os.getpid())

        # Whatever enters from one end goes into the TUN device of that direction; what the
        # delay line writes into a TUN device is routed normally (main table) to the far end.
        netns.ip_batch([
            # A long device queue rides out moments when the delay line is not scheduled.
            f"link set dl-ab mtu {self.mtu} txqueuelen 10000 up", f"link set dl-ba mtu {self.mtu} txqueuelen 10000 up",
            "rule add iif to-a lookup 100 pref 100", "rule add iif to-b lookup 101 pref 101",
            "route add default dev dl-ab table 100", "route add default dev dl-ba table 101",
        ], ns_m)
        if self.rate_bps:
            rate_bytes = self.rate_bps / 8
            burst = tbf_burst_bytes(self.rate_bps, self.mtu)
            limit = max(int(rate_bytes * self.buffer_ms * 1e-3), 2 * burst)
            for dev in ("dl-ab", "dl-ba"):
                netns.run_tool(["tc", "-n", ns_m, "qdisc", "replace", "dev", dev, "root", "tbf",
                                "rate", f"{self.rate_bps}bit", "burst", str(burst), "limit", str(limit)])

    def _delay_queue_bytes(self) -> int:
        # Holds everything in flight through the delay at line rate (10 Gbit/s when uncapped).
        rate_bytes = (self.rate_bps or 10_000_000_000) / 8
        in_flight = rate_bytes * (self.delay_ms + self.jitter_ms) * 1e-3
        return int(min(max(2 * in_flight + (4 << 20), 8 << 20), 1 << 31))

    def _track(self, proc: NamespaceProcess) -> NamespaceProcess:
        if not self._open:
            proc.kill()
            raise RuntimeError(f"{self!r} is not open")
        self._children.append(proc)
        return proc

    def _write_state(self, owner: int | None) -> None:
        write_state(self.name, {
            "name": self.name, "owner_pid": owner, "owner_start": netns.pid_start_time(owner),
            "delay_line_pid": self.delay_line_pid, "namespaces": list(self.namespaces), "rate_bps": self.rate_bps,
            "delay_ms": self.delay_ms, "jitter_ms": self.jitter_ms, "loss": self.loss, "mtu": self.mtu,
            "buffer_ms": self.buffer_ms, "offload": self.offload,
            "addresses": {"a": self.a.address, "b": self.b.address}})

    def _install_sigterm_handler(self) -> None:
        # SIGTERM's default action skips `finally`; turn it into SystemExit so teardown runs.
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _raise_system_exit)
            self._previous_sigterm = signal.SIG_DFL

    def _restore_sigterm_handler(self) -> None:
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is _raise_system_exit:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        self._previous_sigterm = None


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
