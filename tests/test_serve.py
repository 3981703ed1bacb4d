"""`pddcore serve` end to end: the official `openai` client against the gateway over real
reference engine processes (`pddcore engine`) on loopback. Every output is compared with
one engine generating the same request alone (the oracle). The tests that take ``cluster``
run twice: over engines in vLLM's dialect (``--engine reference``) and in SGLang's PD
dialect (``pddcore engine --dialect sglang``, ``--engine sglang``)."""

from __future__ import annotations

import json
import random

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from pddcore.testing.servers import stop_together
from serve_cluster import engine, gateway, together, wait_for

MODEL = "pddcore-reference"


@pytest.fixture(scope="module")
def engines():
    procs = together({name: (lambda role=role: engine(role)) for name, role in
                      (("oracle", "decode"), ("p", "prefill"), ("rld", "decode"), ("md", "decode"))})
    yield procs
    stop_together(procs.values())


ENGINE_ARGS = {"reference": (), "sglang": ("--dialect", "sglang")}


def dialect_args(dialect: str, engines) -> list[str]:
    """The gateway's options for engines of ``dialect`` (SGLang reports no KV size: give it)."""
    if dialect == "reference":
        return []
    return ["--kv-bytes-per-token", str(engines["oracle"].get("/pdd/info")["kv_bytes_per_token"])]


@pytest.fixture(scope="module")
def sglang_engines(engines):
    """P, RLD and MD in SGLang's dialect; the oracle is the same model in vLLM's."""
    procs = together({name: (lambda role=role: engine(role, *ENGINE_ARGS["sglang"])) for name, role in
                      (("p", "prefill"), ("rld", "decode"), ("md", "decode"))})
    yield {"oracle": engines["oracle"], **procs}
    stop_together(procs.values())


# Router settings that pin each pipeline (the embedded model's KV is 8 KiB per token):
ROUTES = {
    # MD's KV is ready within any TTFT budget: P -> MD.
    "P_MD": ["--ttft-slo-s", "1000"],
    # MD's KV misses a budget of 0, RLD decodes first; a large threshold makes the handoff one-shot.
    # (0, not merely tiny: on loopback the link poll soon reads P's counters of earlier tests'
    # pulls, an RTT near 0 at gigabytes per second, and a short prompt's KV then lands within
    # a millisecond.)
    "P_RLD_MD": ["--ttft-slo-s", "0", "--wan-mbps", "100", "--catch-up-threshold", "100000"],
    # The same with threshold 0: any backlog is caught up while RLD decodes, then a final handoff.
    "CATCH_UP": ["--ttft-slo-s", "0", "--wan-mbps", "100", "--catch-up-threshold", "0"],
    # RLD tokens priced so cheap that RLD finishes before MD's KV would land: nothing crosses the
    # WAN. (A slow link too, for the same reason.)
    "RLD_ONLY": ["--ttft-slo-s", "0", "--rld-tpot-s", "1e-7", "--wan-mbps", "100"],
}


def route_gateways(e, dialect: str):
    return together({name: (lambda args=args: gateway([e["p"].url], [e["rld"].url], [e["md"].url], *args,
                                                      *dialect_args(dialect, e), dialect=dialect))
                     for name, args in ROUTES.items()})


@pytest.fixture(scope="module")
def gateways(engines):
    procs = route_gateways(engines, "reference")
    yield procs
    stop_together(procs.values())


@pytest.fixture(scope="module")
def sglang_gateways(sglang_engines):
    procs = route_gateways(sglang_engines, "sglang")
    yield procs
    stop_together(procs.values())


@pytest.fixture(params=["reference", "sglang"])
def dialect(request) -> str:
    return request.param


@pytest.fixture
def cluster(request, dialect):
    """(engines, gateways) of one dialect."""
    if dialect == "sglang":
        return request.getfixturevalue("sglang_engines"), request.getfixturevalue("sglang_gateways")
    return request.getfixturevalue("engines"), request.getfixturevalue("gateways")


def prompt_of(rng: random.Random, n: int | None = None) -> list[int]:
    return [rng.randrange(16, 4096) for _ in range(n or rng.randrange(37, 140))]


