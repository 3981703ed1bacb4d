"""The gateway's pipeline steps in each engine dialect: the one place that knows how a
dialect moves KV from P to a decode engine. Routing, the handoff policy, faults, metrics
and traces stay in :mod:`.gateway`, which calls these steps for one request (a :class:`Run`):

* :meth:`decode` — P prefills the request's context (the prompt and every token the client
  has), then the decoder pulls the KV and streams the rest;
* :meth:`relay` — the same on RLD, keeping P's KV for MD too; it resolves ``prefilled``
  with what :meth:`prefetch` needs once P holds the KV;
* :meth:`prefetch` and :meth:`extend` — MD comes to hold a context's KV (the prompt; the
  prompt plus the tokens so far, for a catch-up round) and keeps it in its prefix cache;
* :meth:`resume_on_md` — MD continues from the client's tokens (the handoff).
Stopping RLD is the same in both: the gateway closes RLD's stream (SGLang's client also posts
``/abort_request``, :mod:`.sglang_upstream`).

Each step yields ``(new token ids, finish reason or None)`` or returns when done, and raises
:class:`.upstream.UpstreamError` when an engine fails (the gateway decides what then).

Example::

    pipeline = VllmPipeline()                    # or SGLangPipeline({p.url: ("10.0.0.1", 8998)})
    async for ids, finish in pipeline.decode(run, md, "MD"):
        ...
"""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from contextlib import aclosing
from typing import AsyncIterator, Awaitable, NoReturn, Protocol

from .upstream import Upstream, UpstreamError

__all__ = ["VllmPipeline", "SGLangPipeline", "Run"]

Chunks = AsyncIterator[tuple[list[int], str | None]]


class Run(Protocol):
    """What the steps use of one request being served (the gateway's ``_Run``)."""

    prompt: list[int]
    sampling: dict

    def leg_id(self, what: str) -> str: ...
    def continuation(self) -> tuple[list[int], dict]: ...
    def pick_prefill(self, tried: list[Upstream]) -> Upstream: ...
    def prefill_failed(self, e: UpstreamError) -> None: ...
    def refuse(self, status: int, message: str) -> NoReturn: ...
    def prefilled(self, context: list[int], cached_tokens: int | None, started: float) -> None: ...
    def keep_running(self, work: Awaitable) -> None: ...
    def note_error(self, message: str) -> None: ...


class VllmPipeline:
    """vLLM's dialect (and the reference engine's): P prefills first, asked with
    ``{"do_remote_decode": true}``, and the decoder then pulls with the ``kv_transfer_params``
    P returned. One prefill serves RLD and MD (``"pdd_consumers": 2``). A decode engine
    prefills by itself too, so MD's extend rounds and its continuation after a handoff are
    plain requests: a prefix-cache hit plus an extend over the handed-off tokens, on MD."""

    extend_crosses_wan = False  # MD computes the handed-off tokens: only their ids cross

    async def decode(self, run: Run, decoder: Upstream, source: str) -> Chunks:
        context, sampling = run.continuation()
        kv = await self._prefill(run, context)
        async with aclosing(decoder.stream(run.leg_id(source.lower()), context, sampling, kv)) as chunks:
            async for item in chunks:
                yield item

    async def relay(self, run: Run, rld: Upstream, prefilled: asyncio.Future) -> Chunks:
        kv = await self._prefill(run, run.prompt, consumers=2)  # one prefill, pulled by RLD and by MD
        prefilled.set_result(kv)
        async with aclosing(rld.stream(run.leg_id("rld"), run.prompt, run.sampling, kv)) as chunks:
            async for item in chunks:
                yield item

    async def prefetch(self, run: Run, md: Upstream, kv: dict) -> None:
        await md.generate(run.leg_id("md-prefetch"), run.prompt, {**run.sampling, "max_tokens": 1}, kv)

    async def extend(self, run: Run, md: Upstream, context: list[int]) -> None:
        await md.generate(run.leg_id("md-extend"), context, {**run.sampling, "max_tokens": 1})

    async def resume_on_md(self, run: Run, md: Upstream) -> Chunks:
        context, sampling = run.continuation()
        async with aclosing(md.stream(run.leg_id("md"), context, sampling)) as chunks:
            async for item in chunks:
                yield item

    async def _prefill(self, run: Run, context: list[int], consumers: int = 1) -> dict:
        """P prefills ``context`` and keeps its KV for ``consumers`` pulls; returns the pulls' params."""
        tried: list[Upstream] = []
        while True:
            p = run.pick_prefill(tried)
            started = time.monotonic()
            try:
                answer = await p.generate(run.leg_id("p"), context, {**run.sampling, "max_tokens": 1},
                                          {"do_remote_decode": True, "pdd_consumers": consumers})
            except UpstreamError as e:
                run.prefill_failed(e)
                continue
            if not answer.kv_transfer_params:
                run.refuse(502, f"prefill engine {p.url} returned no kv_transfer_params: is its KV connector "
                                "configured as a producer?")
            run.prefilled(context, answer.cached_tokens, started)
            return answer.kv_transfer_params


