"""`pddcore.engine`: a reference inference engine server on the CPU (``pddcore engine``).

It serves the subset of vLLM's HTTP dialect that a PDD gateway (:mod:`pddcore.serve`)
drives — tokens in / tokens out, OpenAI completions, ``kv_transfer_params`` — or, with
``--dialect sglang``, SGLang's PD-mode ``/generate`` with bootstrap rooms, over
:mod:`pddcore.model`, so the whole PDD flow runs end to end without a GPU, in CI and
across the emulated WAN. KV moves between engines with :class:`pddcore.TransferEngine`
pulls (:mod:`.kv_link`); each engine keeps a prefix cache, so a decode engine pulls only
the pages it lacks.

One job per file: ``tokenizer`` (bytes as tokens), ``kv_link`` (leases and pulls),
``scheduler`` (the model thread), ``server`` (HTTP routes), ``sglang_server`` (the same in
SGLang's dialect), ``cli``.

Example (two engines and one P -> D request, by hand)::

    pddcore engine --role prefill --port 8100 &
    pddcore engine --role decode --port 8200 &
    curl -s localhost:8100/inference/v1/generate -d '{"token_ids": [20, 21, 22],
         "sampling_params": {"max_tokens": 1}, "kv_transfer_params": {"do_remote_decode": true}}'
    # then POST the returned kv_transfer_params with the same token_ids to :8200
"""

from .scheduler import GenerationRequest, Scheduler
from .server import EngineServer
from .tokenizer import ByteTokenizer

__all__ = ["EngineServer", "Scheduler", "GenerationRequest", "ByteTokenizer"]
