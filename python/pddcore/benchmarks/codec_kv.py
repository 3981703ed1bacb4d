"""Real KV for the ``codec`` bench cases (:mod:`.codec_cases`, :mod:`.codec_greedy`).

Real KV: the embedded model (``pddcore.model`` defaults, seeded weights) prefills the
opening documents of the demo's agentic trace (``pddcore.deploy.trace.agentic_trace``) in
each engine dtype (bfloat16, float16, float32, and float64, the demo's); the pages are
packed (``pddcore.pack``) and viewed as ``[layers * 2 * pages, page elements]``, one row
per page of a layer's K or V. A Hugging Face checkpoint's KV is added when
``PDDCORE_BENCH_CHECKPOINT`` names a Llama / Qwen2 folder on disk; otherwise that part
says "skipped: no checkpoint".

Example::

    kv = embedded_kv(quick=True)["embedded bfloat16"]   # [layers * 2 * pages, page elements]
"""

from __future__ import annotations

import os

import torch

from .. import pack
from ..deploy.trace import Scenario, agentic_trace
from ..model import Model

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
PAGE_SIZE = 16
CHECKPOINT_ENV = "PDDCORE_BENCH_CHECKPOINT"


def one_thread(fn):
    """Runs ``fn`` with torch on one thread: every figure here is per core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def documents(scenario: Scenario, quick: bool) -> list[list[int]]:
    """The distinct opening contexts of the trace's sessions (quick: the first)."""
    seen, out = set(), []
    for s in scenario.sessions:
        if s.first_context not in seen:
            seen.add(s.first_context)
            out.append(list(s.first_context))
    return out[:1] if quick else out


def prefilled_kv(model: Model, contexts: list[list[int]]) -> torch.Tensor:
    """The model's KV of ``contexts`` (each prefilled on its own), packed and viewed as
    ``[layers * 2 * pages, page elements]`` in the model's dtype. A page whose tokens up to
    its end were already taken (the shared system prompt) is taken once: a decode-side
    prefix cache holds it, so P would not send it again."""
    vocab = model.config.vocab_size
    pool = model.new_pool(sum(-(-len(c) // PAGE_SIZE) for c in contexts), PAGE_SIZE)
    pages, taken = [], set()
    for context in contexts:
        context = [t % vocab for t in context]
        seq = pool.new_sequence()
        model.prefill([seq], [context])
        for i, page in enumerate(seq.pages):
            prefix = tuple(context[:(i + 1) * PAGE_SIZE])
            if prefix not in taken:
                taken.add(prefix)
                pages.append(page)
    buf = pack(pool.layout(), torch.tensor(pages, dtype=torch.int64))
    return buf.view(model.dtype).view(model.config.num_layers * 2 * len(pages), -1)


def embedded_kv(quick: bool) -> dict[str, torch.Tensor]:
    contexts = documents(agentic_trace(), quick)
    return {f"embedded {str(d).removeprefix('torch.')}": one_thread(
        lambda d=d: prefilled_kv(Model.default(seed=0, dtype=d), contexts)) for d in DTYPES}


def checkpoint_kv(quick: bool) -> tuple[dict[str, torch.Tensor], str | None]:
    """KV of the checkpoint named by ``PDDCORE_BENCH_CHECKPOINT``, or ({}, why not)."""
    path = os.environ.get(CHECKPOINT_ENV)
    if not path or not os.path.isdir(path):
        return {}, f"skipped: no checkpoint (set {CHECKPOINT_ENV} to a Hugging Face Llama / Qwen2 folder)"
    model = Model.from_pretrained(path)
    name = f"{os.path.basename(os.path.normpath(path))} {str(model.dtype).removeprefix('torch.')}"
    return {name: one_thread(lambda: prefilled_kv(model, documents(agentic_trace(), quick)))}, None
