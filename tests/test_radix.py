"""RadixCache against a naive model: a dict of every cached page-aligned prefix."""

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pddcore.radix import CacheFullError, RadixCache


class NaiveCache:
    """Every cached prefix ``(ns, tokens[:k*page])`` maps to [page, last_access, locks]."""

    def __init__(self, page_size, capacity):
        self.ps, self.capacity = page_size, capacity
        self.entries = {}
        self.clock = 0

    def _chain(self, tokens, ns):
        ps = self.ps
        return [(ns, tuple(tokens[: j * ps])) for j in range(1, len(tokens) // ps + 1)]

    def _hit(self, tokens, ns):
        chain = self._chain(tokens, ns)
        k = 0
        while k < len(chain) and chain[k] in self.entries:
            k += 1
        return chain, k

    def prefix_len(self, tokens, ns):
        return self._hit(tokens, ns)[1] * self.ps

    def match(self, tokens, ns):
        chain, k = self._hit(tokens, ns)
        self.clock += 1
        for key in chain[:k]:
            self.entries[key][1] = self.clock
        return [self.entries[key][0] for key in chain[:k]], k * self.ps

    def new_pages_needed(self, tokens, ns):
        chain, k = self._hit(tokens, ns)
        return len(chain) - k

    def insert(self, tokens, pages, ns):
        chain, k = self._hit(tokens, ns)
        duplicates = [p for p, key in zip(pages, chain[:k]) if p != self.entries[key][0]]
        self.clock += 1
        for key, page in zip(chain[k:], pages[k:]):
            self.entries[key] = [page, 0, 0]
        for key in chain:
            self.entries[key][1] = self.clock
        return k * self.ps, duplicates

    def lock(self, tokens, ns, delta):
        for key in self._chain(tokens, ns):
            self.entries[key][2] += delta

    def _is_leaf(self, key):
        ns, prefix = key
        return not any(k[0] == ns and len(k[1]) == len(prefix) + self.ps and k[1][: len(prefix)] == prefix
                       for k in self.entries)

    def evict(self, n):
        freed = []
        while len(freed) < n:
            candidates = [(v[1], key) for key, v in self.entries.items() if v[2] == 0 and self._is_leaf(key)]
            if not candidates:
                break
            times = [t for t, _ in candidates]
            assert len(set(times)) == len(times), "LRU must never tie between leaves"
            _, key = min(candidates)
            freed.append(self.entries.pop(key)[0])
        return freed

    @property
    def num_locked(self):
        return sum(1 for v in self.entries.values() if v[2] > 0)


# Requests share prefixes of a few base sequences (as agentic turns do), then diverge.
BASES = [(0,) * 12, (0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2), (0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2), (2, 1) * 6]
tokens_st = st.builds(lambda base, cut, tail: list(base[:cut]) + tail,
                      st.sampled_from(BASES), st.integers(0, 12), st.lists(st.integers(0, 2), max_size=3))
ns_st = st.sampled_from([None, None, None, "lora-a"])


class RadixMachine(RuleBasedStateMachine):
    @initialize(page_size=st.integers(1, 3), capacity=st.one_of(st.none(), st.integers(0, 12)))
    def setup(self, page_size, capacity):
        self.cache = RadixCache(page_size=page_size, capacity_pages=capacity)
        self.model = NaiveCache(page_size, capacity)
        self.free = list(range(40))
        self.held = []  # (node, tokens, ns) locked after a match

    @rule(tokens=tokens_st, ns=ns_st)
    def prefix_len(self, tokens, ns):
        assert self.cache.prefix_len(tokens, ns) == self.model.prefix_len(tokens, ns)

    @rule(tokens=tokens_st, ns=ns_st, lock=st.booleans())
    def match(self, tokens, ns, lock):
        got = self.cache.match_prefix(tokens, ns)
        want_pages, want_len = self.model.match(tokens, ns)
        assert (got.pages, got.matched_len) == (want_pages, want_len)
        if lock:
            self.cache.lock(got.node)
            self.model.lock(tokens[:want_len], ns, +1)
            self.held.append((got.node, tokens[:want_len], ns))

    @rule(tokens=tokens_st, ns=ns_st, reuse_cached=st.booleans())
    def insert(self, tokens, ns, reuse_cached):
        ps = self.cache.page_size
        n_pages = len(tokens) // ps
        cached = self.model.prefix_len(tokens, ns) // ps
        need = n_pages - cached
        if need > len(self.free):
            return
        prefix = ([self.model.entries[(ns, tuple(tokens[: (j + 1) * ps]))][0] for j in range(cached)]
                  if reuse_cached else self.free[need: need + cached])
        if len(prefix) < cached:
            return
        pages = prefix + self.free[:need]
        if self.model.capacity is not None and need > self.model.capacity - len(self.model.entries):
            before = (self.cache.num_pages, self.cache.prefix_len(tokens, ns))
            with pytest.raises(CacheFullError):
                self.cache.insert(tokens, pages, ns)
            assert (self.cache.num_pages, self.cache.prefix_len(tokens, ns)) == before
            return
        got = self.cache.insert(tokens, pages, ns)
        want = self.model.insert(tokens, pages, ns)
        assert (got.prefix_len, got.duplicate_pages) == want
        del self.free[:need]

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        node, tokens, ns = self.held.pop(i % len(self.held))
        self.cache.unlock(node)
        self.model.lock(tokens, ns, -1)

    @rule(n=st.integers(0, 6))
    def evict(self, n):
        got = self.cache.evict(n)
        assert got == self.model.evict(n)
        self.free.extend(got)

    @invariant()
    def accounting(self):
        cache = self.cache
        assert cache.num_pages == len(self.model.entries)
        assert cache.num_locked_pages == self.model.num_locked
        assert cache.num_evictable_pages == cache.num_pages - cache.num_locked_pages
        if cache.capacity_pages is not None:
            assert cache.num_pages <= cache.capacity_pages
        assert all((v[0] in cache) for v in self.model.entries.values())


TestRadixAgainstModel = RadixMachine.TestCase
TestRadixAgainstModel.settings = settings(max_examples=200, stateful_step_count=30, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])


def test_lru_evicts_oldest_leaf_tail_first():
    cache = RadixCache(page_size=2)
    cache.insert([1, 1, 2, 2, 3, 3], [10, 11, 12])
    cache.insert([1, 1, 5, 5], [10, 20])
    cache.match_prefix([1, 1, 2, 2, 3, 3])  # the first branch is now the most recent
    assert cache.evict(1) == [20]
    assert cache.evict(1) == [12]  # a leaf's tail goes first; its prefix stays usable
    assert cache.match_prefix([1, 1, 2, 2, 3, 3]).matched_len == 4
    assert cache.evict(5) == [11, 10]
    assert cache.num_pages == 0 and cache.evict(3) == []


def test_eviction_keeps_exact_lru_per_page_across_merges():
    cache = RadixCache(page_size=2)
    cache.insert([1, 1, 2, 2, 3, 3], [10, 11, 12])   # t1
    cache.insert([1, 1, 2, 2, 5, 5], [10, 11, 20])   # t2: splits after [1, 1, 2, 2]
    cache.insert([9, 9], [30])                       # t3
    cache.match_prefix([1, 1, 2, 2, 7, 7])           # t4: touches only the shared part
    assert cache.evict(1) == [12]  # the shared edge, left with one child, merges into it
    assert cache.evict(2) == [20, 30]  # the merged edge's tail is t2, its head t4: [9, 9] (t3) goes between
    assert cache.evict(5) == [11, 10]


def test_eviction_merges_paths_back_into_one_edge():
    cache = RadixCache(page_size=1)
    context = list(range(100))
    cache.insert(context, list(range(100)))
    for i, n in enumerate(range(10, 100, 10)):  # requests sharing ever longer prefixes split the edge
        hit = cache.match_prefix(context[:n])
        cache.insert(context[:n] + [-n], hit.pages + [100 + i])
    cache.match_prefix(context)
    assert sorted(cache.evict(9)) == list(range(100, 109))
    hit = cache.match_prefix(context)
    assert hit.matched_len == 100 and hit.pages == context
    assert hit.node.parent.parent is None and len(hit.node.key) == 100  # one edge again


def test_locked_path_survives_eviction_and_unlock_releases_it():
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3, 4], [0, 1, 2, 3])
    hit = cache.match_prefix([1, 2, 9])
    cache.lock(hit.node)
    cache.lock(hit.node)
    assert cache.num_locked_pages == 2
    assert sorted(cache.evict(10)) == [2, 3]
    cache.unlock(hit.node)
    assert cache.evict(10) == []
    cache.unlock(hit.node)
    assert cache.evict(10) == [1, 0]


