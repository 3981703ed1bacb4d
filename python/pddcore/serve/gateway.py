"""The PDD orchestration of one request over stock engine servers.

Per request: estimate how much of the context each MD holds (:mod:`.placement`), let
:class:`pddcore.router.Router` pick the pipeline, then run it through the engines' own
HTTP API. How KV moves from P to a decode engine is the dialect's, in one policy object of
:mod:`.pipelines`; below is vLLM's (SGLang's pairs every step with P instead):

* ``P_MD`` — P prefills with ``{"do_remote_decode": true}``; MD decodes with the params P
  returned, pulling across the WAN only the pages its prefix cache lacks.
* ``RLD_ONLY`` — the same with RLD as the decoder; nothing crosses the WAN.
* ``P_RLD_MD`` — P prefills once with ``"pdd_consumers": 2`` (it keeps the KV for two
  pulls); RLD pulls inside the datacenter and streams to the client at once, while MD's
  *prefetch* — a one-token request with the same params — pulls the pages MD lacks across
  the WAN and leaves them in MD's prefix cache. Once MD holds the prompt, :class:`pddcore.handoff.HandoffPolicy` decides
  at every RLD token: **one-shot** (stop RLD at that token boundary; MD continues with the
  context plus every token the client has, recomputing the handed-off tokens in one
  extend pass — its prefix-cache hit plus a prefill of the rest), or **catch-up** (MD runs
  an extend-only round over the tokens so far while RLD keeps going; then a short final
  handoff).

Exactly once, in order: the gateway alone decides which engine's tokens reach the client,
appends each to the request's delivered list, and every continuation starts from exactly
that list; tokens an engine produced past a handoff point are never forwarded.

Faults: MD unreachable before the handoff (prefetch or extend round fails) -> RLD finishes
the request. An engine that fails while it streams -> the request continues from its
delivered tokens: on MD if MD holds the prompt, else P prefills the context so far (a
prefix-cache hit) for a healthy RLD, or for an MD. P unreachable -> :class:`GatewayError`
(HTTP 503) before any token. Every engine call has a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, NoReturn, Sequence

from ..handoff import HandoffMode, HandoffPolicy, HandoffState
from ..router import BandwidthEstimator, Pipeline, RouteRequest, Router, RouterConfig
from .metrics import GatewayMetrics
from .pipelines import SGLangPipeline, VllmPipeline
from .placement import PrefixIndex, choose_main, least_loaded
from .upstream import Upstream, UpstreamError

__all__ = ["Gateway", "GatewayConfig", "GatewayError", "RequestTrace"]

log = logging.getLogger("pddcore.serve")


class GatewayError(RuntimeError):
    """A request cannot be served; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class GatewayConfig:
    """``kv_bytes_per_token`` and ``page_size`` describe the engines' KV (the router prices
    transfers with them; :meth:`Gateway.discover` reads them from reference engines).
    ``rld_capacity``: requests one RLD instance decodes at once before it counts as full.
    ``prefetch_timeout_s``: an MD pull that takes longer leaves the request on RLD.
    ``md_cache_tokens``: the size of one MD's prefix cache, for the gateway's estimate."""

    kv_bytes_per_token: float
    page_size: int = 16
    ttft_slo_s: float = 3.0
    rld_tpot_s: float = 0.03
    rld_capacity: int = 8
    prior_wan_bytes_per_s: float = 1.25e9
    prior_wan_rtt_s: float = 0.02
    prefetch_timeout_s: float = 60.0
    md_cache_tokens: int = 1 << 20
    policy: HandoffPolicy = field(default_factory=HandoffPolicy)


@dataclass
class RequestTrace:
    """What happened to one request (the gateway keeps the latest ones for inspection)."""

    rid: str
    prompt_tokens: int
    pipeline: str = ""
    reason: str = ""
    md: str | None = None  # the MD chosen for the request (its URL)
    md_cached_tokens: int = 0
    sources: list[str] = field(default_factory=list)
    handoffs: list[tuple[str, int]] = field(default_factory=list)  # (kind, delivered tokens at the handoff)
    catch_up_rounds: int = 0
    resumes: list[str] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)  # plans dropped without a failure reaching the client
    errors: list[str] = field(default_factory=list)  # the engine calls that failed, and why
    prefill_tokens: int | None = None  # prompt tokens P computed (not in its prefix cache), first prefill
    prefill_s: float | None = None  # the first prefill call, as the gateway timed it
    kv_usable_s: dict[str, float] = field(default_factory=dict)  # "rld" / "md": KV usable, after the prefill
    handoff_gap_s: float | None = None
    finish_reason: str | None = None


