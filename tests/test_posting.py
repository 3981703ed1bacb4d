"""The posting thread of the engine adapters (pddcore.integrations._posting): a PostedWrite's
cancel() returns at once in every state (queued, being posted, posted, failed, a control
message, cancelled already, the poster closing), and its source is handed back only once no
byte of it can be read any more.

The reference is a plain model of the source (:class:`Source`): the fake write counts as a
reader from the moment the engine is asked to post until its post returns without a
transfer, and the fake transfer until it finishes or its cancel() returns. A source reused
while a reader holds it, or never reused, fails the test. A fake write or cancel() held on a
threading.Event shows the ordering: cancel() returned while they were still held."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from pddcore.integrations._posting import PostedWrite, Poster, cancel_all
from pddcore.transfer import TransferError

DEADLINE_S = 60  # only so that a regression fails instead of hanging; no speed is measured


class Source:
    """A staging buffer as the reference sees it: who may still read it, and whether it was
    reused while one did."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.readers = 0
        self.reused = threading.Event()
        self.reused_while_read = False

    def add_readers(self, delta: int) -> None:
        with self._lock:
            self.readers += delta

    def reuse(self) -> None:
        with self._lock:
            self.reused_while_read |= self.readers > 0
        assert not self.reused.is_set(), "the source was handed back twice"
        self.reused.set()

    def check_reused_safely(self) -> None:
        assert self.reused.wait(DEADLINE_S), "the source never came back"
        assert not self.reused_while_read, "the source was handed back while it could still be read"


class FakeTransfer:
    """A Transfer reading ``source`` until it finishes or its cancel() returns; cancel()
    blocks until ``fence`` is set (the peer confirming), as the engine's does."""

    def __init__(self, source: Source, status: str = "pending", cancel_raises: bool = False):
        self.source, self.status, self.error = source, status, None
        self.cancel_raises = cancel_raises
        self.cancel_calls = 0
        self.cancel_entered = threading.Event()
        self.fence = threading.Event()
        if status == "pending":
            source.add_readers(1)

    def finish(self, status: str) -> None:
        self.status = status
        self.source.add_readers(-1)

    def cancel(self) -> None:
        self.cancel_calls += 1
        self.cancel_entered.set()
        assert self.fence.wait(DEADLINE_S)
        if self.status == "pending":
            self.finish("cancelled")
        if self.cancel_raises:
            raise TransferError("the peer did not confirm the fence in time")


class FakeWrite:
    """What the poster calls to post: held until ``release`` is set, then returns ``result``
    (a FakeTransfer or None) or raises it (an Exception)."""

    def __init__(self, source: Source, result: Callable[[], FakeTransfer | None] | Exception):
        self.source, self.result = source, result
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> FakeTransfer | None:
        self.calls += 1
        self.source.add_readers(1)  # the engine may read the source as soon as it posts
        self.entered.set()
        assert self.release.wait(DEADLINE_S)
        self.source.add_readers(-1)  # from here on a transfer, if any, holds the read
        if isinstance(self.result, Exception):
            raise self.result
        return self.result()


def returns(fn: Callable[[], None]) -> threading.Event:
    """Runs ``fn`` on a thread of its own; the event is set once it returned."""
    returned = threading.Event()

    def run() -> None:
        fn()
        returned.set()

    threading.Thread(target=run, daemon=True).start()
    return returned


@pytest.fixture
def poster():
    p = Poster("test-post")
    yield p
    p.close()


def posted_through(poster: Poster) -> None:
    """Returns once the poster finished with every write handed to it so far: they are
    posted in order, so a write handed over after them has been called."""
    barrier = FakeWrite(Source(), lambda: None)
    barrier.release.set()
    poster.post(barrier)
    assert barrier.entered.wait(DEADLINE_S)


def post_now(poster: Poster, source: Source, result) -> PostedWrite:
    """A write posted at once: its post returned before this returns."""
    write = FakeWrite(source, result)
    write.release.set()
    handle = poster.post(write)
    posted_through(poster)
    return handle


def test_a_write_cancelled_before_it_is_posted_never_is_and_frees_its_source_at_once(poster):
    ahead_source, source = Source(), Source()
    ahead = FakeWrite(ahead_source, lambda: None)  # holds the poster's thread
    poster.post(ahead)
    write = FakeWrite(source, lambda: FakeTransfer(source))
    handle = poster.post(write)
    assert ahead.entered.wait(DEADLINE_S)
    handle.cancel(then=source.reuse)
    assert source.reused.is_set()  # at once, on this thread
    assert handle.settled and handle.status == "cancelled" and handle.error == "cancelled before it was posted"
    with pytest.raises(TransferError, match="cancelled before it was posted"):
        handle.done()
    ahead.release.set()
    posted_through(poster)
    assert write.calls == 0
    source.check_reused_safely()


