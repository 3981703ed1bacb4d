"""Per-request pipeline choice for PDD, and the WAN bandwidth estimate it prices with.

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

    md_ready = prefill + rtt + bytes_to_md / wan_bytes_per_s
    rld_done = prefill + output_tokens * rld_tpot

``rtt`` covers MD's page-allocation reply and the last chunk's flight. Everything is
pure arithmetic on the inputs (no clock, no I/O), so the simulator and the real
deployment decide identically. Example::

    router = Router(RouterConfig(kv_bytes_per_token=layout))   # or a plain number
    link = estimator.estimate("md-0")
    route = router.route(RouteRequest(prompt_tokens=65536, md_cached_tokens=60000,
                                      wan_bytes_per_s=link.bytes_per_s, wan_rtt_s=link.rtt_s,
                                      expected_output_tokens=300, prefill_s=1.2))
    route.pipeline, route.bytes_to_md, route.reason
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping

__all__ = ["Pipeline", "RouterConfig", "RouteRequest", "Route", "Router", "LinkEstimate", "BandwidthEstimator"]


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


def _check_nonneg(name: str, value: Any, *, integer: bool = False, optional: bool = False) -> None:
    if value is None and optional:
        return
    if integer:
        ok = type(value) is int and value >= 0
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 and not math.isinf(value)
    if not ok:
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"{name} must be {kind} >= 0{' or None' if optional else ''}, got {value!r}")


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
    """

    kv_bytes_per_token: Any
    ttft_slo_s: float = 3.0
    rld_tpot_s: float = 0.03
    min_md_tokens: int = 16
    wan_value_ratio: float = 1.0
    rld_full_load: float = 1.0
    prefill_tokens_per_s: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "kv_bytes_per_token", _kv_bytes_per_token(self.kv_bytes_per_token))
        for name in ("ttft_slo_s", "wan_value_ratio"):
            _check_nonneg(name, getattr(self, name))
        _check_nonneg("min_md_tokens", self.min_md_tokens, integer=True)
        for name in ("rld_tpot_s", "rld_full_load"):
            value = getattr(self, name)
            _check_nonneg(name, value)
            if value == 0:
                raise ValueError(f"{name} must be > 0")
        _check_nonneg("prefill_tokens_per_s", self.prefill_tokens_per_s, optional=True)
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
    ``ttft_slo_s`` and ``kv_bytes_per_token`` override the config for this request.
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

    def __post_init__(self):
        for name in ("prompt_tokens", "p_cached_tokens", "md_cached_tokens"):
            _check_nonneg(name, getattr(self, name), integer=True)
        for name in ("expected_output_tokens", "max_output_tokens"):
            _check_nonneg(name, getattr(self, name), integer=True, optional=True)
        for name in ("wan_rtt_s", "rld_load"):
            _check_nonneg(name, getattr(self, name))
        for name in ("prefill_s", "ttft_slo_s"):
            _check_nonneg(name, getattr(self, name), optional=True)
        _check_nonneg("wan_bytes_per_s", self.wan_bytes_per_s)
        if self.wan_bytes_per_s == 0:
            raise ValueError("wan_bytes_per_s must be > 0 (BandwidthEstimator keeps a floor)")
        for name in ("p_cached_tokens", "md_cached_tokens"):
            if getattr(self, name) > self.prompt_tokens:
                raise ValueError(f"{name}={getattr(self, name)} exceeds prompt_tokens={self.prompt_tokens}")
        if self.kv_bytes_per_token is not None:
            object.__setattr__(self, "kv_bytes_per_token", _kv_bytes_per_token(self.kv_bytes_per_token))


