"""The trace player: ``python -m pddcore.deploy.client CONFIG`` plays a
:class:`~.trace.Scenario` against a gateway's ``/v1/completions`` (streamed, token prompts,
greedy), closed-loop per session: a turn is sent ``think_s`` after the previous answer
ended, its context being the previous context plus that answer plus the next user tokens.

It records when every token arrived and each request's gateway trace
(``/pdd/requests/{id}``), and at the end the gateway's ``/metrics`` and WAN estimates
(``/pdd/links``) and the engines' ``/pdd/timings`` (only the model passes the trace caused). Everything goes to
``CONFIG["results"]`` (JSON). On stdout it reports progress, one JSON line each: ``{"done":
n}`` per finished request and ``{"md_tokens": n}`` as MD's delivered tokens grow (the
supervisor's fault injection waits for those).

It runs where the gateway is reachable (inside the emulated WAN's cluster A), hence a
process of its own.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .trace import Session

__all__ = ["play"]


def _say(**line: int) -> None:
    print(json.dumps(line), flush=True)


async def _turn(http: aiohttp.ClientSession, url: str, context: list[int], max_tokens: int, t0: float) -> dict:
    record = {"context": context, "max_new_tokens": max_tokens, "submitted": time.monotonic() - t0,
              "times": [], "tokens": []}
    body = {"prompt": context, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    async with http.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"the gateway answered HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"the gateway failed a request: {event['error']}")
            record["id"] = event["id"]
            ids = event["choices"][0].get("token_ids") or []
            record["tokens"] += ids
            record["times"] += [time.monotonic() - t0] * len(ids)
    async with http.get(f"{url}/pdd/requests/{record['id']}") as resp:
        record["trace"] = await resp.json()
    return record


async def _session(http, url: str, s: Session, think_s: float, t0: float, out: list) -> None:
    await asyncio.sleep(max(0.0, s.start_s - (time.monotonic() - t0)))
    context = list(s.first_context)
    for k, max_tokens in enumerate(s.outputs):
        record = await _turn(http, url, context, max_tokens, t0)
        record.update(rid=f"s{s.sid}t{k}", session=s.sid, turn=k)
        out.append(record)
        _say(done=len(out))
        if k + 1 < len(s.outputs):
            context = context + record["tokens"] + list(s.followups[k])
            await asyncio.sleep(think_s)


def md_tokens(metrics_text: str) -> int:
    """Tokens the gateway delivered from MD, read from its Prometheus text."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "pddcore_tokens":
            return int(sum(s.value for s in family.samples
                           if s.name == "pddcore_tokens_total" and s.labels.get("source") == "MD"))
    return 0


async def _watch_md_tokens(http, url: str) -> None:
    said = 0
    while True:
        async with http.get(url + "/metrics") as resp:
            count = md_tokens(await resp.text())
        if count > said:
            said = count
            _say(md_tokens=count)
        await asyncio.sleep(0.05)


async def _timings(http, engines: dict[str, str]) -> dict:
    """Each reachable engine's ``/pdd/timings`` (an engine that is gone gets None)."""
    out = {}
    for role, url in engines.items():
        try:
            async with http.get(url + "/pdd/timings", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                out[role] = await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            out[role] = None
    return out


def _since(before: dict | None, after: dict | None) -> dict | None:
    """The samples ``after`` holds beyond those ``before`` held (the engines keep the latest ones)."""
    if before is None or after is None:
        return None
    return {kind: samples[len(before[kind]):] for kind, samples in after.items()}


async def play(config: dict) -> dict:
    sessions = [Session(s["sid"], s["start_s"], tuple(s["first_context"]), tuple(map(tuple, s["followups"])),
                        tuple(s["outputs"])) for s in config["scenario"]["sessions"]]
    url, engines = config["url"], config["engines"]
    records: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        before = await _timings(http, engines)
        watch = asyncio.ensure_future(_watch_md_tokens(http, url))
        t0 = time.monotonic()
        try:
            await asyncio.gather(*(_session(http, url, s, config["scenario"]["think_s"], t0, records)
                                   for s in sessions))
        finally:
            watch.cancel()
        wall_s = time.monotonic() - t0
        async with http.get(url + "/metrics") as resp:
            metrics = await resp.text()
        async with http.get(url + "/pdd/links") as resp:
            links = await resp.json()
        after = await _timings(http, engines)
    return {"requests": sorted(records, key=lambda r: r["rid"]), "wall_s": wall_s, "metrics": metrics,
            "links": links, "timings": {role: _since(before[role], after[role]) for role in engines}}


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        config = json.load(f)
    results = asyncio.run(play(config))
    with open(config["results"], "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
