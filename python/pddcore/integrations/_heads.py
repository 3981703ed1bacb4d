"""Which KV heads move between which ranks when the two sides run different tensor-parallel sizes.

Rank ``r`` of a side with TP size ``tp`` and ``total_heads`` KV heads holds the global heads
``[r * total_heads // tp, (r + 1) * total_heads // tp)``. A decode rank needs its range; each
prefill rank whose range overlaps it contributes the overlap, sliced out with ``pack(heads=...)``
on the prefill side and written with ``unpack(heads=...)`` on the decode side.

Example (prefill TP 4, decode TP 2, 8 KV heads): decode rank 1 takes prefill ranks 2 and 3::

    >>> head_sources(8, 4, 2, 1)
    [HeadSource(src_rank=2, src_heads=(0, 2), dst_heads=(0, 2)), HeadSource(src_rank=3, src_heads=(0, 2), dst_heads=(2, 4))]
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["HeadSource", "head_sources", "head_slices", "destinations_of"]


class HeadSource(NamedTuple):
    """Prefill rank ``src_rank`` sends its local heads ``src_heads``; they land on the
    decode rank's local heads ``dst_heads`` (both ``(h0, h1)``, half-open; in
    :func:`head_slices`, None for all of that rank's heads)."""

    src_rank: int
    src_heads: tuple[int, int] | None
    dst_heads: tuple[int, int] | None


def _check(total_heads: int, tp: int, side: str) -> int:
    if tp <= 0 or total_heads <= 0:
        raise ValueError(f"{side}: tp={tp} and total_heads={total_heads} must be positive")
    if total_heads % tp:
        raise ValueError(f"{side}: {total_heads} KV heads do not split evenly over TP {tp}")
    return total_heads // tp


def head_sources(total_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[HeadSource]:
    """The prefill ranks (TP ``src_tp``) that feed decode rank ``dst_rank`` (TP ``dst_tp``)."""
    per_src = _check(total_heads, src_tp, "prefill")
    per_dst = _check(total_heads, dst_tp, "decode")
    if not 0 <= dst_rank < dst_tp:
        raise ValueError(f"decode rank {dst_rank} is outside TP size {dst_tp}")
    lo, hi = dst_rank * per_dst, (dst_rank + 1) * per_dst
    sources = []
    for src in range(lo // per_src, (hi - 1) // per_src + 1):
        s_lo, s_hi = max(lo, src * per_src), min(hi, (src + 1) * per_src)
        sources.append(HeadSource(src, (s_lo - src * per_src, s_hi - src * per_src), (s_lo - lo, s_hi - lo)))
    return sources


def head_slices(total_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[HeadSource]:
    """:func:`head_sources` with a range that spans all of its rank's heads given as None:
    ``pack`` and ``unpack`` then move whole pages, and a prefill rank can send a request's
    staged pages as they are. Equal TP sizes: ``[HeadSource(dst_rank, None, None)]``."""
    sources = head_sources(total_heads, src_tp, dst_tp, dst_rank)  # checks the arguments
    per_src, per_dst = total_heads // src_tp, total_heads // dst_tp
    return [HeadSource(s.src_rank, None if s.src_heads == (0, per_src) else s.src_heads,
                       None if s.dst_heads == (0, per_dst) else s.dst_heads) for s in sources]


def destinations_of(total_heads: int, src_tp: int, dst_tp: int, src_rank: int) -> int:
    """How many decode ranks pull from prefill rank ``src_rank``."""
    return sum(any(s.src_rank == src_rank for s in head_sources(total_heads, src_tp, dst_tp, d))
               for d in range(dst_tp))
