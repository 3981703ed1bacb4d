"""`pddcore engine --dialect sglang`: SGLang's PD-mode HTTP dialect, checked against the
installed SGLang's own generated JSON contract (``sglang.api.v1.api_types``, the schema both
its Python and its Rust server enforce), so that a change of SGLang's dialect breaks these
tests. Also the gateway's side of that dialect (:mod:`pddcore.serve.sglang_upstream`)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from contextlib import aclosing

import msgspec
import pytest
import requests

from pddcore.serve.openai_api import sse
from pddcore.serve.sglang_upstream import SGLangUpstream, generate_body, new_output_ids, sglang_sampling
from serve_cluster import engine

api = pytest.importorskip("sglang.api.v1.api_types", reason="SGLang's API contract (sglang 0.5.23) is not installed")


@pytest.fixture(scope="module")
def engines():
    procs = {"oracle": engine("decode"), "p": engine("prefill", "--dialect", "sglang"),
             "d": engine("decode", "--dialect", "sglang")}
    yield procs
    for proc in procs.values():
        proc.stop()


def fields(struct) -> set[str]:
    return {f.encode_name for f in msgspec.structs.fields(struct)}


def oracle(engines, prompt, max_tokens):
    r = requests.post(engines["oracle"].url + "/inference/v1/generate", timeout=120, json={
        "token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})
    return r.json()["choices"][0]["token_ids"]


def paired(engines, prompt, max_tokens, room):
    """The same request to P and the decode engine at once, as SGLang's router sends it
    (decode first, so it asks for the KV before P has it); returns (P's answer, D's events)."""
    port = engines["p"].get("/server_info")["disaggregation_bootstrap_port"]
    body = generate_body(f"r{room}", prompt, {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
                         {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}, True)
    events = []

    def decode():
        with requests.post(engines["d"].url + "/generate", json=body, stream=True, timeout=120) as r:
            events.extend(line[5:].strip().decode() for line in r.iter_lines() if line.startswith(b"data:"))

    thread = threading.Thread(target=decode)
    thread.start()
    answer = requests.post(engines["p"].url + "/generate", json={**body, "stream": False}, timeout=120)
    thread.join()
    return answer, body, events


def test_the_bodies_the_gateway_sends_pass_sglangs_contract():
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    sampling = {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 0, "ignore_eos": True,
                "stop_token_ids": [3], "seed": 11}
    body = generate_body("r1", [5, 6], sampling, {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998,
                                                  "bootstrap_room": 2 ** 63 - 1}, True)
    assert generate_contract_error(body) is None
    parsed = api.GenerateRequest.from_json_value(body)
    assert parsed.bootstrap_room == 2 ** 63 - 1 and parsed.input_ids == [5, 6] and parsed.rid == "r1"
    params = parsed.sampling_params
    assert (params.max_new_tokens, params.sampling_seed, params.top_k, params.stop_token_ids) == (7, 11, -1, [3])
    assert set(sglang_sampling(sampling)) <= fields(api.SamplingParams)  # SGLang refuses unknown sampling keys
    assert api.AbortRequest.from_json_value({"rid": "r1"}).rid == "r1"


def test_a_pair_decodes_one_engines_tokens_in_sglangs_shapes(engines):
    prompt = [random.Random(1).randrange(16, 4096) for _ in range(70)]
    answer, _, events = paired(engines, prompt, 20, room=12345)
    assert answer.status_code == 200, answer.text
    p_reply = api.GenerateResponse.from_json_value(answer.json())
    assert len(p_reply.output_ids) == 1 and isinstance(p_reply.meta_info.finish_reason, api.FinishLength)
    assert events[-1] == "[DONE]"
    seen, out = 0, []
    for data in events[:-1]:
        event = json.loads(data)
        assert set(event) <= fields(api.GenerateResponse), event.keys()
        assert set(event["meta_info"]) <= fields(api.GenerateMetaInfo), event["meta_info"].keys()
        reply = api.GenerateResponse.from_json_value(event)
        assert reply.meta_info.id == "r12345" and reply.meta_info.prompt_tokens == len(prompt)
        new = new_output_ids(event, seen)
        seen += len(new)
        out += new
    assert isinstance(reply.meta_info.finish_reason, api.FinishLength) and reply.meta_info.completion_tokens == 20
    assert out == reply.output_ids == oracle(engines, prompt, 20)
    state = engines["d"].get("/pdd/state")
    assert state["pulls_done"] >= 1 and state["bytes_received"] > 0  # its KV came from P: it cannot prefill


def test_the_small_endpoints_answer_in_sglangs_shapes(engines):
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.arg_groups.fields.disagg import Disagg
    from sglang.srt.entrypoints.openai.protocol import TokenizeResponse

    d = engines["d"].url
    tokens = requests.post(d + "/tokenize", json={"prompt": "héllo"}, timeout=30).json()
    assert set(tokens) == set(TokenizeResponse.model_fields)
    text = requests.post(d + "/detokenize", json={"tokens": tokens["tokens"]}, timeout=30).json()
    assert api.DetokenizeResponse.from_json_value(text).text == "héllo" and set(text) <= fields(api.DetokenizeResponse)
    assert requests.post(d + "/abort_request", json={"rid": "nobody"}, timeout=30).status_code == 200
    info = engines["p"].get("/server_info")
    assert info["disaggregation_mode"] == "prefill" and isinstance(info["disaggregation_bootstrap_port"], int)
    assert {"disaggregation_mode", "disaggregation_bootstrap_port"} <= {f.name for f in record_fields(Disagg)}


@pytest.mark.parametrize("body, words", [
    ({"input_ids": [20, 21], "sampling_params": {"max_new_tokens": 2}}, "without bootstrap room id"),
    ({"text": "hi", "bootstrap_room": 1}, "'input_ids'"),
    ({"input_ids": [20], "bootstrap_room": 1, "sampling_params": {"n": 2}}, "unsupported sampling_params: n"),
    ({"input_ids": [20], "bootstrap_room": 1}, "bootstrap_host"),
])
def test_requests_sglang_refuses_are_refused_with_its_error_shape(engines, body, words):
    r = requests.post(engines["d"].url + "/generate", json=body, timeout=30)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert api.ErrorBody.from_json_value(r.json()["error"]).message


def test_a_room_no_prefill_engine_fills_fails_the_decode_request_after_the_lease_time(engines):
    p = engine("prefill", "--dialect", "sglang", "--lease-s", "1")
    try:
        port = p.get("/server_info")["disaggregation_bootstrap_port"]
        r = requests.post(engines["d"].url + "/generate", timeout=60, json=generate_body(
            "lonely", [20, 21] * 20, {"max_tokens": 3}, {"bootstrap_host": "127.0.0.1", "bootstrap_port": port,
                                                         "bootstrap_room": 77}, False))
        assert r.status_code == 502 and "was not prefilled here within 1 s" in r.json()["error"]["message"], r.text
        assert p.get("/pdd/state")["leases"] == 0
    finally:
        p.stop()


def test_streamed_output_ids_are_read_whole_or_incremental():
    """SGLang streams all the output so far, or only the new tokens with
    --incremental-streaming-output; the gateway reads both as the same tokens."""
    whole = [{"output_ids": [7], "meta_info": {"completion_tokens": 1}},
             {"output_ids": [7, 8, 9], "meta_info": {"completion_tokens": 3}},
             {"output_ids": [7, 8, 9, 4], "meta_info": {"completion_tokens": 4}}]
    incremental = [{"output_ids": [7], "meta_info": {"completion_tokens": 1}},
                   {"output_ids": [8, 9], "meta_info": {"completion_tokens": 3}},
                   {"output_ids": [4], "meta_info": {"completion_tokens": 4}}]
    for events in (whole, incremental):
        seen, chunks = 0, []
        for event in events:
            chunks.append(new_output_ids(event, seen))
            seen += len(chunks[-1])
        assert chunks == [[7], [8, 9], [4]]


def test_leaving_a_stream_early_posts_abort_request_with_its_rid():
    """A stream the gateway leaves (RLD stopped at a handoff, a client gone) is closed and
    its rid posted to /abort_request; a stream read to its end is not."""
    import aiohttp
    from aiohttp import web

    async def main():
        aborted, rids = asyncio.Event(), []

        async def generate(request):
            body = await request.json()
            response = web.StreamResponse()
            await response.prepare(request)
            last = body["sampling_params"]["max_new_tokens"]
            for n in range(1, last + 1):
                reason = {"type": "length", "length": n} if n == last else None
                await response.write(sse({"output_ids": list(range(n)), "meta_info": {
                    "id": body["rid"], "finish_reason": reason, "completion_tokens": n}}))
                await asyncio.sleep(0.01)
            await response.write(sse("[DONE]"))
            return response

        async def abort(request):
            rids.append((await request.json())["rid"])
            aborted.set()
            return web.Response()

        app = web.Application()
        app.add_routes([web.post("/generate", generate), web.post("/abort_request", abort)])
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 5}
        try:
            async with aiohttp.ClientSession() as http:
                rld = SGLangUpstream(f"http://127.0.0.1:{runner.addresses[0][1]}", "relay", http)
                whole = [item async for item in rld.stream("whole", [1, 2], {"max_tokens": 3}, room)]
                async with aclosing(rld.stream("left", [1, 2], {"max_tokens": 500}, room)) as chunks:
                    left = [await anext(chunks) for _ in range(2)]
                await asyncio.wait_for(aborted.wait(), 60)  # a guard against a hang, not a timing
        finally:
            await runner.cleanup()
        return whole, left, rids

    whole, left, rids = asyncio.run(main())
    assert whole == [([0], None), ([1], None), ([2], "length")] and left == [([0], None), ([1], None)]
    assert rids == ["left"]
