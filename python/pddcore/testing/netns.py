"""Network-namespace plumbing for the WAN emulator: the `ip` tool, entering a namespace
from a forked child, running Python callables inside a namespace, and ending every
process a namespace holds.

Namespaces are the named ones `ip netns add` creates (bind mounts under /run/netns).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import select
import signal
import subprocess
import time
import traceback
from typing import Any, Callable, Sequence

NETNS_DIR = "/run/netns"
_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


class NamespaceError(RuntimeError):
    """An `ip`/`tc` command or a namespace operation failed."""


class NamespaceCallError(RuntimeError):
    """A callable run in a namespace raised, or its process died before answering.
    `remote_traceback` holds the child's traceback text when there is one."""

    def __init__(self, message: str, remote_traceback: str = ""):
        super().__init__(message + (f"\n--- traceback in the namespace ---\n{remote_traceback}" if remote_traceback else ""))
        self.remote_traceback = remote_traceback


def run_tool(argv: Sequence[str], stdin: str | None = None) -> str:
    """Runs `ip`/`tc`/`sysctl` and returns stdout; raises NamespaceError with stderr on failure."""
    proc = subprocess.run(list(argv), input=stdin, capture_output=True, text=True)
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise NamespaceError(f"{' '.join(argv)} failed (exit {proc.returncode}): {detail}")
    return proc.stdout


def ip_batch(commands: Sequence[str], netns: str | None = None) -> None:
    """Runs several `ip` commands in one process (`ip -batch`), optionally inside `netns`."""
    run_tool(["ip", *(["-n", netns] if netns else []), "-batch", "-"], stdin="\n".join(commands) + "\n")


def write_sysctls(netns_name: str, values: dict[str, object]) -> None:
    """Sets net.* sysctls inside `netns_name` (through /proc/sys from a child in that namespace,
    so no `sysctl` tool is needed). Keys the kernel lacks (e.g. IPv6 ones) are skipped."""
    spawn_in(netns_name, _write_proc_sys, values).result()


def _write_proc_sys(values: dict[str, object]) -> None:
    for key, value in values.items():
        try:
            with open("/proc/sys/" + key.replace(".", "/"), "w") as f:
                f.write(str(value))
        except FileNotFoundError:
            pass


def wait_port(netns_name: str, port: int, *, udp: bool = False, timeout: float = 10.0) -> None:
    """Returns once a TCP socket listens (or a UDP socket is bound) on `port` inside `netns_name`;
    raises TimeoutError after `timeout` seconds."""
    if not spawn_in(netns_name, _poll_port, port, udp, timeout).result():
        raise TimeoutError(f"nothing {'bound to UDP' if udp else 'listens on TCP'} port {port} in {netns_name} "
                           f"after {timeout} s")


def _poll_port(port: int, udp: bool, timeout: float) -> bool:
    tables = ("udp", "udp6") if udp else ("tcp", "tcp6")
    state = "07" if udp else "0A"  # unconnected / LISTEN, in /proc/net/{tcp,udp}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for table in tables:
            try:
                with open(f"/proc/net/{table}") as f:
                    rows = [line.split() for line in f.readlines()[1:]]
            except FileNotFoundError:
                continue
            if any(int(row[1].rsplit(":", 1)[1], 16) == port and row[3] == state for row in rows):
                return True
        time.sleep(0.005)
    return False


def list_namespaces() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def exists(netns: str) -> bool:
    return os.path.exists(os.path.join(NETNS_DIR, netns))


