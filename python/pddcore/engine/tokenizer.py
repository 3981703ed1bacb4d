"""The reference engine's tokenizer: UTF-8 bytes as token ids, so text prompts work with
the embedded model (which ships no vocabulary file) and every prompt round-trips.

Token ``OFFSET + b`` is byte ``b``; ids below ``OFFSET`` are reserved and ids past the byte
range are model-only tokens, rendered as ``<id>`` so a decoded completion is never empty.

Example::

    tok = ByteTokenizer(vocab_size=4096)
    ids = tok.encode("héllo")                   # 6 ids: é is two bytes
    assert tok.decode(ids) == "héllo"
    tok.apply_chat_template([{"role": "user", "content": "hi"}])   # ids of "user: hi\\nassistant: "
"""

from __future__ import annotations

from typing import Mapping, Sequence

__all__ = ["ByteTokenizer"]

OFFSET = 16


class ByteTokenizer:
    def __init__(self, vocab_size: int):
        if vocab_size < OFFSET + 256:
            raise ValueError(f"a byte tokenizer needs a vocabulary of at least {OFFSET + 256}, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [OFFSET + b for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        out, run = [], bytearray()
        for i in ids:
            if OFFSET <= i < OFFSET + 256:
                run.append(i - OFFSET)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run.clear()
            out.append(f"<{i}>")
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: Sequence[Mapping], add_generation_prompt: bool = True) -> list[int]:
        """``role: content`` lines, then ``assistant: `` when a reply is to follow."""
        lines = []
        for m in messages:
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each message needs a string 'role' and a string 'content'")
            lines.append(f"{m['role']}: {m['content']}\n")
        if add_generation_prompt:
            lines.append("assistant: ")
        return self.encode("".join(lines))
