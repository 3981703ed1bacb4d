"""Extend-Decode Handoff: the token-ID message RLD sends MD (:mod:`.message`), the one-shot /
catch-up policy that decides when to send it (:mod:`.policy`), and the MD-side assembler
(:mod:`.assembler`).

When MD holds the prompt's KV, RLD does not ship the KV of the tokens it decoded in the
meantime; it sends their **token ids** and MD recomputes their KV with one extend pass.
Everything here is pure Python, free of I/O and deterministic, so the reference
deployment and the simulator run the very same code.

Example::

    msg = Handoff("req-7", seq=0, start_pos=4096, token_ids=[11, 42, 7], flags=FINAL)
    data = msg.encode()                     # 27 bytes on the priority lane
    asm = HandoffAssembler("req-7", start_pos=4096)
    for r in asm.accept(data):              # contiguous ranges, ready for an extend pass
        extend(r.start_pos, r.token_ids)
    assert asm.done
"""

from .assembler import HandoffAssembler, TokenRange, split_into_messages
from .message import (FINAL, HEADER_BYTES, MAGIC, MAX_REQUEST_ID_BYTES, MAX_TOKENS, TRAILER_BYTES, VERSION, Handoff,
                    HandoffError, HandoffFlag, SamplerState)
from .policy import HandoffDecision, HandoffMode, HandoffPolicy, HandoffState

__all__ = [
    "FINAL", "HandoffFlag", "HandoffError", "SamplerState", "Handoff",
    "HandoffMode", "HandoffState", "HandoffDecision", "HandoffPolicy",
    "TokenRange", "HandoffAssembler", "split_into_messages",
]
