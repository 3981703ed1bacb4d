"""`pddcore engine` and `pddcore serve` as processes for tests and benchmarks: started here or
inside a namespace of a :class:`pddcore.testing.wan.WanLink`, on the port they picked.

Both commands print one JSON line (``{"url": ...}``) once they serve; :class:`ServerProcess`
waits for it, so a caller can ask for port 0 and learn where the server listens.

Servers that do not depend on each other start and stop together (their start-ups, mostly
imports, overlap).

Example::

    p = ServerProcess(["engine", "--role", "prefill", "--port", "0"], log_path="/tmp/p.log")
    requests.get(p.url + "/health")
    p.stop()
    p, d = start_together([lambda: ServerProcess(["engine", "--role", "prefill", "--port", "0"]),
                           lambda: ServerProcess(["engine", "--role", "decode", "--port", "0"])])
    stop_together([p, d])
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Sequence, TypeVar

__all__ = ["ServerProcess", "start_together", "stop_together"]

_STOP_GRACE_S = 10.0


class ServerProcess:
    """``pddcore ARGS`` started in ``where`` (a WanLink endpoint; None: here), with ``env``
    added to this process's environment and stderr going to ``log_path`` (None: a temporary
    file; a pipe nobody reads would stall a chatty server)."""

    def __init__(self, args: Sequence[str], *, where=None, env: dict | None = None, log_path: str | None = None):
        argv = [sys.executable, "-m", "pddcore.cli", *args]
        env = {**os.environ, **(env or {})}
        self.args = list(args)
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="pddcore-server-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        popen = where.popen if where is not None else subprocess.Popen
        with open(log_path, "w") as log:
            self.proc = popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"pddcore {' '.join(args)} exited with {self.proc.returncode}:\n{self._log_tail()}")
        self.url = json.loads(line)["url"]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> str:
        """Stops the process (SIGTERM, then SIGKILL after 10 s); returns the tail of its log."""
        stop_together([self])
        return self._log_tail()

    def _log_tail(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-3000:]


_Server = TypeVar("_Server", bound=ServerProcess)


def start_together(starts: Sequence[Callable[[], _Server]]) -> list[_Server]:
    """Calls each of ``starts`` (each starts one server and returns it once it serves) on a
    thread of its own; returns the servers in order. When one fails, the others are stopped
    and its error is raised."""
    with ThreadPoolExecutor(max(1, len(starts))) as pool:
        futures = [pool.submit(start) for start in starts]
    started, errors = [], []
    for future in futures:
        try:
            started.append(future.result())
        except Exception as exc:
            errors.append(exc)
    if errors:
        stop_together(started)
        raise errors[0]
    return started


def stop_together(servers: Iterable[ServerProcess]) -> None:
    """SIGTERM to every server still running, then waits for all of them; one still running
    after 10 s gets SIGKILL."""
    running = [s for s in servers if s.proc.poll() is None]
    for server in running:
        server.proc.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for server in running:
        try:
            server.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            server.kill()
