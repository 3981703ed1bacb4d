"""Where the roles run and how they reach each other.

With root (CI, the demo box): one :class:`pddcore.testing.wan.WanLink`. P, RLD, the gateway
and the client run in namespace ``a`` (cluster A), MD in namespace ``b`` (cluster B);
everything between the clusters (the gateway's calls to MD, MD's pulls from P and P's
writes of the pages) crosses the emulated link (tbf bandwidth cap + TUN delay line).
Without root: everything on 127.0.0.1, and what cluster A sends to MD (the gateway's calls,
P's page writes) crosses a userspace :class:`pddcore.testing.relay.WanRelay` (token bucket
+ delay); MD's small pull requests to P go straight. :attr:`Network.kind` says which one ran.
"""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass
from typing import Any, Sequence

from ..testing.relay import WanRelay
from ..testing.wan import WanLink, unavailable_reason

__all__ = ["Network", "Placement"]


@dataclass(frozen=True)
class Placement:
    """One run's places. ``where[side]``: what to start a process of cluster ``side``
    ("a", "b") in (a WanLink endpoint, or None: here); ``host[side]``: its listen address.
    ``md_args``: MD's ``pddcore engine`` options for its ports and the transfer address it
    advertises; ``md_url_from_a``: MD's URL as cluster A dials it (None: the one MD prints)."""

    where: dict[str, Any]
    host: dict[str, str]
    md_args: tuple[str, ...]
    md_url_from_a: str | None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Network:
    """The emulated WAN for a series of runs: ``open()``, then per run ``placement()`` and
    ``popen(side, argv)`` for processes that are not servers; ``close()`` removes everything."""

    def __init__(self, bandwidth_bps: float, delay_ms: float, jitter_ms: float = 0.0, *, force_relay: bool = False):
        self.bandwidth_bps = bandwidth_bps
        self.delay_ms = delay_ms
        self.jitter_ms = jitter_ms
        self.reason = "forced" if force_relay else unavailable_reason()
        self.kind = "userspace relay" if self.reason else "kernel WAN emulator"
        self.link: WanLink | None = None
        self.relay: WanRelay | None = None

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
        """Places for the next run (with the relay: new ports for MD and a new relay)."""
        if self.link is not None:
            a, b = self.link.a.address, self.link.b.address
            return Placement({"a": self.link.a, "b": self.link.b}, {"a": a, "b": b},
                             ("--host", b, "--port", "0"), None)
        if self.relay is not None:
            self.relay.close()
        http_port, transfer_port = _free_port(), _free_port()
        self.relay = WanRelay(self.bandwidth_bps, self.delay_ms)
        http_via = self.relay.forward(("127.0.0.1", http_port), side="a")
        transfer_via = self.relay.forward(("127.0.0.1", transfer_port), side="a")
        self.relay.start()
        local = "127.0.0.1"
        return Placement({"a": None, "b": None}, {"a": local, "b": local},
                         ("--host", local, "--port", str(http_port), "--transfer-listen", f"{local}:{transfer_port}",
                          "--transfer-advertise", f"{local}:{transfer_via}"), f"http://{local}:{http_via}")

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
