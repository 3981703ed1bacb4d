"""One engine server the gateway calls, in vLLM's HTTP dialect (which the reference engine
of :mod:`pddcore.engine` speaks too): ``/inference/v1/generate`` (tokens in, tokens out,
``kv_transfer_params``, SSE streaming), ``/tokenize``, ``/detokenize``.

Every call has a connect timeout and a read timeout (no byte for that long fails the
call); a failure raises :class:`UpstreamError` and, when the engine could not be reached
at all, marks it down for ``down_s`` so that routing avoids it meanwhile. Leaving a
stream early closes its connection, which is how vLLM and the reference engine learn
that a request was abandoned.

Another engine's dialect is a subclass that overrides the hooks under "the dialect" (the
generate path and body, how a stream's events read, what leaving a stream early does) and
the calls whose answers differ (:mod:`.sglang_upstream`).

Example::

    async with aiohttp.ClientSession() as http:
        md = Upstream("http://10.1.0.7:8000", "main", http)
        out = await md.generate("r1", [1, 2, 3], {"max_tokens": 4, "temperature": 0})
        async for ids, finish in md.stream("r2", [1, 2, 3], {"max_tokens": 4}):
            ...
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import aiohttp

__all__ = ["Upstream", "UpstreamError", "Generated"]


class UpstreamError(RuntimeError):
    """An engine call failed. ``unreachable``: no answer at all (connection refused or
    reset, timeout), as opposed to an answer that reports an error (``status``)."""

    def __init__(self, upstream: "Upstream", message: str, *, status: int | None = None, unreachable: bool = False):
        super().__init__(f"{upstream.role} engine {upstream.url}: {message}")
        self.upstream, self.status, self.unreachable = upstream, status, unreachable


@dataclass
class Generated:
    token_ids: list[int]
    finish_reason: str
    kv_transfer_params: dict | None
    cached_tokens: int | None


class Upstream:
    """An engine at ``url`` with a ``role`` (``prefill``, ``relay`` or ``main``)."""

    def __init__(self, url: str, role: str, http: aiohttp.ClientSession, *, connect_timeout_s: float = 5.0,
                 read_timeout_s: float = 60.0, down_s: float = 5.0, api_key: str | None = None):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"an engine URL starts with http:// or https://, got {url!r}")
        self.url, self.role, self.http = url.rstrip("/"), role, http
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        self.down_s = down_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.inflight = 0
        self.picks = 0  # times routing chose this engine
        self.down_until = 0.0

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self.down_until

    def __repr__(self) -> str:
        return f"Upstream({self.role}, {self.url}, inflight={self.inflight})"

    # ---- calls ------------------------------------------------------------------------------
    async def get_json(self, path: str) -> dict:
        async with self._call():
            async with self.http.get(self.url + path, timeout=self.timeout, headers=self.headers) as resp:
                return await self._json(resp)

    async def post_json(self, path: str, body: dict) -> dict:
        async with self._call():
            async with self.http.post(self.url + path, json=body, timeout=self.timeout, headers=self.headers) as resp:
                return await self._json(resp)

    async def tokenize(self, *, prompt: str | None = None, messages: list | None = None) -> list[int]:
        body = {"prompt": prompt} if messages is None else {"messages": messages, "add_generation_prompt": True}
        return list((await self.post_json("/tokenize", body))["tokens"])

    async def detokenize(self, token_ids: list[int]) -> str:
        return (await self.post_json("/detokenize", {"tokens": list(token_ids)}))["prompt"]

    async def generate(self, rid: str, token_ids: list[int], sampling: dict, kv: dict | None = None) -> Generated:
        """The whole answer of one non-streamed generation."""
        body = await self.post_json(self.generate_path, self._generate_body(rid, token_ids, sampling, kv, False))
        try:
            choice = body["choices"][0]
            cached = (body.get("usage") or {}).get("prompt_tokens_details") or {}
            return Generated(list(choice["token_ids"]), choice.get("finish_reason") or "stop",
                             body.get("kv_transfer_params"), cached.get("cached_tokens"))
        except (KeyError, IndexError, TypeError) as e:
            raise UpstreamError(self, f"malformed generate answer ({e!r})") from None

    async def stream(self, rid: str, token_ids: list[int], sampling: dict,
                     kv: dict | None = None) -> AsyncIterator[tuple[list[int], str | None]]:
        """``(new token ids, finish_reason or None)`` as the engine streams them; the last
        item has a finish reason. Raises UpstreamError when the stream fails or ends early."""
        body = self._generate_body(rid, token_ids, sampling, kv, True)
        read = self._event_reader()
        finished = False
        try:
            async with self._call():
                try:
                    async with self.http.post(self.url + self.generate_path, json=body, timeout=self.timeout,
                                              headers=self.headers) as resp:
                        if resp.status != 200:
                            await self._json(resp)
                        async for data in _sse_events(resp):
                            if data == "[DONE]":
                                break
                            event = json.loads(data)
                            if "error" in event:
                                error = event["error"]
                                finished = True  # the engine ended the request itself
                                raise UpstreamError(self, f"stream failed: {_message(error)}",
                                                    status=error.get("code") if isinstance(error, dict) else None)
                            ids, finish = read(event)
                            finished = finish is not None
                            if ids or finish:
                                yield ids, finish
                            if finish:
                                return
                except (aiohttp.ClientPayloadError, json.JSONDecodeError) as e:
                    raise UpstreamError(self, f"broken stream ({e!r})", unreachable=True) from None
            raise UpstreamError(self, "the stream ended before the generation finished", unreachable=True)
        finally:
            if not finished:
                self._abandoned(rid)

    # ---- the dialect: what differs between engines' generate APIs ----------------------------
    generate_path = "/inference/v1/generate"

    def _generate_body(self, rid: str, token_ids: list[int], sampling: dict, kv: dict | None, stream: bool) -> dict:
        body = {"request_id": rid, "token_ids": list(token_ids), "sampling_params": dict(sampling), "stream": stream}
        if kv is not None:
            body["kv_transfer_params"] = kv
        return body

    def _event_reader(self) -> Callable[[dict], tuple[list[int], str | None]]:
        """Reads one stream's events, in order: each to (its new token ids, finish reason or None)."""
        def read(event: dict) -> tuple[list[int], str | None]:
            choice = (event.get("choices") or [{}])[0]
            return list(choice.get("token_ids") or ()), choice.get("finish_reason")
        return read

    def _abandoned(self, rid: str) -> None:
        """A stream was left before the engine ended it: closing its connection, which the
        caller's exit already does, is how vLLM learns it."""

    # ---- plumbing ---------------------------------------------------------------------------
    def _call(self) -> "_Call":
        return _Call(self)

    async def _json(self, resp: aiohttp.ClientResponse) -> dict:
        try:
            body = await resp.json(content_type=None)
        except (json.JSONDecodeError, aiohttp.ContentTypeError):
            body = None
        if resp.status != 200:
            message = _message(body["error"]) if isinstance(body, dict) and "error" in body else (body or resp.reason)
            raise UpstreamError(self, f"HTTP {resp.status}: {message}", status=resp.status)
        if not isinstance(body, dict):
            raise UpstreamError(self, "the answer is not a JSON object", status=resp.status)
        return body


class _Call:
    """Counts a call in flight and turns transport failures into UpstreamError (marking the
    engine down when it could not be reached)."""

    def __init__(self, upstream: Upstream):
        self.upstream = upstream

    async def __aenter__(self) -> None:
        self.upstream.inflight += 1

    async def __aexit__(self, kind, error, tb) -> bool:
        self.upstream.inflight -= 1
        if isinstance(error, UpstreamError):
            if error.unreachable:
                self.upstream.down_until = time.monotonic() + self.upstream.down_s
            return False
        if isinstance(error, (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)):
            self.upstream.down_until = time.monotonic() + self.upstream.down_s
            raise UpstreamError(self.upstream, f"unreachable ({type(error).__name__}: {error})",
                                unreachable=True) from None
        return False


def _message(error) -> str:
    """An engine's error: ``{"message": ...}``, or a bare value (SGLang's schema check answers a string)."""
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


async def _sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent event stream."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data:"):
            yield line[5:].strip()
