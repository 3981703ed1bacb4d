"""Handoff wire format (round trip, size, fuzzed decoder), policy regimes, and the MD-side
assembler under reordering, duplicates and resends."""

import random
import struct
import sys
import uuid

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from pddcore import _C
from pddcore.handoff import (FINAL, Handoff, HandoffAssembler, HandoffDecision, HandoffError, HandoffMode,
                             HandoffPolicy, HandoffState, SamplerState, split_into_messages)



def fast(max_examples):
    return settings(max_examples=max_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])

sampler_st = st.none() | st.builds(SamplerState, st.integers(0, 2**64 - 1), st.integers(0, 2**63 - 1),
                                   st.integers(0, 2**63 - 1))
handoff_st = st.builds(
    Handoff,
    request_id=st.text(min_size=1, max_size=40),
    seq=st.integers(0, 2**63 - 1),
    start_pos=st.integers(0, 2**63 - 1),
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=60),
    flags=st.sampled_from([0, FINAL]),
    sampler_state=sampler_st,
)


def reseal(body_and_header: bytes) -> bytes:
    """Recomputes the length field and CRC so a test reaches the checks behind them."""
    header, body = body_and_header[:10], body_and_header[10:]
    header = header[:6] + struct.pack("<I", len(body))
    msg = header + body
    return msg + struct.pack("<I", _C.crc32c(msg))


# ---- wire format -------------------------------------------------------------------------------

@fast(150)
@given(handoff_st)
def test_round_trip(msg):
    data = msg.encode()
    assert Handoff.decode(data) == msg
    assert Handoff.decode(bytearray(data)) == msg


def test_hundred_tokens_fit_in_512_bytes():
    rng = random.Random(0)
    worst = SamplerState(2**64 - 1, 2**63 - 1, 2**63 - 1)
    for vocab in (32000, 152064, 256000, 1 << 21):
        tokens = [vocab - 1 - rng.randrange(16) for _ in range(100)]  # the largest ids: longest varints
        msg = Handoff("x" * 64, 2**40, 2**40, tokens, FINAL, worst)
        assert len(msg.encode()) <= 512, vocab
    typical = Handoff(str(uuid.UUID(int=rng.getrandbits(128))), 3, 65536,
                      [rng.randrange(152064) for _ in range(100)], FINAL, SamplerState(1234, 100, 100))
    assert len(typical.encode()) <= 360


@fast(400)
@given(st.binary(max_size=200))
def test_decoder_fuzz_random_bytes(data):
    try:
        msg = Handoff.decode(data)
    except HandoffError:
        return
    assert msg.encode() == data  # anything accepted is canonical


@fast(400)
@given(handoff_st, st.data())
def test_decoder_fuzz_mutated_messages(msg, data):
    good = msg.encode()
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "body", "splice"]))
    if kind == "flip":
        i = data.draw(st.integers(0, len(good) - 1))
        bad = good[:i] + bytes([good[i] ^ data.draw(st.integers(1, 255))]) + good[i + 1:]
    elif kind == "truncate":
        bad = good[: data.draw(st.integers(0, len(good) - 1))]
    elif kind == "extend":
        bad = good + data.draw(st.binary(min_size=1, max_size=8))
    elif kind == "body":  # garbage body with a valid header, length and CRC: reaches the field parser
        bad = reseal(good[:10] + data.draw(st.binary(max_size=80)))
    else:  # a valid frame around a corrupted body
        body = bytearray(good[10:-4])
        assume(body)
        i = data.draw(st.integers(0, len(body) - 1))
        body[i] = data.draw(st.integers(0, 255))
        bad = reseal(good[:10] + bytes(body))
    assume(bad != good)
    try:
        decoded = Handoff.decode(bad)
    except HandoffError:
        return
    assert decoded.encode() == bad
    assert kind in ("body", "splice"), "CRC32C must catch every single-byte flip and any truncation"


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b[:5], "shorter than"),
    (lambda b: b"XXXX" + b[4:], "bad magic"),
    (lambda b: b[:4] + b"\x02" + b[5:], "unsupported handoff version 2"),
    (lambda b: reseal(b[:5] + b"\x04" + b[6:-4]), "reserved flag bits"),
    (lambda b: b[:-1], "truncated"),
    (lambda b: b + b"\x00", "trailing bytes"),
    (lambda b: b[:-4] + bytes(4), "CRC32C mismatch"),
    (lambda b: reseal(b[:-4] + b"\x00"), "unexpected bytes after"),
    (lambda b: reseal(b[:10] + b"\x00"), "request_id length 0"),
    (lambda b: reseal(b[:10] + b"\x01\xff" + b[12:-4]), "not valid UTF-8"),
    (lambda b: reseal(b[:10] + b"\x80\x00"), "overlong varint"),
    (lambda b: reseal(b[:10] + b"\x80" * 11), "longer than 10 bytes"),
    (lambda b: reseal(b[:10] + b"\x01a\x00\x00\x05\x01"), "token count 5 exceeds"),
    (lambda b: reseal(b[:10] + b"\x01a\x00\x00\x01\x80\x80\x80\x80\x10"), "token id = 4294967296 is out of range"),
    (lambda b: reseal(b[:10] + b"\x01a\x00\x00\x01\x80"), "varint runs past the end"),
    (lambda b: reseal(b[:10] + b"\x01"), "request_id needs 1 bytes"),
])
def test_malformed_messages_name_the_problem(mutate, message):
    good = Handoff("r", 0, 0, [5], 0).encode()
    with pytest.raises(HandoffError, match=message):
        Handoff.decode(mutate(good))


