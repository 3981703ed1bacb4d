"""The reference PDD deployment, end to end, in small: real processes, real sockets, the
kernel WAN emulator where root (CI) or the userspace relay elsewhere.

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
from pddcore.deploy.staging import RangeAllocator
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
    """Processes this test process started that still run (a role left behind)."""
    me, out = os.getpid(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            out.append(int(pid))
    return out


def _assert_complete_and_exact(result, mode):
    correctness = result["correctness"][mode]
    assert correctness["pass"], correctness
    run = result["runs"][mode]
    for r in run["requests"]:
        assert r["done"] and len(r["tokens"]) == r["max_new_tokens"], r["rid"]
    assert result["metrics"][mode]["ownership_violations"] == []


@pytest.fixture(scope="module")
def demo():
    before = _namespaces() if os.geteuid() == 0 else set()
    with Network(**LINK) as net:
        result = run_demo(agentic_trace(4, **SCENARIO), net, modes=("pd", "pdd"))
    yield result
    assert _children() == [], "the demo left processes behind"
    if os.geteuid() == 0:
        assert _namespaces() == before, "the demo left network namespaces behind"


def test_failed_start_is_reported_and_cleaned_up(tmp_path):
    """A role that cannot start (no model at the path) fails the run with its log, and
    nothing is left running."""
    from pddcore.deploy import DeploymentError, RunConfig, run_deployment

    before = _namespaces() if os.geteuid() == 0 else set()
    missing = str(tmp_path / "no-such-model")
    with Network(**LINK) as net:
        with pytest.raises(DeploymentError, match="no-such-model"):
            run_deployment(RunConfig("pd", kv_bytes_per_token=8192, model={"path": missing}),
                           agentic_trace(1, **SCENARIO), net)
    assert _children() == []
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
        roles = "".join(x[0] for x in r["roles"])
        assert roles == "R" * roles.count("R") + "M" * roles.count("M"), (r["rid"], roles)
    # each handoff moved a request: RLD streamed its start, MD produced tokens after it
    handed = [r["rid"] for r in demo["runs"]["pdd"]["requests"] if r["roles"][0] == "RLD" and r["roles"][-1] == "MD"]
    assert len(handed) == pdd["handoffs"]["one_shot"] + pdd["handoffs"]["catch_up"] >= 1, (handed, pdd["handoffs"])


def test_measurements_add_up_to_the_tokens_and_contexts(demo):
    """What the roles measured matches what the client saw: every token RLD or MD sent,
    except each request's first one there (sampled by P or by MD's extend pass), came
    from a decode step; the run's first request found nothing cached at P."""
    run = demo["runs"]["pdd"]
    summary = run["summary"]
    for role in ("RLD", "MD"):
        sent = sum(r["roles"].count(role) for r in run["requests"])
        started = sum(role in r["roles"] for r in run["requests"])
        steps = summary["decode_steps"][role]
        assert sum(batch for _, batch in steps) == sent - started, role
        assert all(seconds > 0 for seconds, _ in steps)
    first = min(run["requests"], key=lambda r: r["submitted"])
    assert summary["prefills"][first["rid"]][0] == len(first["context"])
    assert sum(n for n, _ in summary["prefills"].values()) == summary["counts"]["p_prefill_tokens"]
    # every KV P sent arrived: to RLD unless the request went P_MD, to MD unless it went RLD_ONLY
    routes = summary["pipelines"]
    assert set(summary["kv_usable_s"]["rld"]) == {rid for rid, route in routes.items() if route != "P_MD"}
    assert set(summary["kv_usable_s"]["md"]) == {rid for rid, route in routes.items() if route != "RLD_ONLY"}


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
    summary, requests = run["summary"], run["requests"]
    text = explain(json.loads(json.dumps(demo["metrics"]["pdd"])))  # what `pddcore demo --json` writes
    patterns = {
        "prefill": r"prefill at P: ([\d.]+) ms per token \((\d+) tokens in ([\d.]+) s\)",
        "fresh": r"fresh context of (\d+) tokens \((\d+) not cached at P\): prefill ([\d.]+) s, then its KV usable "
                 r"at RLD after ([\d.]+ ms|-), at MD after ([\d.]+ ms|-)",
        "usable": r"at (RLD|MD) ([\d.]+ ms) \(([\d.]+ ms) to ([\d.]+ ms), (\d+) requests\)",
        "hits": r"([\d.]+) to ([\d.]+) % of the context in MD's radix cache \(median ([\d.]+) %, (\d+) turns\)",
        "steps": r"(RLD|MD) ([\d.]+ ms) \((\d+) steps, ([\d.]+) requests per step on average\)",
    }
    found = {name: re.findall(pattern, text) for name, pattern in patterns.items()}

    tokens = sum(n for n, _ in summary["prefills"].values())
    seconds = sum(s for _, s in summary["prefills"].values())
    (per_token, printed_tokens, printed_seconds), = found["prefill"]
    assert _printed(per_token + " ms", seconds / tokens) and int(printed_tokens) == tokens
    assert _printed(printed_seconds, seconds)

    fresh = [r for r in requests if r["turn"] == 0]
    assert len(found["fresh"]) == len(fresh) == 2
    for r, (context, prefilled, prefill_s, to_rld, to_md) in zip(fresh, found["fresh"]):
        assert int(context) == len(r["context"]) and int(prefilled) == summary["prefills"][r["rid"]][0]
        assert _printed(prefill_s, summary["prefills"][r["rid"]][1])
        assert _printed(to_rld, summary["kv_usable_s"]["rld"].get(r["rid"]))
        assert _printed(to_md, summary["kv_usable_s"]["md"].get(r["rid"]))

    assert [t for t, *_ in found["usable"]] == ["RLD", "MD"]
    for target, median, low, high, count in found["usable"]:
        usable = list(summary["kv_usable_s"][target.lower()].values())
        assert int(count) == len(usable)
        assert _printed(median, float(np.median(usable)))
        assert _printed(low, min(usable)) and _printed(high, max(usable))

    hits = [summary["md_cached"][r["rid"]] / len(r["context"]) for r in requests if r["turn"] > 0]
    (low, high, median, turns), = found["hits"]
    assert int(turns) == len(hits) == 2
    assert _printed(low, 100 * min(hits)) and _printed(high, 100 * max(hits))
    assert _printed(median, 100 * float(np.median(hits)))

    assert [role for role, *_ in found["steps"]] == ["RLD", "MD"]
    for role, median, count, batch in found["steps"]:
        steps = summary["decode_steps"][role]
        assert int(count) == len(steps)
        assert _printed(median, float(np.median([s for s, _ in steps])))
        assert _printed(batch, float(np.mean([b for _, b in steps])))

    leftover = text
    for pattern in patterns.values():
        leftover = re.sub(pattern, "", leftover)
    assert not re.search(r"\d", leftover), f"a figure the run did not measure: {leftover}"


