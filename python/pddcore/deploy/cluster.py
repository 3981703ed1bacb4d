"""Runs one deployment over a :class:`~.network.Network` through a scenario and returns what
happened: reference engine servers (``pddcore engine``: P and RLD in cluster A, MD in
cluster B), the PDD gateway in front of them (``pddcore serve``, in cluster A) and the
trace player (:mod:`.client`), each an OS process, all driven over HTTP.

Cross-DC PD is the same gateway with no RLD (every request P -> MD); PDD has one. Every
process is started here and ended here, also on failure (SIGTERM, then SIGKILL), and each
dies with this one anyway (PR_SET_PDEATHSIG of the namespace launcher).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable

import requests

from ..testing.servers import ServerProcess, start_together, stop_together
from .network import Network, Placement
from .trace import Scenario

__all__ = ["RunConfig", "RunResult", "run_deployment", "DeploymentError"]


class DeploymentError(RuntimeError):
    """A process failed or the run did not finish; the message carries the logs' tails."""


@dataclass(frozen=True)
class RunConfig:
    """One deployment. ``mode``: "pd" (cross-DC PD: P -> MD only) or "pdd".
    ``model``: ``{"seed": 0}`` (embedded) or ``{"path": ...}``.

    The gateway's router: ``ttft_slo_s`` (the router's default is 3 s; the demo scales it
    with its small emulated link, see :data:`pddcore.deploy.cli.TTFT_SLO_S`), ``rld_tpot_s``
    (what an RLD token costs on a production RLD slot, not this machine's decode step, which
    the run measures), ``rld_capacity``, ``catch_up_threshold``
    (:class:`pddcore.handoff.HandoffPolicy`'s default).

    Faults: ``kill_md_after_s`` (SIGKILL MD that long after the trace started),
    ``kill_md_after_tokens`` (once the client got that many tokens from MD),
    ``md_transfer_timeout_s`` (an MD prefetch that takes longer leaves its request on RLD)."""

    mode: str
    model: dict = field(default_factory=lambda: {"seed": 0})
    page_size: int = 16
    pool_pages: int = 4096
    ttft_slo_s: float = 0.4
    rld_tpot_s: float = 0.03
    rld_capacity: int = 8
    catch_up_threshold: int = 64
    kill_md_after_s: float | None = None
    kill_md_after_tokens: int | None = None
    md_transfer_timeout_s: float | None = None
    deadline_s: float = 900.0


@dataclass
class RunResult:
    """``requests``: what the client recorded per request, with the gateway's trace of it;
    ``metrics``: the gateway's Prometheus text at the end; ``links``: its WAN estimate
    toward each MD at the end and where it came from (``/pdd/links``); ``timings``: each
    engine's model passes during the trace (``/pdd/timings``; None for an engine that was gone)."""

    mode: str
    requests: list[dict]
    metrics: str
    links: dict
    timings: dict
    wall_s: float
    md_killed: bool = False


def run_deployment(config: RunConfig, scenario: Scenario, network: Network,
                   on_progress: Callable[[int], None] | None = None) -> RunResult:
    if config.mode not in ("pd", "pdd"):
        raise ValueError(f"mode must be 'pd' or 'pdd', got {config.mode!r}")
    place = network.placement()
    with tempfile.TemporaryDirectory(prefix="pddcore-demo-") as tmp, ExitStack() as stack:
        servers = _Servers(place, config, tmp, stack)
        roles = {"P": ("a", "prefill"), **({"RLD": ("a", "decode")} if config.mode == "pdd" else {}),
                 "MD": ("b", "decode", *place.md_args)}
        started = servers.engines(roles)
        p = started["P"]
        engines = {name: proc.url for name, proc in started.items()}
        engines["MD"] = place.md_url_from_a or engines["MD"]
        for role in engines.keys() - {"P"}:
            _in_cluster_a(place, _warm_up, p.url, engines[role])
        gateway = servers.gateway(engines, network)
        paths = {"config": os.path.join(tmp, "client.json"), "results": os.path.join(tmp, "results.json")}
        with open(paths["config"], "w") as f:
            json.dump({"url": gateway.url, "engines": engines, "scenario": dataclasses.asdict(scenario),
                       "results": paths["results"]}, f)
        with open(os.path.join(tmp, "client.log"), "w") as log:
            client = network.popen("a", [sys.executable, "-m", "pddcore.deploy.client", paths["config"]],
                                   stdout=subprocess.PIPE, stderr=log, text=True)
        stack.callback(_end, client)
        md_killed = _supervise(config, client, servers, on_progress)
        with open(paths["results"]) as f:
            results = json.load(f)
        return RunResult(config.mode, results["requests"], results["metrics"], results["links"],
                         results["timings"], results["wall_s"], md_killed)


