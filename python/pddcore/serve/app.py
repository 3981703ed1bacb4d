"""The gateway's HTTP face (aiohttp): OpenAI ``/v1/completions`` and
``/v1/chat/completions`` (streamed as server-sent events, or whole), ``/v1/models``,
``/health`` and ``/metrics`` (Prometheus text).

Text prompts and chat messages become token ids through a prefill engine's ``/tokenize``;
output text comes from its ``/detokenize`` (so the gateway needs no tokenizer of its own).
Errors before the first token are HTTP errors (400 for a bad request, 502 / 503 when the
engines fail); after it, an error event ends the stream. A client that disconnects
cancels the request's engine calls (``handler_cancellation``).
"""

from __future__ import annotations

import dataclasses
import uuid
from contextlib import aclosing

from aiohttp import web

from .gateway import Gateway, GatewayError
from .openai_api import (BadRequest, CompletionRequest, TextStream, chunk_body, completion_body, error_body,
                         parse_completion, sse, usage)
from .placement import least_loaded
from .upstream import UpstreamError

__all__ = ["GatewayApp"]

# Streamed text is detokenized (a call to an engine) at most this often; the token ids of
# every chunk go out at once regardless. 20 updates a second read as continuous.
TEXT_EVERY_S = 0.05


class GatewayApp:
    def __init__(self, gateway: Gateway, *, model_name: str | None = None):
        self.gateway = gateway
        self.model_name = model_name

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.add_routes([web.post("/v1/completions", self.completions),
                        web.post("/v1/chat/completions", self.chat_completions),
                        web.get("/v1/models", self.models), web.get("/health", self.health),
                        web.get("/metrics", self.metrics), web.get("/pdd/requests/{rid}", self.trace),
                        web.get("/pdd/links", self.links)])
        app.on_cleanup.append(lambda _: self.gateway.close())
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        metrics = self.gateway.metrics
        try:
            try:
                body = await request.json()
            except ValueError:
                raise BadRequest("the request body is not valid JSON") from None
            req = parse_completion(body, chat=chat)
            prompt = await self._prompt_ids(req)
        except BadRequest as e:
            metrics.errors.labels(kind="bad_request").inc()
            return _error(400, str(e))
        except (UpstreamError, GatewayError) as e:
            metrics.errors.labels(kind="upstream").inc()
            return _error(getattr(e, "status", None) or 502, str(e))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        model = req.model or self.model_name or "pddcore"
        text = TextStream(self._detokenize, every_s=TEXT_EVERY_S)
        async with aclosing(self.gateway.generate(prompt, req.sampling(), rid=rid)) as chunks:
            try:
                first = await anext(chunks, None)
            except GatewayError as e:
                metrics.errors.labels(kind="upstream").inc()
                return _error(e.status, str(e))
            if not req.stream:
                return await self._whole(rid, model, req, prompt, first, chunks, text)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            out: list[int] = []
            try:
                ids = first
                while ids is not None:
                    out += ids
                    delta = await text.add(ids)
                    await response.write(sse(chunk_body(rid, model, req, text=delta, token_ids=ids,
                                                        finish_reason=None,
                                                        prompt_ids=prompt if len(out) == len(ids) else None)))
                    ids = await anext(chunks, None)
                tail = await text.add([], final=True)
                reason = self.gateway.traces[rid].finish_reason or "length"
                await response.write(sse(chunk_body(rid, model, req, text=tail, token_ids=[], finish_reason=reason)))
                if req.include_usage:
                    await response.write(sse({"id": rid, "object": "chat.completion.chunk" if chat else
                                              "text_completion", "created": req.created, "model": model,
                                              "choices": [], "usage": usage(len(prompt), len(out))}))
            except (GatewayError, UpstreamError) as e:
                metrics.errors.labels(kind="upstream").inc()
                await response.write(sse(error_body(getattr(e, "status", None) or 502, str(e))))
            await response.write(sse("[DONE]"))
            return response

    async def _whole(self, rid, model, req: CompletionRequest, prompt, first, chunks, text: TextStream) -> web.Response:
        out = list(first or [])
        try:
            async for ids in chunks:
                out += ids
            body = completion_body(rid, model, req, text=await text.add(out, final=True), token_ids=out,
                                   finish_reason=self.gateway.traces[rid].finish_reason or "length",
                                   prompt_ids=prompt)
        except (GatewayError, UpstreamError) as e:
            self.gateway.metrics.errors.labels(kind="upstream").inc()
            return _error(getattr(e, "status", None) or 502, str(e))
        return web.json_response(body)

    async def _prompt_ids(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, list):
            return req.prompt
        p = self._tokenizer_engine()
        if req.messages is not None:
            return await p.tokenize(messages=req.messages)
        return await p.tokenize(prompt=req.prompt)

    async def _detokenize(self, ids: list[int]) -> str:
        try:
            return await self._tokenizer_engine().detokenize(ids)
        except UpstreamError as e:
            if e.unreachable:
                raise
            return ""  # an engine without a tokenizer (vLLM --skip-tokenizer-init): token ids only, as vLLM answers

    def _tokenizer_engine(self):
        engine = least_loaded(self.gateway.prefill)
        if engine is None:
            raise GatewayError(503, "no prefill engine is reachable to tokenize the prompt")
        return engine

    async def models(self, _: web.Request) -> web.Response:
        name = self.model_name
        if name is None:
            try:
                listing = await self._tokenizer_engine().get_json("/v1/models")
                return web.json_response(listing)
            except (UpstreamError, GatewayError) as e:
                return _error(503, str(e))
        return web.json_response({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "pddcore"}]})

    async def health(self, _: web.Request) -> web.Response:
        gw = self.gateway
        roles = {"prefill": gw.prefill, "relay": gw.relay, "main": gw.main}
        state = {role: [{"url": u.url, "healthy": u.healthy, "inflight": u.inflight} for u in ups]
                 for role, ups in roles.items()}
        serving = any(u.healthy for u in gw.prefill) and any(u.healthy for u in gw.relay + gw.main)
        return web.json_response(state, status=200 if serving else 503)

    async def trace(self, request: web.Request) -> web.Response:
        """What happened to one of the latest requests: route and reason, handoffs, resumes."""
        trace = self.gateway.traces.get(request.match_info["rid"])
        if trace is None:
            return _error(404, "no such request among the latest ones")
        return web.json_response(dataclasses.asdict(trace))

    async def links(self, _: web.Request) -> web.Response:
        """The WAN estimate toward each MD, and where it comes from."""
        gw = self.gateway
        out = {}
        for md in gw.main:
            link = gw.estimator.estimate(md.url)
            out[md.url] = {"bytes_per_s": link.bytes_per_s, "rtt_s": link.rtt_s, "samples": link.samples,
                           "source": gw.link_source(md.url)}
        return web.json_response(out)

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=self.gateway.metrics.exposition(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def _error(status: int, message: str) -> web.Response:
    return web.json_response(error_body(status, message), status=status)
