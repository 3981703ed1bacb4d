"""CRC32C throughput per implementation, against a memcpy of the same bytes in the same run.

Every transfer chunk is checksummed on both sides, so the checksum's speed next to a copy
says what it costs the data path: ``in cache`` is a 256 KiB piece checksummed again and
again (what the TCP backend does right after the kernel's copy of a piece), ``from
memory`` one pass over a buffer far larger than the caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _C
from .results import Result
from .timing import best_seconds

PIECE_BYTES = 256 << 10


@dataclass
class CrcResult(Result):
    implementation: str
    where: str  # "in cache" or "from memory"
    nbytes: int
    crc_gbps: float
    memcpy_gbps: float

    @property
    def ratio(self) -> float:
        return self.crc_gbps / self.memcpy_gbps


def _rate(fn, nbytes: int, calls: int) -> float:
    def run() -> None:
        for _ in range(calls):
            fn()

    return nbytes * calls / best_seconds(run, repeats=5) / 1e9


def crc32c_rates(memory_bytes: int = 256 << 20) -> list[CrcResult]:
    """Each implementation this CPU offers, in cache and from memory."""
    rng = np.random.default_rng(0)
    results = []
    for where, nbytes, calls in (("in cache", PIECE_BYTES, 400), ("from memory", memory_bytes, 1)):
        src = rng.integers(0, 256, nbytes, dtype=np.uint8)
        dst = np.empty_like(src)
        data = src.tobytes()
        memcpy = _rate(lambda: np.copyto(dst, src), nbytes, calls)
        for impl in _C.crc32c_implementations():
            if impl == "table" and where == "from memory":
                continue  # the portable fallback: slow enough from memory to cost a minute of benchmark
            crc = _rate(lambda: _C.crc32c(data, 0, impl), nbytes, calls if impl != "table" else 4)
            results.append(CrcResult(impl, where, nbytes, crc, memcpy))
    return results


def format_table(results: list[CrcResult]) -> str:
    lines = ["crc32c               where         crc GB/s  memcpy GB/s  ratio"]
    for r in results:
        lines.append(f"{r.implementation:<20} {r.where:<12} {r.crc_gbps:>9.1f} {r.memcpy_gbps:>12.1f} {r.ratio:>6.2f}")
    return "\n".join(lines)
