"""A prefix cache over a :class:`KVPool`'s pages: the three moves every role with a
:class:`pddcore.radix.RadixCache` in front of its pool makes (the reference engine, P and MD
of the reference deployment). The cache holds its own page references, so a cached page
outlives the sequence that wrote it.

Example::

    cache = RadixCache(page_size=pool.page_size)
    seq, hit = cached_prefix(pool, cache, prompt[:-1])     # whole cached pages, shared
    logits = with_room(pool, cache, lambda: model.extend([seq], [prompt[hit:]]))
    cache_sequence(pool, cache, prompt, seq)               # the prompt's whole pages, for the next request
"""

from __future__ import annotations

from .allocator import PoolExhaustedError
from .kv_pool import SequenceKV

__all__ = ["with_room", "cache_sequence", "cached_prefix"]


def with_room(pool, cache, fn):
    """Runs ``fn``; while the KV pool is full, evicts least-recently-used pages of the
    prefix ``cache`` (dropping the cache's page references) and tries again."""
    while True:
        try:
            return fn()
        except PoolExhaustedError:
            freed = cache.evict(max(64, pool.num_pages // 8))
            if not freed:
                raise
            pool.allocator.free(freed)


def cache_sequence(pool, cache, tokens, seq) -> None:
    """Records the whole pages of ``seq`` (holding ``tokens``) in the prefix ``cache``; the
    cache takes its own reference on the pages it did not hold yet."""
    full = min(len(tokens), seq.num_tokens) // pool.page_size
    result = cache.insert(list(tokens[:full * pool.page_size]), seq.pages[:full])
    pool.allocator.retain(seq.pages[result.prefix_len // pool.page_size:full])


def cached_prefix(pool, cache, tokens):
    """A new sequence on the longest cached whole-page prefix of ``tokens``, and its length."""
    hit = cache.match_prefix(list(tokens))
    pool.allocator.retain(hit.pages)
    return SequenceKV(pool, list(hit.pages), hit.matched_len), hit.matched_len