def test_decode_rejects_non_bytes():
    with pytest.raises(HandoffError, match="expected bytes"):
        Handoff.decode(12345)
    assert issubclass(HandoffError, ValueError)


@pytest.mark.parametrize("kwargs, message", [
    (dict(request_id=""), "request_id must be 1..256"),
    (dict(request_id="x" * 257), "request_id must be 1..256"),
    (dict(request_id=7), "request_id must be a str"),
    (dict(seq=-1), "seq must be"),
    (dict(start_pos=2**63), "start_pos must be"),
    (dict(token_ids=[1, -2]), r"token_ids\[1\] = -2"),
    (dict(token_ids=[2**32]), r"token_ids\[0\]"),
    (dict(token_ids=[1.0]), "sequence of integers"),
    (dict(flags=4), "bits other than FINAL"),
    (dict(sampler_state=(1, 2, 3)), "SamplerState"),
])
def test_constructor_rejects_bad_fields(kwargs, message):
    fields = dict(request_id="r", seq=0, start_pos=0, token_ids=[1], flags=0, sampler_state=None)
    fields.update(kwargs)
    with pytest.raises(HandoffError, match=message):
        Handoff(**fields)
    with pytest.raises(HandoffError, match="seed"):
        SamplerState(-1, 0, 0)


# ---- policy ------------------------------------------------------------------------------------

POLICY = HandoffPolicy()


@pytest.mark.parametrize("state, expected", [
    (HandoffState(500, md_ready=False, rld_load=0.1), (HandoffMode.WAIT, 0, False)),
    (HandoffState(40, md_ready=True, rld_load=0.1), (HandoffMode.ONE_SHOT, 40, True)),
    (HandoffState(64, md_ready=True, rld_load=0.1), (HandoffMode.ONE_SHOT, 64, True)),
    (HandoffState(65, md_ready=True, rld_load=0.1), (HandoffMode.CATCH_UP, 65, False)),
    (HandoffState(300, md_ready=True, rld_load=0.79), (HandoffMode.CATCH_UP, 300, False)),
    (HandoffState(300, md_ready=True, rld_load=0.8), (HandoffMode.ONE_SHOT, 300, True)),
    (HandoffState(300, md_ready=True, rld_load=1.5), (HandoffMode.ONE_SHOT, 300, True)),
    (HandoffState(90, md_ready=True, rld_load=0.2, rounds_done=1), (HandoffMode.CATCH_UP, 90, False)),
    (HandoffState(30, md_ready=True, rld_load=0.2, rounds_done=1), (HandoffMode.CATCH_UP, 30, True)),
    (HandoffState(0, md_ready=True, rld_load=0.2, rounds_done=2), (HandoffMode.CATCH_UP, 0, True)),
    (HandoffState(90, md_ready=True, rld_load=0.2, rounds_done=4), (HandoffMode.CATCH_UP, 90, True)),
    (HandoffState(90, md_ready=True, rld_load=0.9, rounds_done=1), (HandoffMode.ONE_SHOT, 90, True)),
])
def test_policy_regimes(state, expected):
    decision = POLICY.decide(state)
    assert (decision.mode, decision.num_tokens, decision.final) == expected
    assert decision.reason


