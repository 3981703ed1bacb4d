"""One engine server the gateway calls, in SGLang's HTTP dialect (``sglang.launch_server``,
and ``pddcore engine --dialect sglang``): ``/generate`` with ``input_ids`` and the bootstrap
fields of PD mode, ``/abort_request``, ``/tokenize``, ``/detokenize``, ``/server_info``.

The calls keep :class:`.upstream.Upstream`'s signatures, so the gateway drives both dialects
alike: ``sampling`` comes in vLLM's keys and is renamed here (``max_tokens`` ->
``max_new_tokens``, ``seed`` -> ``sampling_seed``, ``top_k`` 0 -> -1), and ``kv`` holds the
bootstrap fields (``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``) that pair the
request with its prefill. A streamed event carries all the output so far by default and only
the new tokens with SGLang's ``--incremental-streaming-output``; ``meta_info``'s
``completion_tokens`` tells the two apart, so both work. Leaving a stream early closes its
connection and also posts ``/abort_request`` with the request's ``rid``: SGLang notices a
closed stream only at its next check of the connection.

Example::

    async with aiohttp.ClientSession() as http:
        md = SGLangUpstream("http://10.1.0.7:30000", "main", http)
        room = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 42}
        async for ids, finish in md.stream("r1", [1, 2, 3], {"max_tokens": 4}, room):
            ...
"""

from __future__ import annotations

import asyncio
from typing import Callable

from .upstream import Generated, Upstream, UpstreamError

__all__ = ["SGLangUpstream", "sglang_sampling", "new_output_ids"]


def sglang_sampling(sampling: dict) -> dict:
    """vLLM-keyed ``sampling`` as SGLang's ``sampling_params``."""
    out = {"max_new_tokens": int(sampling["max_tokens"]), "temperature": sampling.get("temperature", 1.0),
           "top_p": sampling.get("top_p", 1.0), "top_k": sampling.get("top_k") or -1,
           "ignore_eos": bool(sampling.get("ignore_eos", False)),
           "stop_token_ids": list(sampling.get("stop_token_ids") or ())}
    if sampling.get("seed") is not None:
        out["sampling_seed"] = int(sampling["seed"])
    return out


def new_output_ids(event: dict, seen: int) -> list[int]:
    """The tokens of a streamed ``/generate`` event past the ``seen`` ones already read:
    the tail of all the output so far (SGLang's default), or the event's own tokens
    (``--incremental-streaming-output``), which add up to fewer than ``completion_tokens``
    once a chunk was read before."""
    ids = list(event.get("output_ids") or ())
    total = (event.get("meta_info") or {}).get("completion_tokens")
    cumulative = total is None or len(ids) == total
    return ids[seen:] if cumulative and len(ids) >= seen else ids


def _finish(meta: dict) -> str | None:
    reason = meta.get("finish_reason")
    return reason.get("type") if isinstance(reason, dict) else reason


class SGLangUpstream(Upstream):
    """An SGLang server at ``url`` with a ``role`` (``prefill``, ``relay`` or ``main``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._aborts: set[asyncio.Task] = set()

    async def tokenize(self, *, prompt: str | None = None, messages: list | None = None) -> list[int]:
        body = {"prompt": prompt} if messages is None else {"messages": messages}
        return list((await self.post_json("/tokenize", body))["tokens"])

    async def detokenize(self, token_ids: list[int]) -> str:
        return (await self.post_json("/detokenize", {"tokens": list(token_ids)}))["text"]

    async def generate(self, rid: str, token_ids: list[int], sampling: dict, kv: dict | None = None) -> Generated:
        body = await self.post_json(self.generate_path, self._generate_body(rid, token_ids, sampling, kv, False))
        meta = body.get("meta_info")
        if not isinstance(meta, dict) or not isinstance(body.get("output_ids"), list):
            raise UpstreamError(self, f"malformed generate answer (keys {sorted(body)})")
        self._refused(meta)
        return Generated(list(body["output_ids"]), _finish(meta) or "stop", None, meta.get("cached_tokens"))

    generate_path = "/generate"

    def _generate_body(self, rid: str, token_ids: list[int], sampling: dict, kv: dict | None, stream: bool) -> dict:
        return generate_body(rid, token_ids, sampling, kv, stream)

    def _event_reader(self) -> Callable[[dict], tuple[list[int], str | None]]:
        seen = 0

        def read(event: dict) -> tuple[list[int], str | None]:
            nonlocal seen
            meta = event.get("meta_info") or {}
            self._refused(meta)
            ids = new_output_ids(event, seen)
            seen += len(ids)
            return ids, _finish(meta)
        return read

    def _refused(self, meta: dict) -> None:
        """SGLang ends a request it refused or aborted with finish reason ``abort``."""
        reason = meta.get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            raise UpstreamError(self, f"aborted: {reason.get('message')}", status=reason.get("status_code"))

    def _abandoned(self, rid: str) -> None:
        """Tells the engine to drop ``rid`` now (the closed stream tells it later)."""
        task = asyncio.ensure_future(self.post_json("/abort_request", {"rid": rid}))
        self._aborts.add(task)
        task.add_done_callback(lambda t: (self._aborts.discard(t), t.cancelled() or t.exception()))


def generate_body(rid: str, token_ids: list[int], sampling: dict, kv: dict | None, stream: bool) -> dict:
    return {"rid": rid, "input_ids": list(token_ids), "sampling_params": sglang_sampling(sampling),
            "stream": stream, **(kv or {})}

