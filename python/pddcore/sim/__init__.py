"""`pddcore.sim`: cluster simulator and cost model for PDD deployments.

It decides exactly as the real system does -- routing through :mod:`pddcore.router`,
handoffs through :class:`pddcore.handoff.HandoffPolicy`, P's and MD's prefix hits through
:class:`pddcore.radix.RadixCache` -- and times everything with compute / memory cost
models of data-sheet hardware. One job per module:

* :mod:`.specs` hardware and model specs; :mod:`.costmodel` prefill / decode / extend time
* :mod:`.engine` the discrete-event loop; :mod:`.links` processor-sharing links
* :mod:`.instances` prefill instances with their prefix caches, continuous-batching decode, KV pools
* :mod:`.workload` synthetic agentic traffic and JSONL traces
* :mod:`.cluster` the three deployments' request flow; :mod:`.metrics` summaries
* :mod:`.economics` cost, billed benefit, BCR; :mod:`.capacity` SLA goodput search
* :mod:`.scenarios`, :mod:`.calibration` the report-like setup, every parameter with its source, the
  table beside the report; :mod:`.sensitivity` one parameter changed at a time; :mod:`.sweeps` sweeps and plots

Example::

    from pddcore.sim import calibration_configs, calibration_trace, run_trace
    trace = calibration_trace()              # 2000 requests, seed 1
    for name, config in calibration_configs().items():
        print(name, run_trace(config, trace)["ttft_p90_s"])
"""

from .capacity import max_goodput, run_trace
from .cluster import ClusterSim
from .costmodel import CostModel
from .deployment import ClusterConfig, Pool
from .economics import Prices, bcr
from .metrics import AccountingError, check_accounting, summarize
from .scenarios import calibration_configs, calibration_trace, three_scenarios
from .specs import HARDWARE, MODELS, HardwareSpec, ModelSpec
from .workload import AgenticConfig, Request, TraceError, agentic, read_jsonl, write_jsonl

__all__ = ["ClusterConfig", "ClusterSim", "Pool", "CostModel", "HardwareSpec", "ModelSpec", "HARDWARE", "MODELS",
           "AgenticConfig", "Request", "TraceError", "agentic", "read_jsonl", "write_jsonl", "Prices", "bcr",
           "AccountingError", "check_accounting", "summarize", "run_trace", "max_goodput", "calibration_configs",
           "calibration_trace", "three_scenarios"]