@dataclass(frozen=True)
class Route:
    """The decision. ``bytes_to_md``: KV bytes P sends MD (0 for ``RLD_ONLY``).
    ``expected_md_ready_s``: when MD would hold the prompt's KV, from arrival at P
    (``inf`` for ``RLD_ONLY``). ``reason``: the decision in words, with its numbers."""

    pipeline: Pipeline
    bytes_to_md: int
    expected_md_ready_s: float
    reason: str
    tokens_to_md: int = 0


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
        bytes_to_md = math.ceil(tokens_to_md * bpt)
        prefill_s = self._prefill_s(req)
        transfer_s = bytes_to_md / req.wan_bytes_per_s
        md_ready = prefill_s + req.wan_rtt_s + transfer_s
        sends = f"MD lacks {tokens_to_md} of {req.prompt_tokens} tokens ({bytes_to_md / 1e6:.1f} MB)"

        if md_ready <= slo:
            return Route(Pipeline.P_MD, bytes_to_md, md_ready,
                         f"{sends}; ready at {md_ready:.2f}s within the TTFT SLO {slo:.2f}s", tokens_to_md)
        late = f"{sends}; ready at {md_ready:.2f}s, past the TTFT SLO {slo:.2f}s"
        if req.rld_load >= cfg.rld_full_load:
            return Route(Pipeline.P_MD, bytes_to_md, md_ready,
                         f"{late}, but RLD is full (load {req.rld_load:.2f} >= {cfg.rld_full_load:.2f})",
                         tokens_to_md)

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
                     f"{late}; RLD decodes first, MD takes over after the handoff", tokens_to_md)

    def _prefill_s(self, req: RouteRequest) -> float:
        if req.prefill_s is not None:
            return req.prefill_s
        if self.config.prefill_tokens_per_s is None:
            return 0.0
        return (req.prompt_tokens - req.p_cached_tokens) / self.config.prefill_tokens_per_s


# ---- bandwidth estimation -------------------------------------------------------------------

@dataclass(frozen=True)
class LinkEstimate:
    """Current view of one link: throughput in bytes/s, round-trip time in seconds, and
    how many throughput samples it rests on (0: the prior)."""

    bytes_per_s: float
    rtt_s: float
    samples: int


@dataclass
class _PeerState:
    bytes_per_s: float | None = None
    rtt_s: float | None = None
    samples: int = 0
    last_sample_at: float | None = None
    counters: tuple[float, float] | None = None  # (bytes, busy seconds) at the last used snapshot


# Key names accepted in TransferEngine.stats() per-peer entries, first match wins.
_STATS_BYTES = ("bytes_sent", "bytes", "tx_bytes", "bytes_acked", "bytes_written")
_STATS_SECONDS = ("seconds_busy", "busy_s", "active_s", "busy_seconds", "elapsed_s", "seconds")
_STATS_RATE = ("throughput_bytes_per_s", "bytes_per_s", "throughput_Bps")
_STATS_RATE_BITS = ("throughput_bps",)
_STATS_RTT_S = ("rtt_s", "srtt_s", "rtt")
_STATS_PEER_ID = ("peer_id", "peer", "address", "id")


def _first(entry: Mapping, keys: tuple[str, ...]) -> Any:
    for key in keys:
        value = entry.get(key)
        if value is not None:
            return value
    return None


