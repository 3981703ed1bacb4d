"""Best-of-N wall-clock timing, the one clock every benchmark case uses."""

from __future__ import annotations

import time
from typing import Callable


def best_seconds(fn: Callable[[], object], *, repeats: int = 7, warmup: int = 1) -> float:
    """Runs ``fn`` ``warmup`` times, then ``repeats`` times, and returns the fastest run.

    The minimum is the least noisy estimate of what the code costs when the machine
    lets it run; means and tails belong to latency benchmarks, which record every trial.
    """
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
