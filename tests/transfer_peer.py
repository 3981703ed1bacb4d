"""A transfer engine in its own process, driven over a multiprocessing pipe, so tests move
bytes between two real processes over real sockets (:class:`RemoteEngine`), and a watch on
an engine's connects to one address (:class:`Connects`), for tests that freeze such a peer.
Used by test_transfer_*.py, test_peers.py and the adapters' integration tests."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import threading
import time
from typing import Any


def digest(buf: Any, offset: int = 0, nbytes: int | None = None) -> str:
    view = memoryview(buf).cast("B")
    end = len(view) if nbytes is None else offset + nbytes
    return hashlib.sha256(view[offset:end]).hexdigest()


def _serve(conn, engine_kwargs: dict) -> None:
    from pddcore.transfer import TransferEngine

    engine = TransferEngine(**engine_kwargs)
    buffers: list[bytearray | None] = []
    regions = []
    peers = {}  # address -> Peer, one connection each
    conn.send(("ready", engine.address))
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "region":  # (nbytes) -> (index, descriptor)
                buffers.append(bytearray(args[0]))
                regions.append(engine.register(buffers[-1], target=True))
                reply = (len(regions) - 1, regions[-1].descriptor())
            elif cmd == "fill":  # (index, seed) -> digest of the new contents
                import random
                buf = buffers[args[0]]
                buf[:] = random.Random(args[1]).randbytes(len(buf))
                reply = digest(buf)
            elif cmd == "digest":  # (index, offset, nbytes)
                reply = digest(buffers[args[0]], args[1], args[2])
            elif cmd == "wait_message":  # (timeout, index) -> [(peer, payload, arrival, digest at arrival)]
                deadline = time.monotonic() + args[0]
                got = []
                while not got and time.monotonic() < deadline:
                    got = engine.poll_messages(timeout=deadline - time.monotonic())
                now = time.monotonic()
                reply = [(m.sender, m.payload, now, digest(buffers[args[1]]) if args[1] is not None else None)
                         for m in got]
            elif cmd == "send":  # (address, payload): a control message
                if args[0] not in peers:
                    peers[args[0]] = engine.connect(args[0])
                engine.send(peers[args[0]], args[1])
                reply = None
            elif cmd == "stats":
                reply = engine.stats()
            elif cmd == "unregister":  # (index): also frees the buffer
                engine.unregister(regions[args[0]])
                buffers[args[0]] = regions[args[0]] = None
                reply = None
            elif cmd == "exit":
                engine.close()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown command {cmd}")
            conn.send(("ok", reply))
        except Exception as e:  # reported to the test, which raises it
            conn.send(("error", repr(e)))


class RemoteEngine:
    """Handle on an engine running in a child process."""

    def __init__(self, **engine_kwargs: Any):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, engine_kwargs), daemon=True)
        self.process.start()
        status, self.address = self._conn.recv()
        assert status == "ready"

    def call(self, cmd: str, *args: Any) -> Any:
        self._conn.send((cmd, *args))
        status, reply = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"remote engine: {reply}")
        return reply

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.call("exit")
            except (EOFError, BrokenPipeError, OSError):
                pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class Connects:
    """Watches ``engine.connect`` to ``address`` (through pytest's ``monkeypatch``): ``started``
    once one began, ``ended`` once one returned or raised, ``count`` of them."""

    def __init__(self, monkeypatch, engine: Any, address: str):
        self.started, self.ended, self.count = threading.Event(), threading.Event(), 0
        connect = engine.connect

        def watched(to: str, *args):
            if to != address:
                return connect(to, *args)
            self.count += 1
            self.started.set()
            try:
                return connect(to, *args)
            finally:
                self.ended.set()

        monkeypatch.setattr(engine, "connect", watched)