class Gateway:
    """Engines by role and the state that routing reads; :meth:`generate` serves one request."""

    def __init__(self, prefill: Sequence[Upstream], relay: Sequence[Upstream], main: Sequence[Upstream],
                 config: GatewayConfig, metrics: GatewayMetrics | None = None,
                 pipeline: VllmPipeline | SGLangPipeline | None = None):
        if not prefill:
            raise ValueError("the gateway needs at least one prefill engine")
        if not relay and not main:
            raise ValueError("the gateway needs at least one relay or main decode engine")
        self.prefill, self.relay, self.main = list(prefill), list(relay), list(main)
        self.config = config
        self.pipeline = pipeline or VllmPipeline()
        self.metrics = metrics or GatewayMetrics()
        self.router = Router(RouterConfig(kv_bytes_per_token=config.kv_bytes_per_token, ttft_slo_s=config.ttft_slo_s,
                                          rld_tpot_s=config.rld_tpot_s))
        self.estimator = BandwidthEstimator(prior_bytes_per_s=config.prior_wan_bytes_per_s,
                                            prior_rtt_s=config.prior_wan_rtt_s)
        self.index = PrefixIndex(config.page_size, config.md_cache_tokens)
        self.traces: dict[str, RequestTrace] = {}
        self.counted_links: set[str] = set()  # MD URLs whose link estimate comes from engine counters
        self._background: set[asyncio.Task] = set()

    def rld_load(self) -> float:
        if not self.relay:
            return float("inf")
        return sum(u.inflight for u in self.relay) / (self.config.rld_capacity * len(self.relay))

    async def generate(self, prompt: list[int], sampling: dict, *, rid: str | None = None) -> AsyncIterator[list[int]]:
        """The request's output token ids, in order, each exactly once, in chunks as they come.
        ``sampling`` uses vLLM's ``sampling_params`` keys (``max_tokens`` required)."""
        sampling = dict(sampling)
        if sampling.get("seed") is None:
            sampling["seed"] = secrets.randbits(63)  # every leg of the request samples from one stream
        run = _Run(self, rid or uuid.uuid4().hex, list(prompt), sampling)
        self.traces[run.rid] = run.trace
        while len(self.traces) > 1024:
            self.traces.pop(next(iter(self.traces)))
        async for ids in run.tokens():
            yield ids

    def link_source(self, md_url: str) -> str:
        """Where the WAN estimate of the link to ``md_url`` comes from: the engines' transfer
        counters (:mod:`.link_stats`), timed MD pulls, or the configured prior."""
        if md_url in self.counted_links:
            return "engine counters"
        return "timed pulls" if self.estimator.estimate(md_url).samples else "prior"

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    def keep_running(self, coro) -> None:
        """Lets ``coro`` finish after its request did (an MD prefetch whose KV the session's
        next turn will want), without losing track of it."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class _Run:
    """One request's state while it is served."""

    def __init__(self, gw: Gateway, rid: str, prompt: list[int], sampling: dict):
        self.gw, self.rid, self.prompt, self.sampling = gw, rid, prompt, sampling
        self.max_tokens = int(sampling["max_tokens"])
        self.delivered: list[int] = []
        self.finished = False
        self.trace = RequestTrace(rid, len(prompt))
        self.md: Upstream | None = None
        self.md_holds = 0  # context tokens MD is known to hold (prefetch and extend rounds done)
        self.started = time.monotonic()
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.prefilled_at: float | None = None  # when the latest prefill answered
        self._legs = 0

    # ---- entry --------------------------------------------------------------------------------
    async def tokens(self) -> AsyncIterator[list[int]]:
        gw = self.gw
        self.md, md_cached = choose_main(gw.main, gw.index, self.prompt)
        pipeline, reason = self._route(md_cached)
        self.trace.pipeline, self.trace.reason, self.trace.md_cached_tokens = pipeline.value, reason, md_cached
        self.trace.md = self.md.url if self.md is not None and pipeline is not Pipeline.RLD_ONLY else None
        gw.metrics.requests.labels(route=pipeline.value).inc()
        if pipeline is Pipeline.P_MD:
            stream = self._p_decode(self.md, "MD")
        elif pipeline is Pipeline.RLD_ONLY:
            stream = self._p_decode(least_loaded(gw.relay), "RLD")
        else:
            stream = self._p_rld_md()
        async with aclosing(stream) as chunks:
            async for ids in chunks:
                yield ids
        if self.first_at is not None and len(self.delivered) > 1:
            gw.metrics.tpot.observe((self.last_at - self.first_at) / (len(self.delivered) - 1))

    def _route(self, md_cached: int) -> tuple[Pipeline, str]:
        gw = self.gw
        if self.md is None:
            return Pipeline.RLD_ONLY, "no main decode engine is healthy"
        if not gw.relay or least_loaded(gw.relay) is None:
            return Pipeline.P_MD, "no relay decode engine is healthy"
        link = gw.estimator.estimate(self.md.url)
        route = gw.router.route(RouteRequest(
            prompt_tokens=len(self.prompt), md_cached_tokens=md_cached, wan_bytes_per_s=link.bytes_per_s,
            wan_rtt_s=link.rtt_s, max_output_tokens=self.max_tokens, rld_load=gw.rld_load()))
        return route.pipeline, (f"{route.reason} (link estimate {link.bytes_per_s * 8 / 1e6:.0f} Mbit/s, "
                                f"RTT {link.rtt_s * 1e3:.0f} ms)")

    # ---- what the pipelines (.pipelines) call -------------------------------------------------
    def leg_id(self, what: str) -> str:
        self._legs += 1
        return f"{self.rid}-{what}{self._legs}"

    def continuation(self) -> tuple[list[int], dict]:
        """The context so far (prompt and delivered tokens) and the sampling of the rest."""
        return self.prompt + self.delivered, {**self.sampling, "max_tokens": self.max_tokens - len(self.delivered)}

    def pick_prefill(self, tried: list[Upstream]) -> Upstream:
        """The least loaded P not yet ``tried`` (which it joins); GatewayError when none is left."""
        p = least_loaded(self.gw.prefill, tried)
        if p is None:
            raise GatewayError(503, f"no prefill engine is reachable ({', '.join(u.url for u in self.gw.prefill)})")
        tried.append(p)
        return p

    def prefill_failed(self, e: UpstreamError) -> None:
        """A P call failed: returns when another P may take it (P was unreachable)."""
        self.gw.metrics.upstream_errors.labels(role="prefill").inc()
        log.warning("%s: %s", self.rid, e)
        if not e.unreachable:  # the engine refused the request itself: a 4xx is the client's to fix
            self.refuse(400 if e.status and 400 <= e.status < 500 else 502, str(e))

    def refuse(self, status: int, message: str) -> NoReturn:
        raise GatewayError(status, message)

    def keep_running(self, work) -> None:
        self.gw.keep_running(work)

    def note_error(self, message: str) -> None:
        self.trace.errors.append(message)

    def prefilled(self, context: list[int], cached_tokens: int | None, started: float) -> None:
        """P answered a prefill of ``context`` started at ``started``."""
        self.prefilled_at = time.monotonic()
        if self.trace.prefill_s is None:
            self.trace.prefill_s = self.prefilled_at - started
            self.trace.prefill_tokens = len(context) - (cached_tokens or 0)

    def _deliver(self, ids: list[int], source: str) -> list[int]:
        ids = ids[:self.max_tokens - len(self.delivered)]
        now = time.monotonic()
        if ids and self.first_at is None:
            self.first_at = now
            self.gw.metrics.ttft.observe(now - self.started)
        if ids:
            self.last_at = now
        self.delivered += ids
        self.trace.sources += [source] * len(ids)
        self.gw.metrics.tokens.labels(source=source).inc(len(ids))
        return ids

    async def _stream(self, engine_chunks, source: str, pulled: bool) -> AsyncIterator[list[int]]:
        """Delivers a pipeline step's stream of the continuation until it finishes; ``pulled``:
        the engine pulled P's KV first."""
        async with aclosing(engine_chunks) as chunks:
            async for ids, finish in chunks:
                if pulled:
                    self._kv_usable(source.lower())  # its first token: the engine has pulled the KV
                ids = self._deliver(ids, source)
                if ids:
                    yield ids
                if finish or len(self.delivered) >= self.max_tokens:
                    self._finish(finish or "length")
                    return

    def _kv_usable(self, target: str) -> None:
        """The latest prefill's KV is usable at ``target`` ("rld" or "md") now: record after how long."""
        if self.prefilled_at is not None:
            self.trace.kv_usable_s.setdefault(target, time.monotonic() - self.prefilled_at)

    def _fallback(self, reason: str, what: str) -> None:
        log.warning("%s: %s", self.rid, what)
        self.trace.fallbacks.append(what)
        self.gw.metrics.fallbacks.labels(reason=reason).inc()

    def _finish(self, reason: str) -> None:
        self.finished = True
        self.trace.finish_reason = reason

    async def _p_decode(self, decoder: Upstream | None, source: str) -> AsyncIterator[list[int]]:
        """P prefills, ``decoder`` pulls and decodes; a failure continues elsewhere."""
        if decoder is None:
            raise GatewayError(503, f"no {source} engine is reachable")
        started = time.monotonic()
        try:
            async with aclosing(self._stream(self.gw.pipeline.decode(self, decoder, source), source, True)) as chunks:
                async for ids in chunks:
                    if source == "MD" and self.md_holds == 0:
                        self._md_pulled(self.prefilled_at or started)  # the pull's time, after P's answer if any
                    yield ids
            if source == "MD":
                self.gw.index.record(decoder, self.prompt + self.delivered[:-1])
        except UpstreamError as e:
            self._upstream_failed(e)
            async for ids in self._resume(f"{source} failed"):
                yield ids

    def _md_pulled(self, started: float) -> None:
        """MD holds the prompt now: account the WAN bytes and feed the link estimate."""
        tokens = len(self.prompt) - self.trace.md_cached_tokens
        nbytes = int(tokens * self.gw.config.kv_bytes_per_token)
        self.md_holds = len(self.prompt)
        self.gw.metrics.wan_bytes.inc(nbytes)
        # The call spans two round trips besides the bulk: the request to MD and MD's pull
        # request to P. The rate is the bulk's; only pulls of 1 MiB or more count (estimator).
        link = self.gw.estimator.estimate(self.md.url)
        bulk_s = time.monotonic() - started - 2 * link.rtt_s
        if bulk_s > 0 and self.md.url not in self.gw.counted_links:
            self.gw.estimator.observe(self.md.url, nbytes, bulk_s)
        self.gw.index.record(self.md, self.prompt)

    async def _prefetch(self, prefilled: asyncio.Future) -> bool:
        """Once P holds the prompt's KV (``prefilled`` resolves with what the pipeline needs to
        reach it), MD pulls what it lacks and keeps it; True once MD holds the prompt."""
        ticket = await prefilled
        started = time.monotonic()
        try:
            await asyncio.wait_for(self.gw.pipeline.prefetch(self, self.md, ticket), self.gw.config.prefetch_timeout_s)
        except (UpstreamError, asyncio.TimeoutError) as e:
            timeout = isinstance(e, asyncio.TimeoutError)
            self._fallback("md_prefetch_timeout" if timeout else "md_prefetch_failed",
                           f"MD prefetch {'timed out' if timeout else f'failed ({e})'}: the request stays on RLD")
            self.gw.metrics.upstream_errors.labels(role="main").inc()
            return False
        self._kv_usable("md")
        self._md_pulled(started)
        return True

    def _md_extended(self, context_tokens: int) -> None:
        """MD now holds ``context_tokens`` of context; where the extend runs on P (SGLang's
        dialect), the KV of the tokens past what MD held crossed the WAN."""
        if self.gw.pipeline.extend_crosses_wan:
            tokens = max(0, context_tokens - self.md_holds)
            self.gw.metrics.wan_bytes.inc(int(tokens * self.gw.config.kv_bytes_per_token))

    async def _extend_round(self, upto: int) -> int:
        """MD computes the KV of the context plus the first ``upto`` delivered tokens (one
        extend pass over what its cache lacks) and keeps it; returns the tokens it holds."""
        context = self.prompt + self.delivered[:upto]
        await self.gw.pipeline.extend(self, self.md, context)
        self._md_extended(len(context))
        self.gw.index.record(self.md, context)
        return len(context)

    async def _p_rld_md(self) -> AsyncIterator[list[int]]:
        gw, policy = self.gw, self.gw.config.policy
        rld = least_loaded(gw.relay)
        prefilled = asyncio.get_running_loop().create_future()
        prefetch = asyncio.ensure_future(self._prefetch(prefilled))
        extend: asyncio.Task | None = None
        final: HandoffMode | None = None
        try:
            try:
                async with aclosing(self._stream(gw.pipeline.relay(self, rld, prefilled), "RLD", True)) as rld_tokens:
                    async for ids in rld_tokens:
                        yield ids
                        if extend is not None and extend.done():
                            if extend.exception() is None:
                                self.md_holds = extend.result()
                                self.trace.catch_up_rounds += 1
                                gw.metrics.catch_up_rounds.inc()
                            else:
                                self._fallback("md_extend_failed", f"MD's extend round failed "
                                                                   f"({extend.exception()}): the request stays on RLD")
                                prefetch = None  # no more handoffs
                            extend = None
                        if extend is not None or prefetch is None or not prefetch.done() or not prefetch.result():
                            continue
                        decision = policy.decide(HandoffState(
                            backlog_tokens=len(self.prompt) + len(self.delivered) - self.md_holds, md_ready=True,
                            rld_load=gw.rld_load(), rounds_done=self.trace.catch_up_rounds))
                        if decision.final:
                            final = decision.mode
                            break
                        extend = asyncio.ensure_future(self._extend_round(len(self.delivered)))
            except UpstreamError as e:
                self._upstream_failed(e)
                if prefetch is not None and prefetch.done() and prefetch.result():
                    final = HandoffMode.ONE_SHOT
                    self.trace.resumes.append("RLD failed: handed off to MD")
                    gw.metrics.resumes.labels(reason="rld_failed").inc()
                else:
                    async for ids in self._resume("RLD failed"):
                        yield ids
                    return
        finally:
            if extend is not None:
                extend.cancel()
            if prefetch is not None and not prefetch.done():
                if self.finished:
                    gw.keep_running(prefetch)  # MD keeps the KV for the session's next turn
                else:
                    prefetch.cancel()
        if final is None or self.finished:
            return
        async for ids in self._handoff(final):
            yield ids

    async def _handoff(self, mode: HandoffMode) -> AsyncIterator[list[int]]:
        """RLD stopped at the last delivered token; MD continues from there."""
        kind = "one_shot" if mode is HandoffMode.ONE_SHOT else "catch_up"
        self.trace.handoffs.append((kind, len(self.delivered)))
        self.gw.metrics.handoffs.labels(kind=kind).inc()
        last_rld, handed_off = self.last_at, len(self.prompt) + len(self.delivered)
        try:
            async with aclosing(self._stream(self.gw.pipeline.resume_on_md(self, self.md), "MD", False)) as chunks:
                async for ids in chunks:
                    if handed_off:
                        self._md_extended(handed_off)
                        handed_off = 0
                    if self.trace.handoff_gap_s is None and last_rld is not None:
                        self.trace.handoff_gap_s = time.monotonic() - last_rld
                        self.gw.metrics.handoff_gap.observe(self.trace.handoff_gap_s)
                    yield ids
            self.gw.index.record(self.md, self.prompt + self.delivered[:-1])
        except UpstreamError as e:
            self._upstream_failed(e)
            async for ids in self._resume("MD failed after the handoff"):
                yield ids

    async def _resume(self, why: str) -> AsyncIterator[list[int]]:
        """Continues from the delivered tokens after an engine failed: P prefills the context
        so far (its prefix cache holds the prompt) for a healthy RLD, else for an MD."""
        gw = self.gw
        while not self.finished and len(self.delivered) < self.max_tokens:
            decoder, source = least_loaded(gw.relay), "RLD"
            if decoder is None:
                self.md, _ = choose_main(gw.main, gw.index, self.prompt)
                decoder, source = self.md, "MD"
            if decoder is None:
                raise GatewayError(503, f"{why} and no decode engine is reachable")
            self.trace.resumes.append(f"{why}: resumed on {source} at token {len(self.delivered)}")
            gw.metrics.resumes.labels(reason=why.split(" ")[0].lower() + "_failed").inc()
            try:
                async with aclosing(self._stream(gw.pipeline.decode(self, decoder, source), source, True)) as chunks:
                    async for ids in chunks:
                        yield ids
            except UpstreamError as e:
                self._upstream_failed(e)
                why = f"{source} failed"
        if not self.finished:
            self._finish("length")

    def _upstream_failed(self, e: UpstreamError) -> None:
        log.warning("%s: %s (delivered %d tokens)", self.rid, e, len(self.delivered))
        self.trace.errors.append(f"{e} (at token {len(self.delivered)})")
        self.gw.metrics.upstream_errors.labels(role=e.upstream.role).inc()
        if e.upstream.role == "main":
            self.gw.index.forget(e.upstream)
