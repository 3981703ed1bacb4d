"""The cluster: instances, links and the request flow of the three deployments (each
described by a :class:`~pddcore.sim.deployment.ClusterConfig`).

* **same-DC PD** (``rld=None, cross_dc=False``): P sends each request's full KV to a
  decode instance over RDMA; decode produces every token.
* **cross-DC PD** (``rld=None, cross_dc=True``): decode (MD) sits across the WAN; P
  sends the KV MD lacks (MD's radix cache when ``drc``), MD produces every token.
* **PDD** (``rld`` given): :class:`pddcore.router.Router` picks P_MD, P_RLD_MD or
  RLD_ONLY per request; RLD (next to P, RDMA) decodes at once; when MD holds the KV,
  :class:`pddcore.handoff.HandoffPolicy` decides one-shot or catch-up handoffs, MD runs
  the extend pass inside its next decode step and takes over.

Requests of one session are causal: an agent sends its next turn only after the previous
one has finished (it needs that output), so a request that arrives while its session's
previous request is still running is released when that one finishes, and its TTFT
counts from the release. Without this an open-loop replay would send a turn whose
prefix is still on its way to MD -- something no agent can do.

The router is fed exactly what a real P knows: the prefill queue wait plus prefill
time, MD's cached prefix (a side-effect-free radix lookup), the WAN estimate of a
:class:`pddcore.router.BandwidthEstimator` fed by completed transfers, RLD's load and
the request's output length (the trace's, i.e. a perfect output-length predictor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from .._C import crc32c
from ..handoff import HandoffState
from ..router import BandwidthEstimator, Pipeline, RouteRequest, Router, RouterConfig
from .deployment import ClusterConfig
from .engine import EventLoop
from .instances import DecodeInstance, KVPool, PrefillInstance, PrefixKVPool
from .links import SharedLink
from .workload import Request

__all__ = ["Job", "ClusterSim", "SimRun"]

_WAN = "wan"


class Job:
    """One request's life in the simulation (times in seconds, ``None`` until reached)."""

    __slots__ = ("req", "t_arrive", "keys", "pipeline", "route_reason", "rld", "md", "md_node", "md_matched_pages",
                 "md_reserved", "rld_reserved", "prefill_done", "rld_granted", "md_granted", "wan_transfer",
                 "md_ready", "on_rld", "handed", "rounds", "handoffs", "tokens_rld", "tokens_md", "t_first",
                 "t_done", "t_prefill", "bytes_to_md", "md_hit_tokens", "p_hit_tokens", "extending")

    def __init__(self, req: Request):
        self.req = req
        self.t_arrive = req.arrival_s  # when released to the cluster (session order may delay it)
        self.keys: tuple = ()
        self.pipeline: Pipeline = Pipeline.P_MD
        self.route_reason = ""
        self.rld = self.md = None
        self.md_node = None
        self.md_matched_pages = 0
        self.md_reserved = self.rld_reserved = 0
        self.prefill_done = self.rld_granted = self.md_granted = self.md_ready = self.on_rld = False
        self.wan_transfer = None
        self.handed = self.rounds = 0
        self.handoffs: list[str] = []
        self.tokens_rld = self.tokens_md = 0
        self.t_first: float | None = None
        self.t_done: float | None = None
        self.t_prefill: float | None = None
        self.bytes_to_md = 0
        self.md_hit_tokens = 0
        self.p_hit_tokens = 0
        self.extending = False

    @property
    def ttft(self) -> float:
        return self.t_first - self.t_arrive

    @property
    def tpot(self) -> float:
        out = self.req.output_tokens
        return 0.0 if out <= 1 else (self.t_done - self.t_first) / (out - 1)


@dataclass
class SimRun:
    """What one run leaves behind, for :mod:`pddcore.sim.metrics`."""

    config: ClusterConfig
    jobs: list[Job]
    duration_s: float
    events: int
    wan_bytes: float
    wan_busy_s: float
    wan_last_busy_s: float  # seconds from the first arrival to the WAN's last transfer
    rdma_bytes: float
    instance_busy: dict[str, float] = field(default_factory=dict)
    md_lookup_pages: int = 0
    md_hit_pages: int = 0


