"""The reference engine in SGLang's HTTP dialect (``pddcore engine --dialect sglang``), as a
stock ``sglang.launch_server --disaggregation-mode prefill|decode`` serves it, so a gateway's
SGLang path (:mod:`pddcore.serve.pipelines`) runs end to end on the CPU.

* ``POST /generate`` — ``input_ids``, ``sampling_params`` (SGLang's keys: ``max_new_tokens``,
  ``temperature``, ``top_p``, ``top_k``, ``ignore_eos``, ``stop_token_ids``,
  ``sampling_seed``), ``stream``, ``rid`` and the bootstrap fields of PD mode. The answer is
  ``{"text", "output_ids", "meta_info"}``; streamed, every ``data:`` event carries all the
  output so far (SGLang's default, without ``--incremental-streaming-output``), then
  ``data: [DONE]``.
* ``POST /abort_request`` (``{"rid"}``), ``/tokenize``, ``/detokenize`` (``{"text"}``);
  ``GET /health``, ``/health_generate``, ``/server_info`` (``disaggregation_mode``,
  ``disaggregation_bootstrap_port``, ``page_size``), ``/v1/models`` and the ``/pdd/*`` views.

As in SGLang's PD mode, every generation names a ``bootstrap_room`` (400 without one) and a
decode engine cannot prefill: a gateway sends the same request to a prefill engine and a
decode engine at once, with one room. The prefill engine computes the prompt (its prefix
cache first) and keeps its KV under the room; the decode engine pulls, from the transfer
engine at ``bootstrap_host:bootstrap_port`` (the prefill engine's ``/server_info`` names that
port), only the pages its own prefix cache lacks, waiting for them if it asked first
(:mod:`.kv_link`), then decodes. The prefill engine answers with its one token.
"""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from ..serve.openai_api import BadRequest, sse
from .server import EngineServer, GenerationFailed, _prepend

__all__ = ["SGLangEngineServer"]

# SGLang's sampling_params keys this engine serves, and the reference engine's name for each.
_SAMPLING = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
             "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids", "sampling_seed": "seed"}
_ALL_TOKENS = 1 << 30  # SGLang's top_k for "no top-k" (as is -1)


