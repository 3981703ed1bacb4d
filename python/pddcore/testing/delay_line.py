"""The delay-line process of the WAN emulator.

A forked child enters a namespace, creates two TUN devices there and runs
`pddcore._C.run_delay_line` on them (C++, GIL released): every packet the kernel routes
into one device comes out of the other after the configured delay, with optional bounded,
order-preserving jitter and random loss. The TUN devices are not persistent, so they
vanish with the process. Counters live in a small file the loop keeps mapped and updates
on every turn; `read_stats(path)` reads it from any process, also after the delay line died.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import select
import signal
import struct
from dataclasses import dataclass, fields

import numpy as np

from .. import _C
from . import netns

_TUNSETIFF = 0x400454CA
_TUNSETOFFLOAD = 0x400454D0
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_IFF_VNET_HDR = 0x4000
_TUN_F_CSUM, _TUN_F_TSO4, _TUN_F_TSO6 = 0x01, 0x02, 0x04
_STATS_FILE_BYTES = 4096
_STAT_NAMES: list[str] = list(_C.delay_line_stat_names())
_STATES = {0: "starting", 1: "running", 2: "stopped"}


@dataclass(frozen=True)
class LaneStats:
    """Counters of one direction of the delay line. A packet is what one read of the TUN device
    returns: an IP packet, or with offload a TSO batch of up to 64 KiB plus a 10-byte header."""

    received_packets: int
    received_bytes: int
    forwarded_packets: int
    forwarded_bytes: int
    dropped_loss: int  # dropped by the random loss draw
    dropped_overflow: int  # arrived while the delay queue was full
    write_errors: int  # rejected by the outgoing device
    queue_packets: int  # in the delay queue right now
    queue_bytes: int
    max_queue_packets: int


@dataclass(frozen=True)
class DelayLineStats:
    state: str  # "starting", "running" or "stopped"
    loops: int  # turns of the event loop
    a_to_b: LaneStats
    b_to_a: LaneStats


def create_stats_file(path: str) -> None:
    with open(path, "wb") as f:
        f.truncate(_STATS_FILE_BYTES)


def read_stats(path: str) -> DelayLineStats:
    """Reads the counters a delay line publishes into `path`."""
    with open(path, "rb") as f:
        raw = f.read(8 * len(_STAT_NAMES))
    values = dict(zip(_STAT_NAMES, struct.unpack(f"={len(_STAT_NAMES)}Q", raw)))
    lane = {d: LaneStats(**{f.name: values[f"{d}.{f.name}"] for f in fields(LaneStats)}) for d in ("a_to_b", "b_to_a")}
    return DelayLineStats(_STATES.get(values["state"], "unknown"), values["loops"], lane["a_to_b"], lane["b_to_a"])


def open_tun(name: str, offload: bool = False) -> int:
    """Creates the (non-persistent) TUN device `name` in the current namespace; returns its fd.

    With `offload`, the device takes and hands over TCP segmentation-offload batches (up to
    64 KiB, each prefixed by a 10-byte virtio-net header that the delay line passes through
    untouched) instead of MTU-sized packets: far fewer packets to move per byte.
    """
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    flags = _IFF_TUN | _IFF_NO_PI | (_IFF_VNET_HDR if offload else 0)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), flags))
        if offload:
            fcntl.ioctl(fd, _TUNSETOFFLOAD, _TUN_F_CSUM | _TUN_F_TSO4 | _TUN_F_TSO6)
    except OSError:
        os.close(fd)
        raise
    return fd


@dataclass(frozen=True)
class DelayLineConfig:
    netns: str  # namespace the TUN devices are created in
    tun_a: str  # packets routed into tun_a leave through tun_b after the delay, and back
    tun_b: str
    delay_ns: int
    jitter_ns: int
    loss: float
    seed: int
    queue_bytes: int  # per direction
    stats_path: str
    cpu: int = -1  # pin to this CPU; -1: no pinning
    offload: bool = False  # TSO batches instead of MTU packets (see open_tun)


def start(config: DelayLineConfig, *, detach: bool = False, ready_timeout_s: float = 10.0) -> int:
    """Forks the delay line and returns its pid once both TUN devices exist.

    Attached (default): the process is our child and dies with us. Detached: it runs in its own
    session, is re-parented to init and outlives us (used by `pddcore wan up`).
    Raises netns.NamespaceError with the child's message when it could not start.
    """
    parent = os.getpid()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(config, write_fd, parent, detach)  # never returns
    os.close(write_fd)
    try:
        reply = _read_line(read_fd, ready_timeout_s)
    finally:
        os.close(read_fd)
    if detach:
        os.waitpid(pid, 0)  # the intermediate process exits once the grandchild is running
    if reply.startswith("ok "):
        return int(reply.split()[1])
    if not detach:
        netns.kill_processes([pid], grace_s=0.0)
    raise netns.NamespaceError(f"delay line did not start: {reply or 'no answer'}")


def _read_line(fd: int, timeout_s: float) -> str:
    data = b""
    while not data.endswith(b"\n"):
        if not select.select([fd], [], [], timeout_s)[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def error_path(stats_path: str) -> str:
    """File where a delay line that stopped on an error leaves the reason."""
    return stats_path + ".error"


def _record_error(stats_path: str, exc: BaseException) -> None:
    try:
        with open(error_path(stats_path), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}\n")
    except OSError:
        pass


def _child(config: DelayLineConfig, reply_fd: int, parent: int, detach: bool) -> None:
    status = 1
    try:
        if detach:
            os.setsid()
            if os.fork() != 0:
                status = 0
                return
            devnull = os.open(os.devnull, os.O_RDWR)
            for std in (0, 1, 2):
                os.dup2(devnull, std)
        else:
            netns.die_with_parent(parent)
        stop_read, stop_write = os.pipe()
        os.set_blocking(stop_write, False)
        # A signal makes the C handler write to stop_write, which ends the (GIL-free) loop.
        signal.set_wakeup_fd(stop_write)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: None)
        try:
            netns.enter(config.netns)
            fd_a, fd_b = open_tun(config.tun_a, config.offload), open_tun(config.tun_b, config.offload)
            stats_file = open(config.stats_path, "r+b")
            stats = np.frombuffer(mmap.mmap(stats_file.fileno(), _STATS_FILE_BYTES), dtype=np.uint64)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            os.write(reply_fd, f"error {type(exc).__name__}: {exc}\n".encode())
            return
        os.write(reply_fd, f"ok {os.getpid()}\n".encode())
        os.close(reply_fd)
        _C.run_delay_line(fd_a, fd_b, stop_read, config.delay_ns, config.jitter_ns, config.loss, config.seed,
                          config.queue_bytes, stats[: len(_STAT_NAMES)], config.cpu)
        status = 0
    except BaseException as exc:  # noqa: BLE001 - a child must never return into the parent's code
        _record_error(config.stats_path, exc)
    finally:
        os._exit(status)
