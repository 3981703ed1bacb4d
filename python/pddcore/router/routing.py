"""Per-request pipeline choice for PDD.

:class:`Router` picks one of three pipelines for a request:

* ``P_MD``: P sends MD the KV it lacks, MD decodes everything. Chosen when that KV
  arrives within the TTFT budget; high prefix-hit requests land here because MD's radix
  cache already holds most of their prompt (hit-rate-aware routing).
* ``P_RLD_MD``: RLD (next to P) starts decoding at once; MD takes over after the
  token-id handoff (:mod:`pddcore.handoff`).
* ``RLD_ONLY``: singular traffic: the output is so short that RLD finishes before MD
  would be ready, or the WAN time of the transfer exceeds the RLD time MD would save.
  The MD transfer is not started (or cancelled).

The model behind it, in seconds from the request's arrival at P::

    wire_bytes = bytes_to_md / kv_compression_ratio
    md_ready = prefill + rtt + wire_bytes / wan_bytes_per_s
    rld_done = prefill + output_tokens * rld_tpot

``rtt`` covers MD's page-allocation reply and the last chunk's flight. When P sends the
KV through a :mod:`pddcore.codec` codec, the WAN carries its frames, not the raw KV:
``kv_compression_ratio`` (raw bytes / wire bytes; 1.0 without a codec) turns one into
the other, fixed in :class:`RouterConfig` or learned per request by a
:class:`~pddcore.router.CompressionEstimator`. Everything is pure arithmetic on the
inputs (no clock, no I/O), so the simulator and the real deployment decide
identically. Example::

    router = Router(RouterConfig(kv_bytes_per_token=layout))   # or a plain number
    link = estimator.estimate("md-0")
    route = router.route(RouteRequest(prompt_tokens=65536, md_cached_tokens=60000,
                                      wan_bytes_per_s=link.bytes_per_s, wan_rtt_s=link.rtt_s,
                                      expected_output_tokens=300, prefill_s=1.2))
    route.pipeline, route.bytes_to_md, route.reason

    # P sends through the zstd codec; the ratio its completed sends showed so far:
    ratios = CompressionEstimator()
    ratios.observe(raw_bytes=kv.nbytes, wire_bytes=transfer.nbytes)   # after each send_compressed
    router.route(RouteRequest(..., kv_compression_ratio=ratios.ratio))
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from ._checks import check_nonneg, check_positive

__all__ = ["Pipeline", "RouterConfig", "RouteRequest", "Route", "Router"]


class Pipeline(enum.Enum):
    P_MD = "P_MD"
    P_RLD_MD = "P_RLD_MD"
    RLD_ONLY = "RLD_ONLY"


def _kv_bytes_per_token(value: Any) -> float:
    """A plain number, or anything with ``bytes_per_token()`` (a :class:`pddcore.KVLayout`)."""
    if hasattr(value, "bytes_per_token"):
        value = value.bytes_per_token()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ValueError(f"kv_bytes_per_token must be a positive finite number or a KVLayout, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class RouterConfig:
    """Deployment-wide routing thresholds.

    * ``kv_bytes_per_token``: KV bytes one token occupies, summed over layers; a number
      or a :class:`pddcore.KVLayout` (its ``bytes_per_token()`` is taken).
    * ``ttft_slo_s`` (default 3.0 s): the TTFT budget MD must meet for ``P_MD``. 3 s is a
      common interactive target for long agentic prompts; set it from your SLA.
    * ``rld_tpot_s`` (default 0.03 s): RLD's time per output token at its usual batch,
      about what an H100 needs per decode step over a 64K context at moderate batch.
    * ``min_md_tokens`` (default 16): MD must produce at least this many tokens after
      it takes over, else the handoff's extend pass and bookkeeping outweigh the gain
      and RLD finishes alone.
    * ``wan_value_ratio`` (default 1.0): a transfer is worth it while its WAN time is at
      most this multiple of the RLD decode time MD saves. At 1.0 one second of the WAN
      link is priced like one second of an RLD decode slot: both are the scarce shared
      resources PDD protects. Raise it when WAN capacity is cheap, lower it when scarce.
    * ``rld_full_load`` (default 1.0): at or above this RLD busy fraction RLD has no free
      slot, so every request goes ``P_MD`` (slow beats queued).
    * ``prefill_tokens_per_s`` (default None): P's prefill speed, to estimate the prefill
      time of requests that do not state ``prefill_s``; None treats prefill as 0.
    * ``kv_compression_ratio`` (default 1.0: no codec): raw KV bytes per byte that crosses
      the WAN, when P sends the KV through a :mod:`pddcore.codec` codec. The transfer is
      priced at ``bytes_to_md / kv_compression_ratio`` bytes. Take it from the ratio
      column of ``pddcore bench --cases codec`` for your model's KV dtype, or leave it at
      1.0 and pass each request the ratio a :class:`~pddcore.router.CompressionEstimator`
      learned from the sends so far (``RouteRequest.kv_compression_ratio``).
    """

    kv_bytes_per_token: Any
    ttft_slo_s: float = 3.0
    rld_tpot_s: float = 0.03
    min_md_tokens: int = 16
    wan_value_ratio: float = 1.0
    rld_full_load: float = 1.0
    prefill_tokens_per_s: float | None = None
    kv_compression_ratio: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "kv_bytes_per_token", _kv_bytes_per_token(self.kv_bytes_per_token))
        object.__setattr__(self, "kv_compression_ratio",
                           check_positive("kv_compression_ratio", self.kv_compression_ratio))
        for name in ("ttft_slo_s", "wan_value_ratio"):
            check_nonneg(name, getattr(self, name))
        check_nonneg("min_md_tokens", self.min_md_tokens, integer=True)
        for name in ("rld_tpot_s", "rld_full_load"):
            value = getattr(self, name)
            check_nonneg(name, value)
            if value == 0:
                raise ValueError(f"{name} must be > 0")
        check_nonneg("prefill_tokens_per_s", self.prefill_tokens_per_s, optional=True)
        if self.prefill_tokens_per_s == 0:
            raise ValueError("prefill_tokens_per_s must be > 0 or None")


@dataclass(frozen=True)
class RouteRequest:
    """One request as the router sees it.

    ``prompt_tokens``: prompt length. ``p_cached_tokens``: prefix P holds (P prefills the
    rest). ``md_cached_tokens``: prefix MD holds (from its :class:`pddcore.radix.RadixCache`;
    P sends the rest). ``expected_output_tokens`` / ``max_output_tokens``: the expected
    length is used when known, else the maximum; with neither, the singular filter is off.
    ``wan_bytes_per_s`` / ``wan_rtt_s``: the P->MD link now (:class:`BandwidthEstimator`).
    ``rld_load``: RLD busy fraction. ``prefill_s``: expected prefill time, if known.
    ``ttft_slo_s``, ``kv_bytes_per_token`` and ``kv_compression_ratio`` override the
    config for this request (the last: e.g. ``CompressionEstimator.ratio``).
    """

    prompt_tokens: int
    wan_bytes_per_s: float
    wan_rtt_s: float = 0.0
    p_cached_tokens: int = 0
    md_cached_tokens: int = 0
    expected_output_tokens: int | None = None
    max_output_tokens: int | None = None
    rld_load: float = 0.0
    prefill_s: float | None = None
    ttft_slo_s: float | None = None
    kv_bytes_per_token: float | None = None
    kv_compression_ratio: float | None = None

    def __post_init__(self):
        for name in ("prompt_tokens", "p_cached_tokens", "md_cached_tokens"):
            check_nonneg(name, getattr(self, name), integer=True)
        for name in ("expected_output_tokens", "max_output_tokens"):
            check_nonneg(name, getattr(self, name), integer=True, optional=True)
        for name in ("wan_rtt_s", "rld_load"):
            check_nonneg(name, getattr(self, name))
        for name in ("prefill_s", "ttft_slo_s"):
            check_nonneg(name, getattr(self, name), optional=True)
        check_nonneg("wan_bytes_per_s", self.wan_bytes_per_s)
        if self.wan_bytes_per_s == 0:
            raise ValueError("wan_bytes_per_s must be > 0 (BandwidthEstimator keeps a floor)")
        for name in ("p_cached_tokens", "md_cached_tokens"):
            if getattr(self, name) > self.prompt_tokens:
                raise ValueError(f"{name}={getattr(self, name)} exceeds prompt_tokens={self.prompt_tokens}")
        if self.kv_bytes_per_token is not None:
            object.__setattr__(self, "kv_bytes_per_token", _kv_bytes_per_token(self.kv_bytes_per_token))
        if self.kv_compression_ratio is not None:
            object.__setattr__(self, "kv_compression_ratio",
                               check_positive("kv_compression_ratio", self.kv_compression_ratio))


@dataclass(frozen=True)
class Route:
    """The decision. ``bytes_to_md``: KV bytes P sends MD (0 for ``RLD_ONLY``);
    ``wire_bytes_to_md``: what of them crosses the WAN after the codec, the bytes the
    transfer was priced at (``bytes_to_md`` without one). ``expected_md_ready_s``: when MD
    would hold the prompt's KV, from arrival at P (``inf`` for ``RLD_ONLY``). ``reason``:
    the decision in words, with its numbers."""

    pipeline: Pipeline
    bytes_to_md: int
    expected_md_ready_s: float
    reason: str
    tokens_to_md: int = 0
    wire_bytes_to_md: int = 0


class Router:
    """Decides a :class:`Route` per request from a :class:`RouterConfig`; stateless and
    deterministic, so one instance can serve many threads and the simulator."""

    def __init__(self, config: RouterConfig):
        if not isinstance(config, RouterConfig):
            raise ValueError(f"config must be a RouterConfig, got {type(config).__name__}")
        self.config = config

    def route(self, req: RouteRequest) -> Route:
        cfg = self.config
        bpt = req.kv_bytes_per_token or cfg.kv_bytes_per_token
        slo = cfg.ttft_slo_s if req.ttft_slo_s is None else req.ttft_slo_s
        tokens_to_md = req.prompt_tokens - req.md_cached_tokens
        ratio = req.kv_compression_ratio or cfg.kv_compression_ratio
        bytes_to_md = math.ceil(tokens_to_md * bpt)
        wire_bytes = math.ceil(bytes_to_md / ratio)
        prefill_s = self._prefill_s(req)
        transfer_s = wire_bytes / req.wan_bytes_per_s
        md_ready = prefill_s + req.wan_rtt_s + transfer_s
        sends = f"MD lacks {tokens_to_md} of {req.prompt_tokens} tokens ({bytes_to_md / 1e6:.1f} MB"
        sends += ")" if ratio == 1 else f", {wire_bytes / 1e6:.1f} MB on the WAN at compression ratio {ratio:.3g})"

        if md_ready <= slo:
            return Route(Pipeline.P_MD, bytes_to_md, md_ready,
                         f"{sends}; ready at {md_ready:.2f}s within the TTFT SLO {slo:.2f}s", tokens_to_md,
                         wire_bytes)
        late = f"{sends}; ready at {md_ready:.2f}s, past the TTFT SLO {slo:.2f}s"
        if req.rld_load >= cfg.rld_full_load:
            return Route(Pipeline.P_MD, bytes_to_md, md_ready,
                         f"{late}, but RLD is full (load {req.rld_load:.2f} >= {cfg.rld_full_load:.2f})",
                         tokens_to_md, wire_bytes)

        output = req.expected_output_tokens if req.expected_output_tokens is not None else req.max_output_tokens
        if output is not None:
            which = "expected" if req.expected_output_tokens is not None else "max"
            rld_done = prefill_s + output * cfg.rld_tpot_s
            if rld_done <= md_ready:
                return Route(Pipeline.RLD_ONLY, 0, math.inf,
                             f"{late}; RLD finishes the {which} {output} output tokens at {rld_done:.2f}s, first",
                             0)
            md_tokens = output - math.floor((md_ready - prefill_s) / cfg.rld_tpot_s)
            saved_s = md_tokens * cfg.rld_tpot_s
            if md_tokens < cfg.min_md_tokens:
                return Route(Pipeline.RLD_ONLY, 0, math.inf,
                             f"{late}; MD would take over only {md_tokens} of the {which} {output} output "
                             f"tokens (< min_md_tokens {cfg.min_md_tokens})", 0)
            if transfer_s > cfg.wan_value_ratio * saved_s:
                return Route(Pipeline.RLD_ONLY, 0, math.inf,
                             f"{late}; the transfer holds the WAN {transfer_s:.2f}s to save RLD {saved_s:.2f}s "
                             f"(wan_value_ratio {cfg.wan_value_ratio:g})", 0)
        return Route(Pipeline.P_RLD_MD, bytes_to_md, md_ready,
                     f"{late}; RLD decodes first, MD takes over after the handoff", tokens_to_md, wire_bytes)

    def _prefill_s(self, req: RouteRequest) -> float:
        if req.prefill_s is not None:
            return req.prefill_s
        if self.config.prefill_tokens_per_s is None:
            return 0.0
        return (req.prompt_tokens - req.p_cached_tokens) / self.config.prefill_tokens_per_s
