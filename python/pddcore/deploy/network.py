"""Where the roles run and how they reach each other.

With root (CI, the demo box): one :class:`pddcore.testing.wan.WanLink`. P and RLD run in
namespace ``a`` (cluster A; P reaches RLD over local delivery inside ``a``), MD in
namespace ``b`` (cluster B); P->MD, RLD->MD and MD->RLD cross the emulated link (tbf
bandwidth cap + TUN delay line). Without root: everything on 127.0.0.1 and the traffic
between the clusters crosses a userspace :class:`pddcore.testing.relay.WanRelay`
(token bucket + delay). :attr:`Network.kind` says which one ran.
"""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass
from typing import Sequence

from ..testing.relay import WanRelay
from ..testing.wan import WanLink, unavailable_reason

__all__ = ["Network", "Placement"]


@dataclass(frozen=True)
class Placement:
    """Listen addresses of RLD's and MD's engines, and how each is dialled: by P and RLD
    (``md_from_a``, ``rld_from_p``) and by MD (``rld_from_md``)."""

    p_listen: str
    rld_listen: str
    md_listen: str
    rld_from_p: str
    md_from_a: str
    rld_from_md: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Network:
    """The emulated WAN for a series of runs: ``open()``, then per run ``placement()`` and
    ``popen(role_side, argv)``; ``close()`` removes everything."""

    def __init__(self, bandwidth_bps: float, delay_ms: float, jitter_ms: float = 0.0, *, force_relay: bool = False):
        self.bandwidth_bps = bandwidth_bps
        self.delay_ms = delay_ms
        self.jitter_ms = jitter_ms
        self.reason = "forced" if force_relay else unavailable_reason()
        self.kind = "userspace relay" if self.reason else "kernel WAN emulator"
        self.link: WanLink | None = None
        self.relay: WanRelay | None = None
        self._runs = 0

    def describe(self) -> str:
        link = f"{self.bandwidth_bps / 1e6:g} Mbit/s, {self.delay_ms:g} ms one-way"
        if self.jitter_ms:
            link += f" (+/- {self.jitter_ms:g} ms jitter)"
        if self.reason:
            return f"{link} via the userspace relay (token bucket + delay; kernel emulator unavailable: {self.reason})"
        return f"{link} via the kernel WAN emulator (namespaces, tc tbf, TUN delay line)"

    def open(self) -> "Network":
        if not self.reason:
            self.link = WanLink(rate=int(self.bandwidth_bps), delay_ms=self.delay_ms, jitter_ms=self.jitter_ms).open()
        return self

    def placement(self) -> Placement:
        """Fresh addresses for the next run (a new relay, or new ports on the link)."""
        self._runs += 1
        if self.link is not None:
            a, b = self.link.a.address, self.link.b.address
            rld, md = f"{a}:{17000 + 2 * self._runs}", f"{b}:{17001 + 2 * self._runs}"
            return Placement(f"{a}:0", rld, md, rld, md, rld)
        if self.relay is not None:
            self.relay.close()
        rld_port, md_port = _free_port(), _free_port()
        self.relay = WanRelay(self.bandwidth_bps, self.delay_ms)
        md_via = self.relay.forward(("127.0.0.1", md_port), side="a")
        rld_via = self.relay.forward(("127.0.0.1", rld_port), side="b")
        self.relay.start()
        return Placement("127.0.0.1:0", f"127.0.0.1:{rld_port}", f"127.0.0.1:{md_port}", f"127.0.0.1:{rld_port}",
                         f"127.0.0.1:{md_via}", f"127.0.0.1:{rld_via}")

    def popen(self, side: str | None, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Starts ``argv`` in cluster ``side`` ("a", "b") or, with None, next to the caller."""
        if side is None or self.link is None:
            return subprocess.Popen(list(argv), **kwargs)
        return getattr(self.link, side).popen(list(argv), **kwargs)

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        if self.link is not None:
            self.link.close()
            self.link = None

    def __enter__(self) -> "Network":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()