def test_namespaces_do_not_share_entries():
    cache = RadixCache(page_size=2)
    cache.insert([1, 2, 3, 4], [0, 1], extra_key="model-a")
    assert cache.match_prefix([1, 2, 3, 4]).matched_len == 0
    assert cache.match_prefix([1, 2, 3, 4], extra_key="model-b").matched_len == 0
    assert cache.match_prefix([1, 2, 3, 4, 5], extra_key="model-a").pages == [0, 1]
    assert cache.insert([1, 2, 3, 4], [5, 6]).prefix_len == 0


def test_insert_reports_duplicate_pages_and_partial_pages_are_ignored():
    cache = RadixCache(page_size=4)
    assert cache.insert(list(range(10)), [7, 8]).prefix_len == 0  # two full pages, 2 tokens ignored
    result = cache.insert(list(range(12)), [7, 9, 3])
    assert result.prefix_len == 8 and result.duplicate_pages == [9]
    assert cache.match_prefix(list(range(12))).pages == [7, 8, 3]


def test_locked_node_keeps_its_prefix_when_an_edge_above_splits():
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3, 4], [0, 1, 2, 3])
    hit = cache.match_prefix([1, 2, 3, 4])
    cache.lock(hit.node)
    cache.match_prefix([1, 2, 7])  # splits the locked edge after two tokens
    cache.insert([1, 5], [0, 5])
    assert cache.num_locked_pages == 4
    cache.unlock(hit.node)
    assert cache.num_locked_pages == 0
    assert sorted(cache.evict(10)) == [0, 1, 2, 3, 5]