class SGLangPipeline:
    """SGLang's dialect (PD mode): every step is a pair of requests sent at once, the same
    request to P and to the consumer, with P's bootstrap address and a fresh random
    ``bootstrap_room`` that pairs them, as SGLang's router pairs its servers; the consumer's
    answer is the one that counts, P's is drained and dropped. An SGLang decode engine cannot
    prefill, so MD's prefetch, its extend rounds and its continuation after a handoff are such
    pairs too: MD's decode-side prefix cache (``--disaggregation-decode-enable-radix-cache``) holds
    the earlier context, P is asked for the pages MD lacks (SGLang's ``decode_prefix_len``),
    and P — a prefix-cache hit on its side — computes the handed-off tokens.

    ``bootstrap``: each P's URL -> (host, port) of its bootstrap server."""

    extend_crosses_wan = True  # P computes the handed-off tokens: their KV crosses to MD

    def __init__(self, bootstrap: dict[str, tuple[str, int]]):
        self.bootstrap = dict(bootstrap)

    async def decode(self, run: Run, decoder: Upstream, source: str) -> Chunks:
        context, sampling = run.continuation()
        async with aclosing(self._pair(run, decoder, source.lower(), context, sampling)) as chunks:
            async for item in chunks:
                yield item

    async def relay(self, run: Run, rld: Upstream, prefilled: asyncio.Future) -> Chunks:
        async with aclosing(self._pair(run, rld, "rld", run.prompt, run.sampling, answered=prefilled)) as chunks:
            async for item in chunks:
                yield item

    async def prefetch(self, run: Run, md: Upstream, p: Upstream) -> None:
        """MD pairs with the P that answered RLD's pair: its prefix cache holds the prompt."""
        await self._drain(self._pair(run, md, "md-prefetch", run.prompt, {**run.sampling, "max_tokens": 1},
                                     prefer=p))

    async def extend(self, run: Run, md: Upstream, context: list[int]) -> None:
        await self._drain(self._pair(run, md, "md-extend", context, {**run.sampling, "max_tokens": 1}))

    async def resume_on_md(self, run: Run, md: Upstream) -> Chunks:
        context, sampling = run.continuation()
        async with aclosing(self._pair(run, md, "md", context, sampling)) as chunks:
            async for item in chunks:
                yield item

    @staticmethod
    async def _drain(chunks: Chunks) -> None:
        async with aclosing(chunks):
            async for _ in chunks:
                pass

    async def _pair(self, run: Run, consumer: Upstream, leg: str, context: list[int], sampling: dict, *,
                    prefer: Upstream | None = None, answered: asyncio.Future | None = None) -> Chunks:
        """P and ``consumer`` get the same request at once; yields the consumer's stream. A P
        that fails before the consumer's first token is replaced by another (a new room)."""
        tried: list[Upstream] = []
        while True:
            if prefer is not None and prefer.healthy and not tried:
                p = prefer
                tried.append(p)
            else:
                p = run.pick_prefill(tried)
            host, port = self.bootstrap[p.url]
            room = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": secrets.randbits(63)}
            prefill = asyncio.ensure_future(p.generate(run.leg_id("p"), context, sampling, room))
            prefill.add_done_callback(functools.partial(self._answered, run, p, context, time.monotonic(), answered))
            got_kv = False
            try:
                async with aclosing(consumer.stream(run.leg_id(leg), context, sampling, room)) as chunks:
                    first = asyncio.ensure_future(anext(chunks))
                    try:
                        await asyncio.wait({first, prefill}, return_when=asyncio.FIRST_COMPLETED)
                        if not first.done() and prefill.exception() is not None:
                            run.prefill_failed(prefill.exception())  # the consumer would wait for KV in vain
                            continue
                        item = await first
                    except UpstreamError as e:
                        if e.status is not None and 400 <= e.status < 500:
                            run.refuse(400, str(e))  # the request itself is bad: no other engine takes it
                        raise
                    finally:
                        if not first.done():
                            first.cancel()
                            await asyncio.gather(first, return_exceptions=True)
                    got_kv = True
                    yield item
                    async for item in chunks:
                        yield item
                return
            finally:
                if not prefill.done():
                    if got_kv:
                        run.keep_running(prefill)  # drain P's answer
                    else:
                        prefill.cancel()  # nobody will pull: P drops the request

    @staticmethod
    def _answered(run: Run, p: Upstream, context: list[int], started: float, answered: asyncio.Future | None,
                  answer: asyncio.Future) -> None:
        """P's half of a pair ended: trace it; tell ``answered`` which P holds the KV."""
        if answer.cancelled():
            return
        if answer.exception() is not None:
            run.note_error(f"{answer.exception()} (P's half of a pair)")
            return
        run.prefilled(context, answer.result().cached_tokens, started)
        if answered is not None and not answered.done():
            answered.set_result(p)
