"""`pddcore engine` and `pddcore serve` as processes for tests and benchmarks: started here or
inside a namespace of a :class:`pddcore.testing.wan.WanLink`, on the port they picked.

Both commands print one JSON line (``{"url": ...}``) once they serve; :class:`ServerProcess`
waits for it, so a caller can ask for port 0 and learn where the server listens.

Example::

    p = ServerProcess(["engine", "--role", "prefill", "--port", "0"], log_path="/tmp/p.log")
    requests.get(p.url + "/health")
    p.stop()
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Sequence

__all__ = ["ServerProcess"]


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
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        return self._log_tail()

    def _log_tail(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-3000:]
