"""`run_demo`: one scenario through cross-DC PD and PDD (the gateway over reference engine
servers) on the same emulated WAN, plus the single-process reference decode that judges both."""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..model import load_model
from .cluster import RunConfig, RunResult, run_deployment
from .network import Network
from .reference import compare, reference_outputs
from .report import run_metrics
from .trace import Scenario

__all__ = ["run_demo", "kv_bytes_per_token", "vocab_size"]


def kv_bytes_per_token(model_spec: dict) -> float:
    model = load_model(model_spec)
    return model.new_pool(1, 16).layout().bytes_per_token()


def vocab_size(model_spec: dict) -> int:
    return load_model(model_spec).config.vocab_size


def run_demo(scenario: Scenario, network: Network, *, model: dict | None = None, modes: tuple[str, ...] = ("pd", "pdd"),
             overrides: dict | None = None, progress: Callable[[str, int], None] | None = None) -> dict:
    """Runs ``modes`` in order on the open ``network``; returns metrics, correctness and the raw runs.
    ``overrides``: per-mode RunConfig fields, e.g. ``{"pdd": {"kill_md_after_s": 2.0}}``."""
    model = model or {"seed": 0}
    runs: dict[str, RunResult] = {}
    for mode in modes:
        config = RunConfig(mode, model=model, **(overrides or {}).get(mode, {}))
        runs[mode] = run_deployment(config, scenario, network,
                                    None if progress is None else (lambda n, m=mode: progress(m, n)))
    jobs = [(tuple(r["context"]), r["max_new_tokens"]) for run in runs.values() for r in run.requests]
    reference = reference_outputs(model, jobs)
    return {
        "network": network.describe(), "network_kind": network.kind,
        "kv_bytes_per_token": kv_bytes_per_token(model), "model": model,
        "metrics": {mode: run_metrics(run) for mode, run in runs.items()},
        "correctness": {mode: compare(run.requests, reference) for mode, run in runs.items()},
        "runs": {mode: dataclasses.asdict(run) for mode, run in runs.items()},
    }
