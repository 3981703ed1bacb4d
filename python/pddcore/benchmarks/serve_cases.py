"""The ``serve`` bench case: PDD through the gateway (:mod:`pddcore.serve`) over reference
engine servers (:mod:`pddcore.engine`), cross-DC PD against PDD on the demo's agentic trace.

P and RLD run in namespace ``a`` of an emulated WAN (cluster A), MD in ``b``; the gateway
and the trace player (:mod:`.serve_client`) in ``a``. Each mode starts fresh engines (so
MD's prefix cache starts empty) and a gateway: cross-DC PD has no RLD (every request P ->
MD), PDD has one. Both play the same trace; greedy output must be identical.

Also, on loopback: the gateway's cost per token (TPOT streamed through the gateway against
the same engine streamed directly, same request), and the handoff gap (last RLD token to
first MD token) against the median TPOT.

Example::

    r = serve_case(requests=12)              # root: namespaces, tc, TUN
    print(format_table(r))
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import requests

from .._stats import percentiles
from ..deploy.trace import agentic_trace
from ..testing.servers import ServerProcess
from ..testing.wan import WanLink
from .results import Result

__all__ = ["ServeResult", "serve_case", "format_table"]

# The demo's link and TTFT budget (pddcore.deploy.cli explains the choice): a fresh document's
# KV needs longer than the budget on this link, a follow-up's last pages do not.
BANDWIDTH_MBIT, DELAY_MS, TTFT_SLO_S = 100, 25.0, 0.2


@dataclass
class ServeResult(Result):
    requests: int
    modes: dict = field(default_factory=dict)  # "pd" / "pdd" -> summary (see _summary)
    identical_tokens: bool = False
    gateway_tpot_ms: float = 0.0
    direct_tpot_ms: float = 0.0

    @property
    def ttft_p90_ratio(self) -> float:
        """PDD's TTFT p90 over cross-DC PD's (the goal: <= 0.6)."""
        return self.modes["pdd"]["ttft_s"][90] / self.modes["pd"]["ttft_s"][90]

    @property
    def handoff_gap_over_tpot(self) -> float:
        """The median handoff gap in median PDD TPOTs."""
        return self.modes["pdd"]["handoff_gap_s"][50] / self.modes["pdd"]["tpot_s"][50]

    @property
    def gateway_tpot_ratio(self) -> float:
        return self.gateway_tpot_ms / self.direct_tpot_ms


_TOKEN = secrets.token_hex(32)


def _launch(where, args: list[str], tmp: str, name: str) -> ServerProcess:
    return ServerProcess(args, where=where, env={"PDDCORE_AUTH_TOKEN": _TOKEN},
                         log_path=os.path.join(tmp, f"{name}.log"))


def _engine(where, host: str, role: str, tmp: str, name: str) -> ServerProcess:
    return _launch(where, ["engine", "--role", role, "--host", host, "--port", "0", "--pool-pages", "4096"], tmp, name)


def _gateway(where, host: str, p: str, relay: str | None, main: str | None, tmp: str, name: str,
             *extra: str) -> ServerProcess:
    args = ["serve", "--engine", "reference", "--host", host, "--port", "0", "--prefill", p]
    args += ["--relay", relay] if relay else []
    args += ["--main", main] if main else []
    return _launch(where, args + list(extra), tmp, name)


def _summary(results: dict) -> dict:
    reqs = results["requests"]
    ttft = [r["times"][0] - r["submitted"] for r in reqs]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in reqs if len(r["times"]) > 1]
    gaps = [r["trace"]["handoff_gap_s"] for r in reqs if r["trace"].get("handoff_gap_s") is not None]
    routes: dict[str, int] = {}
    for r in reqs:
        routes[r["trace"]["pipeline"]] = routes.get(r["trace"]["pipeline"], 0) + 1
    wan = [line.split()[-1] for line in results["metrics"].splitlines() if line.startswith("pddcore_wan_kv_bytes_total")]
    return {"ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot), "handoff_gap_s": percentiles(gaps, empty=0.0),
            "handoffs": len(gaps), "routes": routes, "wan_kv_bytes": float(wan[0]) if wan else 0.0,
            "wall_s": results["wall_s"], "tokens": {r["rid"]: r["tokens"] for r in reqs}}


def _play(link: WanLink, mode: str, scenario, tmp: str) -> dict:
    a, b = link.a.address, link.b.address
    procs: list[ServerProcess] = []
    try:
        p = _engine(link.a, a, "prefill", tmp, f"{mode}-p")
        procs.append(p)
        rld = _engine(link.a, a, "decode", tmp, f"{mode}-rld") if mode == "pdd" else None
        procs += [rld] if rld else []
        md = _engine(link.b, b, "decode", tmp, f"{mode}-md")
        procs.append(md)
        for decoder in procs[1:]:
            link.a.call(_warm_up, p.url, decoder.url, timeout=600)  # from cluster A, which reaches both
        gw = _gateway(link.a, a, p.url, rld.url if rld else None, md.url, tmp, f"{mode}-gateway",
                      "--ttft-slo-s", str(TTFT_SLO_S), "--wan-mbps", str(BANDWIDTH_MBIT),
                      "--wan-rtt-ms", str(2 * DELAY_MS))
        procs.append(gw)
        config, results = os.path.join(tmp, f"{mode}.json"), os.path.join(tmp, f"{mode}-results.json")
        with open(config, "w") as f:
            json.dump({"url": gw.url, "scenario": dataclasses.asdict(scenario), "results": results}, f)
        client = link.a.popen([sys.executable, "-m", "pddcore.benchmarks.serve_client", config],
                              stderr=subprocess.PIPE, text=True)
        _, err = client.communicate(timeout=1800)
        if client.returncode != 0:
            raise RuntimeError(f"the {mode} trace player failed:\n{err[-3000:]}")
        with open(results) as f:
            return _summary(json.load(f))
    finally:
        for proc in reversed(procs):
            proc.stop()


def _warm_up(p_url: str, decoder_url: str) -> None:
    """One long P -> decoder request, straight to the engines: first passes allocate and
    first pulls connect, which the trace's first requests should not pay for."""
    prompt = [16 + (11 * i) % 4000 for i in range(1024)]
    answer = requests.post(p_url + "/inference/v1/generate", timeout=300, json={
        "token_ids": prompt, "sampling_params": {"max_tokens": 1}, "kv_transfer_params": {"do_remote_decode": True}})
    answer.raise_for_status()
    requests.post(decoder_url + "/inference/v1/generate", timeout=300, json={
        "token_ids": prompt, "sampling_params": {"max_tokens": 2},
        "kv_transfer_params": answer.json()["kv_transfer_params"]}).raise_for_status()


