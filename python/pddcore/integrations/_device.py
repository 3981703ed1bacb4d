"""The GPU an adapter's KV pool lives on, made current wherever the adapter queues CUDA work.

An engine's scheduler thread has its own GPU current, but an adapter also packs and unpacks
from other threads (SGLang's message pump, a transfer thread), where the current device is
GPU 0. Every entry point that touches the pool therefore runs under :func:`on_device`, and
records its events on (or makes wait) that device's current stream, never the null stream of
another GPU.

Example::

    with on_device(layout.device):        # torch.cuda.device(cuda:3); nothing on the CPU
        pack(layout, pages, out=buf)
        done = record_event(layout.device)  # without waiting: buf is whole once done.query()
                                            # (None off CUDA: it is whole already)
        stream_waits_for(layout.device, forward_done)   # later work on the stream runs after it
                                                         # (the GPU waits, not the host)
        with on_stream(side):               # a stream of the adapter's own (None off CUDA)
            unpack(layout, pages, buf2)
            done = record_event(layout.device)   # after the unpack on that stream only
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["on_device", "on_stream", "on_kv_device", "record_event", "stream_waits_for"]

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Makes ``device`` the current CUDA device while the body runs (no-op off CUDA)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


@contextlib.contextmanager
def on_stream(stream: "torch.cuda.Stream | None") -> Iterator[None]:
    """Makes ``stream`` (of the current device) the current stream while the body runs; None
    (off CUDA): no-op."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield


def on_kv_device(method: F) -> F:
    """Runs ``method`` under :func:`on_device` of its object's ``kv_device``."""

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        with on_device(self.kv_device):
            return method(self, *args, **kwargs)

    return guarded  # type: ignore[return-value]


def record_event(device: torch.device) -> "torch.cuda.Event | None":
    """An event on ``device``'s current stream after the work queued so far; None off CUDA,
    where that work already ran."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def stream_waits_for(device: torch.device, event: "torch.cuda.Event | None") -> None:
    """Makes the work queued next on ``device``'s current stream wait for ``event`` (another
    stream's work); the GPU waits, the calling thread does not. No-op for None or off CUDA."""
    if event is not None and device.type == "cuda":
        torch.cuda.current_stream(device).wait_event(event)
