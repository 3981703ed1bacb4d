"""`KVPool`: the paged KV cache the decoder reads and writes, and `SequenceKV`, one
request's pages in it.

Per layer the pool holds a K and a V token pool of shape ``[num_pages * page_size,
num_kv_heads, head_dim]`` (SGLang's layout). Page ``p`` is slots ``p * page_size ..
(p + 1) * page_size - 1``, one contiguous run of bytes per plane, so
``KVLayout.from_tensors(k_layers, v_layers, tokens_per_page=page_size)`` (what
:meth:`KVPool.layout` returns) lets ``pddcore.pack``/``unpack`` move whole pages. Token
``i`` of a sequence lives in slot ``pages[i // page_size] * page_size + i % page_size``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..layout import KVLayout
from .allocator import PageAllocator
from .config import ModelConfig

__all__ = ["KVPool", "SequenceKV"]


class SequenceKV:
    """One request's pages in a :class:`KVPool`; ``num_tokens`` of them hold valid KV.

    Create it through the pool (:meth:`KVPool.new_sequence`, :meth:`KVPool.allocate_sequence`,
    :meth:`KVPool.fork`) and give it back with :meth:`KVPool.release`.
    """

    def __init__(self, pool: "KVPool", pages: list[int], num_tokens: int):
        self.pool = pool
        self.pages = pages
        self.num_tokens = num_tokens
        self.released = False

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.pool.page_size

    def slots(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Slot indices (int64, on the pool's device) of token positions ``start .. end-1``."""
        end = self.num_tokens if end is None else end
        if not 0 <= start <= end <= self.capacity:
            raise ValueError(f"positions [{start}, {end}) are outside this sequence's {self.capacity} reserved slots")
        ps = self.pool.page_size
        positions = torch.arange(start, end, dtype=torch.int64)
        pages = torch.tensor(self.pages, dtype=torch.int64)
        return (pages[positions // ps] * ps + positions % ps).to(self.pool.device)

    def __repr__(self) -> str:
        return f"SequenceKV({self.num_tokens} tokens in pages {self.pages})"


class KVPool:
    """Paged K/V token pools for every layer of one model, plus the page allocator."""

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int = 16, *,
                 dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu"):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.config = config
        self.page_size = int(page_size)
        self.allocator = PageAllocator(num_pages)
        self.dtype = dtype
        shape = (num_pages * self.page_size, config.num_kv_heads, config.head_dim)
        self.k_layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v_layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.device = self.k_layers[0].device  # "cuda" resolved to "cuda:N", as the model's weights are

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    def layout(self) -> KVLayout:
        """The pool as a :class:`pddcore.KVLayout` with ``tokens_per_page = page_size``."""
        return KVLayout.from_tensors(self.k_layers, self.v_layers, tokens_per_page=self.page_size)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- sequences ----------------------------------------------------------------------
    def new_sequence(self) -> SequenceKV:
        """An empty sequence; the model reserves its pages as tokens arrive."""
        return SequenceKV(self, [], 0)

    def allocate_sequence(self, num_tokens: int) -> SequenceKV:
        """A sequence of ``num_tokens`` tokens whose KV the caller writes itself (for
        example with ``pddcore.unpack(pool.layout(), torch.tensor(seq.pages), buf)``)."""
        seq = self.new_sequence()
        self.append_external(seq, num_tokens)
        return seq

    def append_external(self, seq: SequenceKV, num_tokens: int) -> list[int]:
        """Counts ``num_tokens`` more tokens as held by ``seq`` although their KV is written
        from outside the model (a transfer into the pages); reserves pages as needed and
        returns the newly reserved ones. With a page-aligned ``seq`` (for example a fork
        of a cached prefix) those new pages are exactly where the incoming pages go."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        before = len(seq.pages)
        self.reserve([seq], [num_tokens])
        seq.num_tokens += num_tokens
        return seq.pages[before:]

    def fork(self, parent: SequenceKV, num_tokens: int | None = None) -> SequenceKV:
        """A new sequence whose first ``num_tokens`` (default: all) tokens are ``parent``'s.

        Full pages are shared (reference counted, never written again since sequences
        only grow); a partly used last page is copied into a fresh page, because the
        child will write its next tokens there.
        """
        self._check_owned([parent])
        n = parent.num_tokens if num_tokens is None else num_tokens
        if not 0 <= n <= parent.num_tokens:
            raise ValueError(f"cannot fork {n} tokens from a sequence holding {parent.num_tokens}")
        full, tail = divmod(n, self.page_size)
        shared = parent.pages[:full]
        copied = self.allocator.alloc(1 if tail else 0)
        self.allocator.retain(shared)
        if tail:
            src, dst = parent.pages[full] * self.page_size, copied[0] * self.page_size
            for plane in self.k_layers + self.v_layers:
                plane[dst:dst + tail] = plane[src:src + tail]
        return SequenceKV(self, shared + copied, n)

    def reserve(self, seqs: Sequence[SequenceKV], new_tokens: Sequence[int]) -> None:
        """Makes room for ``new_tokens[i]`` more tokens in ``seqs[i]``: all or nothing
        (:class:`PoolExhaustedError` leaves every sequence as it was)."""
        self._check_owned(seqs)
        needs = [max(0, self.pages_for(s.num_tokens + n) - len(s.pages)) for s, n in zip(seqs, new_tokens)]
        fresh = self.allocator.alloc(sum(needs))
        for seq, need in zip(seqs, needs):
            seq.pages.extend(fresh[:need])
            fresh = fresh[need:]

    def release(self, seq: SequenceKV) -> None:
        """Returns the sequence's page references; the sequence cannot be used afterwards."""
        self._check_owned([seq])
        self.allocator.free(seq.pages)
        seq.pages, seq.num_tokens, seq.released = [], 0, True

    def _check_owned(self, seqs: Sequence[SequenceKV]) -> None:
        for seq in seqs:
            if seq.pool is not self:
                raise ValueError(f"{seq!r} belongs to another KVPool")
            if seq.released:
                raise ValueError("sequence was already released")