def _tpot_ms(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1) * 1e3


def _stream_times(url: str, path: str, body: dict) -> list[float]:
    times = []
    with requests.post(url + path, json=body, stream=True, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith(b"data: {") and b'"token_ids": [' in line and b'"token_ids": []' not in line:
                times.append(time.monotonic())
    return times


def gateway_cost(tokens: int = 200, trials: int = 3) -> tuple[float, float]:
    """Median TPOT (ms) of the same greedy request streamed through a gateway and directly
    from the engine that decodes it, on loopback."""
    with tempfile.TemporaryDirectory(prefix="pddcore-bench-serve-") as tmp:
        p = _engine(None, "127.0.0.1", "prefill", tmp, "p")
        d = _engine(None, "127.0.0.1", "decode", tmp, "d")
        gw = _gateway(None, "127.0.0.1", p.url, d.url, None, tmp, "gateway")
        try:
            via, direct = [], []
            for trial in range(trials):
                prompt = [16 + (7 * i + trial) % 4000 for i in range(64)]
                sampling = {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}
                direct.append(_tpot_ms(_stream_times(d.url, "/inference/v1/generate", {
                    "token_ids": prompt, "sampling_params": sampling, "stream": True})))
                via.append(_tpot_ms(_stream_times(gw.url, "/v1/completions", {
                    "prompt": prompt, "stream": True, "return_token_ids": True, **sampling})))
        finally:
            for proc in (gw, d, p):
                proc.stop()
    return percentiles(via)[50], percentiles(direct)[50]


def serve_case(requests: int = 12, **trace: int) -> ServeResult:
    """``trace``: :func:`pddcore.deploy.agentic_trace` options (the demo's by default)."""
    scenario = agentic_trace(requests, **trace)
    result = ServeResult(requests)
    with tempfile.TemporaryDirectory(prefix="pddcore-bench-serve-") as tmp:
        with WanLink(rate=f"{BANDWIDTH_MBIT}mbit", delay_ms=DELAY_MS) as link:
            for mode in ("pd", "pdd"):
                result.modes[mode] = _play(link, mode, scenario, tmp)
    result.identical_tokens = result.modes["pd"].pop("tokens") == result.modes["pdd"].pop("tokens")
    result.gateway_tpot_ms, result.direct_tpot_ms = gateway_cost()
    return result


def format_table(r: ServeResult) -> str:
    pd, pdd = r.modes["pd"], r.modes["pdd"]
    lines = [f"serve: the agentic trace ({r.requests} requests) through pddcore serve, {BANDWIDTH_MBIT} Mbit/s, "
             f"{DELAY_MS:g} ms one-way",
             f"{'':<22}{'cross-DC PD':>14}{'PDD':>14}{'PDD / PD':>10}"]
    for name, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s")):
        for q in (50, 90, 99):
            a, b = pd[key][q] * 1e3, pdd[key][q] * 1e3
            lines.append(f"{name + f' p{q} (ms)':<22}{a:>14.1f}{b:>14.1f}{b / a:>10.2f}")
    lines.append(f"{'WAN KV (MB)':<22}{pd['wan_kv_bytes'] / 1e6:>14.2f}{pdd['wan_kv_bytes'] / 1e6:>14.2f}")
    lines.append(f"routes: PD {pd['routes']}, PDD {pdd['routes']}; identical tokens: {r.identical_tokens}")
    lines.append(f"handoffs {pdd['handoffs']}, gap median {pdd['handoff_gap_s'][50] * 1e3:.1f} ms = "
                 f"{r.handoff_gap_over_tpot:.2f}x the median TPOT")
    lines.append(f"gateway TPOT {r.gateway_tpot_ms:.2f} ms against {r.direct_tpot_ms:.2f} ms from the engine directly "
                 f"({r.gateway_tpot_ratio:.2f}x, {r.gateway_tpot_ms - r.direct_tpot_ms:+.2f} ms per token)")
    return "\n".join(lines)
