"""The reference engine's HTTP face: the subset of vLLM's server dialect that a PDD gateway
drives, over :class:`.scheduler.Scheduler` (aiohttp).

* ``POST /inference/v1/generate`` — tokens in, tokens out (``token_ids``,
  ``sampling_params``, ``stream``, ``kv_transfer_params``), as vLLM serves it;
* ``POST /v1/completions`` and ``/v1/chat/completions`` — OpenAI, with vLLM's
  ``return_token_ids`` and ``kv_transfer_params``;
* ``POST /tokenize``, ``/detokenize``, ``/inference/v1/abort_requests``;
* ``GET /v1/models``, ``/health``, ``/pdd/state`` (counters, and the transfer engine's per-peer
  counters under ``transfer_peers``), ``/pdd/timings`` (the
  latest decode steps and extend passes: seconds and batch or tokens), ``/pdd/info``
  (page size and KV bytes per token, for a gateway's router).

``role`` decides which ``kv_transfer_params`` the engine accepts: a ``prefill`` engine
takes ``{"do_remote_decode": true}`` (keep the KV for a decode engine to pull), a
``decode`` engine takes the params a prefill engine returned (pull the pages its prefix
cache lacks). Requests without params are prefilled and decoded locally on either.

A client that disconnects cancels its request: the model thread drops it and frees its pages.
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from typing import AsyncIterator

from aiohttp import web

from ..model import Model, SamplingParams
from ..serve.openai_api import (BadRequest, CompletionRequest, chunk_body, completion_body, error_body,
                                parse_completion, sse, usage)
from .scheduler import GenerationRequest, Scheduler
from .tokenizer import ByteTokenizer

__all__ = ["EngineServer"]


class GenerationFailed(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class EngineServer:
    """Routes for one engine; :meth:`app` builds the aiohttp application."""

    def __init__(self, role: str, model: Model, scheduler: Scheduler, *, model_name: str = "pddcore-reference"):
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        self.role, self.model, self.scheduler, self.model_name = role, model, scheduler, model_name
        self.tokenizer = ByteTokenizer(model.config.vocab_size)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.add_routes([
            web.post("/inference/v1/generate", self.generate),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.post("/inference/v1/abort_requests", self.abort),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/pdd/state", self.state),
            web.get("/pdd/info", self.info),
            web.get("/pdd/timings", self.timings),
        ])
        return app

    # ---- generation ------------------------------------------------------------------------
    def _request(self, rid: str, token_ids: list[int], sampling: dict, kv: dict | None, emit,
                 lease_key: str | None = None) -> GenerationRequest:
        vocab = self.model.config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if not token_ids or bad:
            raise BadRequest(f"token ids must be in [0, {vocab}) and at least one; got {bad[:4]}" if bad
                             else "no token ids")
        remote_prefill, remote_decode, consumers = None, False, 1
        if kv:
            if kv.get("do_remote_decode"):
                if self.role != "prefill":
                    raise BadRequest("do_remote_decode asks to keep the KV for a decode engine: send it to a "
                                     "prefill engine")
                remote_decode, consumers = True, kv.get("pdd_consumers", 1)
                if isinstance(consumers, bool) or not isinstance(consumers, int) or not 1 <= consumers <= 16:
                    raise BadRequest(f"pdd_consumers must be an integer in [1, 16], got {consumers!r}")
            elif kv.get("do_remote_prefill"):
                if self.role != "decode":
                    raise BadRequest("do_remote_prefill asks to pull the KV from a prefill engine: send it to a "
                                     "decode engine")
                remote_prefill = kv
        try:
            params = SamplingParams(temperature=float(sampling.get("temperature", 1.0)),
                                    top_k=max(0, int(sampling.get("top_k", 0) or 0)),
                                    top_p=float(sampling.get("top_p", 1.0)))
            max_tokens = int(sampling.get("max_tokens", 16))
        except (TypeError, ValueError) as e:
            raise BadRequest(f"bad sampling_params: {e}") from None
        if max_tokens < 1:
            raise BadRequest(f"max_tokens must be >= 1, got {max_tokens}")
        seed = sampling.get("seed")
        return GenerationRequest(
            rid=rid, token_ids=list(token_ids), max_tokens=max_tokens, params=params,
            seed=secrets.randbits(63) if seed is None else int(seed), emit=emit,
            ignore_eos=bool(sampling.get("ignore_eos", False)),
            stop_token_ids=frozenset(int(t) for t in sampling.get("stop_token_ids") or ()),
            remote_prefill=remote_prefill, remote_decode=remote_decode, consumers=consumers, lease_key=lease_key)

    async def _run(self, rid: str, token_ids: list[int], sampling: dict, kv: dict | None,
                   lease_key: str | None = None) -> AsyncIterator[tuple]:
        """The request's events: ``("tokens", ids)``..., then ``("finish", reason, kv_params,
        cached_tokens)``. Raises GenerationFailed on an engine-side failure; leaving early
        cancels the request."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        req = self._request(rid, token_ids, sampling, kv, lambda e: loop.call_soon_threadsafe(events.put_nowait, e),
                            lease_key)
        self.scheduler.submit(req)
        finished = False
        try:
            while True:
                event = await events.get()
                if event[0] == "error":
                    finished = True
                    raise GenerationFailed(event[1], event[2])
                if event[0] == "finish":
                    finished = True
                    yield event
                    return
                yield event
        finally:
            if not finished:
                self.scheduler.cancel(rid)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            token_ids = body.get("token_ids")
            if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
                raise BadRequest("'token_ids' must be a list of integers")
            sampling = body.get("sampling_params") or {}
            if not isinstance(sampling, dict):
                raise BadRequest("'sampling_params' must be an object")
            rid = str(body.get("request_id") or uuid.uuid4().hex)
            events = self._run(rid, token_ids, sampling, body.get("kv_transfer_params"))
            first = await anext(events)
        except (BadRequest, ValueError) as e:
            return _error(400, str(e))
        except GenerationFailed as e:
            return _error(e.status, str(e))
        if not body.get("stream"):
            out, tail = [], first
            async for event in _prepend(first, events):
                if event[0] == "tokens":
                    out += event[1]
                tail = event
            _, reason, kv, cached = tail
            return web.json_response({"request_id": rid, "output_mode": "tokens", "model": self.model_name,
                                      "choices": [{"index": 0, "finish_reason": reason, "token_ids": out}],
                                      "usage": usage(len(token_ids), len(out), cached),
                                      "kv_transfer_params": kv})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            async for event in _prepend(first, events):
                if event[0] == "tokens":
                    choice = {"index": 0, "finish_reason": None, "token_ids": event[1]}
                else:
                    choice = {"index": 0, "finish_reason": event[1], "token_ids": []}
                await response.write(sse({"request_id": rid, "output_mode": "tokens", "choices": [choice]}))
        except GenerationFailed as e:
            await response.write(sse(error_body(e.status, str(e))))
        await response.write(sse("[DONE]"))
        return response

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def _openai(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            req = parse_completion(await request.json(), chat=chat)
            prompt = self._prompt_ids(req)
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            events = self._run(rid, prompt, req.sampling(), req.kv_transfer_params)
            first = await anext(events)
        except (BadRequest, ValueError) as e:
            return _error(400, str(e))
        except GenerationFailed as e:
            return _error(e.status, str(e))
        if not req.stream:
            out, tail = [], first
            async for event in _prepend(first, events):
                if event[0] == "tokens":
                    out += event[1]
                tail = event
            return web.json_response(completion_body(
                rid, self.model_name, req, text=self.tokenizer.decode(out), token_ids=out, finish_reason=tail[1],
                prompt_ids=prompt, cached_tokens=tail[3], kv_transfer_params=tail[2]))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        out: list[int] = []
        sent = ""
        try:
            async for event in _prepend(first, events):
                new = event[1] if event[0] == "tokens" else []
                out += new
                text = self.tokenizer.decode(out)
                delta, sent = text[len(sent):], text
                await response.write(sse(chunk_body(
                    rid, self.model_name, req, text=delta, token_ids=new,
                    finish_reason=event[1] if event[0] == "finish" else None,
                    prompt_ids=prompt if len(out) == len(new) and event[0] == "tokens" else None)))
            if req.include_usage:
                await response.write(sse({"id": rid, "object": "text_completion", "created": req.created,
                                          "model": self.model_name, "choices": [],
                                          "usage": usage(len(prompt), len(out))}))
        except GenerationFailed as e:
            await response.write(sse(error_body(e.status, str(e))))
        await response.write(sse("[DONE]"))
        return response

    def _prompt_ids(self, req: CompletionRequest) -> list[int]:
        if req.messages is not None:
            return self.tokenizer.apply_chat_template(req.messages)
        return self.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)

    # ---- small endpoints ----------------------------------------------------------------
    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            if isinstance(body.get("messages"), list):
                tokens = self.tokenizer.apply_chat_template(body["messages"],
                                                            bool(body.get("add_generation_prompt", True)))
            elif isinstance(body.get("prompt"), str):
                tokens = self.tokenizer.encode(body["prompt"])
            else:
                raise BadRequest("give 'prompt' (a string) or 'messages'")
        except (BadRequest, ValueError, AttributeError) as e:
            return _error(400, str(e))
        return web.json_response({"tokens": tokens, "count": len(tokens),
                                  "max_model_len": self.model.config.max_position_embeddings})

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise BadRequest("'tokens' must be a list of integers")
        except (BadRequest, ValueError, AttributeError) as e:
            return _error(400, str(e))
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    async def abort(self, request: web.Request) -> web.Response:
        try:
            ids = (await request.json()).get("request_ids")
            if not isinstance(ids, list):
                raise BadRequest("'request_ids' must be a list")
        except (BadRequest, ValueError, AttributeError) as e:
            return _error(400, str(e))
        for rid in ids:
            self.scheduler.cancel(str(rid))
        return web.Response()

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                              "owned_by": "pddcore"}]})

    async def health(self, _: web.Request) -> web.Response:
        return web.Response()

    async def state(self, _: web.Request) -> web.Response:
        return web.json_response({"role": self.role, **self.scheduler.state(),
                                  "transfer_peers": self.scheduler.transfer.stats()["peers"]})

    async def timings(self, _: web.Request) -> web.Response:
        return web.json_response(self.scheduler.timings())

    async def info(self, _: web.Request) -> web.Response:
        layout = self.scheduler.pool.layout()
        return web.json_response({"role": self.role, "page_size": self.scheduler.pool.page_size,
                                  "kv_bytes_per_token": layout.bytes_per_token(),
                                  "transfer_address": self.scheduler.consumer.advertise})


async def _prepend(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item


def _error(status: int, message: str) -> web.Response:
    return web.json_response(error_body(status, message), status=status)
