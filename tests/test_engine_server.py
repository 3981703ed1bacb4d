"""`pddcore engine` on its own: vLLM's tokens-in/tokens-out dialect, KV pulled between two
engine processes (only the pages the decode engine lacks), leases, and clear refusals."""

from __future__ import annotations

import random

import pytest
import requests

from pddcore.engine.tokenizer import ByteTokenizer
from serve_cluster import engine


@pytest.fixture(scope="module")
def pair():
    p, d = engine("prefill"), engine("decode")
    yield p, d
    p.stop()
    d.stop()


def generate(proc, prompt, max_tokens, kv=None, expect=200):
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
    if kv is not None:
        body["kv_transfer_params"] = kv
    r = requests.post(proc.url + "/inference/v1/generate", json=body, timeout=120)
    assert r.status_code == expect, r.text
    return r.json()


def test_byte_tokenizer_round_trips_text_and_renders_model_tokens():
    tok = ByteTokenizer(4096)
    text = "PDD: prefill → relay → main ✓"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([3000, *tok.encode("ok")]) == "<3000>ok"
    with pytest.raises(ValueError, match="at least"):
        ByteTokenizer(100)


def test_decode_pulls_only_the_pages_it_lacks(pair):
    p, d = pair
    page_bytes = int(p.get("/pdd/info")["kv_bytes_per_token"] * 16)
    rng = random.Random(1)
    prompt = [rng.randrange(16, 4096) for _ in range(83)]
    local = generate(d, prompt, 12)["choices"][0]["token_ids"]  # d now caches the prompt's 5 whole pages
    longer = prompt + local + [rng.randrange(16, 4096) for _ in range(40)]
    expected = generate(p, longer, 9)["choices"][0]["token_ids"]
    kv = generate(p, longer, 1, {"do_remote_decode": True})["kv_transfer_params"]
    assert kv["do_remote_prefill"] and kv["remote_num_tokens"] == len(longer)
    before = d.get("/pdd/state")
    out = generate(d, longer, 9, kv)
    after = d.get("/pdd/state")
    held = (len(prompt) + len(local) - 1) // 16  # pages d cached from its own request
    assert out["choices"][0]["token_ids"] == expected
    assert after["bytes_received"] - before["bytes_received"] == ((len(longer) - 1) // 16 - held) * page_bytes
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == held * 16


def test_a_lease_serves_as_many_pulls_as_consumers_then_refuses(pair):
    p, d = pair
    prompt = [random.Random(2).randrange(16, 4096) for _ in range(50)]
    expected = generate(p, prompt, 6)["choices"][0]["token_ids"]
    kv = generate(p, prompt, 1, {"do_remote_decode": True, "pdd_consumers": 2})["kv_transfer_params"]
    extra = [engine("decode"), engine("decode")]  # empty caches: each must pull
    try:
        for consumer in (d, extra[0]):
            assert generate(consumer, prompt, 6, kv)["choices"][0]["token_ids"] == expected
        refused = generate(extra[1], prompt, 6, kv, expect=502)
        assert "no KV held" in refused["error"]["message"]
    finally:
        for proc in extra:
            proc.stop()


@pytest.mark.parametrize("where, kv, words", [
    ("d", {"do_remote_decode": True}, "send it to a prefill engine"),
    ("p", {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1}, "send it to a decode engine"),
    ("p", {"do_remote_decode": True, "pdd_consumers": 0}, "pdd_consumers"),
    ("d", {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "x"},
     "cannot reach the producer"),
])
def test_unusable_kv_transfer_params_are_refused_clearly(pair, where, kv, words):
    p, d = pair
    proc = p if where == "p" else d
    answer = generate(proc, list(range(20, 60)), 2, kv, expect=502 if "reach" in words else 400)
    assert words in answer["error"]["message"]
    assert proc.get("/pdd/state")["running"] == 0


def test_a_write_to_a_decode_engine_that_went_away_is_retired_not_raised():
    """A decode engine killed while P writes the pages it pulled: P's model loop retires
    the failed write (and counts it) instead of failing on it at every iteration."""
    import torch

    from pddcore.engine.kv_link import KvProducer, _Send
    from pddcore.model import Model
    from pddcore.transfer import TransferEngine, TransferError, new_auth_token

    token = new_auth_token()
    # 8 Mbit/s: the 16 MiB write needs 16 s (more than any burst the pacer allows), so the
    # decode engine is gone long before it ends.
    nbytes = 16 << 20
    p, d = TransferEngine(auth_token=token, rate_limit_bps=8e6), TransferEngine(auth_token=token)
    try:
        producer = KvProducer(p, Model.default(seed=0).new_pool(8, 16), "p-test", lease_s=60)
        dst = d.register(torch.zeros(nbytes, dtype=torch.uint8), target=True).descriptor()
        src = p.register(torch.ones(nbytes, dtype=torch.uint8))
        transfer = p.write(p.connect(d.address), src, 0, dst, 0, nbytes)
        producer.sends.append(_Send(transfer, src, "r"))
        d.close()
        with pytest.raises(TransferError):
            transfer.wait(60)
        producer.poll()
        assert producer.sends == [] and producer.sends_failed == 1 and not producer.busy
        with pytest.raises(ValueError):
            p.unregister(src)  # the failed write's source was released with it
    finally:
        p.close()
