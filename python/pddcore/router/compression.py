"""The KV compression ratio the router prices WAN transfers with, learned from completed
codec sends (:class:`CompressionEstimator`), as :class:`~pddcore.router.BandwidthEstimator`
learns the link from completed transfers.

A codec's ratio depends on the KV itself (its dtype, the model, the document), so a fixed
``RouterConfig.kv_compression_ratio`` is a guess made once; the estimator follows what P's
sends really put on the wire.

Example (bytes)::

    ratios = CompressionEstimator()
    ratios.ratio                                          # 1.0: the prior, nothing sent yet
    ratios.observe(raw_bytes=12 << 20, wire_bytes=9 << 20)
    ratios.ratio                                          # 1.333...: the first send replaces the prior
    # each send: kv.nbytes and the Transfer's nbytes from pddcore.codec.send_compressed
    router.route(RouteRequest(..., kv_compression_ratio=ratios.ratio))
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ._checks import check_nonneg, check_positive

__all__ = ["CompressionEstimator"]


@dataclass
class CompressionEstimator:
    """Raw KV bytes per wire byte of recent codec sends: the ratio of two EWMAs, of the raw
    bytes and of the wire bytes of each send, so a send weighs by its size (the router
    prices bytes, and a 100-token handoff says less about a 64K-token prompt's KV than a
    large send does).

    * ``alpha`` (default 0.25): weight of a new send, as in :class:`BandwidthEstimator`.
    * ``prior_ratio`` (default 1.0: as if uncompressed): :attr:`ratio` before any send;
      set it from ``pddcore bench --cases codec`` to start from the codec's expected ratio.

    ``observe(raw_bytes, wire_bytes)``: one completed send, ``raw_bytes`` of KV encoded
    into a ``wire_bytes`` frame (both > 0). A frame can be larger than its raw bytes (an
    incompressible page, the frame header): the ratio then drops below 1, and the router
    prices the extra bytes.
    """

    alpha: float = 0.25
    prior_ratio: float = 1.0
    samples: int = field(default=0, init=False)
    _raw: float = field(default=0.0, init=False, repr=False)
    _wire: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self):
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha!r}")
        self.prior_ratio = check_positive("prior_ratio", self.prior_ratio)

    def observe(self, raw_bytes: int, wire_bytes: int) -> None:
        for name, value in (("raw_bytes", raw_bytes), ("wire_bytes", wire_bytes)):
            check_nonneg(name, value, integer=True)
            if value == 0:
                raise ValueError(f"{name} must be > 0: an empty send says nothing about the ratio")
        if self.samples == 0:
            self._raw, self._wire = float(raw_bytes), float(wire_bytes)
        else:
            self._raw += self.alpha * (raw_bytes - self._raw)
            self._wire += self.alpha * (wire_bytes - self._wire)
        self.samples += 1

    @property
    def ratio(self) -> float:
        """Raw bytes per wire byte: for ``RouteRequest.kv_compression_ratio``."""
        return self._raw / self._wire if self.samples else self.prior_ratio