class _Servers:
    """The run's servers, each stopped when the run's stack unwinds."""

    def __init__(self, place: Placement, config: RunConfig, tmp: str, stack: ExitStack):
        self.place, self.config, self.tmp = place, config, tmp
        self.env = {"PDDCORE_AUTH_TOKEN": secrets.token_hex(32)}
        self.procs: dict[str, ServerProcess] = {}
        stack.callback(lambda: stop_together(self.procs.values()))

    def _start(self, specs: list[tuple[str, str, list[str]]]) -> list[ServerProcess]:
        """Starts the servers of ``specs`` (name, side, arguments) together: their start-ups overlap."""
        def start(name: str, side: str, args: list[str]) -> Callable[[], ServerProcess]:
            def run() -> ServerProcess:
                try:
                    return ServerProcess(args, where=self.place.where[side], env=self.env,
                                         log_path=os.path.join(self.tmp, f"{name}.log"))
                except RuntimeError as e:
                    raise DeploymentError(f"{name} did not start: {e}") from None
            return run

        try:
            procs = start_together([start(*spec) for spec in specs])
        except DeploymentError as e:
            raise DeploymentError(f"{e}\n{self.tails()}") from None
        self.procs.update(zip((name for name, _, _ in specs), procs))
        return procs

    def engines(self, roles: dict[str, tuple[str, ...]]) -> dict[str, ServerProcess]:
        """``roles``: name -> (side, role, listen options...; none: the side's host, port 0)."""
        model = self.config.model
        common = ["--pool-pages", str(self.config.pool_pages), "--page-size", str(self.config.page_size)]
        common += ["--model", model["path"]] if model.get("path") else ["--seed", str(model.get("seed", 0))]
        specs = [(name, side, ["engine", "--role", role, *common,
                               *(listen or ("--host", self.place.host[side], "--port", "0"))])
                 for name, (side, role, *listen) in roles.items()]
        return dict(zip(roles, self._start(specs)))

    def gateway(self, engines: dict[str, str], network: Network) -> ServerProcess:
        c = self.config
        args = ["serve", "--engine", "reference", "--host", self.place.host["a"], "--port", "0",
                "--prefill", engines["P"], "--main", engines["MD"], "--ttft-slo-s", str(c.ttft_slo_s),
                "--rld-tpot-s", str(c.rld_tpot_s), "--rld-capacity", str(c.rld_capacity),
                "--catch-up-threshold", str(c.catch_up_threshold), "--wan-mbps", str(network.bandwidth_bps / 1e6),
                "--wan-rtt-ms", str(2 * network.delay_ms)]
        args += ["--relay", engines["RLD"]] if "RLD" in engines else []
        if c.md_transfer_timeout_s is not None:
            args += ["--prefetch-timeout-s", str(c.md_transfer_timeout_s)]
        return self._start([("gateway", "a", args)])[0]

    def kill(self, name: str) -> None:
        self.procs[name].kill()

    def exited(self, *spare: str) -> str | None:
        """The first server, other than ``spare``, that is no longer running."""
        return next((n for n, p in self.procs.items() if n not in spare and p.proc.poll() is not None), None)

    def tails(self) -> str:
        logs = {name: os.path.join(self.tmp, f"{name}.log") for name in [*self.procs, "client"]}
        return "\n".join(f"--- {name} log ---\n{_tail(path)}" for name, path in logs.items() if os.path.exists(path))


def _supervise(config: RunConfig, client: subprocess.Popen, servers: _Servers,
               on_progress: Callable[[int], None] | None) -> bool:
    """Follows the client's progress lines until it ends, injecting the faults; True when MD
    was killed."""
    started = time.monotonic()
    md_killed = False
    while True:
        if time.monotonic() - started > config.deadline_s:
            raise DeploymentError(f"the run did not finish within {config.deadline_s} s\n{servers.tails()}")
        gone = servers.exited("MD") if md_killed else servers.exited()
        if gone is not None:
            raise DeploymentError(f"{gone} exited with {servers.procs[gone].proc.returncode}\n{servers.tails()}")
        if config.kill_md_after_s is not None and not md_killed \
                and time.monotonic() - started >= config.kill_md_after_s:
            servers.kill("MD")
            md_killed = True
        if not select.select([client.stdout], [], [], 0.05)[0]:
            continue
        line = client.stdout.readline()
        if not line:
            break
        progress = json.loads(line)
        if "done" in progress and on_progress is not None:
            on_progress(progress["done"])
        if "md_tokens" in progress and not md_killed and config.kill_md_after_tokens is not None \
                and progress["md_tokens"] >= config.kill_md_after_tokens:
            servers.kill("MD")
            md_killed = True
    if client.wait() != 0:
        raise DeploymentError(f"the client exited with {client.returncode}\n{servers.tails()}")
    return md_killed


def _in_cluster_a(place: Placement, fn: Callable, *args) -> None:
    where = place.where["a"]
    if where is None:
        fn(*args)
    else:
        where.call(fn, *args, timeout=600)


def _warm_up(p_url: str, decoder_url: str) -> None:
    """One long P -> decoder request, straight to the engines: first passes allocate and
    first pulls connect, which the trace's first requests should not pay for."""
    prompt = [16 + (11 * i) % 4000 for i in range(1024)]
    answer = _checked(requests.post(p_url + "/inference/v1/generate", timeout=300, json={
        "token_ids": prompt, "sampling_params": {"max_tokens": 1}, "kv_transfer_params": {"do_remote_decode": True}}))
    _checked(requests.post(decoder_url + "/inference/v1/generate", timeout=300, json={
        "token_ids": prompt, "sampling_params": {"max_tokens": 2},
        "kv_transfer_params": answer.json()["kv_transfer_params"]}))


def _checked(resp: requests.Response) -> requests.Response:
    if resp.status_code != 200:
        raise DeploymentError(f"the warm-up request to {resp.url} failed: HTTP {resp.status_code}: {resp.text[:500]}")
    return resp


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""
