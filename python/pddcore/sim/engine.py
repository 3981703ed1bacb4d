"""Discrete-event engine: a clock and a heap of pending callbacks.

Events at the same time run in the order they were scheduled (a sequence number breaks
ties), so a run is deterministic. Cancelling marks the event; the heap drops it lazily.

Example::

    loop = EventLoop()
    loop.at(1.5, print, "later")
    handle = loop.after(0.5, print, "never")
    handle.cancel()
    loop.run()          # prints "later"; loop.now == 1.5, loop.events_run == 1
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Any, Callable

__all__ = ["EventLoop", "EventHandle"]


class EventHandle:
    __slots__ = ("time", "callback", "args", "cancelled")

    def __init__(self, time: float, callback: Callable[..., Any], args: tuple):
        self.time, self.callback, self.args, self.cancelled = time, callback, args, False

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    def __init__(self):
        self.now = 0.0
        self.events_run = 0
        self._heap: list[tuple[float, int, EventHandle]] = []
        self._seq = itertools.count()

    def at(self, time: float, callback: Callable[..., Any], *args: Any) -> EventHandle:
        """Runs ``callback(*args)`` at absolute ``time`` (not before now)."""
        if not time >= self.now or math.isinf(time):
            raise ValueError(f"cannot schedule at {time!r}: the clock is at {self.now}")
        handle = EventHandle(time, callback, args)
        heapq.heappush(self._heap, (time, next(self._seq), handle))
        return handle

    def after(self, delay: float, callback: Callable[..., Any], *args: Any) -> EventHandle:
        return self.at(self.now + delay, callback, *args)

    def run(self, until: float = math.inf) -> None:
        """Runs events in time order until none is left or the next is past ``until``."""
        heap = self._heap
        pop = heapq.heappop
        while heap and heap[0][0] <= until:
            time, _, handle = pop(heap)
            if handle.cancelled:
                continue
            self.now = time
            self.events_run += 1
            handle.callback(*handle.args)
