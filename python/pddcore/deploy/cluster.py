"""Runs one deployment (front, P, RLD, MD, client as separate OS processes) over a
:class:`~.network.Network` through a scenario, and returns what happened.

Every process is started here and ended here, also on failure: the front is told to
stop (closing its socket ends every role), stragglers are killed, and each process
dies with this one anyway (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client
from typing import Callable

from .network import Network
from .trace import Scenario

__all__ = ["RunConfig", "RunResult", "run_deployment", "DeploymentError"]


class DeploymentError(RuntimeError):
    """A role process failed or the run did not finish; the message carries its log tail."""


@dataclass(frozen=True)
class RunConfig:
    """One deployment. ``mode``: "pd" (cross-DC PD: P->MD only) or "pdd".
    ``model``: ``{"seed": 0}`` (embedded) or ``{"path": ...}``; ``kv_bytes_per_token``
    for the router (from the model's pool layout). Fault knobs: ``kill_md_after_s``
    (SIGKILL MD that long after the deployment is ready), ``kill_md_after_tokens`` (SIGKILL
    MD once the client got that many tokens from it), ``md_transfer_timeout_s``,
    ``stream_kv`` (P posts each layer's KV as prefill writes it; off: one write after prefill),
    ``corrupt_handoffs`` (RLD sends that many handoff messages malformed first).
    ``rld_tpot_s`` prices an RLD token as a production RLD slot costs (the router's
    default), not at the decode step this machine measures (``run_metrics(...)
    ["decode_step_s"]``): RLD capacity is what PDD keeps small.
    ``ttft_slo_s`` (router default 3 s) is scaled with the small emulated links used here:
    a fresh document's KV needs longer on them; high-hit turns (MD lacks a few pages)
    meet it. ``pddcore demo`` sets its own (:data:`pddcore.deploy.cli.TTFT_SLO_S`).
    ``catch_up_threshold`` is :class:`pddcore.handoff.HandoffPolicy`'s default."""

    mode: str
    kv_bytes_per_token: float
    model: dict = field(default_factory=lambda: {"seed": 0})
    page_size: int = 16
    pool_pages: int = 1536
    staging_bytes: int = 48 << 20
    ttft_slo_s: float = 0.4
    rld_tpot_s: float = 0.03
    rld_capacity: int = 8
    catch_up_threshold: int = 64
    kill_md_after_s: float | None = None
    kill_md_after_tokens: int | None = None
    md_transfer_timeout_s: float | None = None
    stream_kv: bool = True
    corrupt_handoffs: int = 0
    deadline_s: float = 900.0


@dataclass
class RunResult:
    mode: str
    requests: list[dict]
    client_errors: list[str]
    summary: dict
    wall_s: float
    md_killed: bool = False


def run_deployment(config: RunConfig, scenario: Scenario, network: Network,
                   on_progress: Callable[[int], None] | None = None) -> RunResult:
    if config.mode not in ("pd", "pdd"):
        raise ValueError(f"mode must be 'pd' or 'pdd', got {config.mode!r}")
    place = network.placement()
    with tempfile.TemporaryDirectory(prefix="pddcore-demo-") as tmp:
        hub, authkey = os.path.join(tmp, "front.sock"), secrets.token_hex(16)
        common = {"hub": hub, "authkey": authkey, "auth_token": secrets.token_hex(16), "model": config.model,
                  "page_size": config.page_size, "pool_pages": config.pool_pages}
        configs = {
            "front": {"hub": hub, "authkey": authkey, "mode": config.mode, "md_address": place.md_from_a,
                      "rld_address": place.rld_from_p, "md_token_milestone": config.kill_md_after_tokens,
                      "router": {"kv_bytes_per_token": config.kv_bytes_per_token, "ttft_slo_s": config.ttft_slo_s,
                                 "rld_tpot_s": config.rld_tpot_s, "rld_capacity": config.rld_capacity,
                                 "prior_bytes_per_s": network.bandwidth_bps / 8,
                                 "prior_rtt_s": 2 * network.delay_ms / 1e3}},
            "P": {**common, "listen": place.p_listen, "send_bytes": 2 * config.staging_bytes,
                  "md_transfer_timeout_s": config.md_transfer_timeout_s, "stream_kv": config.stream_kv},
            "RLD": {**common, "listen": place.rld_listen, "staging_bytes": config.staging_bytes,
                    "md_address": place.md_from_a, "catch_up_threshold": config.catch_up_threshold,
                    "capacity": config.rld_capacity, "corrupt_handoffs": config.corrupt_handoffs},
            "MD": {**common, "listen": place.md_listen, "staging_bytes": config.staging_bytes,
                   "rld_address": place.rld_from_md if config.mode == "pdd" else None},
            "client": {"hub": hub, "authkey": authkey, "results": os.path.join(tmp, "results.json"),
                       "scenario": dataclasses.asdict(scenario)},
        }
        sides = {"front": None, "P": "a", "RLD": "a", "MD": "b", "client": None}
        roles = ["front", "P", "MD", "client"] + (["RLD"] if config.mode == "pdd" else [])
        procs: dict[str, subprocess.Popen] = {}
        logs: dict[str, str] = {}
        ctl = None
        try:
            for role in roles:
                path = os.path.join(tmp, f"{role}.json")
                with open(path, "w") as f:
                    json.dump(configs[role], f)
                logs[role] = os.path.join(tmp, f"{role}.log")
                with open(logs[role], "w") as log:
                    procs[role] = network.popen(sides[role], [sys.executable, "-m", "pddcore.deploy.launch", role, path],
                                                stdout=log, stderr=subprocess.STDOUT)
                if role == "front":
                    ctl = _connect(hub, authkey, procs["front"], logs)
            return _supervise(config, ctl, procs, logs, configs["client"]["results"], on_progress)
        finally:
            if ctl is not None:
                ctl.close()  # the front stops; every role sees its socket close and exits
            _reap(procs)


def _connect(hub: str, authkey: str, front: subprocess.Popen, logs: dict):
    for _ in range(600):
        if front.poll() is not None:
            raise DeploymentError(f"the front exited at start:\n{_tail(logs['front'])}")
        if os.path.exists(hub):
            try:
                conn = Client(hub, family="AF_UNIX", authkey=bytes.fromhex(authkey))
                conn.send(("hello", "ctl", {}))
                return conn
            except (ConnectionRefusedError, FileNotFoundError):
                pass
        time.sleep(0.05)
    raise DeploymentError("the front did not open its socket within 30 s")


def _supervise(config: RunConfig, ctl, procs: dict, logs: dict, results_path: str,
               on_progress: Callable[[int], None] | None) -> RunResult:
    started = time.monotonic()
    ready_at = None
    md_killed = False
    while procs["client"].poll() is None:
        if time.monotonic() - started > config.deadline_s:
            raise DeploymentError(f"the run did not finish within {config.deadline_s} s\n{_all_tails(logs)}")
        for role, proc in procs.items():
            if role != "client" and proc.poll() is not None and not (role == "MD" and md_killed):
                raise DeploymentError(f"{role} exited with {proc.returncode}\n{_all_tails(logs)}")
        if ready_at is not None and config.kill_md_after_s is not None and not md_killed \
                and time.monotonic() - ready_at >= config.kill_md_after_s:
            md_killed = _kill(procs["MD"])
        if not ctl.poll(0.05):
            continue
        msg = ctl.recv()
        if msg[0] == "md_milestone" and not md_killed:
            md_killed = _kill(procs["MD"])
        elif msg[0] == "ready":
            ready_at = time.monotonic()
        elif msg[0] == "progress" and on_progress is not None:
            on_progress(msg[1])
        elif msg[0] == "failed":
            raise DeploymentError(f"the deployment failed: {msg[1]}\n{_all_tails(logs)}")
    if procs["client"].returncode != 0:
        raise DeploymentError(f"the client exited with {procs['client'].returncode}\n{_all_tails(logs)}")
    ctl.send(("summary",))
    while True:
        msg = ctl.recv()
        if msg[0] == "summary":
            break
    with open(results_path) as f:
        results = json.load(f)
    return RunResult(config.mode, results["requests"], results["errors"], msg[1], results["wall_s"], md_killed)


def _kill(proc: subprocess.Popen) -> bool:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


def _reap(procs: dict[str, subprocess.Popen]) -> None:
    deadline = time.monotonic() + 5
    for proc in procs.values():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _all_tails(logs: dict[str, str]) -> str:
    return "\n".join(f"--- {role} log ---\n{_tail(path)}" for role, path in logs.items())
