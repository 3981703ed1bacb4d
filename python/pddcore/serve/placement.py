"""Which engine serves a request: the least loaded healthy one of a role, and for MainDecode
the one whose prefix cache most likely holds the request's context.

The gateway cannot see inside an MD's cache, so it keeps an estimate: one
:class:`pddcore.radix.RadixCache` per MD, fed with the contexts it routed there (a prompt
once its KV was pulled, a conversation once MD decoded it), bounded to the MD's cache size
and evicted LRU like the real one. The estimate only steers routing — an MD always pulls
exactly the pages it lacks — so a wrong guess costs bandwidth, never a wrong token, and a
new gateway replica that starts with empty trees is correct from its first request.

Example::

    md_index = PrefixIndex(page_size=16, capacity_tokens=1 << 20)
    md_index.record(md, context)              # MD now holds this context's whole pages
    md, cached = choose_main(mains, md_index, tokens)
"""

from __future__ import annotations

import itertools
from typing import Sequence

from ..radix import RadixCache
from .upstream import Upstream

__all__ = ["PrefixIndex", "least_loaded", "choose_main"]


class PrefixIndex:
    """Per-MD estimates of what each MD's prefix cache holds."""

    def __init__(self, page_size: int, capacity_tokens: int):
        if page_size < 1 or capacity_tokens < page_size:
            raise ValueError(f"need page_size >= 1 and capacity_tokens >= page_size, got {page_size}, "
                             f"{capacity_tokens}")
        self.page_size = page_size
        self.capacity_pages = capacity_tokens // page_size
        self._trees: dict[str, RadixCache] = {}
        self._page_ids = itertools.count()

    def cached_tokens(self, md: Upstream, tokens: Sequence[int]) -> int:
        tree = self._trees.get(md.url)
        return 0 if tree is None else tree.prefix_len(list(tokens))

    def record(self, md: Upstream, tokens: Sequence[int]) -> None:
        """``md`` now holds the whole pages of ``tokens``."""
        tree = self._trees.setdefault(md.url, RadixCache(self.page_size))
        full = len(tokens) // self.page_size * self.page_size
        if full == 0:
            return
        new_pages = full // self.page_size - tree.prefix_len(list(tokens[:full])) // self.page_size
        overflow = tree.num_pages + new_pages - self.capacity_pages
        if overflow > 0:
            tree.evict(overflow)
        pages = [next(self._page_ids) for _ in range(full // self.page_size)]
        tree.insert(list(tokens[:full]), pages)

    def forget(self, md: Upstream) -> None:
        """``md`` restarted or failed: assume its cache is empty."""
        self._trees.pop(md.url, None)


def _picked(upstream: Upstream | None) -> Upstream | None:
    if upstream is not None:
        upstream.picks += 1
    return upstream


def least_loaded(upstreams: Sequence[Upstream], exclude: Sequence[Upstream] = ()) -> Upstream | None:
    """The healthy upstream with the fewest calls in flight, the least often picked among
    equals (None when none is healthy)."""
    live = [u for u in upstreams if u.healthy and u not in exclude]
    return _picked(min(live, key=lambda u: (u.inflight, u.picks))) if live else None


def choose_main(mains: Sequence[Upstream], index: PrefixIndex, tokens: Sequence[int]) -> tuple[Upstream | None, int]:
    """The healthy MD with the longest estimated cached prefix of ``tokens`` (ties: the least
    loaded, then the least often picked), so a session stays on the MD that holds its
    history and new sessions spread; and that prefix length."""
    live = [u for u in mains if u.healthy]
    if not live:
        return None, 0
    cached, best = max(((index.cached_tokens(u, tokens), u) for u in live),
                       key=lambda s: (s[0], -s[1].inflight, -s[1].picks))
    return _picked(best), cached
