"""`RadixCache`: the decode-side radix cache (DRC) on MD.

A radix tree over token ids whose edges hold KV page ids, one page per
``page_size`` tokens. MD keeps the KV of past requests in it; P asks how many leading
tokens MD already holds and sends only the suffix. Only whole pages are cached: a
match or insert ignores the tokens of a trailing partial page.

Separate namespaces (``extra_key``: a model, LoRA adapter or cache salt) never share
entries. ``lock`` pins a matched prefix while its pages are in use (a transfer or a
running request); ``evict`` frees least-recently-used unlocked pages, leaf tails
first, and returns their ids to the caller's allocator. The cache never allocates or
frees pages itself: it only records which page holds which tokens.

Pure Python, no I/O, deterministic (recency is an operation counter, not a clock).
Costs per call are O(tokens) at C speed (tuple slice comparisons) plus O(depth) Python
steps; ``evict`` is O(leaves) to order the candidates.

Example::

    cache = RadixCache(page_size=16, capacity_pages=4096)
    hit = cache.match_prefix(prompt)           # MatchResult(pages, matched_len, node)
    cache.lock(hit.node)                       # keep those pages while the request runs
    need = len(prompt) // 16 - len(hit.pages)
    freed = cache.evict(need - min(need, cache.free_pages))  # give `freed` back to the allocator
    new_pages = allocator.alloc(need)
    ...                                        # P writes the suffix KV into new_pages
    cache.insert(prompt, hit.pages + new_pages)
    cache.unlock(hit.node)
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from dataclasses import dataclass
from typing import Hashable, Sequence

__all__ = ["RadixCache", "RadixNode", "MatchResult", "InsertResult", "CacheFullError"]

# Whole-slice comparisons run at C speed; the page-by-page search for a mismatch only
# runs inside the first block that differs.
_COMPARE_BLOCK_TOKENS = 1024


class CacheFullError(ValueError):
    """An insert would need more pages than the free capacity; nothing was changed."""


class RadixNode:
    """One edge of the tree: ``key`` (a page-aligned run of token ids) and ``pages``
    (one id per page). Returned by :meth:`RadixCache.match_prefix` for ``lock``.

    ``times`` holds the recency of the edge's pages as segments ``(end_page, time)``.
    An edge has one segment until eviction merges a lone child into its parent; then
    the parent's (more recent) pages keep their own time, so LRU stays exact per page.
    """

    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "times", "id", "cache")

    def __init__(self, key: tuple, pages: list[int], parent: "RadixNode | None", cache: "RadixCache", node_id: int):
        self.key = key
        self.pages = pages
        self.children: dict[tuple, RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.times: list[tuple[int, int]] = [(len(pages), 0)]
        self.id = node_id
        self.cache = cache

    @property
    def last_access(self) -> int:
        """Recency of the edge's tail page (its least recent one)."""
        return self.times[-1][1]

    def __repr__(self) -> str:
        return f"RadixNode(id={self.id}, tokens={len(self.key)}, pages={len(self.pages)}, lock_ref={self.lock_ref})"


@dataclass(frozen=True)
class MatchResult:
    """``pages`` hold the KV of the first ``matched_len`` tokens (a multiple of the page
    size); ``node`` ends exactly there and is what :meth:`RadixCache.lock` takes."""

    pages: list[int]
    matched_len: int
    node: RadixNode


@dataclass(frozen=True)
class InsertResult:
    """``prefix_len``: leading tokens that were cached already (their pages stay the
    cached ones). ``duplicate_pages``: the caller's pages for that prefix that differ
    from the cached ones; the cache did not take them, so the caller frees them."""

    prefix_len: int
    duplicate_pages: list[int]


