"""The ``codec`` bench case's greedy-agreement harness: do greedy tokens survive FP8 KV?

Greedy agreement: every request of the demo trace (``quick``: the first sessions) is
decoded greedily by the demo's float64 model from the same prefill: on the exact prefix
KV, after that KV went through FP8 and back (as MD would receive it), and, as a control
for how fragile the model's greedy choices are, after rounding it to bfloat16. The first
token comes from the prefill's logits in every arm, as P samples it. Reported per arm:
the fraction of requests whose continuation is identical to the exact one, and where
the others first differ.

Example::

    for arm in greedy_agreement(quick=True):
        print(arm.arm, arm.identical, "of", arm.requests)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import codec, pack, unpack
from ..deploy.trace import agentic_trace
from ..model import Model, SamplerState, SamplingParams, sample, token_agreement
from .codec_kv import PAGE_SIZE, one_thread
from .results import Result


@dataclass
class GreedyAgreement(Result):
    arm: str  # how the prefix KV was altered (a key of ROUNDTRIPS)
    requests: int
    identical: int
    tokens_compared: int
    tokens_matched: int
    first_divergences: list[tuple[int, int]] = field(default_factory=list)  # (request, output position)
    note: str = ""

    @property
    def identical_fraction(self) -> float:
        return self.identical / self.requests


# How the prefix KV reaches MD in each arm of the greedy comparison: through the FP8 codec,
# and, as a control for how fragile the model's greedy choices are, rounded to bfloat16
# (what a bfloat16 engine stores anyway).
ROUNDTRIPS = {
    "fp8": lambda rows: codec.decode(codec.get("fp8").encode(rows), max_bytes=rows.nbytes),
    "bfloat16 rounding (control)": lambda rows: rows.to(torch.bfloat16).to(rows.dtype),
}


def _greedy(logits: torch.Tensor) -> list[int]:
    n = logits.shape[0]
    return sample(logits, [SamplingParams()] * n, [SamplerState(0) for _ in range(n)])


def _roundtrip_copy(model: Model, pool, seq, into, roundtrip) -> None:
    """Writes ``seq``'s KV pages, passed through ``roundtrip`` as ``[layers * 2 * pages,
    page elements]`` rows (one scale per row for fp8), into the sequence ``into``."""
    layout = pool.layout()
    buf = pack(layout, torch.tensor(seq.pages, dtype=torch.int64))
    rows = buf.view(model.dtype).view(model.config.num_layers * 2 * len(seq.pages), -1)
    unpack(layout, torch.tensor(into.pages, dtype=torch.int64), roundtrip(rows).contiguous().view(-1).view(torch.uint8))


def _decode_arms(model: Model, contexts: list[list[int]], max_new: list[int]) -> list[dict[str, list[int]]]:
    """Greedy continuations of each context on its exact prefix KV (``"exact"``) and on that
    KV passed through each of :data:`ROUNDTRIPS`; every request and arm in one decode batch.
    The first token comes from the prefill's logits in every arm, as P samples it."""
    arms = ["exact", *ROUNDTRIPS]
    pages = sum(-(-(len(c) + n) // PAGE_SIZE) for c, n in zip(contexts, max_new))
    pool = model.new_pool(len(arms) * pages, PAGE_SIZE)  # fresh (zeroed): no stale slots sway a page's scale
    seqs = {"exact": [pool.new_sequence() for _ in contexts]}
    first = _greedy(model.prefill(seqs["exact"], contexts))
    for arm, roundtrip in ROUNDTRIPS.items():
        seqs[arm] = [pool.allocate_sequence(len(c)) for c in contexts]
        for exact, copy in zip(seqs["exact"], seqs[arm]):
            _roundtrip_copy(model, pool, exact, copy, roundtrip)
    keys = [(arm, i) for arm in arms for i in range(len(contexts))]
    outputs = {key: [first[key[1]]] for key in keys}
    while True:
        live = [key for key in keys if len(outputs[key]) < max_new[key[1]]]
        if not live:
            break
        tokens = _greedy(model.decode([seqs[arm][i] for arm, i in live], [outputs[key][-1] for key in live]))
        for key, token in zip(live, tokens):
            outputs[key].append(token)
    return [{arm: outputs[arm, i] for arm in arms} for i in range(len(contexts))]


def greedy_agreement(quick: bool) -> list[GreedyAgreement]:
    """The demo trace's requests, turn by turn (a turn's context holds the previous exact
    answer), one :class:`GreedyAgreement` per arm of :data:`ROUNDTRIPS`."""
    scenario = agentic_trace()
    sessions = scenario.sessions[:2] if quick else scenario.sessions
    model = Model.default(seed=0)  # the demo's model: float64 on the CPU
    contexts = {s.sid: list(s.first_context) for s in sessions}
    runs: list[dict[str, list[int]]] = []
    for turn in range(max(len(s.outputs) for s in sessions)):
        active = [s for s in sessions if turn < len(s.outputs)]
        results = one_thread(lambda: _decode_arms(model, [contexts[s.sid] for s in active],
                                                   [s.outputs[turn] for s in active]))
        for s, tokens in zip(active, results):
            runs.append(tokens)
            if turn + 1 < len(s.outputs):
                contexts[s.sid] = contexts[s.sid] + tokens["exact"] + list(s.followups[turn])
    note = f"{len(sessions)} of {len(scenario.sessions)} sessions of the demo trace"
    results = []
    for arm in ROUNDTRIPS:
        result = GreedyAgreement(arm, len(runs), 0, 0, 0, note=note)
        for i, tokens in enumerate(runs):
            agree = token_agreement(tokens["exact"], tokens[arm])
            result.identical += agree.identical
            result.tokens_compared += agree.compared
            result.tokens_matched += agree.matched
            if not agree.identical:
                result.first_divergences.append((i, agree.first_divergence))
        results.append(result)
    return results