def test_a_cancel_during_the_post_returns_while_the_post_is_blocked(poster):
    """The post connects to a dead peer (seconds): cancel() does not wait for it; the
    poster's thread cancels the transfer once the post returned, and only then is the source
    handed back."""
    source = Source()
    transfer = FakeTransfer(source)
    write = FakeWrite(source, lambda: transfer)
    handle = poster.post(write)
    assert write.entered.wait(DEADLINE_S)
    cancelled = returns(lambda: handle.cancel(then=source.reuse))
    assert cancelled.wait(DEADLINE_S)
    assert not write.release.is_set()  # cancel() returned while the post was still blocked
    assert handle.status == "cancelled" and not handle.settled and not source.reused.is_set()
    transfer.fence.set()
    write.release.set()
    source.check_reused_safely()
    assert transfer.cancel_calls == 1 and transfer.status == "cancelled"
    assert handle.settled and handle.status == "cancelled" and handle.error == "cancelled"


def test_a_cancel_after_the_post_returns_while_the_peer_has_not_confirmed(poster):
    """The transfer's cancel() waits for the peer's fence (up to the engine's timeout_s when
    the peer is gone): it runs on the poster's cancel thread, and the source comes back once
    it returned."""
    source = Source()
    transfer = FakeTransfer(source)
    handle = post_now(poster, source, lambda: transfer)
    assert handle.status == "pending" and not handle.settled
    cancelled = returns(lambda: handle.cancel(then=source.reuse))
    assert cancelled.wait(DEADLINE_S) and transfer.cancel_entered.wait(DEADLINE_S)
    assert not transfer.fence.is_set()  # cancel() returned while the transfer's cancel() was blocked
    assert handle.status == "cancelled" and not handle.settled and not source.reused.is_set()
    with pytest.raises(TransferError, match="cancelled"):
        handle.done()
    transfer.fence.set()
    source.check_reused_safely()
    assert handle.settled and transfer.cancel_calls == 1


def test_a_cancel_the_peer_never_confirms_still_hands_the_source_back(poster):
    source = Source()
    transfer = FakeTransfer(source, cancel_raises=True)
    handle = post_now(poster, source, lambda: transfer)
    transfer.fence.set()
    handle.cancel(then=source.reuse)
    source.check_reused_safely()
    assert handle.status == "cancelled"
    assert handle.error == "cancelled; the peer did not confirm the cancel: the peer did not confirm the fence in time"


def test_cancels_do_not_queue_behind_a_write_waiting_to_be_posted(poster):
    """A posted transfer's cancel runs while the poster's thread is held by the next write."""
    source, next_source = Source(), Source()
    transfer = FakeTransfer(source)
    handle = post_now(poster, source, lambda: transfer)
    held = FakeWrite(next_source, lambda: None)
    poster.post(held)
    assert held.entered.wait(DEADLINE_S)
    transfer.fence.set()
    handle.cancel(then=source.reuse)
    source.check_reused_safely()
    assert not held.release.is_set()  # settled while the poster's thread was still held
    held.release.set()


@pytest.mark.parametrize("outcome", ["post raised", "control message", "transfer done"])
def test_a_cancel_of_a_finished_write_changes_nothing_and_frees_at_once(poster, outcome):
    source = Source()
    transfer = FakeTransfer(source, status="done")
    result = {"post raised": ConnectionError("peer unreachable"), "control message": lambda: None,
              "transfer done": lambda: transfer}[outcome]
    handle = post_now(poster, source, result)
    status = {"post raised": "failed", "control message": "done", "transfer done": "done"}[outcome]
    assert handle.status == status and handle.settled
    handle.cancel(then=source.reuse)
    assert source.reused.is_set()  # at once
    source.check_reused_safely()
    assert handle.status == status and transfer.cancel_calls == 0
    if outcome == "post raised":
        assert handle.error == "could not post: peer unreachable"
    else:
        assert handle.done()


def test_a_cancel_of_a_failed_transfer_runs_its_fence_off_the_callers_thread(poster):
    """A failed transfer reads nothing any more, so its source comes back at once; its
    cancel() still runs (it lifts the quarantine of the destination ranges), on the poster's
    cancel thread, and once only."""
    source = Source()
    transfer = FakeTransfer(source)
    handle = post_now(poster, source, lambda: transfer)
    transfer.finish("failed")
    handle.cancel(then=source.reuse)
    assert source.reused.is_set()
    assert transfer.cancel_entered.wait(DEADLINE_S) and not transfer.fence.is_set()
    handle.cancel()
    transfer.fence.set()
    poster.close()  # waits for the cancel
    assert transfer.cancel_calls == 1 and handle.status == "failed" and handle.settled


