"""Writes an adapter posts from a thread of its own, each once the GPU work that fills its
source has run, so that the engine's scheduler thread queues a pack and returns without ever
waiting on the GPU.

The caller packs on its current stream, records an event after the pack and hands the
:class:`Poster` the write with that event; the poster's thread waits on the event and then
posts the write. Writes are posted in the order they were handed over.

Example::

    poster = Poster("pdd-post")
    pack(layout, pages, out=buf.tensor)                          # queued on the current stream
    write = poster.post(functools.partial(engine.write, peer, buf.region, 0, dst, 0, buf.nbytes),
                        after=record_event(device), device=device)   # None: nothing to wait for
    write.status        # "pending" until posted and done, then as the Transfer's
    write.cancel()      # not posted yet: it never will be (buf is free); else the transfer's cancel()
    poster.close()      # posts what is queued, then stops
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from ..transfer import Transfer, TransferError
from ._device import on_device

__all__ = ["Poster", "PostedWrite"]


class PostedWrite:
    """A write handed to a :class:`Poster`; reads like the :class:`Transfer` it becomes
    (``status``, ``error``, ``done()``, ``cancel()``). A write that posts nothing to track (a
    control message) is done once sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._posted = False
        self._cancelled = False
        self._transfer: Transfer | None = None
        self._error: str | None = None

    @property
    def status(self) -> str:
        """"pending", "done", "failed" or "cancelled"."""
        with self._lock:
            if self._error is not None:
                return "failed"
            if self._cancelled:
                return "cancelled"
            if self._transfer is not None:
                return self._transfer.status
            return "done" if self._posted else "pending"

    @property
    def error(self) -> str | None:
        """Why the write failed or was cancelled; None while pending or when done."""
        with self._lock:
            if self._error is not None:
                return self._error
            if self._cancelled:
                return "cancelled before it was posted"
            return self._transfer.error if self._transfer is not None else None

    def done(self) -> bool:
        """True once posted and finished; raises TransferError if it failed or was cancelled."""
        status = self.status
        if status in ("failed", "cancelled"):
            raise TransferError(f"transfer {status}: {self.error}")
        return status == "done"

    def cancel(self) -> None:
        """A write not posted yet never will be, so its source may be reused at once; a posted
        one is cancelled as :meth:`Transfer.cancel` does."""
        with self._lock:
            if not self._posted:
                self._cancelled = True
                return
            transfer = self._transfer
        if transfer is not None:
            transfer.cancel()

    def _post(self, write: Callable[[], Transfer | None]) -> None:
        with self._lock:  # a cancel() either comes first (nothing is posted) or sees the transfer
            if self._cancelled:
                return
            try:
                self._transfer = write()
            except Exception as exc:
                self._error = f"could not post: {exc}"
            self._posted = True

    def _fail(self, reason: str) -> None:
        with self._lock:
            self._error, self._posted = reason, True


class Poster:
    """One thread that posts writes in order, each after its event completed."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, write: Callable[[], Transfer | None], *, after: "torch.cuda.Event | None" = None,
             device: torch.device = torch.device("cpu")) -> PostedWrite:
        """Queues ``write`` (which posts and returns its Transfer, or None) to run once
        ``after`` (an event on ``device``) completed; returns at once."""
        handle = PostedWrite()
        self._jobs.put((write, after, device, handle))
        return handle

    def close(self) -> None:
        """Posts every write queued so far, then stops the thread."""
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            write, after, device, handle = job
            with on_device(device):  # this thread has GPU 0 current otherwise
                try:
                    if after is not None:
                        after.synchronize()
                except Exception as exc:  # a CUDA error: the pack did not run
                    handle._fail(f"the pack before it failed: {exc}")
                    continue
                handle._post(write)

