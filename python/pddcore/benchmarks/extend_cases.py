"""The reference model's handoff recompute: one extend pass over N handed-off tokens
against the N decode steps that produced them (the baseline, measured in the same run),
on the embedded float64 CPU model, for N from 1 to 512.

Both passes start from a fork of the same cached prefix; their last logits must agree
to rounding (float64), which every point checks before it is reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model import Model
from .results import Result
from .timing import best_seconds

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass
class ExtendResult(Result):
    prefix: int
    new_tokens: int
    decode_steps_s: float
    extend_s: float

    @property
    def speedup(self) -> float:
        """N decode steps over one extend of N tokens."""
        return self.decode_steps_s / self.extend_s

    @property
    def extend_ms_per_token(self) -> float:
        return 1000 * self.extend_s / self.new_tokens


def extend_vs_decode_steps(model: Model, prefix_len: int, new_tokens: int, *, repeats: int = 3) -> ExtendResult:
    """Times one extend of ``new_tokens`` and ``new_tokens`` decode steps after a ``prefix_len`` prefix."""
    pool = model.new_pool(num_pages=(prefix_len + new_tokens) // 16 + 8, page_size=16)
    prefix = pool.new_sequence()
    model.prefill([prefix], [[(31 * i + 7) % model.config.vocab_size for i in range(prefix_len)]])
    tokens = [(17 * i + 5) % model.config.vocab_size for i in range(new_tokens)]
    last: dict[str, torch.Tensor] = {}

    def decode_steps():
        seq = pool.fork(prefix)
        for t in tokens:
            last["decode"] = model.decode([seq], [t])
        pool.release(seq)

    def extend_once():
        seq = pool.fork(prefix)
        last["extend"] = model.extend([seq], [tokens])
        pool.release(seq)

    warmup = 1 if repeats > 1 else 0
    decode_s = best_seconds(decode_steps, repeats=repeats, warmup=warmup)
    extend_s = best_seconds(extend_once, repeats=repeats, warmup=warmup)
    torch.testing.assert_close(last["extend"], last["decode"], rtol=0, atol=1e-10)
    pool.release(prefix)
    return ExtendResult(prefix_len, new_tokens, decode_s, extend_s)


def extend_sweep(tokens: tuple[int, ...] = TOKENS, *, prefix_len: int = 512, repeats: int = 3,
                 model: Model | None = None, progress=None) -> list[ExtendResult]:
    """One point per entry of ``tokens`` on the embedded model (one torch thread while it runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: extra OpenMP threads only contend on a small CPU
    try:
        model = model or Model.default(seed=0)
        results = []
        for n in tokens:
            results.append(extend_vs_decode_steps(model, prefix_len, n, repeats=repeats))
            if progress is not None:
                progress(n)
        return results
    finally:
        torch.set_num_threads(threads)


def format_extend(results: list[ExtendResult]) -> str:
    lines = [f"{'tokens':>6} {'extend ms':>10} {'ms/token':>9} {'decode steps ms':>16} {'speedup':>8}"]
    for r in results:
        lines.append(f"{r.new_tokens:>6} {1000 * r.extend_s:>10.1f} {1000 * r.extend_s / r.new_tokens:>9.2f} "
                     f"{1000 * r.decode_steps_s:>16.1f} {r.speedup:>7.1f}x")
    return "\n".join(lines)