def oracle(engines, prompt: list[int], max_tokens: int, *, temperature: float = 0.0, seed: int | None = None):
    sampling = {"max_tokens": max_tokens, "temperature": temperature, "ignore_eos": True}
    if seed is not None:
        sampling["seed"] = seed
    r = requests.post(engines["oracle"].url + "/inference/v1/generate",
                      json={"token_ids": prompt, "sampling_params": sampling}, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def stream_tokens(gw, prompt, max_tokens: int, *, on_tokens=None, **kwargs) -> tuple[list[int], str, dict]:
    """Streams a completion with the openai client; returns (token ids, text, the gateway's trace)."""
    ids, text, rid = [], "", None
    stream = client(gw).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                           temperature=kwargs.pop("temperature", 0.0),
                                           extra_body={"return_token_ids": True, "ignore_eos": True}, **kwargs)
    for chunk in stream:
        rid = chunk.id
        ids += chunk.choices[0].token_ids or []
        text += chunk.choices[0].text
        if on_tokens is not None:
            on_tokens(ids)
    return ids, text, gw.get(f"/pdd/requests/{rid}")


@pytest.mark.parametrize("route", ["P_MD", "P_RLD_MD", "RLD_ONLY"])
def test_openai_stream_is_one_engines_output_on_every_route(cluster, route):
    engines, gateways = cluster
    rng = random.Random(route)
    prompt = prompt_of(rng)
    ids, _, trace = stream_tokens(gateways[route], prompt, 160)
    assert trace["pipeline"] == route, trace["reason"]
    assert ids == oracle(engines, prompt, 160)
    sources = trace["sources"]
    if route == "P_RLD_MD":
        assert [h[0] for h in trace["handoffs"]] == ["one_shot"], trace
        at = trace["handoffs"][0][1]
        assert sources == ["RLD"] * at + ["MD"] * (160 - at)  # one switch, at the handoff point
        assert 0 < at < 160 and trace["handoff_gap_s"] > 0
    else:
        assert set(sources) == {"MD" if route == "P_MD" else "RLD"}


def test_catch_up_rounds_then_a_final_handoff(cluster):
    engines, gateways = cluster
    prompt = prompt_of(random.Random(7), 90)
    ids, _, trace = stream_tokens(gateways["CATCH_UP"], prompt, 240)
    assert ids == oracle(engines, prompt, 240)
    assert trace["catch_up_rounds"] >= 1 and [h[0] for h in trace["handoffs"]] == ["catch_up"], trace
    assert trace["sources"][-1] == "MD"


def test_sampled_continuation_keeps_the_seeded_stream(cluster):
    engines, gateways = cluster
    prompt = prompt_of(random.Random(11))
    ids, _, trace = stream_tokens(gateways["P_RLD_MD"], prompt, 150, temperature=0.9, seed=1234)
    assert trace["handoffs"], trace
    assert ids == oracle(engines, prompt, 150, temperature=0.9, seed=1234)


def test_text_prompts_chat_and_whole_answers(cluster):
    engines, gateways = cluster
    gw, oracle_url = gateways["P_MD"], engines["oracle"].url
    whole = client(gw).completions.create(model=MODEL, prompt="The WAN is slow, so", max_tokens=12,
                                          temperature=0, extra_body={"return_token_ids": True})
    prompt_ids = requests.post(oracle_url + "/tokenize", json={"prompt": "The WAN is slow, so"}).json()["tokens"]
    choice = whole.choices[0]
    assert choice.prompt_token_ids == prompt_ids
    assert choice.token_ids == oracle(engines, prompt_ids, 12)[:len(choice.token_ids)]
    assert choice.text == requests.post(oracle_url + "/detokenize", json={"tokens": choice.token_ids}).json()["prompt"]
    assert whole.usage.prompt_tokens == len(prompt_ids) and whole.usage.completion_tokens == len(choice.token_ids)

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo, wörld"}]
    chat_ids = requests.post(oracle_url + "/tokenize", json={"messages": messages}).json()["tokens"]
    expected = oracle(engines, chat_ids, 20)
    chat = client(gw).chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                              extra_body={"return_token_ids": True, "ignore_eos": True})
    assert chat.choices[0].token_ids == expected
    streamed, content = [], ""
    for chunk in client(gw).chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                    stream=True, stream_options={"include_usage": True},
                                                    extra_body={"return_token_ids": True, "ignore_eos": True}):
        if chunk.choices:
            streamed += chunk.choices[0].token_ids or []
            content += chunk.choices[0].delta.content or ""
        else:
            assert chunk.usage.completion_tokens == 20
    assert streamed == expected and content == chat.choices[0].message.content


