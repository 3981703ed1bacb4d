"""Percentile summaries of measured samples, the one way the simulator's metrics and the
deployment report summarise latencies.

Example::

    percentiles([0.1, 0.2, 0.4], (50, 90))          # {50: 0.2, 90: 0.36...}
    percentiles([], (50, 99), empty=float("nan"))   # {50: nan, 99: nan}
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

__all__ = ["percentiles"]


def percentiles(samples: Iterable[float], qs: Sequence[float] = (50, 90, 99), *,
                empty: float | None = None) -> dict[float, float]:
    """``{q: q-th percentile}`` of ``samples`` (a flat sequence or 1-D array of floats),
    linear interpolation between the two nearest samples (numpy's default). With no
    samples: ``empty`` for every ``q``, or ValueError when ``empty`` is None."""
    values = np.fromiter(samples, dtype=float)
    if values.size == 0:
        if empty is None:
            raise ValueError("no samples to take percentiles of")
        return {q: empty for q in qs}
    return {q: float(v) for q, v in zip(qs, np.percentile(values, list(qs)))}
