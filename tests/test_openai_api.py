"""The OpenAI dialect pieces the gateway and the reference engine share, in process."""

from __future__ import annotations

import asyncio

import pytest

from pddcore.engine.tokenizer import ByteTokenizer
from pddcore.serve.openai_api import BadRequest, TextStream, parse_completion

TOK = ByteTokenizer(4096)


async def _decode(ids):
    return TOK.decode(ids)


def test_text_stream_holds_half_characters_back_and_ends_with_everything():
    ids = TOK.encode("añb")  # ñ is two bytes
    stream = TextStream(_decode)
    deltas = [asyncio.run(stream.add([i])) for i in ids]
    assert deltas == ["a", "", "ñ", "b"]
    assert asyncio.run(stream.add([], final=True)) == ""


def test_text_stream_decodes_at_most_every_interval_and_catches_up_at_the_end():
    calls = []

    async def counting(ids):
        calls.append(len(ids))
        return TOK.decode(ids)

    stream = TextStream(counting, every_s=3600.0)
    ids = TOK.encode("hello")
    deltas = [asyncio.run(stream.add([i])) for i in ids]
    assert deltas == ["h", "", "", "", ""] and calls == [1]
    assert asyncio.run(stream.add([], final=True)) == "ello" and calls == [1, 5]


@pytest.mark.parametrize("body, words", [
    ([], "JSON object"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": [1, -2]}, "token ids"),
    ({"prompt": "x", "logprobs": 2}, "logprobs"),
    ({"prompt": "x", "stream_options": 3}, "stream_options"),
])
def test_bad_completion_bodies_name_their_problem(body, words):
    with pytest.raises(BadRequest, match=words):
        parse_completion(body, chat=False)


def test_a_completion_body_normalizes_to_vllm_sampling():
    req = parse_completion({"prompt": [[5, 6]], "max_tokens": 3, "top_k": -1, "seed": 9, "temperature": 0,
                            "stop_token_ids": [7], "stream": True, "stream_options": {"include_usage": True}},
                           chat=False)
    assert req.prompt == [5, 6] and req.stream and req.include_usage
    assert req.sampling() == {"max_tokens": 3, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "ignore_eos": False,
                              "stop_token_ids": [7], "seed": 9}
