"""The control messages between producer and consumer workers (each names the request it
concerns under ``req``):

* ``pull`` (consumer -> each producer rank it needs): request ``req``'s blocks
  ``[skip_blocks, skip_blocks + num_blocks)``, the producer's local heads ``src_heads``
  (None: all), written into the consumer's region ``region`` (hex descriptor) at ``offset``,
  ``seg_bytes`` long; ``d_req`` is the consumer's request id, ``d_engine`` its vLLM
  ``engine_id`` (one per consumer, shared by its ranks), ``d_tp`` its TP size and ``reply``
  its engine address;
* ``done`` (the producer's write notification): rank ``src``'s share of ``req`` landed;
* ``fail`` (either way): ``req`` failed for ``reason``;
* ``drop`` (consumer -> producer): consumer ``d_engine``'s request ``d_req`` needs nothing
  from this producer rank: it aborted before pulling, or (MLA) no rank of its TP size reads it;
* ``alive`` (consumer -> producer, a heartbeat): a consumer still waits for ``req``'s KV, so
  its lease starts again; ``key`` is the lease key of the producer's answer (``pdd_lease_key``),
  which only an engine handed the request holds.

Push mode (``req`` is the producer's request id, which also keys the layer stream):

* ``reserve`` (producer -> consumer rank): a push buffer of ``nbytes`` for a stream of
  ``num_layers`` layers, answered at ``reply`` (the producer's engine address);
* ``reserved`` (the answer): the buffer is the consumer's region ``region`` (hex
  descriptor) from ``offset`` on;
* ``refused`` (the other answer): no push buffer, for ``reason``;
* ``stream_failed`` (producer -> consumer): the stream of ``req`` will not complete.

Example::

    MESSAGES.encode("done", req="d-1", src=0)          # b'PDDVLLM1{"k": "done", "req": "d-1", "src": 0}'
"""

from __future__ import annotations

from .._messages import MessageSchema, is_head_range, is_hex, is_int, is_str

__all__ = ["MAGIC", "MESSAGES"]

MAGIC = b"PDDVLLM1"
MESSAGES = MessageSchema(MAGIC, "PDDConnector", key="req", key_check=is_str, kinds={
    "pull": {"d_req": is_str, "d_engine": is_str, "skip_blocks": is_int, "num_blocks": is_int, "d_tp": is_int, "src_heads": is_head_range,
             "region": is_hex, "offset": is_int, "seg_bytes": is_int, "reply": is_str},
    "done": {"src": is_int},
    "fail": {"reason": is_str},
    "drop": {"d_req": is_str, "d_engine": is_str},
    "alive": {"key": is_hex},
    "reserve": {"nbytes": is_int, "num_layers": is_int, "reply": is_str},
    "reserved": {"region": is_hex, "offset": is_int},
    "refused": {"reason": is_str},
    "stream_failed": {"reason": is_str},
})