def test_follow_up_turn_pulls_only_the_suffix(cluster):
    engines, gateways = cluster
    gw, md = gateways["P_MD"], engines["md"]
    info = engines["p"].get("/pdd/info")
    page, page_bytes = info["page_size"], int(info["kv_bytes_per_token"] * info["page_size"])
    rng = random.Random(3)
    turn1 = prompt_of(rng, 101)
    out1, _, trace1 = stream_tokens(gw, turn1, 30)
    assert trace1["md_cached_tokens"] == 0
    turn2 = turn1 + out1 + prompt_of(rng, 23)
    before = md.get("/pdd/state")["bytes_received"]
    out2, _, trace2 = stream_tokens(gw, turn2, 30)
    held = (len(turn1) + len(out1) - 1) // page * page  # MD cached turn 1's whole pages (last token: no KV)
    assert trace2["md_cached_tokens"] == held
    assert f"MD lacks {len(turn2) - held} of {len(turn2)} tokens" in trace2["reason"]
    pulled = md.get("/pdd/state")["bytes_received"] - before
    assert pulled == ((len(turn2) - 1) // page - held // page) * page_bytes  # only the suffix crossed
    assert out2 == oracle(engines, turn2, 30)


def test_sglang_handoff_moves_only_the_pages_of_the_handed_off_tokens(sglang_engines, sglang_gateways):
    """In SGLang's dialect MD cannot prefill: the handoff is a P + MD pair over the context and
    the client's tokens, and MD's decode-side prefix cache (the prompt, from its prefetch)
    leaves only the pages past the prompt to cross; P computes those tokens."""
    e = sglang_engines
    info = e["oracle"].get("/pdd/info")
    page, page_bytes = info["page_size"], int(info["kv_bytes_per_token"] * info["page_size"])
    prompt = prompt_of(random.Random(29), 95)  # 15 tokens past 5 whole pages: from 2 handed-off tokens on, a page
    before, wan_before = e["md"].get("/pdd/state"), wan_kv_bytes(sglang_gateways["P_RLD_MD"])
    ids, _, trace = stream_tokens(sglang_gateways["P_RLD_MD"], prompt, 120)
    assert ids == oracle(e, prompt, 120) and [h[0] for h in trace["handoffs"]] == ["one_shot"], trace
    at = trace["handoffs"][0][1]
    after = e["md"].get("/pdd/state")
    prefetched = (len(prompt) - 1) // page  # MD lacked the whole prompt
    handed_off = (len(prompt) + at - 1) // page - len(prompt) // page  # past the prompt's cached pages
    assert after["bytes_received"] - before["bytes_received"] == (prefetched + handed_off) * page_bytes
    assert after["pulls_done"] - before["pulls_done"] == 1 + (handed_off > 0)
    assert after["requests"] - before["requests"] == 2  # MD's prefetch and its continuation
    # the gateway counts both crossings: the prompt's KV (prefetch) and the handed-off tokens'
    assert wan_kv_bytes(sglang_gateways["P_RLD_MD"]) - wan_before == (len(prompt) + at) * info["kv_bytes_per_token"]


def test_an_sglang_gateway_refuses_a_prefill_url_that_is_no_sglang_prefill_server(sglang_engines):
    e = sglang_engines
    with pytest.raises(RuntimeError, match="is not an SGLang prefill server"):
        gateway([e["rld"].url], [], [e["md"].url], *dialect_args("sglang", e), dialect="sglang")


def wan_kv_bytes(gw) -> float:
    text = requests.get(gw.url + "/metrics", timeout=30).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "pddcore_wan_kv_bytes_total")


def test_metrics_are_prometheus_text_and_count_what_happened(engines):
    e = engines
    gw = gateway([e["p"].url], [e["rld"].url], [e["md"].url], *ROUTES["P_MD"])
    try:
        rng = random.Random(5)
        for _ in range(3):
            stream_tokens(gw, prompt_of(rng), 8)
        requests.post(gw.url + "/v1/completions", json={"prompt": [], "max_tokens": 3}, timeout=30)
        text = requests.get(gw.url + "/metrics", timeout=30).text
    finally:
        gw.stop()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert value["pddcore_requests_total", (("route", "P_MD"),)] == 3
    assert value["pddcore_request_errors_total", (("kind", "bad_request"),)] == 1
    assert value["pddcore_ttft_seconds_count", ()] == 3
    assert value["pddcore_tokens_total", (("source", "MD"),)] == 24
    assert value["pddcore_wan_kv_bytes_total", ()] > 0
    assert families["pddcore_ttft_seconds"].type == "histogram"