@fast(60)
@given(st.integers(65, 5000), st.floats(0, 0.79), st.floats(0.05, 0.9))
def test_catch_up_converges_to_one_final_handoff(backlog, load, extend_ratio):
    """RLD keeps decoding while MD extends each batch, producing extend_ratio tokens per
    handed token; the policy must end with exactly one FINAL decision."""
    decisions, rounds = [], 0
    while True:
        d = POLICY.decide(HandoffState(backlog, md_ready=True, rld_load=load, rounds_done=rounds))
        decisions.append(d)
        if d.final:
            break
        rounds += 1
        backlog = int(d.num_tokens * extend_ratio)
    assert decisions[0].mode is HandoffMode.CATCH_UP
    assert all(d.mode is HandoffMode.CATCH_UP for d in decisions)
    assert len(decisions) <= POLICY.max_rounds + 1
    assert decisions[-1].num_tokens <= POLICY.catch_up_threshold or rounds == POLICY.max_rounds


def test_policy_and_state_validate():
    with pytest.raises(ValueError, match="backlog_tokens"):
        HandoffState(-1, True, 0.0)
    with pytest.raises(ValueError, match="rld_load"):
        HandoffState(1, True, float("nan"))
    with pytest.raises(ValueError, match="max_rounds"):
        HandoffPolicy(max_rounds=0)
    with pytest.raises(ValueError, match="catch_up_threshold"):
        HandoffPolicy(catch_up_threshold=-1)
    assert isinstance(HandoffPolicy(catch_up_threshold=0).decide(HandoffState(0, True, 0.0)), HandoffDecision)


# ---- assembler ---------------------------------------------------------------------------------

@st.composite
def deliveries(draw):
    """RLD's output split into batches, then delivered with drops (resent later),
    duplicates, stale partial resends, and any order."""
    start = draw(st.integers(0, 10_000))
    tokens = draw(st.lists(st.integers(0, 2**32 - 1), max_size=80))
    cuts = sorted(draw(st.lists(st.integers(0, len(tokens)), max_size=6)))
    messages = split_into_messages("req", start, tokens, cuts + [len(tokens)],
                                   sampler_state=SamplerState(7, len(tokens), len(tokens)))
    wire = []
    for m in messages:
        copies = draw(st.integers(1, 3))  # 1 = sent once; more = duplicates / resends after drops
        wire += [m] * copies
        if m.token_ids and draw(st.booleans()):  # a resend that re-splits the batch
            cut = draw(st.integers(0, len(m.token_ids)))
            wire.append(Handoff("req", m.seq, m.start_pos, m.token_ids[:cut], 0))
    order = draw(st.permutations(wire))
    as_bytes = draw(st.booleans())
    return start, tokens, [m.encode() if as_bytes else m for m in order]


@fast(200)
@given(deliveries())
def test_assembler_reproduces_rld_output_exactly(case):
    start, tokens, wire = case
    asm = HandoffAssembler("req", start)
    got, next_pos, finals = [], start, 0
    for m in wire:
        for r in asm.accept(m):
            assert r.start_pos == next_pos, "ranges must be contiguous"
            got.extend(r.token_ids)
            next_pos = r.end_pos
            finals += r.final
    assert got == tokens
    assert asm.done and asm.tokens == tuple(tokens) and finals == 1
    assert asm.end_pos == start + len(tokens)
    assert asm.sampler_state == SamplerState(7, len(tokens), len(tokens))
    for m in wire:  # idempotent after completion
        assert asm.accept(m) == []


def test_assembler_yields_only_contiguous_ranges():
    asm = HandoffAssembler("r", 100)
    m0, m1, m2 = split_into_messages("r", 100, list(range(10)), [3, 6, 10])
    assert asm.accept(m2) == [] and asm.accept(m1) == []
    [r] = asm.accept(m0)
    assert (r.start_pos, r.token_ids, r.final) == (100, tuple(range(10)), True)
    assert asm.done


