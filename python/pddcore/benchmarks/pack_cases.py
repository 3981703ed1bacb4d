"""pack / unpack throughput against a contiguous copy of the same bytes.

Each case builds a K/V pool whose pages have the given size (dense pages, or vLLM 0.33's
rows whose K and V halves alternate), packs a random permutation of half its pages (so
no two ids are adjacent and nothing coalesces), and compares GB/s with
``torch.Tensor.copy_`` of the same number of contiguous bytes on as many threads, with
torch's ``index_select(..., out=)`` per plane and with a naive ``index_select`` + ``cat``.
pack and unpack run in canonical order and in pool order (``order="pool"``: whole pages
as they lie, for a pool of the same format). The copy, the pack and unpack of both orders
and ``index_select`` take one turn each per round, in an order that rotates, and each
figure is the median of its rounds; the naive one is the best of 3.
The quick points are the goal rows: dense 128 KiB pages and vLLM rows, on 1 and 2 threads.
"""

from __future__ import annotations

from dataclasses import dataclass

import statistics
import time

import torch

import pddcore

from .results import Result
from .timing import best_seconds

PAGE_BYTES = (2 << 10, 32 << 10, 128 << 10, 256 << 10)
THREADS = (1, 2)


@dataclass
class PackResult(Result):
    """One point: ``total_bytes`` moved by each contender, and the best time (seconds) of each."""

    page_bytes: int
    threads: int
    vllm_rows: bool
    total_bytes: int
    copy_s: float
    pack_s: float
    unpack_s: float
    index_select_out_s: float
    naive_s: float
    pool_pack_s: float  # order="pool"
    pool_unpack_s: float
    rounds: int

    def _gbps(self, seconds: float) -> float:
        return self.total_bytes / seconds / 1e9

    @property
    def copy_gbps(self) -> float:
        return self._gbps(self.copy_s)

    @property
    def pack_gbps(self) -> float:
        return self._gbps(self.pack_s)

    @property
    def unpack_gbps(self) -> float:
        return self._gbps(self.unpack_s)

    @property
    def pool_pack_gbps(self) -> float:
        return self._gbps(self.pool_pack_s)

    @property
    def pool_unpack_gbps(self) -> float:
        return self._gbps(self.pool_unpack_s)

    @property
    def index_select_out_gbps(self) -> float:
        return self._gbps(self.index_select_out_s)

    @property
    def naive_gbps(self) -> float:
        return self._gbps(self.naive_s)

    @property
    def label(self) -> str:
        return "vLLM rows" if self.vllm_rows else f"{self.page_bytes >> 10} KiB pages"

    @property
    def pack_ratio(self) -> float:
        return self.pack_gbps / self.copy_gbps

    @property
    def unpack_ratio(self) -> float:
        return self.unpack_gbps / self.copy_gbps

    @property
    def pool_pack_ratio(self) -> float:
        return self.pool_pack_gbps / self.copy_gbps

    @property
    def pool_unpack_ratio(self) -> float:
        return self.pool_unpack_gbps / self.copy_gbps

    @property
    def index_select_out_ratio(self) -> float:
        return self.index_select_out_gbps / self.copy_gbps

    @property
    def naive_ratio(self) -> float:
        return self.naive_gbps / self.copy_gbps


# vLLM 0.33's cells: 16 tokens x 8 heads x 128 fp16 per K (and V) page, the two halves of each row side by side.
VLLM_ROWS = dict(tokens=16, heads=8, dim=128)