def test_malformed_handoff_is_rejected_and_resent():
    """The first handoff arrives malformed: MD rejects it, RLD re-sends, and every request
    still completes with exact outputs."""
    # A long first answer: RLD is still decoding it when MD is ready, however loaded the machine.
    # A TTFT SLO no transfer meets: the first request goes P -> RLD -> MD whatever the link
    # estimate reads (no borderline route), so there is a handoff to corrupt.
    scenario = agentic_trace(2, **{**SCENARIO, "first_output_tokens": 384})
    with Network(**LINK) as net:
        result = run_demo(scenario, net, modes=("pdd",),
                          overrides={"pdd": {"corrupt_handoffs": 1, "ttft_slo_s": 0.01}})
    handoffs = result["metrics"]["pdd"]["handoffs"]
    counts = result["runs"]["pdd"]["summary"]["counts"]
    assert handoffs["one_shot"] + handoffs["catch_up"] >= 1, counts
    assert handoffs["rejected"] >= 1, counts
    _assert_complete_and_exact(result, "pdd")


def test_md_killed_mid_run():
    """MD dies mid-run: the requests it owned are resumed on RLD from the tokens the client
    already has, and every output is still exact."""
    # Follow-up answers long enough that MD is still streaming one when it is killed. A TTFT
    # SLO every transfer meets: every request goes P -> MD whatever the link estimate reads
    # (no borderline route), so MD streams tokens to be killed in.
    scenario = agentic_trace(4, **{**SCENARIO, "output_tokens": 160})
    with Network(**LINK) as net:
        result = run_demo(scenario, net, modes=("pdd",),
                          overrides={"pdd": {"kill_md_after_tokens": 10, "ttft_slo_s": 30.0}})
    metrics = result["metrics"]["pdd"]
    counts = result["runs"]["pdd"]["summary"]["counts"]
    assert metrics["md_killed"], counts
    _assert_complete_and_exact(result, "pdd")
    assert counts.get("md_lost", 0) == 1 and counts.get("finished_RLD", 0) >= 1
    # MD was killed while streaming a request it had taken over: RLD finished it from the
    # tokens the client already had (MD tokens, then RLD tokens again)
    assert counts.get("md_lost_resumed_on_rld", 0) >= 1, counts
    resumed = [r for r in result["runs"]["pdd"]["requests"] if "M" in "".join(x[0] for x in r["roles"])
               and r["roles"][-1] == "RLD"]
    assert resumed, "no request moved back from MD to RLD"


