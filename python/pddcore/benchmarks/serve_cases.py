"""The ``serve`` bench case: PDD through the gateway (:mod:`pddcore.serve`) over reference
engine servers (:mod:`pddcore.engine`), cross-DC PD against PDD on the demo's agentic trace
and link, as :func:`pddcore.deploy.run_demo` runs them (fresh engines per mode, so MD's
prefix cache starts empty; cross-DC PD has no RLD). Greedy output must be identical.

Also, on loopback: the gateway's cost per token (TPOT streamed through the gateway against
the same engine streamed directly, same request), and the handoff gap (last RLD token to
first MD token) against the median TPOT.

Example::

    r = serve_case(requests=12)
    print(format_table(r))
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from dataclasses import dataclass, field

import requests

from .._stats import percentiles
from ..deploy import Network, agentic_trace, run_demo
from ..deploy.cli import LABELS, TTFT_SLO_S
from ..testing.servers import ServerProcess, start_together, stop_together
from .results import Result

__all__ = ["ServeResult", "serve_case", "summarize", "gateway_cost", "format_table"]

BANDWIDTH_MBIT, DELAY_MS = 100, 25.0  # pddcore demo's link


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


def _engine(role: str, tmp: str) -> ServerProcess:
    return ServerProcess(["engine", "--role", role, "--port", "0"], env={"PDDCORE_AUTH_TOKEN": _TOKEN},
                         log_path=os.path.join(tmp, f"{role}.log"))


def _summary(run: dict, metrics: dict) -> dict:
    reqs = run["requests"]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in reqs if len(r["times"]) > 1]
    gaps = [r["trace"]["handoff_gap_s"] for r in reqs if r["trace"].get("handoff_gap_s") is not None]
    return {"ttft_s": percentiles([r["times"][0] - r["submitted"] for r in reqs]), "tpot_s": percentiles(tpot),
            "handoff_gap_s": percentiles(gaps, empty=0.0), "handoffs": len(gaps),
            "routes": {route: n for route, n in metrics["routes"].items() if n},
            "wan_kv_bytes": metrics["wan_bytes"], "wall_s": run["wall_s"]}


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
        p, d = start_together([lambda: _engine("prefill", tmp), lambda: _engine("decode", tmp)])
        gw = ServerProcess(["serve", "--engine", "reference", "--port", "0", "--prefill", p.url, "--relay", d.url],
                           env={"PDDCORE_AUTH_TOKEN": _TOKEN}, log_path=os.path.join(tmp, "gateway.log"))
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
            stop_together((gw, d, p))
    return percentiles(via)[50], percentiles(direct)[50]


def serve_case(requests: int = 12, *, cost_tokens: int = 200, cost_trials: int = 3, **trace: int) -> ServeResult:
    """``trace``: :func:`pddcore.deploy.agentic_trace` options (the demo's by default);
    ``cost_tokens`` and ``cost_trials``: the size of :func:`gateway_cost`'s measurement."""
    scenario = agentic_trace(requests, **trace)
    with Network(BANDWIDTH_MBIT * 1e6, DELAY_MS) as network:
        demo = run_demo(scenario, network, overrides={mode: {"ttft_slo_s": TTFT_SLO_S} for mode in LABELS})
    result = summarize(demo)
    result.gateway_tpot_ms, result.direct_tpot_ms = gateway_cost(cost_tokens, cost_trials)
    return result


def summarize(demo: dict) -> ServeResult:
    """The figures of a :func:`pddcore.deploy.run_demo` result of both modes (``pd`` and
    ``pdd``), less the gateway's cost per token."""
    result = ServeResult(len(demo["runs"]["pd"]["requests"]))
    for mode in LABELS:
        result.modes[mode] = _summary(demo["runs"][mode], demo["metrics"][mode])
    tokens = {mode: [r["tokens"] for r in demo["runs"][mode]["requests"]] for mode in LABELS}
    result.identical_tokens = tokens["pd"] == tokens["pdd"] and all(c["pass"] for c in demo["correctness"].values())
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
