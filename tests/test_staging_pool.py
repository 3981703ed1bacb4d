"""The adapters' staging pool: one arena allocated up front, spans handed out, kept registered
when released, given back (merged with their neighbours) when room is needed, withdrawn from
peers before reuse when discarded; checked against a model of which bytes each live buffer owns."""

from __future__ import annotations

import random

import pytest
import torch

from pddcore.integrations._staging import StagingExhausted, StagingPool, _size_class
from pddcore.transfer import TransferEngine

KIB = 1 << 10


@pytest.fixture
def engine():
    e = TransferEngine(listen="127.0.0.1:0")
    yield e
    e.close()


def span(pool: StagingPool, buf) -> tuple[int, int]:
    """Where ``buf``'s bytes are in the arena, from its tensor's address."""
    start = buf.tensor.data_ptr() - pool._arena.data_ptr()
    return start, start + buf.nbytes


def test_size_classes_stay_within_an_eighth_above_the_size(engine):
    pool = StagingPool(engine, "cpu", 64 << 20)
    for nbytes in [0, 1, 64 * KIB, 64 * KIB + 1, 100 * KIB, 1 << 20, (1 << 20) + 1, 5_000_000, 33 << 20]:
        buf = pool.acquire(nbytes)
        assert buf.nbytes == nbytes and buf.tensor.numel() == nbytes
        assert max(nbytes, 64 * KIB) <= buf.size <= max(64 * KIB, nbytes * 9 // 8 + 1)
        assert buf.region.nbytes == buf.size
        pool.release(buf)


def test_released_spans_merge_so_a_larger_buffer_fits_and_a_full_arena_says_what_sizes_it(engine):
    pool = StagingPool(engine, "cpu", 256 * KIB, name="test arena (staging_bytes)")
    bufs = [pool.acquire(64 * KIB) for _ in range(4)]
    assert sorted(span(pool, b)[0] for b in bufs) == [0, 64 * KIB, 128 * KIB, 192 * KIB]
    with pytest.raises(StagingExhausted, match=r"test arena \(staging_bytes\).* 0 of 262144 bytes are free"):
        pool.acquire(1)
    first, second, third, fourth = sorted(bufs, key=lambda b: span(pool, b)[0])
    pool.release(first)
    pool.release(third)  # two free 64 KiB spans, apart
    with pytest.raises(StagingExhausted, match="largest span 65536"):
        pool.acquire(128 * KIB, target=True)
    assert len(engine.regions()) == 2  # the idle buffers were given back to make room: unregistered
    pool.release(second)  # now first, second and third are adjacent
    big = pool.acquire(192 * KIB, target=True)
    assert span(pool, big) == (0, 192 * KIB) and big.region.target
    assert {r.nbytes for r in engine.regions()} == {192 * KIB, 64 * KIB}  # big, and fourth still out


def test_a_released_buffer_is_reused_registered_and_a_discarded_one_only_after_its_withdrawal(engine):
    pool = StagingPool(engine, "cpu", 128 * KIB)
    src = pool.acquire(10 * KIB)
    region = src.region
    pool.release(src)
    again = pool.acquire(20 * KIB)
    assert again.region is region and span(pool, again)[0] == span(pool, src)[0]  # same class: no new registration
    rx = pool.acquire(64 * KIB, target=True)
    descriptor = rx.region.descriptor()
    pool.discard(rx)
    assert rx.region not in engine.regions()  # peers' writes into it are refused from now on
    fresh = pool.acquire(64 * KIB, target=True)
    assert span(pool, fresh) == span(pool, rx) and fresh.region.descriptor() != descriptor


def test_live_buffers_never_overlap_over_random_use(engine):
    """Random acquires (sources and targets, 0 to 300 KiB), releases and discards on a 1 MiB
    arena: every live buffer lies inside the arena, no two share a byte, and a refusal happens
    only when no free stretch of the arena could hold the request's size class."""
    pool = StagingPool(engine, "cpu", 1 << 20)
    rng = random.Random(7)
    live = []
    for _ in range(600):
        if live and rng.random() < 0.45:
            buf = live.pop(rng.randrange(len(live)))
            (pool.discard if rng.random() < 0.3 else pool.release)(buf)
            continue
        nbytes = rng.randrange(300 * KIB)
        try:
            buf = pool.acquire(nbytes, target=rng.random() < 0.5)
        except StagingExhausted:
            held = sorted((b.offset, b.offset + b.size) for b in live)
            gaps = [b[0] - a[1] for a, b in zip([(0, 0)] + held, held + [(1 << 20, 0)])]
            assert max(gaps) < _size_class(nbytes)  # truly no room, idle buffers given back
            continue
        buf.tensor.fill_(len(live) % 251)
        live.append(buf)
        spans = sorted((b.offset, b.offset + b.size) for b in live)
        assert all(0 <= a and b <= 1 << 20 for a, b in spans)
        assert all(prev[1] <= nxt[0] for prev, nxt in zip(spans, spans[1:]))
        assert all(span(pool, b) == (b.offset, b.offset + b.nbytes) for b in live)
    assert pool.free_bytes + sum(b.size for b in live) + sum(b.size for bs in pool._idle.values() for b in bs) \
        == 1 << 20


def test_arena_is_allocated_once_and_pinned_for_gpu_kv(engine, monkeypatch):
    """The arena is the pool's only allocation, made in the constructor; for KV on a GPU it is
    pinned host memory (torch.empty stood in for: no GPU needed)."""
    calls = []
    real_empty = torch.empty

    def recording_empty(*size, **kwargs):
        calls.append(kwargs.get("pin_memory", False))
        return real_empty(*size, **{k: v for k, v in kwargs.items() if k != "pin_memory"})

    monkeypatch.setattr(torch, "empty", recording_empty)
    pool = StagingPool(engine, "cuda:1", 256 * KIB)
    assert calls == [True]
    for _ in range(3):
        pool.release(pool.acquire(100 * KIB))
    assert calls == [True]
    with pytest.raises(ValueError, match="below one buffer"):
        StagingPool(engine, "cpu", 1000)
