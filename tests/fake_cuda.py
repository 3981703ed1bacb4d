"""A stand-in for the ``torch.cuda`` calls the engine adapters make (``device``,
``current_stream``, ``Event``), for checking on a CPU-only machine which GPU is current
wherever an adapter queues work (each thread has its own current device, as with CUDA), and
that nothing reads what an unfinished kernel writes (``events_done = False``).

Example::

    cuda = FakeCuda(monkeypatch)
    cuda.watch(monkeypatch, pddcore.integrations.vllm.producer, "pack")   # records each call
    ...
    cuda.calls   # [("pack", device(type='cuda', index=3)), ("synchronize", device(...)), ...]
"""

from __future__ import annotations

import contextlib
import threading

import torch


class FakeCuda:
    """Replaces ``torch.cuda.device`` / ``current_stream`` / ``Event``; records, per call of a
    watched function and per stream use, the device current on the calling thread (None: none
    was made current there)."""

    def __init__(self, monkeypatch):
        self._local = threading.local()
        self.calls: list[tuple[str, torch.device | None]] = []
        self.events_done = True   # what every event's query() answers: False holds the GPU work back
        monkeypatch.setattr(torch.cuda, "device", self._device)
        monkeypatch.setattr(torch.cuda, "current_stream", self._stream)
        monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _Event(self))

    @property
    def current(self) -> torch.device | None:
        return getattr(self._local, "device", None)

    @contextlib.contextmanager
    def _device(self, device):
        saved, self._local.device = self.current, torch.device(device)
        try:
            yield
        finally:
            self._local.device = saved

    def _stream(self, device=None):
        if device is None or torch.device(device) != self.current:
            self.calls.append(("stream of another device", torch.device(device) if device is not None else None))
        return _Stream(self)

    def watch(self, monkeypatch, module, name: str, label: str | None = None) -> None:
        """Records (``label``, default ``name``) the current device whenever ``module.name`` is
        called, then calls it."""
        real = getattr(module, name)

        def recorded(*args, **kwargs):
            self.calls.append((label or name, self.current))
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)


class _Stream:
    def __init__(self, cuda: FakeCuda):
        self._cuda = cuda

    def synchronize(self) -> None:
        self._cuda.calls.append(("synchronize", self._cuda.current))


class _Event:
    def __init__(self, cuda: FakeCuda):
        self._cuda = cuda

    def record(self, stream=None) -> None:
        self._cuda.calls.append(("record", self._cuda.current))

    def query(self) -> bool:
        return self._cuda.events_done

    def synchronize(self) -> None:
        self._cuda.calls.append(("event synchronize", self._cuda.current))