@pytest.mark.parametrize("body, words", [
    ("not json", "not valid JSON"),
    ({"max_tokens": 4}, "'prompt'"),
    ({"prompt": [20, 21], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [20, 21], "stop": ["\n"]}, "stop strings"),
    ({"prompt": [20, 21], "n": 2}, "n=1"),
    ({"prompt": [20, 99999], "max_tokens": 2}, "token ids must be in"),
    ({"prompt": [20, "x"]}, "token ids"),
])
def test_bad_requests_get_a_400_that_says_why(cluster, body, words):
    url = cluster[1]["P_MD"].url + "/v1/completions"
    r = requests.post(url, data=body, timeout=30) if isinstance(body, str) else requests.post(url, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_bad_chat_request_raises_in_the_openai_client(gateways):
    with pytest.raises(openai.BadRequestError, match="messages"):
        client(gateways["P_MD"]).chat.completions.create(model=MODEL, messages=[{"role": "user"}])


def test_client_disconnect_cancels_the_engine_request(cluster):
    engines, gateways = cluster
    rld = engines["rld"]
    before = rld.get("/pdd/state")["cancelled"]
    with requests.post(gateways["RLD_ONLY"].url + "/v1/completions", stream=True, timeout=60,
                       json={"prompt": prompt_of(random.Random(9)), "max_tokens": 5000, "ignore_eos": True,
                             "stream": True, "temperature": 0}) as r:
        lines = r.iter_lines()
        got = [line for line in (next(lines) for _ in range(6)) if line]
        assert got and json.loads(got[0][5:])["choices"]
    state = wait_for(lambda: (s := rld.get("/pdd/state"))["cancelled"] > before and s["running"] == 0 and s,
                     "RLD to drop the abandoned request")
    assert state["generated_tokens"] < state["prompt_tokens"] + 5000


# ---- faults, each on engines of its own -------------------------------------------------------
@pytest.fixture
def spare(request):
    """A fresh decode engine that a test may kill (in the test's dialect, if it has one)."""
    proc = engine("decode", *ENGINE_ARGS[request.getfixturevalue("dialect") if "dialect" in request.fixturenames
                                         else "reference"])
    yield proc
    proc.stop()


def test_md_killed_mid_stream_resumes_on_rld(cluster, dialect, spare):
    engines = cluster[0]
    gw = gateway([engines["p"].url], [engines["rld"].url], [spare.url], *ROUTES["P_MD"],
                 *dialect_args(dialect, engines), dialect=dialect)
    try:
        prompt = prompt_of(random.Random(13))
        ids, _, trace = stream_tokens(gw, prompt, 200, on_tokens=lambda got: len(got) >= 20 and
                                      spare.proc.poll() is None and spare.kill())
    finally:
        gw.stop()
    assert ids == oracle(engines, prompt, 200)
    assert trace["resumes"] and trace["sources"][0] == "MD" and trace["sources"][-1] == "RLD", trace


def test_rld_killed_before_the_handoff_continues_on_md(cluster, dialect, spare):
    engines = cluster[0]
    gw = gateway([engines["p"].url], [spare.url], [engines["md"].url], *ROUTES["RLD_ONLY"],
                 *dialect_args(dialect, engines), dialect=dialect)
    try:
        prompt = prompt_of(random.Random(17))
        ids, _, trace = stream_tokens(gw, prompt, 120, on_tokens=lambda got: len(got) >= 15 and
                                      spare.proc.poll() is None and spare.kill())
    finally:
        gw.stop()
    assert ids == oracle(engines, prompt, 120)
    assert trace["resumes"] and trace["sources"][0] == "RLD" and trace["sources"][-1] == "MD", trace


@pytest.mark.parametrize("how", ["unreachable", "pull_timeout"])
def test_md_that_cannot_take_over_leaves_the_request_on_rld(cluster, dialect, how):
    engines = cluster[0]
    main = "http://127.0.0.1:1" if how == "unreachable" else engines["md"].url
    extra = ["--prefetch-timeout-s", "0.001"] if how == "pull_timeout" else []
    gw = gateway([engines["p"].url], [engines["rld"].url], [main], *ROUTES["P_RLD_MD"], *extra,
                 *dialect_args(dialect, engines), dialect=dialect)
    try:
        prompt = prompt_of(random.Random(how))
        ids, _, trace = stream_tokens(gw, prompt, 80)
    finally:
        gw.stop()
    assert ids == oracle(engines, prompt, 80) and not trace["handoffs"], trace
    # MD never takes over by a handoff; only a resume after a failed RLD stream (recorded, with
    # the error in trace["errors"]) may move the request there, as CI's fresh run once saw
    assert set(trace["sources"]) == {"RLD"} or (trace["resumes"] and trace["errors"]), trace
    if how == "unreachable" and trace["pipeline"] == "RLD_ONLY":
        # the gateway's link poll (pddcore.serve.link_stats) found MD down before the request came
        assert trace["reason"] == "no main decode engine is healthy", trace
    else:
        assert trace["pipeline"] == "P_RLD_MD" and trace["fallbacks"], trace


def test_prefill_down_is_a_clear_error(cluster, dialect):
    engines = cluster[0]
    bootstrap = ["--bootstrap-port", "8998"] if dialect == "sglang" else []  # P cannot tell it: it is down
    gw = gateway(["http://127.0.0.1:1"], [engines["rld"].url], [engines["md"].url], "--kv-bytes-per-token", "8192",
                 "--page-size", "16", *bootstrap, dialect=dialect)
    try:
        with pytest.raises(openai.APIStatusError, match="no prefill engine is reachable") as caught:
            client(gw).completions.create(model=MODEL, prompt=[20, 21, 22], max_tokens=4, stream=True)
        assert caught.value.status_code == 503
    finally:
        gw.stop()


def test_sessions_stay_on_the_md_that_holds_their_prefix(engines, spare):
    """Two MDs: a session's follow-up turns go where its history is cached, and load
    spreads the sessions' first turns over both."""
    e = engines
    gw = gateway([e["p"].url], [e["rld"].url], [e["md"].url, spare.url], *ROUTES["P_MD"])
    try:
        rng = random.Random(19)
        sessions = [prompt_of(rng, 70) for _ in range(4)]
        firsts, follow_ups = [], []
        for turn1 in sessions:
            out, _, trace = stream_tokens(gw, turn1, 10)
            firsts.append(trace["md"])
            turn2 = turn1 + out + prompt_of(rng, 9)
            out2, _, trace2 = stream_tokens(gw, turn2, 10)
            follow_ups.append((trace2["md"], trace2["md_cached_tokens"] == (len(turn1) + len(out) - 1) // 16 * 16))
            assert out2 == oracle(engines, turn2, 10)
    finally:
        gw.stop()
    assert [md for md, _ in follow_ups] == firsts
    assert all(held for _, held in follow_ups)  # the estimate: turn 1's whole pages
    assert set(firsts) == {e["md"].url, spare.url}


def test_concurrent_requests_each_get_their_own_tokens_once(engines, gateways):
    """Requests in flight together on the dual-send route: none is lost, duplicated or mixed up."""
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(23)
    prompts = [prompt_of(rng) for _ in range(5)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: stream_tokens(gateways["P_RLD_MD"], p, 60), prompts))
    for prompt, (ids, _, trace) in zip(prompts, results):
        assert ids == oracle(engines, prompt, 60), trace
        assert len(trace["sources"]) == 60


def test_link_counters_of_several_prefill_engines_add_up():
    from pddcore.serve.link_stats import _add

    total: dict = {}
    _add(total, {"path_limited_bytes": 3e6, "path_limited_seconds": 0.5, "rtt_s": 0.0, "bytes_sent": 4e6})
    _add(total, {"path_limited_bytes": 1e6, "path_limited_seconds": 0.25, "rtt_s": 0.05})
    _add(total, {"path_limited_bytes": 0.0, "path_limited_seconds": 0.0, "rtt_s": 0.04})
    assert total == {"path_limited_bytes": 4e6, "path_limited_seconds": 0.75, "bytes_sent": 4e6, "rtt_s": 0.04}
