"""The control messages between producer and consumer workers (each names the request it
concerns under ``req``):

* ``pull`` (consumer -> each producer rank it needs): request ``req``'s blocks
  ``[skip_blocks, skip_blocks + num_blocks)``, the producer's local heads ``src_heads``
  (None: all), written into the consumer's region ``region`` (hex descriptor) at ``offset``,
  ``seg_bytes`` long; ``d_req`` is the consumer's request id, ``d_tp`` its TP size and
  ``reply`` its engine address;
* ``done`` (the producer's write notification): rank ``src``'s share of ``req`` landed;
* ``fail`` (either way): ``req`` failed for ``reason``;
* ``drop`` (consumer -> producer): the consumer aborted ``req`` before pulling it.

Example::

    MESSAGES.encode("done", req="d-1", src=0)          # b'PDDVLLM1{"k": "done", "req": "d-1", "src": 0}'
"""

from __future__ import annotations

from .._messages import MessageCodec, is_head_range, is_hex, is_int, is_str

__all__ = ["MAGIC", "MESSAGES"]

MAGIC = b"PDDVLLM1"
MESSAGES = MessageCodec(MAGIC, "PDDConnector", key="req", key_check=is_str, kinds={
    "pull": {"d_req": is_str, "skip_blocks": is_int, "num_blocks": is_int, "d_tp": is_int, "src_heads": is_head_range,
             "region": is_hex, "offset": is_int, "seg_bytes": is_int, "reply": is_str},
    "done": {"src": is_int},
    "fail": {"reason": is_str},
    "drop": {},
})
