"""`pddcore.deploy`: PDD as real OS processes on an emulated WAN (``pddcore demo``): the
``pddcore serve`` gateway (:mod:`pddcore.serve`) in front of ``pddcore engine`` reference
servers (:mod:`pddcore.engine`), driven over HTTP by a trace player.

One job per file: ``network`` (kernel WAN emulator or userspace relay, and where each
process runs), ``cluster`` (starts, watches and ends one deployment, injects its faults),
``client`` (the trace player), ``trace`` (the agentic scenario), ``reference`` (the
single-process oracle), ``report`` (metrics, table, plot, the run explained), ``demo``
(both modes plus the oracle) and ``cli``.

Routing, handoffs and fault handling are the gateway's (:mod:`pddcore.serve.gateway`):
the demo has no orchestration of its own. KV moves as the engines pull it
(:mod:`pddcore.engine.kv_link` over :class:`pddcore.TransferEngine`); a handoff is the
gateway sending MD the context plus the delivered token ids.

Example::

    from pddcore.deploy import Network, agentic_trace, run_demo

    with Network(bandwidth_bps=100e6, delay_ms=25) as net:
        result = run_demo(agentic_trace(8), net)
    result["metrics"]["pdd"]["ttft_s"], result["correctness"]["pdd"]["pass"]
"""

from .cluster import DeploymentError, RunConfig, RunResult, run_deployment
from .demo import run_demo
from .network import Network
from .trace import Scenario, Session, agentic_trace

__all__ = ["run_demo", "run_deployment", "RunConfig", "RunResult", "DeploymentError", "Network", "agentic_trace",
           "Scenario", "Session"]
