"""Serving instances: prefill (FIFO, compute-bound, with a bounded prefix cache) and
decode (continuous batching under a KV-capacity budget), plus the decode-side radix
cache's capacity model.

Decode runs in steps: every running request produces one token per step, and a
request whose KV arrives mid-step joins at the next step boundary. Steps are counted,
so a request's progress is ``step - start_step`` -- never a loop over the batch -- and
the steps of an unchanged batch run as one timed segment (:class:`DecodeInstance`).

KV memory is reserved before a request's KV is sent (prompt plus output, so nothing
is ever preempted); a reservation that does not fit waits, first come first served.
That is the page-allocation reply a real decode instance gives before P may write.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Any, Callable, Iterator

from ..radix import RadixCache, RadixNode
from .costmodel import CostModel
from .engine import EventHandle, EventLoop

__all__ = ["PrefillInstance", "DecodeInstance", "KVPool", "PrefixKVPool"]


def _cache_evicting(cache: RadixCache, keys: tuple, page_ids: Iterator[int], held_pages: int = 0) -> bool:
    """Caches the pages of ``keys`` the cache lacks, evicting LRU pages to make room
    beside ``held_pages`` held outside it; False (nothing changed) when locked pages
    leave too little room."""
    current = cache.match_prefix(keys)
    need = len(keys) - current.matched_len
    short = need - (cache.capacity_pages - cache.num_pages - held_pages)
    if short > 0:
        cache.lock(current.node)  # the prefix being extended must survive the eviction
        room = cache.num_evictable_pages >= short
        if room:
            cache.evict(short)
        cache.unlock(current.node)
        if not room:
            return False
    cache.insert(keys, current.pages + [next(page_ids) for _ in range(need)])
    return True


class PrefillInstance:
    """Serves prefills one at a time in arrival order; long-context prefill saturates
    the chips alone, so batching would not raise throughput.

    With ``cache_tokens`` the instance keeps a prefix cache of that many KV tokens (in
    its HBM and any host-memory tier; :class:`pddcore.radix.RadixCache`, LRU,
    ``page_tokens`` per page): a prompt hits only the pages of it still cached here,
    and recomputes the rest. A queued prefill locks its cached prefix; its own pages
    join the cache when it ends. Without ``cache_tokens`` every prompt hits what the
    trace says P caches."""

    def __init__(self, loop: EventLoop, cost: CostModel, name: str, cache_tokens: int | None = None,
                 page_tokens: int = 64):
        self.loop, self.cost, self.name = loop, cost, name
        self.free_at = 0.0
        self.busy_s = 0.0
        self.page_tokens = page_tokens
        self.cache = None if cache_tokens is None else RadixCache(page_size=1,
                                                                  capacity_pages=cache_tokens // page_tokens)
        self._page_ids = itertools.count()

    def hit_tokens(self, keys: tuple | None, trace_cached: int) -> int:
        """Prompt tokens this instance would not recompute (no side effects); ``keys``
        None: the prompt's prefix is unknown, so the trace's ``trace_cached`` counts."""
        if self.cache is None or keys is None:
            return trace_cached
        return self.cache.prefix_len(keys) * self.page_tokens

    def quote(self, prompt_tokens: int, hit_tokens: int) -> tuple[float, float]:
        """(queue wait, service time) a prefill submitted now would see."""
        service = self.cost.prefill_seconds(prompt_tokens - hit_tokens, hit_tokens)
        return max(0.0, self.free_at - self.loop.now), service

    def submit(self, keys: tuple | None, prompt_tokens: int, trace_cached: int, on_done: Callable[..., Any],
               *args: Any) -> int:
        """Queues a prefill; ``on_done(*args)`` runs when it completes. Returns the
        prompt tokens it hits (does not recompute)."""
        node = None
        if self.cache is None or keys is None:
            hit = trace_cached
        else:
            match = self.cache.match_prefix(keys)
            node, hit = match.node, match.matched_len * self.page_tokens
            self.cache.lock(node)
        wait, service = self.quote(prompt_tokens, hit)
        self.free_at = self.loop.now + wait + service
        self.busy_s += service
        self.loop.at(self.free_at, self._done, keys, node, on_done, args)
        return hit

    def preload(self, keys: tuple) -> None:
        """Caches ``keys`` as if computed before the run (skipped when locked pages leave no room)."""
        if self.cache is not None:
            _cache_evicting(self.cache, keys, self._page_ids)

    def _done(self, keys: tuple, node: RadixNode | None, on_done: Callable[..., Any], args: tuple) -> None:
        if node is not None:
            self.cache.unlock(node)
            _cache_evicting(self.cache, keys, self._page_ids)
        on_done(*args)


class _Slot:
    __slots__ = ("job", "start_step", "base_ctx", "finish_step", "emitted_at_join", "on_done", "removed")

    def __init__(self, job, start_step, base_ctx, finish_step, emitted_at_join, on_done):
        self.job, self.start_step, self.base_ctx = job, start_step, base_ctx
        self.finish_step, self.emitted_at_join = finish_step, emitted_at_join
        self.on_done, self.removed = on_done, False


class KVPool:
    """KV-token budget of one decode instance with a FIFO queue of waiting reservations.
    ``max_requests`` caps concurrent reservations (the engine's max running batch)."""

    def __init__(self, capacity_tokens: int, max_requests: int):
        self.capacity = capacity_tokens
        self.max_requests = max_requests
        self.used = 0
        self.count = 0
        self._waiting: deque = deque()
        self._waiting_tokens = 0

    @property
    def load(self) -> float:
        """Busy fraction: the larger of KV and slot use, counting waiting reservations."""
        return max((self.used + self._waiting_tokens) / self.capacity,
                   (self.count + len(self._waiting)) / self.max_requests)

    def reserve(self, job: Any, tokens: int, granted: Callable[[Any], Any]) -> None:
        """Calls ``granted(job)`` once ``tokens`` are reserved for ``job`` (now, or later
        in FIFO order)."""
        if tokens > self.capacity:
            raise ValueError(f"a reservation of {tokens} KV tokens exceeds the pool's capacity {self.capacity}")
        self._enqueue((job, tokens, granted), tokens)

    def release(self, job: Any, tokens: int) -> None:
        self.used -= tokens
        self.count -= 1
        self._drain()

    def cancel_waiting(self, job: Any) -> bool:
        for i, entry in enumerate(self._waiting):
            if entry[0] is job:
                del self._waiting[i]
                self._waiting_tokens -= entry[1]
                self._drain()
                return True
        return False

    def _enqueue(self, entry: tuple, tokens: int) -> None:
        self._waiting.append(entry)
        self._waiting_tokens += tokens
        self._drain()

    def _drain(self) -> None:
        while self._waiting and self.count < self.max_requests and self._try(self._waiting[0]):
            self._waiting_tokens -= self._waiting.popleft()[1]

    def _try(self, entry: tuple) -> bool:
        job, tokens, granted = entry
        if self.used + tokens > self.capacity:
            return False
        self.used += tokens
        self.count += 1
        granted(job)
        return True


class PrefixKVPool(KVPool):
    """A :class:`KVPool` whose free pages also hold a decode-side radix cache (DRC).

    Pages are ``page_tokens`` tokens. Cached prefixes occupy the pool until evicted
    (LRU, by :class:`pddcore.radix.RadixCache`); a running request locks its prefix.
    ``used`` counts tokens reserved outside the cache (suffixes in flight and outputs).
    Keys are page identities (one radix token per KV page), so the real cache code
    decides hits and evictions at page granularity. A waiting request holds no lock:
    it looks its prefix up when it is granted, so waiting never pins memory.
    """

    def __init__(self, capacity_tokens: int, max_requests: int, page_tokens: int = 64):
        super().__init__(capacity_tokens, max_requests)
        self.page_tokens = page_tokens
        self.cache = RadixCache(page_size=1, capacity_pages=capacity_tokens // page_tokens)
        self._page_ids = itertools.count()
        self.hit_pages = 0
        self.lookup_pages = 0

    def cached_prefix_tokens(self, keys: tuple) -> int:
        """Tokens of the prompt with page identities ``keys`` this MD holds (no side effects)."""
        return self.cache.prefix_len(keys) * self.page_tokens

    def reserve_prefix(self, job: Any, keys: tuple, extra_tokens: int,
                       granted: Callable[[Any, RadixNode, int, int], Any]) -> None:
        """Reserves the pages of ``keys`` MD lacks plus ``extra_tokens``; once granted,
        ``granted(job, node, matched_pages, reserved_tokens)`` with the cached prefix
        locked at ``node``."""
        worst = len(keys) * self.page_tokens + extra_tokens
        if worst > self.capacity:
            raise ValueError(f"a reservation of {worst} KV tokens exceeds the pool's capacity {self.capacity}")
        self._enqueue((job, worst, granted, keys, extra_tokens), worst)

    def preload(self, keys: tuple) -> None:
        """Caches ``keys`` as if they had been received before the run, evicting LRU
        pages if needed; skipped when the pool is too full of locked pages."""
        _cache_evicting(self.cache, keys, self._page_ids, held_pages=-(-self.used // self.page_tokens))

    def insert_locked(self, keys: tuple, matched_pages: int, old: RadixNode) -> RadixNode:
        """Caches the whole prompt once its suffix arrived; moves the lock from ``old``."""
        current = self.cache.match_prefix(keys)
        new_pages = [next(self._page_ids) for _ in range(len(keys) - current.matched_len)]
        self.cache.insert(keys, current.pages + new_pages)
        node = self.cache.match_prefix(keys).node
        self.cache.lock(node)
        self.cache.unlock(old)
        return node

    def unlock(self, node: RadixNode) -> None:
        self.cache.unlock(node)
        self._drain()

    @property
    def load(self) -> float:
        locked = self.cache.num_locked_pages * self.page_tokens
        return max((self.used + locked + self._waiting_tokens) / self.capacity,
                   (self.count + len(self._waiting)) / self.max_requests)

    def _try(self, entry: tuple) -> bool:
        if len(entry) == 3:
            return super()._try(entry)
        job, _, granted, keys, extra = entry
        match = self.cache.match_prefix(keys)
        self.cache.lock(match.node)
        tokens = (len(keys) - match.matched_len) * self.page_tokens + extra
        free = (self.cache.capacity_pages - self.cache.num_pages) * self.page_tokens - self.used
        if tokens > free:
            shortfall = -(-(tokens - free) // self.page_tokens)
            if shortfall > self.cache.num_evictable_pages:
                self.cache.unlock(match.node)
                return False
            self.cache.evict(shortfall)
        self.used += tokens
        self.count += 1
        self.hit_pages += match.matched_len
        self.lookup_pages += len(keys)
        granted(job, match.node, match.matched_len, tokens)
        return True


class DecodeInstance:
    """Continuous-batching decode with handoff extend passes folded into its steps.

    ``join`` adds a request whose KV is present; it emits ``tokens`` tokens, the first
    at the join itself when ``first_token_now`` (the token prefill computed, streamed
    when decode starts), then ``on_done(job)``. ``remove`` takes a request out
    (handoff) and says how many tokens it emitted here. ``extend`` queues an extend
    pass that runs inside the next step and calls back when that step ends.

    While the batch does not change, consecutive steps run as one *segment* (one event,
    timed in closed form by :meth:`CostModel.decode_steps_seconds`) up to the next
    finishing request; a join, removal or extend cuts the segment at the end of the
    step in flight, exactly where per-step simulation would have acted.
    """

    def __init__(self, loop: EventLoop, cost: CostModel, pool: KVPool, name: str):
        self.loop, self.cost, self.pool, self.name = loop, cost, pool, name
        self.step = 0
        self.batch = 0
        self._ctx_offset = 0  # sum over running of (base context - start step)
        self.busy_s = 0.0
        self._finish: list[tuple[int, int, _Slot]] = []
        self._slots: dict[Any, _Slot] = {}
        self._joining: list[tuple] = []
        self._extends: list[tuple] = []
        self._in_step_extends: list[tuple] = []
        self._seq = itertools.count()
        self._event: EventHandle | None = None
        self._seg_start = 0.0   # segment: start time, steps planned, extend time in its first step
        self._seg_steps = 0
        self._seg_extend_s = 0.0
        self._planned_s = 0.0
        self._pending_leave: list[_Slot] = []

    @property
    def context_tokens(self) -> int:
        """KV tokens of the running requests as of the last step boundary."""
        return self._ctx_offset + self.batch * self.step

    def join(self, job: Any, context_tokens: int, tokens: int, first_token_now: bool,
             on_first: Callable[[Any, float], Any] | None, on_done: Callable[[Any], Any]) -> None:
        if self._event is None:
            self._admit(job, context_tokens, tokens, first_token_now, on_first, on_done)
            self._start_segment()
        else:
            self._joining.append((job, context_tokens, tokens, first_token_now, on_first, on_done))
            self._cut()

    def emitted(self, job: Any) -> int:
        """Tokens ``job`` has emitted here so far (0 while it waits to join)."""
        slot = self._slots.get(job)
        return 0 if slot is None else slot.emitted_at_join + self._steps_now() - slot.start_step

    def remove(self, job: Any) -> int:
        """Stops ``job`` now; returns the tokens it emitted here."""
        for i, entry in enumerate(self._joining):
            if entry[0] is job:
                del self._joining[i]
                return 0
        steps_now = self._steps_now()
        self._cut()
        slot = self._slots.pop(job)
        slot.removed = True
        # The step in flight still runs with this request in it (its work is wasted);
        # the batch and context shrink from the next segment on.
        self._pending_leave.append(slot)
        return slot.emitted_at_join + steps_now - slot.start_step

    def extend(self, new_tokens: int, cached_tokens: int, on_done: Callable[..., Any], *args: Any) -> None:
        self._extends.append((new_tokens, cached_tokens, on_done, args))
        if self._event is None:
            self._start_segment()
        else:
            self._cut()

    # ---- stepping ------------------------------------------------------------------------------
    def _admit(self, job, context_tokens, tokens, first_token_now, on_first, on_done) -> None:
        emitted = 0
        if first_token_now:
            if on_first is not None:
                on_first(job, self.loop.now)
            emitted = 1
            if tokens == 1:
                on_done(job)
                return
        slot = _Slot(job, self.step, context_tokens, self.step + tokens - emitted, emitted, on_done)
        self._slots[job] = slot
        heapq.heappush(self._finish, (slot.finish_step, next(self._seq), slot))
        self.batch += 1
        self._ctx_offset += context_tokens - self.step

    def _steps_now(self) -> int:
        """Step counter as of now: the segment's complete steps added."""
        if self._event is None or self.batch == 0:
            return self.step
        return self.step + self._steps_done(self.loop.now - self._seg_start)

    def _steps_done(self, elapsed: float) -> int:
        """Complete steps of the current segment after ``elapsed`` seconds (binary search
        on the closed-form duration)."""
        lo, hi = 0, self._seg_steps
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._segment_seconds(mid) <= elapsed:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _segment_seconds(self, steps: int) -> float:
        return self._seg_extend_s + self.cost.decode_steps_seconds(self.batch, self.context_tokens, steps)

    def _cut(self) -> None:
        """Ends the current segment after the step in flight."""
        if self._event is None or self._seg_steps <= 1:
            return
        done = self._steps_done(self.loop.now - self._seg_start)
        if done + 1 >= self._seg_steps:
            return
        self._event.cancel()
        self._seg_steps = done + 1
        end = self._seg_start + self._segment_seconds(self._seg_steps)
        self.busy_s -= self._planned_s - (end - self._seg_start)
        self._planned_s = end - self._seg_start
        self._event = self.loop.at(end, self._end_segment)

    def _start_segment(self) -> None:
        self._seg_extend_s = 0.0
        if self._extends:
            self._in_step_extends, self._extends = self._extends, []
            self._seg_extend_s = sum(self.cost.extend_seconds(n, c) for n, c, _, _ in self._in_step_extends)
        if self.batch == 0 and not self._in_step_extends:
            self._event = None
            return
        if self.batch == 0:
            self._seg_steps = 1
            dt = self._seg_extend_s
        else:
            # Steps with extends or joins pending are single; otherwise run to the next finish.
            finish = self._finish
            while finish[0][2].removed:
                heapq.heappop(finish)
            self._seg_steps = 1 if self._in_step_extends else finish[0][0] - self.step
            dt = self._segment_seconds(self._seg_steps)
        self._seg_start = self.loop.now
        self._planned_s = dt
        self.busy_s += dt
        self._event = self.loop.after(dt, self._end_segment)

    def _end_segment(self) -> None:
        steps = self._seg_steps
        if self.batch:
            self.step += steps
        for slot in self._pending_leave:
            self.batch -= 1
            self._ctx_offset -= slot.base_ctx - slot.start_step
        self._pending_leave.clear()
        finished = []
        heap = self._finish
        while heap and (heap[0][2].removed or heap[0][0] <= self.step):
            _, _, slot = heapq.heappop(heap)
            if slot.removed:
                continue
            del self._slots[slot.job]
            self.batch -= 1
            self._ctx_offset -= slot.base_ctx - slot.start_step
            finished.append(slot)
        extends, self._in_step_extends = self._in_step_extends, []
        joining, self._joining = self._joining, []
        for entry in joining:
            self._admit(*entry)
        self._event = None
        self._start_segment()
        for slot in finished:
            slot.on_done(slot.job)
        for _, _, on_done, args in extends:
            on_done(*args)