class ClusterSim:
    """Runs one :class:`ClusterConfig` over a list of requests (arrival order)."""

    def __init__(self, config: ClusterConfig):
        self.cfg = cfg = config
        self.loop = loop = EventLoop()
        p_cost, d_cost = cfg.cost_model(cfg.prefill), cfg.cost_model(cfg.decode)
        p_cache = None
        if cfg.prefill_cache_ratio is not None:
            p_cache = int((p_cost.kv_capacity_tokens() - cfg.model.max_context) * cfg.prefill_cache_ratio)
        self.prefills = [PrefillInstance(loop, p_cost, f"P{i}", p_cache, cfg.drc_page_tokens)
                         for i in range(cfg.prefill.instances)]
        d_cap = d_cost.kv_capacity_tokens()
        self._md_cache = cfg.cross_dc and cfg.drc

        def d_pool():
            if self._md_cache:
                return PrefixKVPool(d_cap, cfg.max_batch, cfg.drc_page_tokens)
            return KVPool(d_cap, cfg.max_batch)

        prefix = "MD" if cfg.cross_dc else "D"
        self.decodes = [DecodeInstance(loop, d_cost, d_pool(), f"{prefix}{i}") for i in range(cfg.decode.instances)]
        rdma_bps = cfg.rdma_gbps * 1e9 / 8
        self.rdma = {}
        self.rlds: list[DecodeInstance] = []
        if cfg.rld is not None:
            r_cost = cfg.cost_model(cfg.rld)
            self.rlds = [DecodeInstance(loop, r_cost, KVPool(r_cost.kv_capacity_tokens(), cfg.max_batch), f"RLD{i}")
                         for i in range(cfg.rld.instances)]
            for d in self.rlds:
                self.rdma[d] = SharedLink(loop, rdma_bps, 0.0, f"rdma-{d.name}")
            # RLD's time per token at its typical load: a half-full KV pool of mid-length contexts.
            ctx = cfg.model.max_context // 2
            batch = max(1, min(cfg.max_batch, r_cost.kv_capacity_tokens() // 2 // ctx))
            rld_tpot = r_cost.decode_step_seconds(batch, batch * ctx)
        else:
            rld_tpot = 0.03
        if not cfg.cross_dc:
            for d in self.decodes:
                self.rdma[d] = SharedLink(loop, rdma_bps, 0.0, f"rdma-{d.name}")
        wan_bps = cfg.wan_gbps * 1e9 / 8
        self.wan = SharedLink(loop, wan_bps, cfg.wan_rtt_s, _WAN)
        self.estimator = BandwidthEstimator(prior_bytes_per_s=wan_bps, prior_rtt_s=cfg.wan_rtt_s)
        self.router = Router(RouterConfig(cfg.model.kv_bytes_per_token, ttft_slo_s=cfg.router_ttft_slo_s,
                                          rld_tpot_s=rld_tpot))
        self.policy = cfg.handoff
        self.bpt = cfg.model.kv_bytes_per_token
        self.jobs: list[Job] = []
        self._session_pages: dict[Any, tuple] = {}
        self._next_page = 0
        self._session_busy: dict[Any, list[Job]] = {}  # session -> requests held back behind a running one
        self._prefix_holders: dict[Any, set[int]] = {}  # session -> indices of the P that cached some of it

    # ---- driving ----------------------------------------------------------------------------
    def run(self, requests: Sequence[Request]) -> SimRun:
        if not requests:
            raise ValueError("no requests to simulate")
        for r in requests:
            if r.prompt_tokens + r.output_tokens > self.cfg.model.max_context:
                raise ValueError(f"request {r.id!r}: {r.prompt_tokens} prompt + {r.output_tokens} output tokens "
                                 f"exceed the model's {self.cfg.model.max_context}-token context")
        self.jobs = [Job(r) for r in requests]
        if self.cfg.warm_start:
            self._warm_caches()
        previous = -math.inf
        for job in self.jobs:
            if job.req.arrival_s < previous:
                raise ValueError(f"request {job.req.id!r} arrives at {job.req.arrival_s}, before the previous "
                                 f"request; pass requests in arrival order")
            previous = job.req.arrival_s
            self.loop.at(job.req.arrival_s, self._release, job)
        self.loop.run()
        unfinished = [j.req.id for j in self.jobs if j.t_done is None]
        if unfinished:
            raise RuntimeError(f"{len(unfinished)} requests never finished (first: {unfinished[:5]}); "
                               f"the simulation deadlocked")
        start = self.jobs[0].req.arrival_s
        end = max(j.t_done for j in self.jobs)
        busy = {i.name: i.busy_s for i in self.prefills + self.rlds + self.decodes}
        pools = [d.pool for d in self.decodes if isinstance(d.pool, PrefixKVPool)]
        return SimRun(self.cfg, self.jobs, end - start, self.loop.events_run, self.wan.bytes_delivered,
                      self.wan.busy_s, max(0.0, self.wan.last_busy_at - start), sum(link.bytes_delivered for link in self.rdma.values()), busy,
                      sum(p.lookup_pages for p in pools), sum(p.hit_pages for p in pools))

    def _warm_caches(self) -> None:
        """The prefix each session's first request hits was cached before the trace on
        the session's home P and, with a decode-side cache, on its MD."""
        pt, md_cache = self.cfg.drc_page_tokens, self._md_cache
        for job in self.jobs:
            session = job.req.session
            if session is None or session in self._session_pages:
                continue
            keys = tuple(range(self._next_page, self._next_page + job.req.cached_tokens // pt))
            self._next_page += len(keys)
            self._session_pages[session] = keys
            if keys:
                home = self._session_hash(session) % len(self.prefills)
                self.prefills[home].preload(keys)
                self._prefix_holders[session] = {home}
                if md_cache:
                    self._pick_decode(job).pool.preload(keys)

    # ---- arrival and routing --------------------------------------------------------------------
    def _page_keys(self, req: Request) -> tuple:
        """Page identities of the prompt: the session's previous pages for the cached
        prefix, fresh ones for the rest."""
        pt = self.cfg.drc_page_tokens
        pages = req.prompt_tokens // pt
        shared = self._session_pages.get(req.session, ()) if req.session is not None else ()
        keep = min(req.cached_tokens // pt, len(shared), pages)
        fresh = range(self._next_page, self._next_page + pages - keep)
        self._next_page += pages - keep
        keys = shared[:keep] + tuple(fresh)
        if req.session is not None:
            self._session_pages[req.session] = keys
        return keys

    def _release(self, job: Job) -> None:
        session = job.req.session
        if session is None:
            self._arrive(job)
        elif session in self._session_busy:
            self._session_busy[session].append(job)
        else:
            self._session_busy[session] = []
            self._arrive(job)

    def _session_done(self, job: Job) -> None:
        session = job.req.session
        if session is None:
            return
        held = self._session_busy[session]
        if held:
            nxt = held.pop(0)
            nxt.t_arrive = self.loop.now
            self._arrive(nxt)
        else:
            del self._session_busy[session]

    def _arrive(self, job: Job) -> None:
        req, cfg = job.req, self.cfg
        job.keys = self._page_keys(req)
        # A request without a session shares its prefix with no one we know of: P hits
        # what the trace says.
        p_keys = job.keys if req.session is not None else None
        p, (wait, service), p_hit = self._pick_prefill(req, p_keys)
        job.md = self._pick_decode(job)
        if self.rlds:
            job.rld = min(self.rlds, key=lambda d: d.pool.load)
            md_cached = job.md.pool.cached_prefix_tokens(job.keys) if cfg.drc else 0
            link = self.estimator.estimate(_WAN, now=self.loop.now)
            route = self.router.route(RouteRequest(
                prompt_tokens=req.prompt_tokens, wan_bytes_per_s=link.bytes_per_s, wan_rtt_s=link.rtt_s,
                p_cached_tokens=p_hit, md_cached_tokens=md_cached,
                expected_output_tokens=req.output_tokens, rld_load=job.rld.pool.load, prefill_s=wait + service))
            job.pipeline, job.route_reason = route.pipeline, route.reason
        if job.pipeline is Pipeline.P_MD:
            job.rld = None
        if job.pipeline is not Pipeline.RLD_ONLY:
            self._reserve_md(job)
        else:
            job.md = None
        if job.rld is not None:
            job.rld_reserved = req.prompt_tokens + req.output_tokens
            job.rld.pool.reserve(job, job.rld_reserved, self._rld_granted)
        job.p_hit_tokens = p.submit(p_keys, req.prompt_tokens, req.cached_tokens, self._prefill_done, job)

    def _pick_prefill(self, req: Request, keys: tuple | None) -> tuple[PrefillInstance, tuple[float, float], int]:
        """The P that would finish this prefill first, counting its queue and what its
        cache holds (a cache-aware router); ties go to the one idle longest.
        Returns (P, (queue wait, service time), hit tokens)."""
        # A P that never cached this session hits nothing, so of those only the least busy
        # can win: look up just it and the session's holders.
        least_busy = min(range(len(self.prefills)), key=lambda i: self.prefills[i].free_at)
        holders = self._prefix_holders.get(req.session, set()) if keys is not None else set()
        best = None
        for i in sorted(holders | {least_busy}):
            p = self.prefills[i]
            hit = p.hit_tokens(keys, req.cached_tokens)
            wait, service = p.quote(req.prompt_tokens, hit)
            rank = (wait + service, p.free_at)
            if best is None or rank < best[0]:
                best = (rank, i, (wait, service), hit)
        _, i, quote, hit = best
        if keys is not None:
            self._prefix_holders.setdefault(req.session, set()).add(i)
        return self.prefills[i], quote, hit

    @staticmethod
    def _session_hash(session: Any) -> int:
        # CRC32C, not hash(): str hashes change per process (PYTHONHASHSEED).
        return crc32c(repr(session).encode())

    def _pick_decode(self, job: Job) -> DecodeInstance:
        # With a decode-side cache a session sticks to one MD (its prefixes live there);
        # without one, the least loaded instance takes the request.
        if self._md_cache and job.req.session is not None:
            return self.decodes[self._session_hash(job.req.session) % len(self.decodes)]
        return min(self.decodes, key=lambda d: d.pool.load)

    def _reserve_md(self, job: Job) -> None:
        req, pool = job.req, job.md.pool
        if isinstance(pool, PrefixKVPool):
            pt = self.cfg.drc_page_tokens
            partial = req.prompt_tokens - len(job.keys) * pt
            pool.reserve_prefix(job, job.keys, partial + req.output_tokens, self._md_prefix_granted)
        else:
            job.md_reserved = req.prompt_tokens + req.output_tokens
            pool.reserve(job, job.md_reserved, self._md_granted)

    def _md_prefix_granted(self, job: Job, node, matched_pages: int, reserved: int) -> None:
        job.md_node, job.md_matched_pages, job.md_reserved = node, matched_pages, reserved
        job.md_hit_tokens = matched_pages * self.cfg.drc_page_tokens
        self._md_granted(job)

    # ---- KV movement ----------------------------------------------------------------------------
    def _prefill_done(self, job: Job) -> None:
        job.prefill_done = True
        job.t_prefill = self.loop.now
        self._send_rld(job)
        self._send_md(job)

    def _rld_granted(self, job: Job) -> None:
        job.rld_granted = True
        self._send_rld(job)

    def _md_granted(self, job: Job) -> None:
        job.md_granted = True
        self._send_md(job)

    def _send_rld(self, job: Job) -> None:
        if job.rld is not None and job.prefill_done and job.rld_granted:
            self.rdma[job.rld].send(job.req.prompt_tokens * self.bpt, self._rld_kv_arrived, job)

    def _send_md(self, job: Job) -> None:
        if job.md is None or not (job.prefill_done and job.md_granted) or job.t_done is not None:
            return
        tokens = job.req.prompt_tokens - job.md_hit_tokens
        job.bytes_to_md = tokens * self.bpt
        if self.cfg.cross_dc:
            job.wan_transfer = self.wan.send(job.bytes_to_md, self._md_kv_arrived, job, self.loop.now)
        else:
            self.rdma[job.md].send(job.bytes_to_md, self._md_kv_arrived, job, self.loop.now)

    def _rld_kv_arrived(self, job: Job) -> None:
        job.on_rld = True
        req = job.req
        job.rld.join(job, req.prompt_tokens, req.output_tokens, True, self._first_token, self._rld_finished)
        if job.md_ready:
            self._consider_handoff(job)

    def _md_kv_arrived(self, job: Job, started_at: float) -> None:
        job.wan_transfer = None
        req, pool = job.req, job.md.pool
        if self.cfg.cross_dc:
            elapsed = self.loop.now - started_at - self.cfg.wan_rtt_s
            if elapsed > 0:
                self.estimator.observe(_WAN, int(job.bytes_to_md), elapsed, self.cfg.wan_rtt_s, now=self.loop.now)
        if isinstance(pool, PrefixKVPool):
            job.md_node = pool.insert_locked(job.keys, job.md_matched_pages, job.md_node)
            arrived = (len(job.keys) - job.md_matched_pages) * self.cfg.drc_page_tokens
            pool.used -= arrived
            job.md_reserved -= arrived
        job.md_ready = True
        if job.pipeline is Pipeline.P_MD:
            job.md.join(job, req.prompt_tokens, req.output_tokens, True, self._first_token, self._md_finished)
        elif job.on_rld:
            self._consider_handoff(job)
        elif not job.rld_granted and job.rld.pool.cancel_waiting(job):
            # RLD never had room for it and MD is ready first: MD serves it alone.
            job.rld = None
            job.md.join(job, req.prompt_tokens, req.output_tokens, True, self._first_token, self._md_finished)

    # ---- handoff ---------------------------------------------------------------------------------
    def _consider_handoff(self, job: Job) -> None:
        if job.t_done is not None or job.extending:
            return
        emitted = job.rld.emitted(job)
        decision = self.policy.decide(HandoffState(emitted - job.handed, True, job.rld.pool.load, job.rounds))
        job.handoffs.append(decision.mode.value)
        one_way = self.cfg.wan_rtt_s / 2
        if decision.final:
            emitted = job.rld.remove(job)
            if emitted == job.req.output_tokens:  # RLD emitted its last token just now
                self._rld_finished(job)
                return
            job.tokens_rld = emitted
            job.rld.pool.release(job, job.rld_reserved)
            job.on_rld = False
            backlog = emitted - job.handed
            job.handed = emitted
            self.loop.after(one_way, job.md.extend, backlog, job.req.prompt_tokens + emitted - backlog,
                            self._md_takes_over, job)
        else:
            job.extending = True
            job.rounds += 1
            backlog = decision.num_tokens
            start = job.req.prompt_tokens + job.handed
            job.handed += backlog
            self.loop.after(one_way, job.md.extend, backlog, start, self._catch_up_done, job)

    def _catch_up_done(self, job: Job) -> None:
        job.extending = False
        self.loop.after(self.cfg.wan_rtt_s / 2, self._consider_handoff, job)

    def _md_takes_over(self, job: Job) -> None:
        req = job.req
        first_now = job.tokens_rld == 0  # RLD stopped before streaming anything
        job.md.join(job, req.prompt_tokens + job.tokens_rld, req.output_tokens - job.tokens_rld, first_now,
                    self._first_token, self._md_finished)

    # ---- completion ------------------------------------------------------------------------------
    def _first_token(self, job: Job, t: float) -> None:
        if job.t_first is None:
            job.t_first = t

    def _rld_finished(self, job: Job) -> None:
        job.tokens_rld = job.req.output_tokens
        job.on_rld = False
        job.rld.pool.release(job, job.rld_reserved)
        job.t_done = self.loop.now
        if job.md is not None:
            if job.wan_transfer is not None:
                self.wan.cancel(job.wan_transfer)
                job.wan_transfer = None
            if job.md_granted:
                self._release_md(job)
            elif not job.md.pool.cancel_waiting(job):
                raise RuntimeError(f"request {job.req.id!r}: MD reservation neither granted nor waiting")
        self._session_done(job)

    def _md_finished(self, job: Job) -> None:
        job.tokens_md = job.req.output_tokens - job.tokens_rld
        job.t_done = self.loop.now
        self._release_md(job)
        self._session_done(job)

    def _release_md(self, job: Job) -> None:
        job.md.pool.release(job, job.md_reserved)
        self._unlock_md(job)

    def _unlock_md(self, job: Job) -> None:
        if job.md_node is not None:
            job.md.pool.unlock(job.md_node)
            job.md_node = None
