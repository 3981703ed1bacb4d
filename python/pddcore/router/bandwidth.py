"""The WAN bandwidth estimate the router prices transfers with: a per-peer EWMA of observed
throughput and RTT (:class:`BandwidthEstimator`), read as a :class:`LinkEstimate`.

Example (bytes/s and seconds)::

    est = BandwidthEstimator()
    est.observe("md-0", nbytes=256 << 20, seconds=0.4, now=0.0)    # 256 MiB in 0.4 s
    est.estimate("md-0", now=0.0)    # LinkEstimate(bytes_per_s=671088640.0, rtt_s=0.02, samples=1):
                                     # the first sample replaces the prior; no RTT seen, so the prior's
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping

from ._checks import check_nonneg

__all__ = ["LinkEstimate", "BandwidthEstimator"]


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


# The TCP backend's path-limited counters: preferred over any bytes / seconds pair below.
_PATH_LIMITED_BYTES, _PATH_LIMITED_SECONDS = "path_limited_bytes", "path_limited_seconds"
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
        check_nonneg("min_sample_bytes", self.min_sample_bytes, integer=True)
        for name in ("floor_bytes_per_s", "prior_bytes_per_s", "half_life_s"):
            value = getattr(self, name)
            check_nonneg(name, value)
            if value == 0:
                raise ValueError(f"{name} must be > 0")
        check_nonneg("prior_rtt_s", self.prior_rtt_s)
        if self.prior_bytes_per_s < self.floor_bytes_per_s:
            raise ValueError(f"prior_bytes_per_s={self.prior_bytes_per_s} is below floor_bytes_per_s="
                             f"{self.floor_bytes_per_s}")

    # ---- feeding ---------------------------------------------------------------------------
    def observe(self, peer: Hashable, nbytes: int, seconds: float, rtt_s: float | None = None,
                now: float | None = None) -> None:
        """One finished transfer to ``peer``: ``nbytes`` in ``seconds`` of wall time (and
        the RTT seen meanwhile, if known)."""
        check_nonneg("nbytes", nbytes, integer=True)
        check_nonneg("seconds", seconds)
        check_nonneg("rtt_s", rtt_s, optional=True)
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

            {"peers": {address: {"path_limited_bytes": float, "path_limited_seconds": float,
                                 "bytes_sent": float, "seconds_busy": float, "rtt_s": float, ...}}}

        The TCP backend's ``path_limited_*`` counters (the kernel's delivery-rate samples,
        integrated over the time the path, not the sender, set the pace) are used where
        present: bytes over busy time also counts the waits of a sender that streams KV
        layer by layer as prefill writes it, and reads low. While they show no new
        path-limited time (only small transfers), the estimate keeps what it had.
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
                check_nonneg(f"peer {peer!r} rtt", rtt)
                if rtt > 0:  # 0 until the engine's first ping came back
                    self._add_rtt(state, float(rtt))
            if _PATH_LIMITED_BYTES in entry and _PATH_LIMITED_SECONDS in entry:
                nbytes, busy = entry[_PATH_LIMITED_BYTES], entry[_PATH_LIMITED_SECONDS]
            else:
                nbytes, busy = _first(entry, _STATS_BYTES), _first(entry, _STATS_SECONDS)
            if nbytes is not None and busy is not None:
                check_nonneg(f"peer {peer!r} bytes", nbytes)
                check_nonneg(f"peer {peer!r} seconds", busy)
                if self._counter_sample(state, float(nbytes), float(busy), now):
                    sampled.append(peer)
                continue
            rate = _first(entry, _STATS_RATE)
            if rate is None and _first(entry, _STATS_RATE_BITS) is not None:
                rate = _first(entry, _STATS_RATE_BITS)
                check_nonneg(f"peer {peer!r} throughput", rate)
                rate = rate / 8
            if rate is not None:
                check_nonneg(f"peer {peer!r} throughput", rate)
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
