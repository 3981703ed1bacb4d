"""Workloads: synthetic agentic traffic and JSONL traces.

A :class:`Request` is what arrives at the cluster: arrival time, prompt length, how
many leading prompt tokens an unbounded prefix cache would hold (``cached_tokens``),
output length, and optionally a ``session``. Requests of one session share prefixes:
the first ``cached_tokens`` tokens of a request are the first tokens of the previous
request of its session. P's and MD's radix caches are modelled on these session
prefixes, so each hits only what it computed or was sent before and has not evicted;
a request without a session shares nothing with anyone on MD, and P hits its
``cached_tokens`` as given.

JSONL trace format (one JSON object per line, blank lines allowed, arrivals in
non-decreasing order)::

    {"arrival_s": 0.125, "prompt_tokens": 48213, "cached_tokens": 46800, "output_tokens": 412, "session": "s17"}

``arrival_s`` (number >= 0, seconds from the start), ``prompt_tokens`` (integer >= 1),
``cached_tokens`` (integer, 0 <= cached <= prompt), ``output_tokens`` (integer >= 1)
are required; ``session`` (string or integer) and ``id`` (string or integer, default:
the line's position) are optional. Any other key is an error, so a misspelt field is
never silently ignored.

Synthetic agentic traffic (:func:`agentic`): sessions whose context grows turn by turn
(prompt = previous prompt + tool output, so the hit rate is previous / current), with
a per-request hit rate drawn from a mixture: ``high_hit_fraction`` of requests hit
in [0.95, 1), the rest uniformly in a range below 0.95 chosen to meet ``mean_hit``
(:meth:`AgenticConfig.low_hit_range`). A session that would outgrow ``max_context`` is compacted (fresh lognormal
prompt keeping part of its prefix). Outputs are lognormal and short; inter-arrival
times are Gamma-distributed with coefficient of variation ``burstiness`` (1 = Poisson).
The session process is run for a while before the first emitted request, so a trace
starts in steady state: its first requests already hit P's cache.

Example::

    reqs = agentic(AgenticConfig(rate=9.0, num_requests=2000, mean_hit=0.9), seed=1)
    write_jsonl(reqs, "trace.jsonl")
    assert read_jsonl("trace.jsonl") == reqs
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Iterable

import numpy as np

__all__ = ["Request", "TraceError", "AgenticConfig", "agentic", "read_jsonl", "write_jsonl", "scale_rate"]


class TraceError(ValueError):
    """A trace line is malformed; the message names the file, line and field."""


@dataclass(frozen=True)
class Request:
    id: int | str
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    session: int | str | None = None

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens


_REQUIRED = ("arrival_s", "prompt_tokens", "cached_tokens", "output_tokens")
_OPTIONAL = ("session", "id")


def _check_request(fields: dict, where: str) -> None:
    unknown = sorted(set(fields) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise TraceError(f"{where}: unknown field(s) {', '.join(unknown)} (expected {', '.join(_REQUIRED + _OPTIONAL)})")
    for name in _REQUIRED:
        if name not in fields:
            raise TraceError(f"{where}: missing required field {name!r}")
    arrival = fields["arrival_s"]
    if isinstance(arrival, bool) or not isinstance(arrival, (int, float)) or not 0 <= arrival < math.inf:
        raise TraceError(f"{where}: arrival_s must be a finite number >= 0, got {arrival!r}")
    for name, low in (("prompt_tokens", 1), ("cached_tokens", 0), ("output_tokens", 1)):
        value = fields[name]
        if type(value) is not int or value < low:
            raise TraceError(f"{where}: {name} must be an integer >= {low}, got {value!r}")
    if fields["cached_tokens"] > fields["prompt_tokens"]:
        raise TraceError(f"{where}: cached_tokens {fields['cached_tokens']} exceeds prompt_tokens "
                         f"{fields['prompt_tokens']}")
    for name in _OPTIONAL:
        value = fields.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, str))):
            raise TraceError(f"{where}: {name} must be a string or an integer, got {value!r}")


def read_jsonl(path: str | os.PathLike) -> list[Request]:
    """Reads a trace; raises :class:`TraceError` at the first bad line."""
    requests: list[Request] = []
    previous = 0.0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{os.fspath(path)}:{lineno}"
            try:
                fields = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(fields, dict):
                raise TraceError(f"{where}: expected a JSON object, got {type(fields).__name__}")
            _check_request(fields, where)
            if fields["arrival_s"] < previous:
                raise TraceError(f"{where}: arrival_s {fields['arrival_s']} is before the previous request's "
                                 f"{previous}; traces must be in arrival order")
            previous = fields["arrival_s"]
            requests.append(Request(fields.get("id", len(requests)), float(fields["arrival_s"]),
                                    fields["prompt_tokens"], fields["cached_tokens"], fields["output_tokens"],
                                    fields.get("session")))
    if not requests:
        raise TraceError(f"{os.fspath(path)}: the trace holds no requests")
    return requests


def write_jsonl(requests: Iterable[Request], path: str | os.PathLike) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            fields = {"id": r.id, "arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
                      "cached_tokens": r.cached_tokens, "output_tokens": r.output_tokens}
            if r.session is not None:
                fields["session"] = r.session
            f.write(json.dumps(fields) + "\n")


def scale_rate(requests: list[Request], factor: float) -> list[Request]:
    """The same requests arriving ``factor`` times faster (inter-arrival times divided)."""
    if not factor > 0:
        raise ValueError(f"factor must be > 0, got {factor!r}")
    return [Request(r.id, r.arrival_s / factor, r.prompt_tokens, r.cached_tokens, r.output_tokens, r.session)
            for r in requests]


@dataclass(frozen=True)
class AgenticConfig:
    """Synthetic agentic traffic; see the module docstring. Defaults: 64K-context agent
    sessions with the report's skew (75 % of requests above 95 % hit, mean hit 0.9)."""

    rate: float = 9.0
    num_requests: int = 3000
    burstiness: float = 2.0
    mean_hit: float = 0.90
    high_hit_fraction: float = 0.75
    max_context: int = 65536
    prompt_median: int = 24000
    prompt_sigma: float = 0.6
    output_median: int = 350
    output_sigma: float = 0.9
    max_output: int = 4096
    session_turn_s: float = 60.0

    def __post_init__(self):
        for name in ("rate", "burstiness", "prompt_sigma", "output_sigma", "session_turn_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("num_requests", "max_context", "prompt_median", "output_median", "max_output"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.max_output >= self.max_context:
            raise ValueError(f"max_output {self.max_output} leaves no room for a prompt in max_context "
                             f"{self.max_context}")
        if not 0 <= self.high_hit_fraction <= 1:
            raise ValueError(f"high_hit_fraction must be in [0, 1], got {self.high_hit_fraction!r}")
        lo, hi = self.hit_bounds()
        if not lo <= self.mean_hit <= hi:
            raise ValueError(f"mean_hit {self.mean_hit} is unreachable with high_hit_fraction "
                             f"{self.high_hit_fraction}: it must lie in [{lo:.3f}, {hi:.3f}]")

    def hit_bounds(self) -> tuple[float, float]:
        """The mean hit rates the mixture can reach."""
        f = self.high_hit_fraction
        return f * 0.975, f * 0.975 + (1 - f) * 0.95

    def low_hit_range(self) -> tuple[float, float]:
        """The uniform range of the low-hit component that gives ``mean_hit``: as wide as
        possible, ending at 0.95 when the mean allows, else starting at 0."""
        f = self.high_hit_fraction
        if f >= 1:
            return 0.0, 0.0
        low_mean = (self.mean_hit - f * 0.975) / (1 - f)
        if low_mean >= 0.475:
            return 2 * low_mean - 0.95, 0.95
        return 0.0, 2 * low_mean


def agentic(config: AgenticConfig = AgenticConfig(), seed: int = 0) -> list[Request]:
    """Synthetic agentic requests (deterministic for a seed)."""
    cfg = config
    rng = np.random.default_rng(seed)
    sessions = max(1, round(cfg.rate * cfg.session_turn_s))
    # The session process runs `burn` turns before the trace starts, so the trace opens
    # in steady state (sessions mid-way, P's cache warm) rather than with a cold burst.
    burn = 4 * sessions
    n = cfg.num_requests + burn
    shape = 1.0 / cfg.burstiness ** 2
    gaps = rng.gamma(shape, 1.0 / (cfg.rate * shape), size=cfg.num_requests)
    arrivals = np.cumsum(gaps) - gaps[0]
    high = rng.random(n) < cfg.high_hit_fraction
    hits = np.where(high, rng.uniform(0.95, 1.0, n), rng.uniform(*cfg.low_hit_range(), n))
    outputs = np.minimum(cfg.max_output, np.maximum(1, rng.lognormal(math.log(cfg.output_median),
                                                                       cfg.output_sigma, n))).astype(int)
    fresh = np.maximum(rng.lognormal(math.log(cfg.prompt_median), cfg.prompt_sigma, n), 1)
    pick = rng.integers(0, sessions, n)
    context = [0] * sessions  # tokens of the session's last prompt, which P (and maybe MD) cached
    out = []
    for i in range(n):
        s, h, c = int(pick[i]), float(hits[i]), context[int(pick[i])]
        room = cfg.max_context - int(outputs[i])  # prompt and output share the context window
        grown = math.ceil(c / h) if h > 0 and c > 0 else 0
        if c > 0 and c < grown <= room:
            prompt, cached = grown, c
        else:
            # New session or compaction: a fresh prompt keeping part of the old prefix.
            prompt = min(int(fresh[i]), room)
            cached = min(c, math.floor(h * prompt))
        context[s] = prompt
        if i >= burn:
            out.append(Request(i - burn, float(arrivals[i - burn]), prompt, cached, int(outputs[i]), s))
    return out
