"""PDD end to end, in small, as `pddcore demo` runs it: the gateway (`pddcore serve`) over
reference engine servers (`pddcore engine`) and a trace player, all real processes talking
HTTP and the transfer engine, over the kernel WAN emulator where root (CI) or the userspace
relay elsewhere.

These tests check what a run must do on any machine (exact outputs, routes, handoffs,
faults, cleanup). How PDD's TTFT compares with cross-DC PD's is a performance figure that
shared cores move: `pddcore demo` measures and prints it (docs/demo.md), no test asserts it."""

import json
import os
import re
import subprocess

import numpy as np
import pytest

from pddcore.deploy import Network, agentic_trace, run_demo
from pddcore.deploy.report import explain
from pddcore.testing.relay import WanRelay

# Two sessions: each opens with a fresh document (low hit at P and MD) and goes on with a
# short high-hit turn. Shipping a document's KV (~2.7 MB) over the link takes ~0.5 s,
# far more than RLD's eager start, and well below what RLD needs for the 192-token
# answer (so MD takes over, also on a fast idle machine).
SCENARIO = dict(turns=2, system_tokens=64, document_tokens=256, user_tokens=16, first_output_tokens=192,
                output_tokens=12, singular_every=0, stagger_s=0.5, think_s=0.1)
LINK = dict(bandwidth_bps=50e6, delay_ms=20)


