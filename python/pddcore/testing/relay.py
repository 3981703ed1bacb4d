"""A userspace WAN relay: the fallback when :class:`pddcore.testing.wan.WanLink` cannot
run (not root). TCP connections to a listen port are forwarded to a target address;
bytes pay a token-bucket bandwidth cap per direction (shared by all connections that
cross the link that way) and a one-way delay, in order.

It shapes at the application level: TCP between the endpoints and the relay runs at
loopback speed, so there is no slow start or loss over the emulated link, only its
rate and propagation delay. The kernel emulator (`WanLink`) is the faithful one.

Example::

    relay = WanRelay(rate_bps=100e6, delay_ms=25)
    port = relay.forward(("127.0.0.1", md_port), side="a")   # a-side clients dial `port`
    relay.start()
    ...
    relay.close()
"""

from __future__ import annotations

import asyncio
import socket
import threading

__all__ = ["WanRelay"]

_READ_BYTES = 64 << 10
_QUEUE_CHUNKS = 64


class _TokenBucket:
    """Serialises bytes at ``rate_bps``: each chunk leaves when the previous one has."""

    def __init__(self, rate_bps: float | None):
        self.rate_bps = rate_bps
        self.next_free = 0.0
        self.bytes = 0

    def departure(self, now: float, nbytes: int) -> float:
        self.bytes += nbytes
        if not self.rate_bps:
            return now
        self.next_free = max(now, self.next_free) + nbytes * 8 / self.rate_bps
        return self.next_free


class WanRelay:
    """Forwards TCP ports across an emulated link (side ``a`` <-> side ``b``).

    ``rate_bps``: cap per direction (None: none); ``delay_ms``: one-way delay.
    Call :meth:`forward` for each target, then :meth:`start`; :meth:`close` stops
    everything (idempotent).
    """

    def __init__(self, rate_bps: float | None, delay_ms: float, host: str = "127.0.0.1"):
        if rate_bps is not None and rate_bps <= 0:
            raise ValueError(f"rate_bps must be positive or None, got {rate_bps}")
        if delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
        self.rate_bps = rate_bps
        self.delay_s = delay_ms / 1e3
        self.host = host
        self._buckets = {"a": _TokenBucket(rate_bps), "b": _TokenBucket(rate_bps)}  # keyed by sending side
        self._routes: list[tuple[socket.socket, tuple[str, int], str]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def forward(self, target: tuple[str, int], side: str) -> int:
        """Listens on a free port of ``host`` for clients on ``side`` ("a" or "b") and
        forwards to ``target`` on the other side; returns the port."""
        if side not in ("a", "b"):
            raise ValueError(f"side must be 'a' or 'b', got {side!r}")
        if self._thread is not None:
            raise RuntimeError("forward() must be called before start()")
        sock = socket.socket()
        sock.bind((self.host, 0))
        sock.listen(64)
        self._routes.append((sock, target, side))
        return sock.getsockname()[1]

    def bytes_sent(self, side: str) -> int:
        """Bytes that crossed the link from ``side``."""
        return self._buckets[side].bytes

    def start(self) -> "WanRelay":
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="wan-relay", daemon=True)
        self._thread.start()
        ready.wait()
        return self

    def close(self) -> None:
        if self._loop is not None and not self._stopped.is_set():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self._stopped.set()
        for sock, _, _ in self._routes:
            sock.close()

    def __enter__(self) -> "WanRelay":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------
    def _run(self, ready: threading.Event) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        for sock, target, side in self._routes:
            sock.setblocking(False)
            loop.run_until_complete(asyncio.start_server(
                lambda r, w, t=target, s=side: self._serve(r, w, t, s), sock=sock))
        ready.set()
        try:
            loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: tuple[str, int],
                     side: str) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*target)
        except OSError:
            writer.close()
            return
        for w in (writer, up_writer):
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        other = "b" if side == "a" else "a"
        await asyncio.gather(self._pump(reader, up_writer, self._buckets[side]),
                             self._pump(up_reader, writer, self._buckets[other]), return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, bucket: _TokenBucket) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(_QUEUE_CHUNKS)

        async def deliver() -> None:
            try:
                while True:
                    due, data = await queue.get()
                    wait = due - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    if data is None:
                        break
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        delivery = loop.create_task(deliver())
        try:
            while True:
                data = await reader.read(_READ_BYTES)
                now = loop.time()
                if not data:
                    await queue.put((now + self.delay_s, None))
                    break
                leaves = bucket.departure(now, len(data))
                if leaves > now:  # the link is busy: read no faster than it drains (TCP backpressure)
                    await asyncio.sleep(leaves - now)
                await queue.put((leaves + self.delay_s, data))
        except (ConnectionError, OSError):
            await queue.put((loop.time(), None))
        await delivery
