"""The reference engine's model thread: continuous batching over one KV pool with a prefix
cache, and the KV link (:mod:`.kv_link`) in both directions.

Each loop: take new requests, cancellations and KV-link messages; start new requests
(a prefix-cache hit, then one extend pass over the rest of the prompt, or a pull of the
pages the cache lacks first); one batched decode step over every running request; retire
finished ones into the prefix cache. Only this thread touches the model and the pool.

Sampling is keyed by position: the token at absolute position ``i`` of a sequence is drawn
with ``SamplerState(seed, i)``. A continuation sent with the context plus the tokens already
produced therefore samples exactly what the first engine would have, also at temperature
> 0 — which is what makes a handoff between reference engines invisible.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..model import Model, PoolExhaustedError, SamplerState, SamplingParams, SequenceKV, sample
from ..model.prefix_cache import cache_sequence, cached_prefix, with_room
from ..radix import RadixCache
from ..transfer import TransferEngine
from .kv_link import KvConsumer, KvLinkError, KvProducer, PendingPull, parse_message

__all__ = ["GenerationRequest", "Scheduler", "Event"]

log = logging.getLogger("pddcore.engine")

TIMING_SAMPLES = 1 << 16

Event = tuple  # ("tokens", [ids]) | ("finish", reason, kv_transfer_params | None, cached_tokens) | ("error", status, message)


@dataclass
class GenerationRequest:
    """One generation. ``emit`` is called from the model thread with each :data:`Event`."""

    rid: str
    token_ids: list[int]
    max_tokens: int
    params: SamplingParams
    seed: int
    emit: Callable[[Event], None]
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    remote_prefill: dict | None = None  # kv_transfer_params of a producer: pull the prompt's KV
    remote_decode: bool = False  # keep the prompt's KV for decode engines to pull ...
    consumers: int = 1  # ... this many times
    lease_key: str | None = None  # the name decode engines pull the KV by (default: rid)


@dataclass
class _Active:
    req: GenerationRequest
    seq: SequenceKV
    cached_tokens: int
    outputs: list[int] = field(default_factory=list)
    pull: PendingPull | None = None

    @property
    def last_position(self) -> int:
        return len(self.req.token_ids) + len(self.outputs)


class Scheduler:
    """Owns the model, the pool, the prefix cache and the KV link; :meth:`submit` and
    :meth:`cancel` may be called from any thread."""

    def __init__(self, model: Model, *, pool_pages: int, page_size: int, transfer: TransferEngine,
                 engine_id: str, lease_s: float = 60.0, pull_timeout_s: float = 30.0, max_batch: int = 64,
                 advertise: str | None = None):
        self.model = model
        self.pool = model.new_pool(pool_pages, page_size)
        self.cache = RadixCache(page_size=page_size)
        self.transfer = transfer
        self.producer = KvProducer(transfer, self.pool, engine_id, lease_s, advertise)
        self.consumer = KvConsumer(transfer, self.pool, pull_timeout_s, advertise)
        self.max_batch = max_batch
        self.eos = frozenset(model.config.eos_token_ids)
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: list[GenerationRequest] = []
        self.active: dict[str, _Active] = {}
        # The latest model passes, for /pdd/timings: (seconds, batch size) per decode step and
        # (seconds, tokens computed) per extend pass.
        self.decode_steps: deque[tuple[float, int]] = deque(maxlen=TIMING_SAMPLES)
        self.extend_passes: deque[tuple[float, int]] = deque(maxlen=TIMING_SAMPLES)
        self.counts = {"requests": 0, "finished": 0, "cancelled": 0, "failed": 0, "prompt_tokens": 0,
                       "cached_tokens": 0, "generated_tokens": 0}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, name="pddcore-engine-model", daemon=True),
                         threading.Thread(target=self._pump, name="pddcore-engine-link", daemon=True)]
        for t in self._threads:
            t.start()

    # ---- any thread -----------------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> None:
        self.inbox.put(("submit", req))

    def cancel(self, rid: str) -> None:
        self.inbox.put(("cancel", rid))

    def close(self) -> None:
        self._stop.set()
        self.inbox.put(("stop",))
        for t in self._threads:
            t.join(timeout=5)

    def state(self) -> dict:
        """Counters and occupancy, for the engine's ``/pdd/state``."""
        return {**self.counts, "running": len(self.active), "waiting": len(self.waiting),
                "free_pages": self.pool.allocator.num_free, "cached_pages": self.cache.num_pages,
                "leases": len(self.producer.leases), "pulls_served": self.producer.pulls_served,
                "sends_failed": self.producer.sends_failed,
                "bytes_sent": self.producer.bytes_sent, "pulls_done": self.consumer.pulls_done,
                "bytes_received": self.consumer.bytes_received}

    def timings(self) -> dict:
        """The latest decode steps ``[seconds, batch]`` and extend passes ``[seconds, tokens]``
        (up to :data:`TIMING_SAMPLES` each), for the engine's ``/pdd/timings``."""
        return {"decode_steps": [list(x) for x in self.decode_steps.copy()],  # copy(): one atomic step
                "extend_passes": [list(x) for x in self.extend_passes.copy()]}

    # ---- the KV link's messages ------------------------------------------------------------
    def _pump(self) -> None:
        while not self._stop.is_set():
            for message in self.transfer.poll_messages(0.05):
                parsed = parse_message(message)
                if parsed is not None:
                    self.inbox.put(("link", message, *parsed))

    # ---- model thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._iterate()
            except Exception:  # noqa: BLE001 - a bug must fail requests, never hang them all
                log.exception("the model loop failed; failing the requests it held")
                for act in list(self.active.values()):
                    self._fail(act, 500, "the engine's model loop failed (see its log)")

    def _iterate(self) -> None:
        idle = not (self.active or self.waiting or self.producer.busy)
        self._drain(timeout=0.05 if idle else 0.0)
        self.producer.poll()
        for pull in self.consumer.expired():
            self._pulled(pull)
        self._admit()
        self._decode()

    def _drain(self, timeout: float) -> None:
        try:
            item = self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind = item[0]
            if kind == "submit":
                self.counts["requests"] += 1
                self.waiting.append(item[1])
            elif kind == "cancel":
                self._cancel(item[1])
            elif kind == "link":
                _, message, what, body = item
                if what == "pull":
                    self.producer.serve(message, body)
                else:
                    pull = self.consumer.on_message(message, what, body)
                    if pull is not None:
                        self._pulled(pull)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _cancel(self, rid: str) -> None:
        for req in [r for r in self.waiting if r.rid == rid]:
            self.waiting.remove(req)
            self.counts["cancelled"] += 1
        act = self.active.pop(rid, None)
        if act is not None:
            self.counts["cancelled"] += 1
            self.pool.release(act.seq)

    def _admit(self) -> None:
        """Starts waiting requests while the batch has room: local ones with one batched
        extend pass, remote-prefill ones by asking their producer for the missing pages."""
        starting: list[_Active] = []
        while self.waiting and len(self.active) + len(starting) < self.max_batch:
            req = self.waiting.pop(0)
            # Keep one prompt token out of the cache match: its logits give the first output.
            seq, hit = cached_prefix(self.pool, self.cache, req.token_ids[:-1])
            act = _Active(req, seq, hit)
            self.counts["prompt_tokens"] += len(req.token_ids)
            self.counts["cached_tokens"] += hit
            if req.remote_prefill is not None and self._start_pull(act):
                continue
            starting.append(act)
        if starting:
            self._extend(starting)

    def _start_pull(self, act: _Active) -> bool:
        """True when a pull is now in flight for ``act`` (it waits in :attr:`active`)."""
        page = self.pool.page_size
        want = (len(act.req.token_ids) - 1) // page  # whole pages the prompt minus its last token fills
        have = act.seq.num_tokens // page
        if want <= have:
            return False
        try:
            act.pull = self.consumer.start(act.req.rid, act.req.remote_prefill, have, want - have)
        except KvLinkError as e:
            self._fail(act, 502, str(e))
            return True
        self.active[act.req.rid] = act
        return True

    def _pulled(self, pull: PendingPull) -> None:
        act = self.active.get(pull.rid)
        if act is None or act.pull is not pull:
            return  # cancelled meanwhile
        act.pull = None
        if pull.outcome != "ok":
            self._fail(act, 502, f"pulling the prompt's KV failed: {pull.outcome}")
            return
        try:
            pages = with_room(self.pool, self.cache,
                              lambda: self.pool.append_external(act.seq, pull.num_pages * self.pool.page_size))
        except PoolExhaustedError:
            self._fail(act, 503, "the KV pool is full")
            return
        self.consumer.land(pull, pages)
        del self.active[act.req.rid]
        self._extend([act])

    def _extend(self, acts: list[_Active]) -> None:
        """One extend pass over each request's prompt tokens past what its sequence holds."""
        started = time.perf_counter()
        new_tokens = [a.req.token_ids[a.seq.num_tokens:] for a in acts]
        try:
            logits = with_room(self.pool, self.cache, lambda: self.model.extend([a.seq for a in acts], new_tokens))
        except PoolExhaustedError:
            for a in acts:
                self._fail(a, 503, "the KV pool is full")
            return
        self.extend_passes.append((time.perf_counter() - started, sum(map(len, new_tokens))))
        tokens = sample(logits, [a.req.params for a in acts],
                        [SamplerState(a.req.seed, a.last_position) for a in acts])
        for act, token in zip(acts, tokens):
            self.active[act.req.rid] = act
            self._emit_token(act, token)

    def _decode(self) -> None:
        batch = [a for a in self.active.values() if a.pull is None][:self.max_batch]
        if not batch:
            return
        started = time.perf_counter()
        try:
            logits = with_room(self.pool, self.cache,
                               lambda: self.model.decode([a.seq for a in batch], [a.outputs[-1] for a in batch]))
        except PoolExhaustedError:
            victim = max(batch, key=lambda a: a.seq.num_tokens)
            self._fail(victim, 503, "the KV pool is full")
            return
        self.decode_steps.append((time.perf_counter() - started, len(batch)))
        tokens = sample(logits, [a.req.params for a in batch],
                        [SamplerState(a.req.seed, a.last_position) for a in batch])
        for act, token in zip(batch, tokens):
            self._emit_token(act, token)

    def _emit_token(self, act: _Active, token: int) -> None:
        act.outputs.append(token)
        self.counts["generated_tokens"] += 1
        act.req.emit(("tokens", [token]))
        stop = (token in act.req.stop_token_ids) or (token in self.eos and not act.req.ignore_eos)
        if stop or len(act.outputs) >= act.req.max_tokens:
            self._finish(act, "stop" if stop else "length")

    def _finish(self, act: _Active, reason: str) -> None:
        self.active.pop(act.req.rid, None)
        req = act.req
        params = None
        if req.remote_decode:
            prompt_pages = act.seq.pages[:self.pool.pages_for(len(req.token_ids))]
            params = self.producer.lease(req.lease_key or req.rid, prompt_pages, len(req.token_ids), req.consumers)
        cache_sequence(self.pool, self.cache, req.token_ids + act.outputs[:-1], act.seq)
        self.pool.release(act.seq)
        self.counts["finished"] += 1
        req.emit(("finish", reason, params, act.cached_tokens))

    def _fail(self, act: _Active, status: int, message: str) -> None:
        self.active.pop(act.req.rid, None)
        self.pool.release(act.seq)
        self.counts["failed"] += 1
        log.warning("%s: %s", act.req.rid, message)
        act.req.emit(("error", status, message))