def _namespaces():
    """This process's WAN namespaces (other test runs on the machine have their own)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.startswith(f"pddwan-{os.getpid()}x")}


def _children():
    """Processes this test process started that still run (compared before and after a run:
    earlier tests may have started helpers that live as long as this process, such as
    multiprocessing's resource tracker)."""
    me, out = os.getpid(), set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            out.add(int(pid))
    return out


def _roles(r):
    """The request's producing roles in order, one letter per token: "RRRMMM"."""
    return "".join(source[0] for source in r["trace"]["sources"])


def _assert_complete_and_exact(result, mode):
    correctness = result["correctness"][mode]
    assert correctness["pass"], correctness
    for r in result["runs"][mode]["requests"]:
        assert len(r["tokens"]) == r["max_new_tokens"] == len(r["trace"]["sources"]), r["rid"]


@pytest.fixture(scope="module")
def demo():
    before, children = _namespaces() if os.geteuid() == 0 else set(), _children()
    with Network(**LINK) as net:
        result = run_demo(agentic_trace(4, **SCENARIO), net, modes=("pd", "pdd"))
    yield result
    assert _children() <= children, "the demo left processes behind"
    if os.geteuid() == 0:
        assert _namespaces() == before, "the demo left network namespaces behind"


def test_failed_start_is_reported_and_cleaned_up(tmp_path):
    """A role that cannot start (no model at the path) fails the run with its log, and
    nothing is left running."""
    from pddcore.deploy import DeploymentError, RunConfig, run_deployment

    before, children = _namespaces() if os.geteuid() == 0 else set(), _children()
    missing = str(tmp_path / "no-such-model")
    with Network(**LINK) as net:
        with pytest.raises(DeploymentError, match="no-such-model"):
            run_deployment(RunConfig("pd", model={"path": missing}),
                           agentic_trace(1, **SCENARIO), net)
    assert _children() <= children
    if os.geteuid() == 0:
        assert _namespaces() == before


def test_outputs_identical_to_reference(demo):
    for mode in ("pd", "pdd"):
        _assert_complete_and_exact(demo, mode)


def test_pdd_routes_and_hands_off(demo):
    pdd, pd = demo["metrics"]["pdd"], demo["metrics"]["pd"]
    assert pd["routes"]["P_MD"] == 4 and pd["tokens"]["RLD"] == 0
    assert pdd["routes"]["P_RLD_MD"] >= 1, pdd["routes"]      # the fresh documents
    assert pdd["handoffs"]["one_shot"] + pdd["handoffs"]["catch_up"] >= 1
    assert pdd["tokens"]["RLD"] > 0 and pdd["tokens"]["MD"] > 0
    # every handed-off request switched owner once: RLD tokens, then MD tokens, nothing else
    for r in demo["runs"]["pdd"]["requests"]:
        roles = _roles(r)
        assert roles == "R" * roles.count("R") + "M" * roles.count("M"), (r["rid"], roles)
    # each handoff moved a request: RLD streamed its start, MD produced tokens after it, from
    # the token the gateway handed off at
    handed = [r for r in demo["runs"]["pdd"]["requests"] if _roles(r)[:1] == "R" and _roles(r)[-1:] == "M"]
    assert len(handed) == pdd["handoffs"]["one_shot"] + pdd["handoffs"]["catch_up"] >= 1, pdd["handoffs"]
    for r in handed:
        (_, at), = r["trace"]["handoffs"]
        assert _roles(r).index("M") == at


def test_the_wan_estimate_comes_from_the_engines_counters(demo):
    """Across the emulated WAN the path sets P's pace to MD: the gateway's estimate of that
    link rests on P's transfer counters (path-limited bytes and time, RTT), not on timing
    MD's pulls, and it is within the link's rate."""
    for mode in ("pd", "pdd"):
        (link,) = demo["runs"][mode]["links"].values()
        assert link["source"] == "engine counters", (mode, link)
        assert link["samples"] >= 1 and link["rtt_s"] > 0
        if os.geteuid() == 0:  # the kernel emulator's tbf: the estimate cannot beat its rate
            assert link["bytes_per_s"] <= LINK["bandwidth_bps"] / 8 * 1.05, (mode, link)


def test_measurements_add_up_to_the_tokens_and_contexts(demo):
    """What the engines and the gateway measured matches what the client saw: every token
    MD sent, except each request's first one there (sampled after its prefetch or extend
    pass), came from one of MD's decode steps, and RLD ran at least as many; P's extend
    passes computed exactly the prompt tokens its prefix cache lacked, and the run's first
    request found nothing cached at P."""
    run = demo["runs"]["pdd"]
    requests, timings = run["requests"], run["timings"]
    for role in ("RLD", "MD"):
        sent = sum(r["trace"]["sources"].count(role) for r in requests)
        started = sum(role in r["trace"]["sources"] for r in requests)
        steps = timings[role]["decode_steps"]
        assert all(seconds > 0 for seconds, _ in steps)
        if role == "MD":
            assert sum(batch for _, batch in steps) == sent - started
        else:  # RLD may decode past the token the gateway handed off at
            assert sum(batch for _, batch in steps) >= sent - started
    first = min(requests, key=lambda r: r["submitted"])
    assert first["trace"]["prefill_tokens"] == len(first["context"])
    assert sum(n for _, n in timings["P"]["extend_passes"]) == sum(r["trace"]["prefill_tokens"] for r in requests)
    # each request's KV became usable where it went: at RLD unless it went P_MD, at MD unless RLD_ONLY
    for r in requests:
        route, usable = r["trace"]["pipeline"], r["trace"]["kv_usable_s"]
        assert ("rld" in usable) == (route != "P_MD") and ("md" in usable) == (route != "RLD_ONLY"), r["rid"]
        assert all(seconds > 0 for seconds in usable.values())


def test_the_serve_bench_case_reads_the_run(demo):
    """`pddcore bench --cases serve` runs this deployment: its figures are the run's own
    (recomputed here from each request's times and trace), and its table prints them with
    the gateway's cost per token measured on loopback."""
    from pddcore.benchmarks.serve_cases import format_table, gateway_cost, summarize

    r = summarize(demo)
    assert r.requests == 4 and r.identical_tokens
    for mode in ("pd", "pdd"):
        requests, summary = demo["runs"][mode]["requests"], r.modes[mode]
        ttft = [req["times"][0] - req["submitted"] for req in requests]
        assert summary["ttft_s"][50] == pytest.approx(float(np.median(ttft)))
        assert summary["ttft_s"][90] == pytest.approx(float(np.percentile(ttft, 90)))
        assert summary["routes"] == {k: n for k, n in demo["metrics"][mode]["routes"].items() if n}
        assert summary["wan_kv_bytes"] == demo["metrics"][mode]["wan_bytes"] > 0
        gaps = [req["trace"]["handoff_gap_s"] for req in requests if req["trace"].get("handoff_gap_s") is not None]
        assert summary["handoffs"] == len(gaps) and (mode == "pdd" or not gaps)
    assert r.modes["pdd"]["handoffs"] >= 1 and r.ttft_p90_ratio == pytest.approx(
        r.modes["pdd"]["ttft_s"][90] / r.modes["pd"]["ttft_s"][90])
    r.gateway_tpot_ms, r.direct_tpot_ms = gateway_cost(tokens=16, trials=1)
    assert r.gateway_tpot_ms > 0 and r.direct_tpot_ms > 0
    table = format_table(r)
    assert "identical tokens: True" in table and f"{r.gateway_tpot_ratio:.2f}x" in table


def _printed(figure: str, value: float | None) -> bool:
    """``figure`` (as printed: "12.3 ms", "0.45", "-") is ``value`` to its printed precision."""
    if value is None:
        return figure == "-"
    number = figure.removesuffix(" ms")
    decimals = len(number.partition(".")[2])
    return abs(float(number) - (value * 1e3 if figure.endswith(" ms") else value)) <= 0.5 * 10 ** -decimals + 1e-9


def test_explanation_prints_what_the_run_measured(demo):
    """The text printed after the run is built from the run's JSON and nothing else: each
    figure in it is recomputed here from the raw measurements and compared, and no
    other number is left in it."""
    run = demo["runs"]["pdd"]
    requests, timings = run["requests"], run["timings"]
    text = explain(json.loads(json.dumps(demo["metrics"]["pdd"])))  # what `pddcore demo --json` writes
    patterns = {
        "prefill": r"prefill at P: ([\d.]+) ms per token \((\d+) tokens in ([\d.]+) s of extend passes\)",
        "fresh": r"fresh context of (\d+) tokens \((\d+) not cached at P\): prefill call ([\d.]+) s, then its KV "
                 r"usable at RLD after ([\d.]+ ms|-), at MD after ([\d.]+ ms|-)",
        "usable": r"at (RLD|MD) ([\d.]+ ms) \(([\d.]+ ms) to ([\d.]+ ms), (\d+) requests\)",
        "hits": r"([\d.]+) to ([\d.]+) % of the context in MD's prefix cache, as the gateway's radix tree tracks it "
                r"\(median ([\d.]+) %, (\d+) turns\)",
        "steps": r"(RLD|MD) ([\d.]+ ms) \((\d+) steps, ([\d.]+) requests per step on average\)",
    }
    found = {name: re.findall(pattern, text) for name, pattern in patterns.items()}

    passes = timings["P"]["extend_passes"]
    tokens, seconds = sum(n for _, n in passes), sum(s for s, _ in passes)
    (per_token, printed_tokens, printed_seconds), = found["prefill"]
    assert _printed(per_token + " ms", seconds / tokens) and int(printed_tokens) == tokens
    assert _printed(printed_seconds, seconds)

    fresh = [r for r in requests if r["turn"] == 0]
    assert len(found["fresh"]) == len(fresh) == 2
    for r, (context, prefilled, prefill_s, to_rld, to_md) in zip(fresh, found["fresh"]):
        trace = r["trace"]
        assert int(context) == len(r["context"]) and int(prefilled) == trace["prefill_tokens"]
        assert _printed(prefill_s, trace["prefill_s"])
        assert _printed(to_rld, trace["kv_usable_s"].get("rld"))
        assert _printed(to_md, trace["kv_usable_s"].get("md"))

    assert [t for t, *_ in found["usable"]] == ["RLD", "MD"]
    for target, median, low, high, count in found["usable"]:
        usable = [r["trace"]["kv_usable_s"][target.lower()] for r in requests
                  if target.lower() in r["trace"]["kv_usable_s"]]
        assert int(count) == len(usable)
        assert _printed(median, float(np.median(usable)))
        assert _printed(low, min(usable)) and _printed(high, max(usable))

    hits = [r["trace"]["md_cached_tokens"] / len(r["context"]) for r in requests if r["turn"] > 0]
    (low, high, median, turns), = found["hits"]
    assert int(turns) == len(hits) == 2
    assert _printed(low, 100 * min(hits)) and _printed(high, 100 * max(hits))
    assert _printed(median, 100 * float(np.median(hits)))

    assert [role for role, *_ in found["steps"]] == ["RLD", "MD"]
    for role, median, count, batch in found["steps"]:
        steps = timings[role]["decode_steps"]
        assert int(count) == len(steps)
        assert _printed(median, float(np.median([s for s, _ in steps])))
        assert _printed(batch, float(np.mean([b for _, b in steps])))

    leftover = text
    for pattern in patterns.values():
        leftover = re.sub(pattern, "", leftover)
    assert not re.search(r"\d", leftover), f"a figure the run did not measure: {leftover}"


def test_md_killed_mid_run():
    """MD dies mid-run: the gateway resumes the requests it was streaming on RLD from the
    tokens the client already has, routes the next ones past it, and every output is
    still exact."""
    # Follow-up answers long enough that MD is still streaming one when it is killed. A TTFT
    # SLO every transfer meets: every request goes P -> MD whatever the link estimate reads
    # (no borderline route), so MD streams tokens to be killed in.
    scenario = agentic_trace(4, **{**SCENARIO, "output_tokens": 160})
    with Network(**LINK) as net:
        result = run_demo(scenario, net, modes=("pdd",),
                          overrides={"pdd": {"kill_md_after_tokens": 10, "ttft_slo_s": 30.0}})
    metrics = result["metrics"]["pdd"]
    assert metrics["md_killed"], metrics
    _assert_complete_and_exact(result, "pdd")
    assert metrics["faults"].get("resumes:md_failed", 0) >= 1, metrics["faults"]
    # MD was killed while streaming a request: RLD finished it from the tokens the client
    # already had (MD tokens, then RLD tokens)
    resumed = [r for r in result["runs"]["pdd"]["requests"] if "MR" in _roles(r)]
    assert resumed, "no request moved from MD to RLD"
    for r in resumed:
        assert any("resumed on RLD" in line for line in r["trace"]["resumes"]), r["trace"]["resumes"]
    assert result["runs"]["pdd"]["timings"]["MD"] is None  # gone


def test_md_transfer_timeout_stays_on_rld():
    """An MD prefetch that outlives its deadline is abandoned; the request stays on RLD."""
    scenario = agentic_trace(2, **{**SCENARIO, "turns": 2})
    with Network(**LINK) as net:  # the SLO no transfer meets: the first request goes P -> RLD -> MD
        result = run_demo(scenario, net, modes=("pdd",),
                          overrides={"pdd": {"md_transfer_timeout_s": 0.2, "ttft_slo_s": 0.01}})
    metrics = result["metrics"]["pdd"]
    assert metrics["faults"].get("fallbacks:md_prefetch_timeout", 0) >= 1, metrics["faults"]
    _assert_complete_and_exact(result, "pdd")
    first = result["runs"]["pdd"]["requests"][0]
    assert set(first["trace"]["sources"]) == {"RLD"}
    assert first["trace"]["fallbacks"] == ["MD prefetch timed out: the request stays on RLD"]


def test_relay_carries_what_crosses_the_wan():
    """Without the kernel emulator (forced here), the userspace relay carries everything
    cluster A sends MD: the page writes and the gateway's calls, not a direct loopback path."""
    scenario = agentic_trace(2, **{**SCENARIO, "turns": 1})
    with Network(**LINK, force_relay=True) as net:
        result = run_demo(scenario, net, modes=("pd",))
        relayed = net.relay.bytes_sent("a")
    _assert_complete_and_exact(result, "pd")
    wan = result["metrics"]["pd"]["wan_bytes"]
    assert wan > 0 and relayed >= wan, (relayed, wan)


def test_default_trace_mix():
    """The default scenario: agentic sessions (long first answer on a fresh document, then
    high-hit short turns) alternate with stand-alone singular requests."""
    trace = agentic_trace()
    assert trace.num_requests == 24
    singular = [s for s in trace.sessions if len(s.outputs) == 1]
    agentic = [s for s in trace.sessions if len(s.outputs) > 1]
    assert len(singular) == 4 and all(s.outputs == (4,) and not s.followups for s in singular)
    assert [len(s.first_context) - 128 - 16 for s in agentic] == [1280, 384, 512, 384]
    assert all(s.outputs == (384, 64, 64, 64, 64) and len(s.followups) == 4 for s in agentic)
    assert len({s.first_context[:128] for s in trace.sessions}) == 1     # one shared system prompt
    assert agentic_trace(3, singular_every=0, document_tokens=100).num_requests == 3
    with pytest.raises(ValueError, match="singular_every"):
        agentic_trace(singular_every=-1)
    with pytest.raises(ValueError, match="document"):
        agentic_trace(document_tokens=())


def test_userspace_relay_caps_rate_and_delays():
    import socket
    import threading
    import time

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    got = []

    def sink():
        conn, _ = server.accept()
        n = 0
        while chunk := conn.recv(1 << 16):
            n += len(chunk)
        got.append((n, time.monotonic()))
        conn.close()

    threading.Thread(target=sink, daemon=True).start()
    relay = WanRelay(rate_bps=8e6, delay_ms=50)
    port = relay.forward(server.getsockname(), side="a")
    relay.start()
    try:
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(b"x" * 500_000)       # 4 Mbit at 8 Mbit/s: ~0.5 s, plus 50 ms
        # The sink reports once the relay closed its side; 500 kB at 8 Mbit/s need 0.55 s,
        # so a minute without the report means the relay lost the stream.
        deadline = time.monotonic() + 60
        while not got:
            assert time.monotonic() < deadline, "the sink got no end of stream through the relay within 60 s"
            time.sleep(0.01)
    finally:
        relay.close()
        server.close()
    n, end = got[0]
    assert n == 500_000
    assert end - start >= 0.5 and relay.bytes_sent("a") == 500_000