def test_assembler_signals_an_empty_final():
    asm = HandoffAssembler("r", 5)
    m0, m1 = split_into_messages("r", 5, [1, 2], [2, 2])
    assert [r.final for r in asm.accept(m0)] == [False]
    assert not asm.done
    [r] = asm.accept(m1)
    assert r.final and r.token_ids == () and asm.done


@pytest.mark.parametrize("second, message", [
    (Handoff("r", 1, 11, [9, 3], 0), "says token 9 at position 11"),
    (Handoff("r", 1, 12, [3, 4, 5], 0), "FINAL message ends at 13"),
    (Handoff("r", 1, 10, [1], FINAL), "earlier FINAL ended at 13"),
    (Handoff("other", 0, 10, [1], 0), "reached the assembler of 'r'"),
    (Handoff("r", 0, 9, [1], 0), "before this handoff's start 10"),
])
def test_assembler_rejects_conflicts_without_changing_state(second, message):
    asm = HandoffAssembler("r", 10)
    asm.accept(Handoff("r", 0, 10, [1, 2, 3], FINAL))
    with pytest.raises(HandoffError, match=message):
        asm.accept(second)
    assert asm.tokens == (1, 2, 3) and asm.done


def test_assembler_rejects_pending_conflict_and_garbage():
    asm = HandoffAssembler("r", 0)
    asm.accept(Handoff("r", 1, 5, [7, 8], 0))
    with pytest.raises(HandoffError, match="says token 9 at position 6"):
        asm.accept(Handoff("r", 2, 6, [9], 0))
    with pytest.raises(HandoffError, match="tokens up to position 7 but the FINAL message ends at 5"):
        asm.accept(Handoff("r", 0, 0, [1, 2, 3, 4, 5], FINAL))
    with pytest.raises(HandoffError, match="bad magic"):
        asm.accept(b"garbage-garbage-garbage")
    assert asm.next_pos == 0 and asm.end_pos is None
    with pytest.raises(ValueError, match="start_pos"):
        HandoffAssembler("r", -1)


def test_assembler_holds_at_most_max_window_tokens_ahead():
    """Tokens past next_pos + max_window are refused (nothing buffered); up to it they wait,
    and once the gap fills they are delivered."""
    asm = HandoffAssembler("r", 100, max_window=64)
    with pytest.raises(HandoffError, match="more than max_window=64 tokens past the first missing position 100"):
        asm.accept(Handoff("r", 1, 101, list(range(64)), 0))
    assert asm._pending == {} and asm.next_pos == 100
    assert asm.accept(Handoff("r", 1, 101, list(range(63)), 0)) == []  # ends exactly at 100 + 64
    [r] = asm.accept(Handoff("r", 0, 100, [7], 0))
    assert r.token_ids == (7, *range(63)) and asm.next_pos == 164
    asm.accept(Handoff("r", 2, 164, list(range(64)), FINAL))  # the window moves with next_pos
    assert asm.done and len(asm.tokens) == 128
    with pytest.raises(ValueError, match="max_window"):
        HandoffAssembler("r", 0, max_window=0)


def _lines_run(fn) -> int:
    """Python lines executed by ``fn()`` (a cost measure that does not depend on the clock)."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def test_assembler_cost_per_message_does_not_grow_with_what_it_holds():
    """After FINAL, with 10 or with 20,000 tokens held behind a gap, accepting one more
    one-token message executes the same number of Python lines."""
    costs = []
    for held in (10, 20_000):
        asm = HandoffAssembler("r", 0, max_window=1 << 16)
        asm.accept(Handoff("r", 9, 2, list(range(held)), FINAL))  # position 0 and 1 missing
        costs.append(_lines_run(lambda: asm.accept(Handoff("r", 10, 3, [1], 0))))
    assert costs[0] == costs[1]


def test_split_into_messages_validates_batches():
    with pytest.raises(ValueError, match="non-decreasing"):
        split_into_messages("r", 0, [1, 2, 3], [2, 1, 3])
    with pytest.raises(ValueError, match="end at 3"):
        split_into_messages("r", 0, [1, 2, 3], [2])