def enter(netns: str) -> None:
    """Moves the calling thread into `netns` (meant for a freshly forked, single-threaded child)."""
    fd = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NamespaceError(f"setns into {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def die_with_parent(parent_pid: int) -> None:
    """Makes the kernel kill this (child) process when its parent exits, so nothing outlives a
    killed test run. Exits at once if the parent is already gone."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)


def pids_in(netns: str) -> list[int]:
    """Processes whose network namespace is `netns`."""
    if not exists(netns):
        return []
    return [int(p) for p in run_tool(["ip", "netns", "pids", netns]).split()]


def pid_alive(pid: int, start_time: int | None = None) -> bool:
    """True if `pid` runs and is not a zombie (and, given `start_time`, is still the same process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    if fields[0] in ("Z", "X"):
        return False
    return start_time is None or int(fields[19]) == start_time


def pid_start_time(pid: int) -> int:
    """Start time of `pid` in clock ticks since boot (with the pid, names a process uniquely)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def kill_processes(pids: Sequence[int], grace_s: float = 1.0) -> None:
    """SIGTERM, then SIGKILL whatever still runs after `grace_s`; waits until all are gone
    and reaps the ones that are our children."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while True:
            for pid in pids:
                _reap(pid)
            pids = [p for p in pids if pid_alive(p)]
            if not pids or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        if not pids:
            return
    raise NamespaceError(f"processes {pids} survived SIGKILL")


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


class NamespaceProcess:
    """A Python callable running in a forked child inside a network namespace.

    The child dies with its parent. `result()` waits for the callable's return value
    (pickled back through a pipe) or re-raises its exception as NamespaceCallError.
    """

    def __init__(self, pid: int, result_fd: int, netns: str):
        self.pid = pid
        self.netns = netns
        self._fd = result_fd
        self._payload = bytearray()
        self._status: int | None = None

    @property
    def alive(self) -> bool:
        return self._status is None and pid_alive(self.pid)

    def result(self, timeout: float | None = None) -> Any:
        """The callable's return value. Raises TimeoutError after `timeout` seconds (the child
        keeps running; call kill() to end it) and NamespaceCallError when the callable raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._fd >= 0:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._fd], [], [], wait)[0]:
                raise TimeoutError(f"callable in {self.netns} (pid {self.pid}) still running after {timeout} s")
            chunk = os.read(self._fd, 1 << 20)
            if chunk:
                self._payload += chunk
            else:
                os.close(self._fd)
                self._fd = -1
        self._wait()
        if not self._payload:
            raise NamespaceCallError(f"process {self.pid} in {self.netns} died before answering "
                                     f"({_describe_status(self._status)})")
        kind, value, remote_tb = pickle.loads(bytes(self._payload))
        if kind == "ok":
            return value
        raise NamespaceCallError(f"callable in {self.netns} raised {value!r}", remote_tb) from (
            value if isinstance(value, BaseException) else None)

    def kill(self) -> None:
        """Ends the child (SIGKILL) and reaps it; result() then raises NamespaceCallError."""
        if self._status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._wait()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _wait(self) -> None:
        if self._status is None:
            try:
                self._status = os.waitpid(self.pid, 0)[1]
            except ChildProcessError:  # already reaped by a namespace teardown
                self._status = -1


def _describe_status(status: int) -> str:
    if status < 0:
        return "ended by a namespace teardown"
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.WEXITSTATUS(status)}"


def spawn_in(netns: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> NamespaceProcess:
    """Forks a child that enters `netns` and runs `fn(*args, **kwargs)` (closures and lambdas
    are fine: nothing is pickled on the way in; the return value must pickle)."""
    if not exists(netns):
        raise NamespaceError(f"no network namespace {netns!r}")
    parent = os.getpid()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns
        status = 1
        try:
            os.close(read_fd)
            die_with_parent(parent)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                enter(netns)
                payload = pickle.dumps(("ok", fn(*args, **kwargs), ""))
            except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
                remote_tb = traceback.format_exc()
                try:
                    payload = pickle.dumps(("err", exc, remote_tb))
                except Exception:  # unpicklable exception: send its text
                    payload = pickle.dumps(("err", RuntimeError(repr(exc)), remote_tb))
            view = memoryview(payload)
            while view:
                view = view[os.write(write_fd, view):]
            status = 0
        finally:
            os._exit(status)
    os.close(write_fd)
    return NamespaceProcess(pid, read_fd, netns)