@dataclass
class BandwidthEstimator:
    """Per-peer EWMA of observed WAN throughput and RTT, with a floor and a decay.

    Time is passed in (``now``, any monotonic seconds) rather than read, so the
    simulator and the tests are deterministic; without ``now`` nothing decays.

    * ``alpha`` (default 0.25): weight of a new throughput sample. One outlier moves
      the estimate by a quarter; a real change shows after about 4 transfers.
    * ``rtt_alpha`` (default 0.125): the smoothed-RTT gain of TCP (RFC 6298).
    * ``min_sample_bytes`` (default 1 MiB): smaller transfers are latency-bound and
      say little about bandwidth; their RTT still counts.
    * ``floor_bytes_per_s`` (default 1e6, 8 Mbit/s): the estimate never drops below it,
      so a stalled link prices transfers as very slow, never as impossible.
    * ``prior_bytes_per_s`` (default 1.25e9, 10 Gbit/s) and ``prior_rtt_s`` (default
      0.02 s): the view of a peer before any sample; the low end of the WAN links PDD
      targets and a typical metro/regional inter-DC round trip.
    * ``half_life_s`` (default 60 s): without new samples the estimate drifts back to the
      prior, half way per half-life, so an old stall or burst stops steering routing.

    Example::

        est = BandwidthEstimator()
        est.observe("md-0", nbytes=256 << 20, seconds=0.4, rtt_s=0.031, now=t)
        est.update_from_stats(engine.stats(), now=t)     # TransferEngine counters
        link = est.estimate("md-0", now=t)                # LinkEstimate
    """

    alpha: float = 0.25
    rtt_alpha: float = 0.125
    min_sample_bytes: int = 1 << 20
    floor_bytes_per_s: float = 1e6
    prior_bytes_per_s: float = 1.25e9
    prior_rtt_s: float = 0.02
    half_life_s: float = 60.0
    _peers: dict[Hashable, _PeerState] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        for name in ("alpha", "rtt_alpha"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        _check_nonneg("min_sample_bytes", self.min_sample_bytes, integer=True)
        for name in ("floor_bytes_per_s", "prior_bytes_per_s", "half_life_s"):
            value = getattr(self, name)
            _check_nonneg(name, value)
            if value == 0:
                raise ValueError(f"{name} must be > 0")
        _check_nonneg("prior_rtt_s", self.prior_rtt_s)
        if self.prior_bytes_per_s < self.floor_bytes_per_s:
            raise ValueError(f"prior_bytes_per_s={self.prior_bytes_per_s} is below floor_bytes_per_s="
                             f"{self.floor_bytes_per_s}")

    # ---- feeding ---------------------------------------------------------------------------
    def observe(self, peer: Hashable, nbytes: int, seconds: float, rtt_s: float | None = None,
                now: float | None = None) -> None:
        """One finished transfer to ``peer``: ``nbytes`` in ``seconds`` of wall time (and
        the RTT seen meanwhile, if known)."""
        _check_nonneg("nbytes", nbytes, integer=True)
        _check_nonneg("seconds", seconds)
        _check_nonneg("rtt_s", rtt_s, optional=True)
        if nbytes > 0 and seconds == 0:
            raise ValueError(f"{nbytes} bytes in 0 seconds is not a throughput sample")
        state = self._peers.setdefault(peer, _PeerState())
        if nbytes >= max(self.min_sample_bytes, 1):
            self._add_rate(state, nbytes / seconds, now)
        if rtt_s is not None:
            self._add_rtt(state, rtt_s)

    def update_from_stats(self, stats: Mapping, now: float | None = None) -> list[Hashable]:
        """Feeds the estimator from a :meth:`pddcore.TransferEngine.stats` snapshot;
        returns the peers that got a throughput sample.

        Read from it (cumulative counters per peer; deltas between snapshots are the
        samples, the first snapshot gives the average since the engine started)::

            {"peers": {address: {"bytes_sent": float, "seconds_busy": float, "rtt_s": float, ...}}}

        ``rtt_s == 0`` means "not measured yet" and is skipped. Also accepted, for other
        engines: ``peers`` as a list of dicts carrying ``peer_id`` / ``peer`` / ``address`` /
        ``id``; bytes under ``bytes`` / ``tx_bytes`` / ``bytes_acked`` / ``bytes_written``;
        busy time under ``busy_s`` / ``active_s`` / ``busy_seconds`` / ``elapsed_s`` /
        ``seconds``; RTT under ``srtt_s`` / ``rtt`` (seconds) or ``rtt_ms``; and, when no
        counters are present, a current rate under ``throughput_bytes_per_s`` /
        ``bytes_per_s`` / ``throughput_Bps`` (bytes/s) or ``throughput_bps`` (bits/s).
        A counter that went backwards (engine restarted) restarts the baseline.
        """
        if not isinstance(stats, Mapping):
            raise ValueError(f"stats must be a mapping, got {type(stats).__name__}")
        sampled = []
        for peer, entry in self._peer_entries(stats.get("peers", {})):
            state = self._peers.setdefault(peer, _PeerState())
            rtt = _first(entry, _STATS_RTT_S)
            if rtt is None and entry.get("rtt_ms") is not None:
                rtt = entry["rtt_ms"] / 1e3
            if rtt is not None:
                _check_nonneg(f"peer {peer!r} rtt", rtt)
                if rtt > 0:  # 0 until the engine's first ping came back
                    self._add_rtt(state, float(rtt))
            nbytes, busy = _first(entry, _STATS_BYTES), _first(entry, _STATS_SECONDS)
            if nbytes is not None and busy is not None:
                _check_nonneg(f"peer {peer!r} bytes", nbytes)
                _check_nonneg(f"peer {peer!r} seconds", busy)
                if self._counter_sample(state, float(nbytes), float(busy), now):
                    sampled.append(peer)
                continue
            rate = _first(entry, _STATS_RATE)
            if rate is None and _first(entry, _STATS_RATE_BITS) is not None:
                rate = _first(entry, _STATS_RATE_BITS)
                _check_nonneg(f"peer {peer!r} throughput", rate)
                rate = rate / 8
            if rate is not None:
                _check_nonneg(f"peer {peer!r} throughput", rate)
                if rate > 0:
                    self._add_rate(state, float(rate), now)
                    sampled.append(peer)
        return sampled

    @classmethod
    def from_stats(cls, stats: Mapping, now: float | None = None, **config: Any) -> "BandwidthEstimator":
        """A new estimator (``config`` as for the constructor) seeded from one snapshot."""
        est = cls(**config)
        est.update_from_stats(stats, now)
        return est

    # ---- reading ---------------------------------------------------------------------------
    def estimate(self, peer: Hashable, now: float | None = None) -> LinkEstimate:
        state = self._peers.get(peer)
        bw = self.prior_bytes_per_s if state is None or state.bytes_per_s is None else self._decayed(state, now)
        rtt = self.prior_rtt_s if state is None or state.rtt_s is None else state.rtt_s
        return LinkEstimate(max(bw, self.floor_bytes_per_s), rtt, 0 if state is None else state.samples)

    @property
    def peers(self) -> list[Hashable]:
        return list(self._peers)

    # ---- internals -------------------------------------------------------------------------
    def _add_rate(self, state: _PeerState, rate: float, now: float | None) -> None:
        if state.bytes_per_s is None:
            state.bytes_per_s = rate
        else:
            # Decay the old estimate first so a sample after a long silence is weighed
            # against what estimate() would have said, not against stale history.
            current = self._decayed(state, now)
            state.bytes_per_s = current + self.alpha * (rate - current)
        state.samples += 1
        if now is not None:
            state.last_sample_at = now

    def _decayed(self, state: _PeerState, now: float | None) -> float:
        bw = state.bytes_per_s
        if now is not None and state.last_sample_at is not None and now > state.last_sample_at:
            keep = 0.5 ** ((now - state.last_sample_at) / self.half_life_s)
            bw = self.prior_bytes_per_s + (bw - self.prior_bytes_per_s) * keep
        return bw

    def _add_rtt(self, state: _PeerState, rtt: float) -> None:
        state.rtt_s = rtt if state.rtt_s is None else state.rtt_s + self.rtt_alpha * (rtt - state.rtt_s)

    def _counter_sample(self, state: _PeerState, nbytes: float, busy: float, now: float | None) -> bool:
        base = state.counters
        if base is None or nbytes < base[0] or busy < base[1]:
            base = (0.0, 0.0)  # first snapshot, or the engine restarted: average since its start
        d_bytes, d_busy = nbytes - base[0], busy - base[1]
        if d_bytes < max(self.min_sample_bytes, 1) or d_busy <= 0:
            state.counters = base  # too little new traffic: keep accumulating against this baseline
            return False
        self._add_rate(state, d_bytes / d_busy, now)
        state.counters = (nbytes, busy)
        return True

    @staticmethod
    def _peer_entries(peers: Any):
        if isinstance(peers, Mapping):
            for peer, entry in peers.items():
                if not isinstance(entry, Mapping):
                    raise ValueError(f"stats['peers'][{peer!r}] must be a mapping, got {type(entry).__name__}")
                yield peer, entry
        elif isinstance(peers, (list, tuple)):
            for i, entry in enumerate(peers):
                peer = _first(entry, _STATS_PEER_ID) if isinstance(entry, Mapping) else None
                if peer is None:
                    raise ValueError(f"stats['peers'][{i}] names no peer (expected one of {_STATS_PEER_ID})")
                yield peer, entry
        else:
            raise ValueError(f"stats['peers'] must be a mapping or a list, got {type(peers).__name__}")
