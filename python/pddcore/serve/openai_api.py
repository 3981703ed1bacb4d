"""The OpenAI completions dialect both HTTP faces of pddcore speak (the gateway of
:mod:`pddcore.serve` and the reference engine of :mod:`pddcore.engine`): request parsing
with clear 400s, and response / stream-chunk bodies, with vLLM's extensions
(``return_token_ids``, ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``kv_transfer_params``).

A completion is produced as token ids; :class:`TextStream` turns the growing list of ids
into text deltas with any ``decode(ids) -> str`` (the engine's tokenizer, or an engine's
``/detokenize``), holding back an incomplete UTF-8 character until its last byte arrives.

Example::

    req = parse_completion({"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}, chat=False)
    body = completion_body("cmpl-1", "m", req, text="hi", token_ids=[5, 6], finish_reason="length",
                           prompt_ids=[1, 2, 3])
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

__all__ = ["BadRequest", "CompletionRequest", "parse_completion", "completion_body", "chunk_body", "usage",
           "error_body", "TextStream", "sse"]


class BadRequest(ValueError):
    """The client's request is malformed or asks for something unsupported (HTTP 400)."""


@dataclass
class CompletionRequest:
    """One completion or chat completion, normalized. Exactly one of ``prompt`` (text or
    token ids) and ``messages`` is set."""

    chat: bool
    model: str | None
    prompt: str | list[int] | None
    messages: list[dict] | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    ignore_eos: bool
    stop_token_ids: list[int]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    user: str | None
    kv_transfer_params: dict | None
    created: int = field(default_factory=lambda: int(time.time()))

    def sampling(self) -> dict:
        """The request's sampling in vLLM's ``sampling_params`` keys."""
        out = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
               "top_k": self.top_k, "ignore_eos": self.ignore_eos, "stop_token_ids": list(self.stop_token_ids)}
        if self.seed is not None:
            out["seed"] = self.seed
        return out


_UNSUPPORTED = {"stop": "stop strings (use stop_token_ids)", "logprobs": "logprobs", "echo": "echo",
                "best_of": "best_of", "suffix": "suffix", "logit_bias": "logit_bias", "tools": "tools",
                "top_logprobs": "top_logprobs", "response_format": "response_format"}


def _number(body: dict, key: str, default: float, lo: float, hi: float, *, integer: bool = False) -> Any:
    value = body.get(key, default)
    if value is None:
        value = default
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not lo <= value <= hi:
        what = "an integer" if integer else "a number"
        raise BadRequest(f"'{key}' must be {what} in [{lo}, {hi}], got {value!r}")
    return value


def _token_ids(value: Any, key: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                              for t in value):
        raise BadRequest(f"'{key}' must be a list of non-negative integer token ids")
    return value


def parse_completion(body: Any, *, chat: bool) -> CompletionRequest:
    """Validates an OpenAI ``/v1/completions`` (``chat=False``) or ``/v1/chat/completions``
    body. Raises :class:`BadRequest` naming the first problem."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for key, what in _UNSUPPORTED.items():
        if body.get(key) not in (None, False, [], ""):
            raise BadRequest(f"'{key}' is not supported here: {what}")
    if body.get("n", 1) not in (1, None):
        raise BadRequest("only n=1 is supported")
    prompt = messages = None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise BadRequest("'messages' must be a non-empty list of {role, content} objects with string content")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list):
            prompt = _token_ids(prompt, "prompt")
        elif not isinstance(prompt, str):
            raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)")
        if not prompt:
            raise BadRequest("'prompt' is empty")
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("'stream_options' must be an object")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"'seed' must be an integer, got {seed!r}")
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise BadRequest("'kv_transfer_params' must be an object")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("'user' must be a string")
    return CompletionRequest(
        chat=chat, model=body.get("model"), prompt=prompt, messages=messages,
        max_tokens=_number(body, max_key, 16, 1, 1 << 20, integer=True),
        temperature=float(_number(body, "temperature", 1.0, 0.0, 100.0)),
        top_p=float(_number(body, "top_p", 1.0, 1e-9, 1.0)),
        top_k=max(0, _number(body, "top_k", 0, -1, 1 << 30, integer=True)),
        seed=seed, ignore_eos=bool(body.get("ignore_eos", False)),
        stop_token_ids=_token_ids(body.get("stop_token_ids") or [], "stop_token_ids"),
        stream=bool(body.get("stream", False)), include_usage=bool(stream_options.get("include_usage", False)),
        return_token_ids=bool(body.get("return_token_ids", False)), user=user, kv_transfer_params=kv)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def completion_body(rid: str, model: str, req: CompletionRequest, *, text: str, token_ids: Sequence[int],
                    finish_reason: str, prompt_ids: Sequence[int], cached_tokens: int | None = None,
                    kv_transfer_params: dict | None = None) -> dict:
    """The whole (non-streamed) response."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if req.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids)
        if not req.chat:
            choice["prompt_token_ids"] = list(prompt_ids)
    body = {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": req.created,
            "model": model, "choices": [choice],
            "usage": usage(len(prompt_ids), len(token_ids), cached_tokens)}
    if req.chat and req.return_token_ids:
        body["prompt_token_ids"] = list(prompt_ids)
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body


def chunk_body(rid: str, model: str, req: CompletionRequest, *, text: str, token_ids: Sequence[int],
               finish_reason: str | None, prompt_ids: Sequence[int] | None = None) -> dict:
    """One streamed chunk; ``prompt_ids`` go in the first chunk when ``return_token_ids``."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if req.chat:
        choice["delta"] = {"content": text} if prompt_ids is None else {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids)
        if prompt_ids is not None and not req.chat:
            choice["prompt_token_ids"] = list(prompt_ids)
    body = {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": req.created, "model": model, "choices": [choice]}
    if req.chat and req.return_token_ids and prompt_ids is not None:
        body["prompt_token_ids"] = list(prompt_ids)
    return body


def error_body(status: int, message: str) -> dict:
    kind = {400: "BadRequestError", 404: "NotFoundError", 499: "ClientClosedRequest"}.get(
        status, "ServiceUnavailableError" if status in (502, 503, 504) else "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def sse(body: dict | str) -> bytes:
    """One server-sent event (``data: ...``, blank line)."""
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode()


class TextStream:
    """Text deltas of a growing completion. ``decode`` maps all ids so far to text; a
    trailing U+FFFD (half a UTF-8 character) is held back until it completes or the
    completion ends. ``every_s``: decode at most this often (a decode may be a call to an
    engine); ids added meanwhile come with the next delta, and the final one has them all."""

    def __init__(self, decode: Callable[[list[int]], Awaitable[str]], every_s: float = 0.0):
        self.decode, self.every_s = decode, every_s
        self.ids: list[int] = []
        self.sent = ""
        self._decoded_at = -math.inf

    async def add(self, new_ids: Sequence[int], *, final: bool = False) -> str:
        self.ids.extend(new_ids)
        now = time.monotonic()
        if not self.ids or (not final and now - self._decoded_at < self.every_s):
            return ""
        self._decoded_at = now
        text = await self.decode(self.ids)
        if not final and text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")
        if not text.startswith(self.sent):
            return ""  # the decoder revised earlier text (rare); keep what the client has
        delta, self.sent = text[len(self.sent):], text
        return delta