def test_capacity_is_enforced_without_side_effects():
    cache = RadixCache(page_size=1, capacity_pages=3)
    cache.insert([1, 2], [0, 1])
    with pytest.raises(CacheFullError, match="needs 2 new pages but only 1"):
        cache.insert([1, 2, 3, 4], [0, 1, 2, 3])
    assert cache.num_pages == 2 and cache.prefix_len([1, 2, 3, 4]) == 2 and 2 not in cache
    assert cache.free_pages == 1
    assert cache.insert([1, 2, 3], [0, 1, 2]).prefix_len == 2
    assert cache.free_pages == 0


@pytest.mark.parametrize("tokens, pages, message", [
    ([1, 2, 3, 4], [0], "fill 2 pages, but 1 page ids"),
    ([1, 2, 3, 4], [0, 1, 2], "fill 2 pages, but 3 page ids"),
    ([1, 2, 3, 4], [0, -1], "must be >= 0"),
    ([1, 2, 3, 4], [0, 0], "same page id twice"),
    ([1, 2, 3, 4], [0, 1.5], "must be 64-bit integers"),
    (None, [], "sequence of token ids"),
])
def test_insert_rejects_bad_input(tokens, pages, message):
    cache = RadixCache(page_size=2)
    with pytest.raises(ValueError, match=message):
        cache.insert(tokens, pages)
    assert cache.num_pages == 0


def test_insert_rejects_a_page_the_cache_already_holds():
    cache = RadixCache(page_size=1)
    cache.insert([1, 2], [0, 1])
    with pytest.raises(ValueError, match=r"pages \[1\] are cached already"):
        cache.insert([3, 4], [5, 1])
    assert cache.prefix_len([3, 4]) == 0 and cache.num_pages == 2


def test_bad_nodes_and_arguments_are_rejected():
    cache, other = RadixCache(), RadixCache()
    cache.insert([1, 2], [0, 1])
    node = cache.match_prefix([1, 2]).node
    with pytest.raises(ValueError, match="another RadixCache"):
        other.lock(node)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(node)
    with pytest.raises(ValueError, match="expected a RadixNode"):
        cache.lock("node")
    cache.evict(2)
    with pytest.raises(ValueError, match="no longer in the cache"):
        cache.lock(node)
    with pytest.raises(ValueError, match="hashable"):
        cache.match_prefix([1], extra_key=[])
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(page_size=0)
    with pytest.raises(ValueError, match="capacity_pages"):
        RadixCache(capacity_pages=-1)
    with pytest.raises(ValueError, match="num_pages"):
        cache.evict(1.0)


def test_reset_returns_every_page_and_detaches_nodes():
    cache = RadixCache(page_size=1)
    cache.insert([1, 2, 3], [4, 5, 6])
    node = cache.match_prefix([1, 2]).node
    cache.lock(node)
    assert cache.reset() == [4, 5, 6]
    assert cache.num_pages == 0 and cache.num_locked_pages == 0
    with pytest.raises(ValueError, match="no longer in the cache"):
        cache.unlock(node)


def test_long_sequences_match_across_compare_blocks():
    base = list(range(5000))
    cache = RadixCache(page_size=16)
    cache.insert(base, list(range(len(base) // 16)))
    probe = base[:3000] + [-1] + base[3001:]
    assert cache.prefix_len(probe) == 3000 // 16 * 16
    hit = cache.match_prefix(probe)
    assert hit.matched_len == 2992 and hit.pages == list(range(187))