class RadixCache:
    """Page-granular prefix cache; see the module docstring.

    ``page_size``: tokens per KV page (the engine's page size). ``capacity_pages``: the
    most pages the cache may hold (``None``: unbounded); :meth:`insert` raises
    :class:`CacheFullError` rather than exceed it, so the caller evicts first and
    returns the freed pages to its allocator.
    """

    def __init__(self, page_size: int = 1, capacity_pages: int | None = None):
        if type(page_size) is not int or page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
        if capacity_pages is not None and (type(capacity_pages) is not int or capacity_pages < 0):
            raise ValueError(f"capacity_pages must be None or an integer >= 0, got {capacity_pages!r}")
        self.page_size = page_size
        self.capacity_pages = capacity_pages
        self._roots: dict[Hashable, RadixNode] = {}
        self._ids = itertools.count()
        self._clock = 0
        self._owned: set[int] = set()
        self._locked_pages = 0
        self._evictable_leaves: set[RadixNode] = set()  # unlocked, childless, not a root
        # Eviction candidates by (tail recency, id). Entries go stale when a leaf is touched,
        # gains a child, is locked or removed; they are skipped when popped, and the heap is
        # rebuilt when stale entries outnumber live ones, so evict costs O(k log n).
        self._lru_heap: list[tuple[int, int, RadixNode]] = []

    # ---- accounting ----------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        """Pages the cache holds."""
        return len(self._owned)

    @property
    def num_locked_pages(self) -> int:
        """Pages on a locked path (never evicted)."""
        return self._locked_pages

    @property
    def num_evictable_pages(self) -> int:
        return len(self._owned) - self._locked_pages

    @property
    def free_pages(self) -> int | float:
        """Pages that can be inserted without eviction (``inf`` when unbounded)."""
        if self.capacity_pages is None:
            return float("inf")
        return self.capacity_pages - len(self._owned)

    def __contains__(self, page: int) -> bool:
        return page in self._owned

    # ---- queries ---------------------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int], extra_key: Hashable = None) -> MatchResult:
        """Longest cached page-aligned prefix of ``tokens`` in namespace ``extra_key``.

        Marks the matched path as recently used and splits an edge where the match ends
        inside it, so that ``result.node`` covers exactly ``matched_len`` tokens.
        """
        key = self._key(tokens)
        root = self._root(extra_key)
        node, pos, partial, common = self._walk(root, key)
        if partial is not None:
            node = self._split(partial, common)
            pos += common
        self._touch(node)
        return MatchResult(self._path_pages(node), pos, node)

    def prefix_len(self, tokens: Sequence[int], extra_key: Hashable = None) -> int:
        """Tokens of ``tokens`` the cache holds, without touching recency or the tree
        (what MD reports to P and the router)."""
        key = self._key(tokens)
        root = self._root(extra_key, create=False)
        if root is None:
            return 0
        _, pos, _, common = self._walk(root, key)
        return pos + common

    # ---- updates -------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int], extra_key: Hashable = None) -> InsertResult:
        """Caches ``pages[i]`` as the KV of tokens ``[i*page_size, (i+1)*page_size)``.

        ``len(pages)`` must equal ``len(tokens) // page_size``. Pages of a prefix that is
        cached already are not taken (see :class:`InsertResult`); the new pages must not
        be held by the cache already. Raises before changing anything.
        """
        key = self._key(tokens)
        try:
            pages = array("q", pages).tolist()  # validates integer ids at C speed
        except (TypeError, OverflowError) as e:
            raise ValueError(f"page ids must be 64-bit integers: {e}") from None
        if len(pages) != len(key) // self.page_size:
            raise ValueError(f"{len(tokens)} tokens at page_size={self.page_size} fill {len(key) // self.page_size} "
                             f"pages, but {len(pages)} page ids were given")
        if pages and min(pages) < 0:
            raise ValueError(f"page ids must be >= 0, got {min(pages)}")
        root = self._root(extra_key)
        node, pos, partial, common = self._walk(root, key)
        prefix_len = pos + common
        cached = self._path_pages(node) + (partial.pages[: common // self.page_size] if partial else [])
        new_pages = pages[prefix_len // self.page_size:]
        if len(set(new_pages)) != len(new_pages):
            raise ValueError("the new pages of one insert contain the same page id twice")
        if not self._owned.isdisjoint(new_pages):
            already = [p for p in new_pages if p in self._owned]
            raise ValueError(f"pages {already[:8]} are cached already for other tokens")
        if len(new_pages) > self.free_pages:
            raise CacheFullError(f"insert needs {len(new_pages)} new pages but only {self.free_pages} of "
                                 f"{self.capacity_pages} are free; evict first")

        if partial is not None:
            node = self._split(partial, common)
        if new_pages:
            node = self._add_child(node, key[prefix_len:], new_pages)
        self._touch(node)
        mine = pages[: len(cached)]
        duplicates = [] if mine == cached else [p for p, c in zip(mine, cached) if p != c]
        return InsertResult(prefix_len, duplicates)

    def lock(self, node: RadixNode) -> None:
        """Pins ``node`` and its ancestors: their pages are never evicted until
        :meth:`unlock`. Locks nest (a count per node)."""
        self._check_node(node)
        while node.parent is not None:
            if node.lock_ref == 0:
                self._locked_pages += len(node.pages)
                if not node.children:
                    self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Undoes one :meth:`lock` of ``node``."""
        self._check_node(node)
        if node.parent is not None and node.lock_ref == 0:
            raise ValueError(f"{node!r} is not locked")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._locked_pages -= len(node.pages)
                if not node.children:
                    self._make_evictable(node)
            node = node.parent

    def evict(self, num_pages: int) -> list[int]:
        """Frees up to ``num_pages`` unlocked pages, least recently used first, from the
        tails of leaves (a prefix outlives its extensions). Returns the freed page ids,
        fewer than asked only when nothing more is evictable; ``num_pages <= 0`` frees
        nothing. A parent left with one child is merged into it, so paths stay short."""
        if type(num_pages) is not int:
            raise ValueError(f"num_pages must be an integer, got {num_pages!r}")
        freed: list[int] = []
        heap = self._lru_heap
        while len(freed) < num_pages and heap:
            time, _, node = heapq.heappop(heap)
            if node not in self._evictable_leaves or time != node.last_access:
                continue  # stale entry
            tail_start = node.times[-2][0] if len(node.times) > 1 else 0
            take = min(num_pages - len(freed), len(node.pages) - tail_start)
            keep = len(node.pages) - take
            freed.extend(reversed(node.pages[keep:]))
            if keep:
                del node.pages[keep:]
                node.key = node.key[: keep * self.page_size]
                node.times = _cut_times(node.times, keep)[0]
                self._push_lru(node)
                continue
            parent = node.parent
            self._detach(node)
            if parent.parent is None or parent.lock_ref:
                continue
            if not parent.children:
                self._make_evictable(parent)
            elif len(parent.children) == 1:
                self._merge_into_child(parent)
        self._owned.difference_update(freed)
        return freed

    def reset(self) -> list[int]:
        """Drops every entry, locked or not; returns all pages the cache held."""
        pages = sorted(self._owned)
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                n = stack.pop()
                stack.extend(n.children.values())
                n.parent = None
        self._roots.clear()
        self._owned.clear()
        self._evictable_leaves.clear()
        self._lru_heap.clear()
        self._locked_pages = 0
        return pages

    # ---- internals -----------------------------------------------------------------------------
    def _key(self, tokens: Sequence[int]) -> tuple:
        if hasattr(tokens, "tolist"):  # numpy arrays and torch tensors: compare Python ints
            tokens = tokens.tolist()
        try:
            key = tuple(tokens)
        except TypeError:
            raise ValueError(f"tokens must be a sequence of token ids, got {type(tokens).__name__}") from None
        return key[: len(key) - len(key) % self.page_size]

    def _root(self, extra_key: Hashable, create: bool = True) -> RadixNode | None:
        try:
            root = self._roots.get(extra_key)
        except TypeError:
            raise ValueError(f"extra_key must be hashable, got {type(extra_key).__name__}") from None
        if root is None and create:
            root = self._roots[extra_key] = RadixNode((), [], None, self, next(self._ids))
        return root

    def _walk(self, root: RadixNode, key: tuple) -> tuple[RadixNode, int, RadixNode | None, int]:
        """Follows ``key`` down from ``root`` without changing anything. Returns the last
        fully matched node, the tokens matched to its end, and (when the match continues
        into one more edge but stops inside it) that edge and the page-aligned length
        matched in it."""
        ps = self.page_size
        node, pos = root, 0
        while pos < len(key):
            child = node.children.get(key[pos: pos + ps])
            if child is None:
                break
            edge = child.key
            if key[pos: pos + len(edge)] == edge:
                node, pos = child, pos + len(edge)
                continue
            return node, pos, child, self._common_pages(edge, key, pos)
        return node, pos, None, 0

    def _common_pages(self, edge: tuple, key: tuple, pos: int) -> int:
        """Page-aligned length of the common prefix of ``edge`` and ``key[pos:]``;
        at least one page (the child lookup matched it), less than ``len(edge)``."""
        ps = self.page_size
        limit = min(len(edge), len(key) - pos)
        block = max(ps, _COMPARE_BLOCK_TOKENS // ps * ps)
        start = ps
        while start + block <= limit and edge[start: start + block] == key[pos + start: pos + start + block]:
            start += block
        while start + ps <= limit and edge[start: start + ps] == key[pos + start: pos + start + ps]:
            start += ps
        return start

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cuts ``child``'s edge after ``at`` tokens; returns the new upper node. The
        original node object keeps the lower part, so a node someone holds still stands
        for the same full prefix."""
        parent = child.parent
        upper = RadixNode(child.key[:at], child.pages[: at // self.page_size], parent, self, next(self._ids))
        upper.lock_ref = child.lock_ref
        upper.times, child.times = _cut_times(child.times, at // self.page_size)
        parent.children[upper.key[: self.page_size]] = upper
        child.key = child.key[at:]
        child.pages = child.pages[at // self.page_size:]
        child.parent = upper
        upper.children[child.key[: self.page_size]] = child
        return upper

    def _merge_into_child(self, node: RadixNode) -> None:
        """Joins an unlocked ``node`` with its only child (which keeps its identity)."""
        (child,) = node.children.values()
        offset = len(node.pages)
        child.key = node.key + child.key
        child.pages = node.pages + child.pages
        child.times = node.times + [(end + offset, t) for end, t in child.times]
        child.parent = node.parent
        node.parent.children[node.key[: self.page_size]] = child
        node.parent = None
        node.children = {}

    def _add_child(self, node: RadixNode, key: tuple, pages: list[int]) -> RadixNode:
        child = RadixNode(key, pages, node, self, next(self._ids))
        node.children[key[: self.page_size]] = child
        self._evictable_leaves.discard(node)
        self._make_evictable(child)
        self._owned.update(pages)
        return child

    def _detach(self, node: RadixNode) -> None:
        del node.parent.children[node.key[: self.page_size]]
        node.parent = None
        self._evictable_leaves.discard(node)

    def _make_evictable(self, node: RadixNode) -> None:
        self._evictable_leaves.add(node)
        self._push_lru(node)

    def _push_lru(self, node: RadixNode) -> None:
        heap = self._lru_heap
        if len(heap) > 2 * len(self._evictable_leaves) + 64:
            heap[:] = [(n.last_access, n.id, n) for n in self._evictable_leaves]
            heapq.heapify(heap)
        heapq.heappush(heap, (node.last_access, node.id, node))

    def _touch(self, node: RadixNode) -> None:
        self._clock += 1
        leaf = node if node in self._evictable_leaves else None
        while node is not None:
            node.times = [(len(node.pages), self._clock)]
            node = node.parent
        if leaf is not None:
            self._push_lru(leaf)  # its old entry is stale now

    def _path_pages(self, node: RadixNode) -> list[int]:
        chunks = []
        while node.parent is not None:
            chunks.append(node.pages)
            node = node.parent
        return [p for chunk in reversed(chunks) for p in chunk]

    def _check_node(self, node: RadixNode) -> None:
        if not isinstance(node, RadixNode):
            raise ValueError(f"expected a RadixNode, got {type(node).__name__}")
        if node.cache is not self:
            raise ValueError(f"{node!r} belongs to another RadixCache")
        top = node
        while top.parent is not None:
            top = top.parent
        if top not in self._roots.values():
            raise ValueError(f"{node!r} is no longer in the cache (evicted or reset)")


def _cut_times(times: list[tuple[int, int]], at: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Splits recency segments ``(end_page, time)`` at page ``at``: (before, after)."""
    before, after, start = [], [], 0
    for end, t in times:
        if start < at:
            before.append((min(end, at), t))
        if end > at:
            after.append((end - at, t))
        start = end
    return before, after
