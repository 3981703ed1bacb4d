"""`pddcore.serve`: PDD in front of stock engine servers (``pddcore serve``).

An OpenAI-compatible gateway that runs every PDD mechanism through the engines' own HTTP
APIs — vLLM's ``/inference/v1/generate`` with ``kv_transfer_params``, or SGLang's
``/generate`` with the bootstrap fields of its PD mode (the reference engine of
:mod:`pddcore.engine` speaks either): hit-rate-aware routing
over P_MD / P_RLD_MD / RLD_ONLY, dual send (RLD pulls inside the datacenter while MD
prefetches across the WAN), the one-shot and catch-up token-id handoffs (MD's prefix-cache
hit plus an extend over the handed-off tokens), and recovery when an engine fails.

One job per file: ``openai_api`` (the request and response dialect), ``upstream`` (one
engine's HTTP client, vLLM's dialect), ``sglang_upstream`` (the same in SGLang's),
``pipelines`` (how each dialect moves KV from P to a decoder), ``placement`` (load balance,
MD prefix estimates), ``gateway`` (one request's orchestration), ``metrics`` (Prometheus),
``app`` (HTTP routes), ``launch`` and ``cli``.

Example (three reference engines and the gateway, then any OpenAI client)::

    pddcore engine --role prefill --port 8100 &
    pddcore engine --role decode --port 8200 &     # RLD
    pddcore engine --role decode --port 8300 &     # MD
    pddcore serve --engine reference --prefill http://127.0.0.1:8100 \\
        --relay http://127.0.0.1:8200 --main http://127.0.0.1:8300 --port 8080
"""

from .gateway import Gateway, GatewayConfig, GatewayError, RequestTrace
from .metrics import GatewayMetrics
from .upstream import Upstream, UpstreamError

__all__ = ["Gateway", "GatewayConfig", "GatewayError", "RequestTrace", "GatewayMetrics", "Upstream",
           "UpstreamError"]