def test_a_second_cancel_runs_its_own_callback_and_the_transfers_cancel_once(poster):
    source = Source()
    transfer = FakeTransfer(source)
    handle = post_now(poster, source, lambda: transfer)
    first, second = threading.Event(), threading.Event()
    handle.cancel(then=first.set)
    handle.cancel(then=second.set)
    assert transfer.cancel_entered.wait(DEADLINE_S)
    assert not first.is_set() and not second.is_set()
    transfer.fence.set()
    assert first.wait(DEADLINE_S) and second.wait(DEADLINE_S)
    handle.cancel(then=source.reuse)  # settled already: at once
    assert source.reused.is_set()
    source.check_reused_safely()
    assert transfer.cancel_calls == 1


def test_a_callback_that_raises_does_not_stop_the_poster(poster, caplog):
    source = Source()
    transfer = FakeTransfer(source)
    handle = post_now(poster, source, lambda: transfer)

    def broken() -> None:
        raise RuntimeError("callback bug")

    handle.cancel(then=broken)
    handle.cancel(then=source.reuse)
    transfer.fence.set()
    source.check_reused_safely()
    assert "callback bug" in caplog.text
    later_source = Source()
    later = post_now(poster, later_source, lambda: None)
    assert later.status == "done"  # the posting thread is still alive


def test_close_waits_for_the_cancels_asked_before_it(poster):
    """A cancel asked while the post is blocked, and one of a posted transfer: close() posts
    what is queued, and returns only once both transfers' cancels returned, so no thread of
    the poster is left reading a source."""
    during, after = Source(), Source()
    posted_transfer = FakeTransfer(after)
    handle_after = post_now(poster, after, lambda: posted_transfer)
    blocked_transfer = FakeTransfer(during)
    write = FakeWrite(during, lambda: blocked_transfer)
    handle_during = poster.post(write)
    assert write.entered.wait(DEADLINE_S)
    handle_during.cancel(then=during.reuse)
    handle_after.cancel(then=after.reuse)
    assert posted_transfer.cancel_entered.wait(DEADLINE_S)
    seen_when_closed = {}

    def close() -> None:
        poster.close()
        seen_when_closed.update(during=during.reused.is_set(), after=after.reused.is_set())

    closed = returns(close)
    write.release.set()
    posted_transfer.fence.set()
    blocked_transfer.fence.set()
    assert closed.wait(DEADLINE_S)
    assert seen_when_closed == {"during": True, "after": True}
    during.check_reused_safely()
    after.check_reused_safely()
    assert blocked_transfer.cancel_calls == 1 and posted_transfer.cancel_calls == 1


def test_a_cancel_after_close_runs_on_the_callers_thread():
    poster = Poster("test-post")
    source = Source()
    transfer = FakeTransfer(source)
    handle = post_now(poster, source, lambda: transfer)
    poster.close()
    transfer.fence.set()
    handle.cancel(then=source.reuse)
    assert source.reused.is_set()  # no thread is left: it ran here
    source.check_reused_safely()


def test_a_write_handed_over_after_close_fails_and_is_never_posted():
    poster = Poster("test-post")
    poster.close()
    write = FakeWrite(Source(), lambda: None)
    write.release.set()
    handle = poster.post(write)
    assert handle.status == "failed" and "closed" in handle.error and handle.settled
    with pytest.raises(TransferError, match="closed"):
        handle.done()
    assert write.calls == 0


def test_cancel_all_runs_its_callback_once_every_write_settled(poster):
    queued_source, posted_source = Source(), Source()
    ahead = FakeWrite(Source(), lambda: None)
    transfer = FakeTransfer(posted_source)
    handle_posted = post_now(poster, posted_source, lambda: transfer)
    poster.post(ahead)
    assert ahead.entered.wait(DEADLINE_S)
    handle_queued = poster.post(FakeWrite(queued_source, lambda: FakeTransfer(queued_source)))
    released = threading.Event()

    def release_both() -> None:
        queued_source.reuse()
        posted_source.reuse()
        released.set()

    cancel_all([handle_queued, handle_posted], then=release_both)
    assert transfer.cancel_entered.wait(DEADLINE_S) and not released.is_set()
    transfer.fence.set()
    queued_source.check_reused_safely()
    posted_source.check_reused_safely()
    ahead.release.set()
    nothing = threading.Event()
    cancel_all([], then=nothing.set)
    assert nothing.is_set()


def test_a_cancel_waiting_on_one_peer_delays_no_other_cancel(poster):
    """Each transfer's cancel waits on its own: a second write's source comes back while the
    first one's peer has still not confirmed."""
    stuck_source, source = Source(), Source()
    stuck, transfer = FakeTransfer(stuck_source), FakeTransfer(source)
    stuck_handle = post_now(poster, stuck_source, lambda: stuck)
    handle = post_now(poster, source, lambda: transfer)
    stuck_handle.cancel(then=stuck_source.reuse)
    assert stuck.cancel_entered.wait(DEADLINE_S)
    transfer.fence.set()
    handle.cancel(then=source.reuse)
    source.check_reused_safely()
    assert not stuck.fence.is_set() and not stuck_source.reused.is_set()
    stuck.fence.set()
    stuck_source.check_reused_safely()
