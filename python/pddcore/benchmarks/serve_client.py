"""The trace player of the ``serve`` bench case: ``python -m pddcore.benchmarks.serve_client
CONFIG`` plays a :class:`pddcore.deploy.Scenario` against a gateway's ``/v1/completions``
(streamed, token prompts, greedy), closed-loop per session like the demo's client: a turn is
sent ``think_s`` after the previous answer ended, its context being the previous context
plus that answer plus the next user tokens. It records when every token arrived and each
request's gateway trace, and writes them to ``CONFIG["results"]`` (JSON).

It runs where the gateway is reachable (inside the emulated WAN's namespace ``a``), hence
a process of its own."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp

from ..deploy.trace import Session


async def _turn(http: aiohttp.ClientSession, url: str, context: list[int], max_tokens: int, t0: float) -> dict:
    record = {"context_len": len(context), "max_new_tokens": max_tokens, "submitted": time.monotonic() - t0,
              "times": [], "tokens": []}
    body = {"prompt": context, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    async with http.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
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
        if k + 1 < len(s.outputs):
            context = context + record["tokens"] + list(s.followups[k])
            await asyncio.sleep(think_s)


async def play(config: dict) -> dict:
    sessions = [Session(s["sid"], s["start_s"], tuple(s["first_context"]), tuple(map(tuple, s["followups"])),
                        tuple(s["outputs"])) for s in config["scenario"]["sessions"]]
    records: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        t0 = time.monotonic()
        await asyncio.gather(*(_session(http, config["url"], s, config["scenario"]["think_s"], t0, records)
                               for s in sessions))
        wall_s = time.monotonic() - t0
        async with http.get(config["url"] + "/metrics") as resp:
            metrics = await resp.text()
    return {"requests": sorted(records, key=lambda r: r["rid"]), "wall_s": wall_s, "metrics": metrics}


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        config = json.load(f)
    results = asyncio.run(play(config))
    with open(config["results"], "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
