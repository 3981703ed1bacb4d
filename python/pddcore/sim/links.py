"""Network links with processor sharing: concurrent transfers split the bandwidth
equally (what many long-lived TCP or RDMA flows converge to), after a round trip.

A transfer of ``n`` bytes first waits ``rtt_s`` (the receiver's page-allocation reply
and the first chunk's flight, as in :mod:`pddcore.router`), then joins the shared
queue. With ``k`` transfers active each gets ``bytes_per_s / k``. The queue is kept in
*virtual time* (bytes served to every active transfer so far), so an arrival or a
departure costs O(log k) instead of touching every transfer.

Example::

    loop = EventLoop()
    wan = SharedLink(loop, bytes_per_s=1e9, rtt_s=0.02, name="wan")
    wan.send(2e9, on_done)          # alone: done at 0.02 + 2.0 s
    wan.send(1e9, on_done)          # shares: the 1 GB one is done at 0.02 + 2.0 s too
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Callable

from .engine import EventHandle, EventLoop

__all__ = ["SharedLink", "LinkTransfer"]


class LinkTransfer:
    __slots__ = ("nbytes", "on_done", "args", "tag", "start_virtual", "active", "cancelled", "_delay")

    def __init__(self, nbytes: float, on_done: Callable[..., Any], args: tuple):
        self.nbytes, self.on_done, self.args = nbytes, on_done, args
        self.tag = 0.0
        self.start_virtual = 0.0
        self.active = False
        self.cancelled = False
        self._delay: EventHandle | None = None


class SharedLink:
    """A processor-sharing link; ``bytes_delivered``, ``busy_s`` and ``last_busy_at``
    (when a transfer last ended) record its use."""

    def __init__(self, loop: EventLoop, bytes_per_s: float, rtt_s: float = 0.0, name: str = "link"):
        if not bytes_per_s > 0:
            raise ValueError(f"{name}: bytes_per_s must be > 0, got {bytes_per_s!r}")
        if not rtt_s >= 0:
            raise ValueError(f"{name}: rtt_s must be >= 0, got {rtt_s!r}")
        self.loop, self.bytes_per_s, self.rtt_s, self.name = loop, float(bytes_per_s), float(rtt_s), name
        self.bytes_delivered = 0.0
        self.busy_s = 0.0
        self.last_busy_at = 0.0
        self._virtual = 0.0
        self._updated_at = 0.0
        self._active = 0
        self._heap: list[tuple[float, int, LinkTransfer]] = []
        self._seq = itertools.count()
        self._next: EventHandle | None = None

    def send(self, nbytes: float, on_done: Callable[..., Any], *args: Any) -> LinkTransfer:
        """Starts a transfer; ``on_done(*args)`` runs when its last byte has arrived."""
        if not nbytes >= 0:
            raise ValueError(f"{self.name}: nbytes must be >= 0, got {nbytes!r}")
        t = LinkTransfer(float(nbytes), on_done, args)
        t._delay = self.loop.after(self.rtt_s, self._join, t)
        return t

    def cancel(self, t: LinkTransfer) -> None:
        """Stops ``t``; the bytes already sent stay counted, ``on_done`` never runs."""
        if t.cancelled or (not t.active and t._delay is None):
            return
        t.cancelled = True
        if t._delay is not None:
            t._delay.cancel()
            t._delay = None
            return
        self._advance()
        self.bytes_delivered += self._virtual - t.start_virtual
        t.active = False
        self._active -= 1
        self._reschedule()

    # ---- processor sharing -----------------------------------------------------------------
    def _advance(self) -> None:
        now = self.loop.now
        if self._active:
            self._virtual += (now - self._updated_at) * self.bytes_per_s / self._active
            self.busy_s += now - self._updated_at
            self.last_busy_at = now
        self._updated_at = now

    def _join(self, t: LinkTransfer) -> None:
        t._delay = None
        if t.nbytes == 0:
            t.on_done(*t.args)
            return
        self._advance()
        t.start_virtual = self._virtual
        t.tag = self._virtual + t.nbytes
        t.active = True
        self._active += 1
        heapq.heappush(self._heap, (t.tag, next(self._seq), t))
        self._reschedule()

    def _reschedule(self) -> None:
        heap = self._heap
        while heap and not heap[0][2].active:
            heapq.heappop(heap)
        if self._next is not None:
            self._next.cancel()
            self._next = None
        if heap:
            wait = max(0.0, (heap[0][0] - self._virtual) * self._active / self.bytes_per_s)
            self._next = self.loop.after(wait, self._complete)

    def _complete(self) -> None:
        self._next = None
        self._advance()
        heap = self._heap
        done = []
        # Finish every transfer whose tag the virtual clock has reached (float slack of 1 byte).
        while heap and (not heap[0][2].active or heap[0][0] <= self._virtual + 1.0):
            _, _, t = heapq.heappop(heap)
            if t.active:
                t.active = False
                self._active -= 1
                self.bytes_delivered += t.nbytes
                done.append(t)
        self._reschedule()
        for t in done:
            t.on_done(*t.args)
