"""RadixCache insert and match throughput on agentic traffic, as a ratio to a hash-chain
prefix cache (vLLM-style: one dict entry per page keyed by the hash of all tokens up to
it, per-page LRU) measured on the same requests in the same run.

Workload: requests of 8K-64K tokens; 90 % of each request is a prefix of one of a few
long shared contexts (agent sessions, system prompts), the last 10 % is new. Each
request does what MD does: match, lock, evict what the new pages need, insert, unlock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..radix import RadixCache
from . import results

VOCAB = 152_064
SHARED_FRACTION = 0.9
MIN_TOKENS, MAX_TOKENS = 8 << 10, 64 << 10


def workload(num_requests: int, num_contexts: int = 8, seed: int = 0):
    """Yields the token lists, built lazily so only one request is alive at a time. Each
    comes from ``tolist()`` like an engine's token ids, so no int object is shared with
    an earlier request (which would let comparisons short-cut on identity)."""
    rng = np.random.default_rng(seed)
    contexts = rng.integers(0, VOCAB, (num_contexts, MAX_TOKENS))
    for _ in range(num_requests):
        length = int(rng.integers(MIN_TOKENS, MAX_TOKENS + 1))
        shared = int(length * SHARED_FRACTION)
        context = contexts[int(rng.integers(num_contexts))]
        yield np.concatenate([context[:shared], rng.integers(0, VOCAB, length - shared)]).tolist()


class HashChainCache:
    """The baseline: one entry per full page, keyed by a hash chained over the pages
    before it, evicted page by page in LRU order (vLLM's automatic prefix caching)."""

    def __init__(self, page_size: int, capacity_pages: int):
        self.page_size, self.capacity = page_size, capacity_pages
        self.blocks: OrderedDict[int, int] = OrderedDict()

    def page_hashes(self, tokens: list[int]) -> list[int]:
        ps, h, out = self.page_size, None, []
        for i in range(0, len(tokens) - ps + 1, ps):
            h = hash((h, tuple(tokens[i: i + ps])))
            out.append(h)
        return out

    def match(self, hashes: list[int]) -> list[int]:
        pages = []
        for h in hashes:
            page = self.blocks.get(h)
            if page is None:
                break
            self.blocks.move_to_end(h)
            pages.append(page)
        return pages

    def evict(self, num_pages: int) -> list[int]:
        """Frees the ``num_pages`` least recently used pages."""
        return [self.blocks.popitem(last=False)[1] for _ in range(min(num_pages, len(self.blocks)))]

    def insert(self, hashes: list[int], pages: list[int]) -> None:
        for h, page in zip(hashes, pages):
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                self.blocks[h] = page


@dataclass
class Result(results.Result):
    """One point: ``tokens`` looked up over ``requests`` requests; the seconds each cache
    spent matching and inserting them all; the share of ``tokens`` each found cached."""

    requests: int
    page_size: int
    capacity_tokens: int
    tokens: int
    radix_match_s: float
    radix_insert_s: float
    chain_match_s: float
    chain_insert_s: float
    radix_hit_rate: float
    chain_hit_rate: float

    @property
    def radix_match_ops_s(self) -> float:
        return self.requests / self.radix_match_s

    @property
    def radix_insert_ops_s(self) -> float:
        return self.requests / self.radix_insert_s

    @property
    def chain_match_ops_s(self) -> float:
        return self.requests / self.chain_match_s

    @property
    def chain_insert_ops_s(self) -> float:
        return self.requests / self.chain_insert_s

    @property
    def match_ratio(self) -> float:
        return self.radix_match_ops_s / self.chain_match_ops_s

    @property
    def insert_ratio(self) -> float:
        return self.radix_insert_ops_s / self.chain_insert_ops_s

    @property
    def request_ratio(self) -> float:
        """Whole requests (match + insert) per second, RadixCache over the baseline."""
        radix_s = 1 / self.radix_match_ops_s + 1 / self.radix_insert_ops_s
        chain_s = 1 / self.chain_match_ops_s + 1 / self.chain_insert_ops_s
        return chain_s / radix_s

    def table(self) -> str:
        return (f"{self.requests} requests, {self.tokens / self.requests / 1024:.1f}K tokens each on average, "
                f"page {self.page_size}, capacity {self.capacity_tokens / 1e6:.1f}M tokens\n"
                f"{'':14}{'match ops/s':>12}{'insert ops/s':>14}{'hit rate':>10}\n"
                f"{'RadixCache':14}{self.radix_match_ops_s:12.0f}{self.radix_insert_ops_s:14.0f}"
                f"{self.radix_hit_rate:10.3f}\n"
                f"{'hash chain':14}{self.chain_match_ops_s:12.0f}{self.chain_insert_ops_s:14.0f}"
                f"{self.chain_hit_rate:10.3f}\n"
                f"{'ratio':14}{self.match_ratio:11.2f}x{self.insert_ratio:13.2f}x\n"
                f"whole requests (match + insert): {self.request_ratio:.2f}x the hash chain")


def take(free: list[int], n: int) -> list[int]:
    """Allocates ``n`` pages from the end of a free list (O(n), like a real allocator)."""
    pages = free[len(free) - n:]
    del free[len(free) - n:]
    return pages


def run_case(num_requests: int, page_size: int, capacity_tokens: int = 2_000_000) -> Result:
    capacity = capacity_tokens // page_size
    radix = RadixCache(page_size=page_size, capacity_pages=capacity)
    chain = HashChainCache(page_size, capacity)
    radix_free, chain_free = list(range(capacity)), list(range(capacity))
    t_rm = t_ri = t_cm = t_ci = 0.0
    total = radix_hit = chain_hit = 0
    clock = time.perf_counter
    for tokens in workload(num_requests):
        n_pages = len(tokens) // page_size
        total += n_pages * page_size

        t0 = clock()
        hit = radix.match_prefix(tokens)
        t1 = clock()
        radix.lock(hit.node)
        need = n_pages - len(hit.pages)
        radix_free += radix.evict(need - min(need, radix.free_pages))
        new_pages = take(radix_free, need)
        radix.insert(tokens, hit.pages + new_pages)
        radix.unlock(hit.node)
        t2 = clock()
        t_rm += t1 - t0
        t_ri += t2 - t1
        radix_hit += hit.matched_len

        t0 = clock()
        hashes = chain.page_hashes(tokens)
        cached = chain.match(hashes)
        t1 = clock()
        need = n_pages - len(cached)
        chain_free += chain.evict(need - min(need, len(chain_free)))
        new_pages = take(chain_free, need)
        chain.insert(hashes, cached + new_pages)
        t2 = clock()
        t_cm += t1 - t0
        t_ci += t2 - t1
        chain_hit += len(cached) * page_size
    return Result(num_requests, page_size, capacity_tokens, total, t_rm, t_ri, t_cm, t_ci, radix_hit / total,
                  chain_hit / total)
