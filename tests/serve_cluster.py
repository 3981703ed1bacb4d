"""Real processes for the gateway tests: reference engines (``pddcore engine``) and gateways
(``pddcore serve``), each on a free loopback port, stopped (or killed) by the test."""

from __future__ import annotations

import time

import requests

from pddcore.testing.servers import ServerProcess, start_together

TOKEN = "a3f1c0de9b7e4d2a8c6f5e1b0a9d8c7e6f5a4b3c2d1e0f9a"  # 192 bits, for every engine's transfer engine


class Proc(ServerProcess):
    """A ``pddcore`` server on loopback whose engines share the test token."""

    def __init__(self, *args: str):
        super().__init__(args, env={"PDDCORE_AUTH_TOKEN": TOKEN})

    def get(self, path: str) -> dict:
        return requests.get(self.url + path, timeout=30).json()


def engine(role: str, *extra: str) -> Proc:
    return Proc("engine", "--role", role, "--port", "0", "--pool-pages", "2048", *extra)


def gateway(prefill: list[str], relay: list[str], main: list[str], *extra: str, dialect: str = "reference") -> Proc:
    args = ["serve", "--engine", dialect, "--port", "0", "--prefill", *prefill]
    if relay:
        args += ["--relay", *relay]
    if main:
        args += ["--main", *main]
    return Proc(*args, *extra)


def together(starts: dict) -> dict:
    """``{name: start}`` -> ``{name: server}``, the servers started together."""
    return dict(zip(starts, start_together(list(starts.values()))))


def wait_for(predicate, what: str, timeout_s: float = 60.0):
    """Polls ``predicate`` until it returns a truthy value; fails naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)
