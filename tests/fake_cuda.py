"""A stand-in for the ``torch.cuda`` calls the engine adapters make (``device``, ``stream``,
``Stream``, ``current_stream``, ``Event``), for checking on a CPU-only machine which GPU and
which stream are current wherever an adapter queues work (each thread has its own, as with
CUDA), and that nothing reads what an unfinished kernel writes (``events_done = False``).

Example::

    cuda = FakeCuda(monkeypatch)
    cuda.watch(monkeypatch, pddcore.integrations.vllm.producer, "pack")   # records each call
    ...
    cuda.calls   # [("pack", device(type='cuda', index=3)), ("synchronize", device(...)), ...]
    cuda.streams # [("pack", "default"), ("synchronize", "default"), ...]: the stream current at each
"""

from __future__ import annotations

import contextlib
import threading

import torch


class FakeCuda:
    """Replaces ``torch.cuda.device`` / ``stream`` / ``Stream`` / ``current_stream`` / ``Event``;
    records, per call of a watched function and per stream use, the device current on the
    calling thread (None: none was made current there) in ``calls``, and the stream current
    there (``"default"``, or the name of a ``Stream`` made) in ``streams``."""

    def __init__(self, monkeypatch):
        self._local = threading.local()
        self.calls: list[tuple[str, torch.device | None]] = []
        self.streams: list[tuple[str, str]] = []
        self.made_streams: list[_Stream] = []
        self.events_done = True   # what every event's query() answers: False holds the GPU work back
        monkeypatch.setattr(torch.cuda, "device", self._device)
        monkeypatch.setattr(torch.cuda, "stream", self._use_stream)
        monkeypatch.setattr(torch.cuda, "Stream", self._new_stream)
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

    @property
    def current_stream_name(self) -> str:
        stream = getattr(self._local, "stream", None)
        return "default" if stream is None else stream.name

    def record(self, label: str) -> None:
        self.calls.append((label, self.current))
        self.streams.append((label, self.current_stream_name))

    @contextlib.contextmanager
    def _use_stream(self, stream):
        if stream.device != self.current:
            self.calls.append(("stream of another device", stream.device))
        saved, self._local.stream = getattr(self._local, "stream", None), stream
        try:
            yield
        finally:
            self._local.stream = saved

    def _new_stream(self, device=None):
        stream = _Stream(self, torch.device(device) if device is not None else self.current,
                         f"stream {len(self.made_streams)}")
        self.made_streams.append(stream)
        return stream

    def _stream(self, device=None):
        if device is None or torch.device(device) != self.current:
            self.calls.append(("stream of another device", torch.device(device) if device is not None else None))
        current = getattr(self._local, "stream", None)
        return current if current is not None else _Stream(self, self.current, "default")

    def watch(self, monkeypatch, module, name: str, label: str | None = None) -> None:
        """Records (``label``, default ``name``) the current device whenever ``module.name`` is
        called, then calls it."""
        real = getattr(module, name)

        def recorded(*args, **kwargs):
            self.record(label or name)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)


class _Stream:
    def __init__(self, cuda: FakeCuda, device: torch.device | None, name: str):
        self._cuda, self.device, self.name = cuda, device, name

    def synchronize(self) -> None:
        self._cuda.record("synchronize")


class _Event:
    def __init__(self, cuda: FakeCuda):
        self._cuda = cuda

    def record(self, stream=None) -> None:
        self._cuda.calls.append(("record", self._cuda.current))
        self._cuda.streams.append(("record", self._cuda.current_stream_name if stream is None else stream.name))

    def query(self) -> bool:
        return self._cuda.events_done

    def synchronize(self) -> None:
        self._cuda.record("event synchronize")
