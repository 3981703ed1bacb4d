"""The correctness oracle: every request's context decoded again by
:func:`pddcore.model.generate` in one process (greedy), compared token by token with
what the deployment streamed to the client."""

from __future__ import annotations

import multiprocessing as mp

import torch

from ..model import generate, token_agreement
from ..model import load_model

__all__ = ["reference_outputs", "compare"]

_model = None


def _init(model_spec: dict) -> None:
    global _model
    torch.set_num_threads(1)
    _model = load_model(model_spec)


def _decode(job: tuple[tuple[int, ...], int]) -> list[int]:
    context, max_new = job
    return generate(_model, list(context), max_new)


def reference_outputs(model_spec: dict, jobs: list[tuple[tuple[int, ...], int]], workers: int = 2) -> dict:
    """``{(context, max_new): tokens}`` for the distinct jobs, on ``workers`` processes
    (in this process, on one thread, when there are at most 4 jobs: starting workers
    would cost more)."""
    unique = sorted(set(jobs), key=lambda j: -len(j[0]))
    if len(unique) <= 4 or workers <= 1:
        threads = torch.get_num_threads()
        model = load_model(model_spec)
        torch.set_num_threads(1)
        try:
            return {job: generate(model, list(job[0]), job[1]) for job in unique}
        finally:
            torch.set_num_threads(threads)
    ctx = mp.get_context("spawn")
    with ctx.Pool(max(1, min(workers, len(unique))), initializer=_init, initargs=(model_spec,)) as pool:
        outputs = pool.map(_decode, unique, chunksize=1)
    return dict(zip(unique, outputs))


def compare(requests: list[dict], reference: dict) -> dict:
    """Per-run verdict: identical count, agreement rate and first divergences."""
    identical, matched, compared, divergent = 0, 0, 0, []
    for r in requests:
        ref = reference[(tuple(r["context"]), r["max_new_tokens"])]
        agree = token_agreement(ref, r["tokens"])
        identical += agree.identical
        matched += agree.matched
        compared += agree.compared
        if not agree.identical:
            divergent.append({"rid": r["rid"], "first_divergence": agree.first_divergence})
    return {"requests": len(requests), "identical": identical, "agreement": matched / max(compared, 1),
            "divergent": divergent, "pass": identical == len(requests)}
