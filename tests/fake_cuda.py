"""A stand-in for the ``torch.cuda`` calls the engine adapters make (``device``, ``stream``,
``Stream``, ``current_stream``, ``Event``), for checking on a CPU-only machine which GPU and
which stream are current wherever an adapter queues work (each thread has its own, as with
CUDA), which thread waits on the GPU, and that nothing reads what an unfinished kernel writes
(``events_done = False``).

While ``events_done`` is False the GPU work queued from then on does not run: an event
recorded meanwhile stays pending, and a stream's or such an event's ``synchronize()`` blocks
until a test sets it True again (events recorded before stay complete), except on the thread
that set it False, where such a wait could never end and raises :class:`WaitedOnHeldGPU`.

Example::

    cuda = FakeCuda(monkeypatch)
    cuda.watch(monkeypatch, pddcore.integrations.vllm.producer, "pack")   # records each call
    ...
    cuda.calls   # [("pack", device(type='cuda', index=3)), ("synchronize", device(...)), ...]
    cuda.streams # [("pack", "default"), ("synchronize", "default"), ...]: the stream current at each
    cuda.threads # [("pack", "MainThread"), ("event synchronize", "pdd-post-0"), ...]: the calling thread
"""

from __future__ import annotations

import contextlib
import threading

import torch


_CURRENT = object()  # record()'s default: the device current on the calling thread


class WaitedOnHeldGPU(AssertionError):
    """A thread waited on GPU work that only it could let run: a hang on a real GPU's stand-in."""


class FakeCuda:
    """Replaces ``torch.cuda.device`` / ``stream`` / ``Stream`` / ``current_stream`` / ``Event``;
    records, per call of a watched function and per stream use, the device current on the
    calling thread (None: none was made current there) in ``calls``, the stream current
    there (``"default"``, or the name of a ``Stream`` made) in ``streams``, and the calling
    thread's name in ``threads``, all in the order the calls came."""

    def __init__(self, monkeypatch):
        self._local = threading.local()
        self.calls: list[tuple[str, torch.device | None]] = []
        self.streams: list[tuple[str, str]] = []
        self.threads: list[tuple[str, str]] = []
        self.made_streams: list[_Stream] = []
        self._ran = threading.Condition()
        self._events_done = True
        self._holder: threading.Thread | None = None
        self.releases = 0   # how often held GPU work was let run
        monkeypatch.setattr(torch.cuda, "device", self._device)
        monkeypatch.setattr(torch.cuda, "stream", self._use_stream)
        monkeypatch.setattr(torch.cuda, "Stream", self._new_stream)
        monkeypatch.setattr(torch.cuda, "current_stream", self._stream)
        monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _Event(self))

    @property
    def events_done(self) -> bool:
        """False holds the GPU work queued from now on back; True lets it all run."""
        return self._events_done

    @events_done.setter
    def events_done(self, done: bool) -> None:
        with self._ran:
            if done and not self._events_done:
                self.releases += 1
            self._events_done = done
            self._holder = None if done else threading.current_thread()
            self._ran.notify_all()

    def wait_for_gpu(self, label: str, ran) -> None:
        """Records ``label`` (a host wait on the GPU), then returns once ``ran()`` holds."""
        self.record(label)
        with self._ran:
            if not ran() and self._holder is threading.current_thread():
                raise WaitedOnHeldGPU(f"{label} on {self._holder.name}, which holds the GPU work back")
            self._ran.wait_for(ran)

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

    def record(self, label: str, stream: str | None = None, device: object = _CURRENT) -> None:
        """Notes a call of ``label`` (on ``stream`` and ``device``, default the current ones)."""
        with self._ran:  # the three lists stay in step across threads
            self.calls.append((label, self.current if device is _CURRENT else device))
            self.streams.append((label, self.current_stream_name if stream is None else stream))
            self.threads.append((label, threading.current_thread().name))

    @contextlib.contextmanager
    def _use_stream(self, stream):
        if stream.device != self.current:
            self.record("stream of another device", device=stream.device)
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
            self.record("stream of another device", device=torch.device(device) if device is not None else None)
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
        self._cuda.wait_for_gpu("synchronize", lambda: self._cuda.events_done)

    def wait_event(self, event) -> None:
        self._cuda.record("stream wait event", self.name)


class _Event:
    def __init__(self, cuda: FakeCuda):
        self._cuda = cuda
        self._held_at: int | None = None   # cuda.releases when recorded while the GPU was held

    def record(self, stream=None) -> None:
        self._cuda.record("record", None if stream is None else stream.name)
        self._held_at = None if self._cuda.events_done else self._cuda.releases

    def query(self) -> bool:
        return self._held_at is None or self._cuda.releases > self._held_at

    def synchronize(self) -> None:
        self._cuda.wait_for_gpu("event synchronize", self.query)
