"""`pddcore.deploy`: the reference PDD deployment as real OS processes (``pddcore demo``).

One job per file:

* ``front`` — the router in front (:mod:`pddcore.router`), request lifecycle, output
  ownership checks, fault handling; ``prefill`` — P; ``relay_decode`` — RLD;
  ``main_decode`` — MD; ``client`` — the trace-playing client driver.
* ``decoding`` (the decode loop RLD and MD share), ``node`` (front connection, model,
  engine; the prefix cache is :mod:`pddcore.model.prefix_cache`), ``wire`` (engine-lane
  messages), ``staging`` (ranges of the receivers' staging regions), ``launch`` (process
  entry point).
* ``network`` (kernel WAN emulator or userspace relay), ``cluster`` (starts, watches and
  ends one deployment), ``trace`` (the agentic scenario), ``reference`` (the
  single-process oracle), ``report`` (metrics, table, plot), ``demo`` and ``cli``.

Data paths: P -> RLD and P -> MD are :class:`pddcore.TransferEngine` writes of
:func:`pddcore.pack`-ed pages into registered staging regions (the write's
notification says the bytes were verified and applied); RLD -> MD handoffs
(:mod:`pddcore.handoff`) and MD -> RLD readiness go on the engine's priority lane.
Control (routing, token streams) goes over Unix sockets to the front.

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