class SGLangEngineServer(EngineServer):
    """Routes for one engine in SGLang's dialect; :meth:`app` builds the application."""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.add_routes([
            web.post("/generate", self.sglang_generate),
            web.post("/abort_request", self.abort_request),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.sglang_detokenize),
            web.get("/health", self.health),
            web.get("/health_generate", self.health),
            web.get("/server_info", self.server_info),
            web.get("/v1/models", self.models),
            web.get("/pdd/state", self.state),
            web.get("/pdd/info", self.info),
            web.get("/pdd/timings", self.timings),
        ])
        return app

    # ---- generation ------------------------------------------------------------------------
    def _parse(self, body) -> tuple[str, list[int], dict, dict, str | None]:
        """(rid, input ids, sampling in the reference engine's keys, kv params, lease key)."""
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        input_ids = body.get("input_ids")
        if not isinstance(input_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                      for t in input_ids):
            raise BadRequest("'input_ids' must be a list of integers (this engine has no text input)")
        given = body.get("sampling_params") or {}
        if not isinstance(given, dict):
            raise BadRequest("'sampling_params' must be an object")
        unknown = sorted(set(given) - set(_SAMPLING))
        if unknown:
            raise BadRequest(f"unsupported sampling_params: {', '.join(unknown)}")
        sampling = {_SAMPLING[k]: v for k, v in given.items() if v is not None}
        sampling.setdefault("max_tokens", 128)  # SGLang's default max_new_tokens
        top_k = sampling.get("top_k", -1)
        sampling["top_k"] = 0 if top_k in (-1, _ALL_TOKENS) else top_k
        room = body.get("bootstrap_room")
        if isinstance(room, bool) or not isinstance(room, int) or room < 0:
            raise BadRequest("Invalid request: Disaggregated request received without bootstrap room id "
                             "(bootstrap_room must be a non-negative integer)")
        key = f"sglang-room-{room}"
        if self.role == "prefill":
            sampling["max_tokens"] = 1  # a prefill engine computes the first token only
            return self._rid(body), input_ids, sampling, {"do_remote_decode": True}, key
        host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
        if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int):
            raise BadRequest("a decode engine needs 'bootstrap_host' and 'bootstrap_port' of the prefill engine")
        kv = {"do_remote_prefill": True, "remote_host": host, "remote_port": port, "remote_request_id": key,
              "wait": True}
        return self._rid(body), input_ids, sampling, kv, None

    @staticmethod
    def _rid(body: dict) -> str:
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise BadRequest("'rid' must be a string")
        return rid or uuid.uuid4().hex

    def _reply(self, rid: str, prompt: list[int], out: list[int], cached: int, finish: tuple | None,
               started: float) -> dict:
        """One answer or stream event in SGLang's shape, with all the output so far."""
        reason = None
        if finish is not None:
            reason = ({"type": "stop", "matched": out[-1]} if finish[1] == "stop"
                      else {"type": "length", "length": len(out)})
        return {"text": self.tokenizer.decode(out), "output_ids": list(out),
                "meta_info": {"id": rid, "finish_reason": reason, "prompt_tokens": len(prompt),
                              "completion_tokens": len(out), "cached_tokens": cached,
                              "e2e_latency": time.monotonic() - started}}

    async def sglang_generate(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        try:
            body = await request.json()
            rid, prompt, sampling, kv, key = self._parse(body)
            events = self._run(rid, prompt, sampling, kv, key)
            first = await anext(events)
        except (BadRequest, ValueError) as e:
            return _error(400, str(e))
        except GenerationFailed as e:
            return _error(e.status, str(e))
        out: list[int] = []
        if not body.get("stream"):
            try:
                async for event in _prepend(first, events):
                    if event[0] == "tokens":
                        out += event[1]
                    else:
                        return web.json_response(self._reply(rid, prompt, out, event[3] or 0, event, started))
            except GenerationFailed as e:
                return _error(e.status, str(e))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        cached = 0
        try:
            async for event in _prepend(first, events):
                if event[0] == "tokens":
                    out += event[1]
                    await response.write(sse(self._reply(rid, prompt, out, cached, None, started)))
                else:
                    await response.write(sse(self._reply(rid, prompt, out, event[3] or 0, event, started)))
        except GenerationFailed as e:
            await response.write(sse({"error": {"message": str(e), "type": "invalid_request_error",
                                                 "code": e.status, "retryable": False}}))
        await response.write(sse("[DONE]"))
        return response

    # ---- small endpoints ----------------------------------------------------------------
    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            rid = (await request.json()).get("rid")
            if not isinstance(rid, str) or not rid:
                raise BadRequest("'rid' must be a non-empty string")
        except (BadRequest, ValueError, AttributeError) as e:
            return _error(400, str(e))
        self.scheduler.cancel(rid)
        return web.Response()

    async def sglang_detokenize(self, request: web.Request) -> web.Response:
        try:
            tokens = (await request.json()).get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise BadRequest("'tokens' must be a list of integers")
        except (BadRequest, ValueError, AttributeError) as e:
            return _error(400, str(e))
        return web.json_response({"text": self.tokenizer.decode(tokens)})

    async def server_info(self, _: web.Request) -> web.Response:
        """The few fields of SGLang's ``/server_info`` that a gateway reads. The bootstrap port
        is the transfer engine's: decode engines pull from it."""
        port = int(self.scheduler.producer.advertise.rpartition(":")[2])
        return web.json_response({"disaggregation_mode": self.role, "disaggregation_bootstrap_port": port,
                                  "page_size": self.scheduler.pool.page_size,
                                  "served_model_name": self.model_name})


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)
