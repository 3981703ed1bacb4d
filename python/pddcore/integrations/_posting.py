"""Writes an adapter posts from a thread of its own, each once the GPU work that fills its
source has run, so that the engine's scheduler thread queues a pack and returns without ever
waiting on the GPU, nor on a peer.

The caller packs on its current stream, records an event after the pack and hands the
:class:`Poster` the write with that event; the poster's thread waits on the event and then
posts the write. Writes are posted in the order they were handed over. A cancel returns at
once too: the wait for the peer's fence runs on a thread of the poster's own for each cancel,
so that it queues behind no write waiting on the GPU, nor behind another peer's fence.

Example::

    poster = Poster("pdd-post")
    pack(layout, pages, out=buf.tensor)                          # queued on the current stream
    write = poster.post(functools.partial(engine.write, peer, buf.region, 0, dst, 0, buf.nbytes),
                        after=record_event(device), device=device)   # None: nothing to wait for
    write.status        # "pending" until posted and done, then as the Transfer's
    write.cancel(then=functools.partial(pool.release, buf))   # returns at once; "cancelled"
    # then() runs once no byte of buf can be read any more: at once if the write was not
    # posted yet, else once the post returned and the transfer's cancel() returned
    poster.close()      # posts what is queued, waits for the cancels, then stops
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable

import torch

from ..transfer import Transfer, TransferError
from ._device import on_device

__all__ = ["Poster", "PostedWrite", "cancel_all"]

log = logging.getLogger(__name__)

_QUEUED, _POSTING, _POSTED = "queued", "posting", "posted"


class PostedWrite:
    """A write handed to a :class:`Poster`; reads like the :class:`Transfer` it becomes
    (``status``, ``error``, ``done()``), but :meth:`cancel` returns at once.

    ``status`` is "pending" while the write is queued, being posted or its transfer runs,
    then as the transfer ends ("done" or "failed"); a write that posts nothing to track (a
    control message) is done once sent, one whose post raised is "failed". A :meth:`cancel`
    while it is pending makes it "cancelled" from then on, whatever the post or the transfer
    do next; a cancel of a finished write changes nothing. ``settled`` says when the source
    may be reused: for a write never cancelled, once its status left "pending"; a cancelled
    write reads "cancelled" at once but settles only once its post and its transfer's cancel()
    returned."""

    def __init__(self, run_cancel: Callable[[Callable[[], None]], None]):
        self._run_cancel = run_cancel  # runs a blocking Transfer.cancel() off the caller's thread
        self._lock = threading.Lock()
        self._stage = _QUEUED
        self._transfer: Transfer | None = None
        self._error: str | None = None         # why the post failed
        self._cancelled = False                # cancel() came while the write was pending
        self._fence = "none"                   # the transfer's cancel(): "none", "running" or "returned"
        self._fence_error: str | None = None   # what that cancel() raised
        self._then: list[Callable[[], None]] = []

    @property
    def status(self) -> str:
        """"pending", "done", "failed" or "cancelled"."""
        with self._lock:
            return self._status()

    @property
    def error(self) -> str | None:
        """Why the write failed or was cancelled; None while pending or when done."""
        with self._lock:
            if self._cancelled:
                if self._stage == _QUEUED:
                    return "cancelled before it was posted"
                if self._error is not None:
                    return f"cancelled while it was posted; {self._error}"
                if self._fence_error is not None:
                    return f"cancelled; the peer did not confirm the cancel: {self._fence_error}"
                return "cancelled"
            if self._error is not None:
                return self._error
            return self._transfer.error if self._transfer is not None else None

    @property
    def settled(self) -> bool:
        """True once no byte of the source can be read any more: never posted and never will
        be, the post returned without a transfer or raised, the transfer finished, or its
        cancel() returned (raised or not)."""
        with self._lock:
            return self._settled()

    def done(self) -> bool:
        """True once posted and finished; raises TransferError if it failed or was cancelled."""
        status = self.status
        if status in ("failed", "cancelled"):
            raise TransferError(f"transfer {status}: {self.error}")
        return status == "done"

    def cancel(self, then: Callable[[], None] | None = None) -> None:
        """Returns at once. A write not posted yet never will be; one being posted is cancelled
        by the poster's thread once its post returned; a posted transfer's blocking
        :meth:`Transfer.cancel` (the peer's fence) runs on a cancel thread of the poster, for a
        failed transfer too (its fence lifts the quarantine of the destination ranges).

        ``then`` runs once the write is settled (see ``settled``): here if it already is, else
        on the poster's thread that settles it, so it must be quick; what it raises is logged.
        Every call's ``then`` runs once, a second cancel adds its own."""
        with self._lock:
            if then is not None:
                self._then.append(then)
            fence, status = None, self._status()
            if status == "pending":
                self._cancelled = True
                if self._stage == _POSTED:
                    fence = self._start_fence()
            elif status == "failed" and self._fence == "none":  # the fence lifts the quarantine of its destination
                fence = self._start_fence()
            ready = self._take_then()
        if fence is not None:
            self._run_cancel(fence)
        _run_all(ready)

    def _status(self) -> str:
        if self._cancelled:
            return "cancelled"
        if self._error is not None:
            return "failed"
        if self._stage != _POSTED:
            return "pending"
        return self._transfer.status if self._transfer is not None else "done"

    def _settled(self) -> bool:
        if self._stage == _QUEUED:
            return self._cancelled
        if self._stage == _POSTING:
            return False
        if self._transfer is None:
            return True
        if self._cancelled:  # its transfer's cancel() started when it was cancelled or posted
            return self._fence == "returned"
        return self._transfer.status != "pending"

    def _take_then(self) -> list[Callable[[], None]]:
        """The callbacks to run now, taken out under the lock so that each runs once."""
        if not self._then or not self._settled():
            return []
        ready, self._then = self._then, []
        return ready

    def _start_fence(self) -> Callable[[], None] | None:
        """Under the lock: the transfer's cancel() to run, if there is a transfer."""
        if self._transfer is None:
            return None
        self._fence = "running"
        return functools.partial(self._cancel_transfer, self._transfer)

    def _cancel_transfer(self, transfer: Transfer) -> None:
        try:
            transfer.cancel()
            error = None
        except Exception as exc:  # the peer did not confirm; the engine stopped reading our source all the same
            error = str(exc)
        with self._lock:
            self._fence, self._fence_error = "returned", error
            ready = self._take_then()
        _run_all(ready)

    def _post(self, write: Callable[[], Transfer | None]) -> None:
        with self._lock:
            if self._cancelled:  # cancelled before it was posted: it never will be
                return
            self._stage = _POSTING
        transfer, error = None, None
        try:  # without the lock: a cancel() meanwhile only marks the write, and the fence follows here
            transfer = write()
        except Exception as exc:
            error = f"could not post: {exc}"
        with self._lock:
            self._stage, self._transfer, self._error = _POSTED, transfer, error
            fence = self._start_fence() if self._cancelled else None
            ready = self._take_then()
        if fence is not None:
            self._run_cancel(fence)
        _run_all(ready)

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self._cancelled:  # already settled, never posted
                return
            self._stage, self._error = _POSTED, reason


def _run_all(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        try:
            callback()
        except Exception:  # one callback's fault must not stop a poster thread nor the others
            log.exception("a callback of a settled write raised")


def cancel_all(writes: list[PostedWrite], then: Callable[[], None]) -> None:
    """Cancels every write (returning at once) and runs ``then`` once all of them settled:
    here if they already are, else on the poster's thread that settles the last one."""
    lock, left = threading.Lock(), [len(writes) + 1]  # + 1: this call's own, so then() runs once all are asked

    def settled_one() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()

    for write in writes:
        write.cancel(then=settled_one)
    settled_one()


class Poster:
    """One thread that posts writes in order, each after its event completed, and a thread
    for each cancel of a posted transfer while it waits for its peer's fence (up to the
    engine's ``timeout_s`` when the peer is gone: one such wait delays no other cancel)."""

    def __init__(self, name: str):
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._accepting = True   # posts are taken until close() began
        self._closed = False
        self._cancelling: set[threading.Thread] = set()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, write: Callable[[], Transfer | None], *, after: "torch.cuda.Event | None" = None,
             device: torch.device = torch.device("cpu")) -> PostedWrite:
        """Queues ``write`` (which posts and returns its Transfer, or None) to run once
        ``after`` (an event on ``device``) completed; returns at once. Once :meth:`close`
        began, the write is never posted and reads "failed" (nothing is left to post it)."""
        handle = PostedWrite(self._cancel_later)
        with self._lock:  # close() queues its stop under this lock: no write lands behind it
            if self._accepting:
                self._jobs.put((write, after, device, handle))
                return handle
        handle._fail("not posted: the poster is closed")
        return handle

    def close(self) -> None:
        """Posts every write queued so far, waits for every cancel asked so far (so that no
        transfer of a cancelled write still reads its source), then stops. A cancel asked
        afterwards runs on its caller's thread: no other is left."""
        with self._lock:
            self._accepting = False
            self._jobs.put(None)
        self._thread.join()
        with self._lock:
            self._closed = True
            cancelling = list(self._cancelling)
        for thread in cancelling:
            thread.join()

    def _cancel_later(self, cancel: Callable[[], None]) -> None:
        with self._lock:
            if not self._closed:
                thread = threading.Thread(target=self._run_cancel, args=(cancel,), name=f"{self._name}-cancel",
                                          daemon=True)
                self._cancelling.add(thread)
                thread.start()
                return
        cancel()

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

    def _run_cancel(self, cancel: Callable[[], None]) -> None:
        try:
            cancel()
        finally:
            with self._lock:
                self._cancelling.discard(threading.current_thread())
