"""Per-request pipeline choice for PDD (:mod:`.routing`: :class:`Router` picks ``P_MD``,
``P_RLD_MD`` or ``RLD_ONLY``), and what it prices WAN transfers with: the bandwidth
estimate (:mod:`.bandwidth`: :class:`BandwidthEstimator`) and, when P sends the KV
through a codec, the compression ratio its sends showed (:mod:`.compression`:
:class:`CompressionEstimator`).

Example::

    estimator = BandwidthEstimator()
    estimator.update_from_stats(engine.stats(), now=t)           # TransferEngine counters
    link = estimator.estimate("md-0", now=t)
    router = Router(RouterConfig(kv_bytes_per_token=layout))     # or a plain number
    route = router.route(RouteRequest(prompt_tokens=65536, md_cached_tokens=60000,
                                      wan_bytes_per_s=link.bytes_per_s, wan_rtt_s=link.rtt_s,
                                      expected_output_tokens=300, prefill_s=1.2))
    route.pipeline, route.bytes_to_md, route.reason
"""

from .bandwidth import BandwidthEstimator, LinkEstimate
from .compression import CompressionEstimator
from .routing import Pipeline, Route, RouteRequest, Router, RouterConfig

__all__ = ["Pipeline", "RouterConfig", "RouteRequest", "Route", "Router", "LinkEstimate", "BandwidthEstimator",
           "CompressionEstimator"]