def median_rounds(contenders: dict, rounds: int) -> dict[str, float]:
    """Runs every contender once per round (after one warm-up round), round r starting
    with the r-th so none always follows the same one; the median seconds of each."""
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds + 1):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            contenders[name]()
            if r > 0:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def run_case(page_bytes: int, threads: int, total_bytes: int = 64 << 20, layers: int = 2,
             vllm_rows: bool = False, rounds: int = 9) -> PackResult:
    """Measures one (page size, thread count) point; ``total_bytes`` is what one pack moves.
    ``vllm_rows``: the pool is laid out as vLLM 0.33 allocates it (K and V halves of every
    row, 256-byte cells; ``page_bytes`` is then 32 KiB)."""
    planes = 2 * layers
    if vllm_rows:
        page_bytes = VLLM_ROWS["tokens"] * VLLM_ROWS["heads"] * VLLM_ROWS["dim"] * 2
    pages_moved = max(1, total_bytes // (planes * page_bytes))
    pool_pages = 2 * pages_moved
    if vllm_rows:
        rows = [torch.randn(pool_pages, VLLM_ROWS["tokens"], VLLM_ROWS["heads"], 2 * VLLM_ROWS["dim"],
                            dtype=torch.float16) for _ in range(layers)]
        k, v = [t[..., :VLLM_ROWS["dim"]] for t in rows], [t[..., VLLM_ROWS["dim"]:] for t in rows]
    else:
        elems = page_bytes // 2  # fp16 elements per page
        k = [torch.randn(pool_pages, elems, dtype=torch.float16) for _ in range(layers)]
        v = [torch.randn(pool_pages, elems, dtype=torch.float16) for _ in range(layers)]
    layout = pddcore.KVLayout.from_tensors(k, v)
    ids = torch.randperm(pool_pages)[:pages_moved]
    moved = layout.packed_nbytes(len(ids))
    buf = torch.empty(moved, dtype=torch.uint8)
    src = torch.randn(moved // 2, dtype=torch.float16).view(torch.uint8)
    dst = torch.empty_like(src)
    per_plane = [torch.empty((pages_moved,) + tuple(k[0].shape[1:]), dtype=torch.float16) for _ in range(planes)]
    all_planes = [t for pair in zip(k, v) for t in pair]

    old_pdd, old_torch = pddcore.get_num_threads(), torch.get_num_threads()
    pddcore.set_num_threads(threads)
    torch.set_num_threads(threads)
    page_format = layout.pool_page_format
    try:
        t = median_rounds({
            "copy": lambda: dst.copy_(src),
            "pack": lambda: pddcore.pack(layout, ids, out=buf),
            "unpack": lambda: pddcore.unpack(layout, ids, buf),
            "pool_pack": lambda: pddcore.pack(layout, ids, out=buf, order="pool"),
            "pool_unpack": lambda: pddcore.unpack(layout, ids, buf, order="pool", page_format=page_format),
            "index_out": lambda: [torch.index_select(p, 0, ids, out=o) for p, o in zip(all_planes, per_plane)],
        }, rounds)
        naive = best_seconds(lambda: torch.cat([p.index_select(0, ids).reshape(-1) for p in all_planes]), repeats=3)
    finally:
        pddcore.set_num_threads(old_pdd)
        torch.set_num_threads(old_torch)
    return PackResult(page_bytes, threads, vllm_rows, moved, t["copy"], t["pack"], t["unpack"], t["index_out"], naive,
                      t["pool_pack"], t["pool_unpack"], rounds)


def points(quick: bool) -> list[tuple[int, int, bool]]:
    """(page bytes, threads, vLLM rows) of a run: the goal rows, and every dense page size
    unless ``quick``."""
    dense = [128 << 10] if quick else list(PAGE_BYTES)
    return [(p, t, False) for p in dense for t in THREADS] + [(0, t, True) for t in THREADS]


def run_points(quick: bool) -> list[PackResult]:
    total = (16 << 20) if quick else (64 << 20)
    return [run_case(p, t, total_bytes=total, vllm_rows=v) for p, t, v in points(quick)]


def format_table(results: list[PackResult]) -> str:
    lines = [f"{'pages':>15} {'thr':>3} {'copy GB/s':>9} {'pack':>6} {'unpack':>6} {'pool pack':>9} "
             f"{'pool unpack':>11} {'idx_sel(out)':>12} {'naive':>6}   (ratios to copy; medians of "
             f"{results[0].rounds if results else 0} interleaved rounds)"]
    for r in results:
        lines.append(f"{r.label:>15} {r.threads:>3} {r.copy_gbps:>9.2f} {r.pack_ratio:>6.2f} "
                     f"{r.unpack_ratio:>6.2f} {r.pool_pack_ratio:>9.2f} {r.pool_unpack_ratio:>11.2f} "
                     f"{r.index_select_out_ratio:>12.2f} {r.naive_ratio:>6.2f}")
    return "\n".join(lines)