def test_md_transfer_timeout_stays_on_rld():
    """A P->MD transfer that outlives its deadline is cancelled; the request stays on RLD."""
    scenario = agentic_trace(2, **{**SCENARIO, "turns": 2})
    with Network(**LINK) as net:  # the SLO no transfer meets: the first request goes P -> RLD -> MD
        result = run_demo(scenario, net, modes=("pdd",),
                          overrides={"pdd": {"md_transfer_timeout_s": 0.2, "ttft_slo_s": 0.01}})
    counts = result["runs"]["pdd"]["summary"]["counts"]
    assert counts.get("md_transfer_timeout", 0) >= 1, counts
    assert counts.get("stayed_on_rld_after_md_timeout", 0) >= 1, counts
    _assert_complete_and_exact(result, "pdd")
    first = result["runs"]["pdd"]["requests"][0]
    assert set(first["roles"]) == {"RLD"}


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


def test_range_allocator_reuses_and_merges():
    ranges = RangeAllocator(1024, align=64)
    a, b, c = ranges.alloc(100), ranges.alloc(64), ranges.alloc(256)
    assert (a, b, c) == (0, 128, 192)
    assert ranges.alloc(1024) is None
    ranges.free(b)
    ranges.free(a)
    assert ranges.alloc(192) == 0          # the two freed neighbours merged
    with pytest.raises(ValueError, match="not an allocated range"):
        ranges.free(5)


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


def test_front_flags_tokens_from_the_wrong_owner_duplicates_and_gaps(tmp_path):
    """The front's per-token check (what makes 'exactly once, in order, one owner' a
    test): RLD after its final handoff, MD before it, a repeat and a gap are violations."""
    from pddcore.deploy.front import Front, _Request
    from pddcore.router import Pipeline

    front = Front({"hub": str(tmp_path / "hub.sock"), "authkey": "00" * 16, "mode": "pdd",
                   "router": {"kv_bytes_per_token": 8192, "ttft_slo_s": 0.4, "rld_tpot_s": 0.03,
                              "prior_bytes_per_s": 1e7, "prior_rtt_s": 0.04}})
    try:
        front.requests["r"] = _Request("r", [1, 2, 3], 8, 0, pipeline=Pipeline.P_RLD_MD)
        front.on_tokens("RLD", "RLD", [("r", 0, 11), ("r", 1, 12)])
        assert front.violations == []
        front.on_tokens("MD", "MD", [("r", 2, 13)])                 # MD before the handoff
        front.on_handoff("RLD", "r", 2, "one_shot")
        front.on_tokens("RLD", "RLD", [("r", 2, 13)])               # RLD after its final handoff
        assert len(front.violations) == 2
        front.on_tokens("MD", "MD", [("r", 2, 13), ("r", 2, 13), ("r", 4, 15)])  # ok, repeat, gap
        assert len(front.violations) == 4
        assert front.requests["r"].delivered == [11, 12, 13]
        assert front.requests["r"].sources == ["RLD", "RLD", "MD"]
    finally:
        front.listener.close()
