"""The receiving side of the benchmarks that move bytes between processes: an engine (and
the raw-socket baseline's listener) in a process of its own, which announces its region
descriptor through a small info file, and answers priority-lane latency probes.

Example::

    proc = mp.get_context("spawn").Process(target=engine_sink, args=("127.0.0.1:0", nbytes, info))
    proc.start()
    address = desc_address(bytes.fromhex(read_info(info).split()[0]))
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

from .auth import bench_token

PROBE = struct.Struct("<3sBd")  # b"lat", phase, send time
RAW_SPAN = struct.Struct("<QQ")  # offset, length of one round's share on one connection


def write_info(path: str, text: str) -> None:
    """Publishes a receiver's address/descriptor to a sender in another process or namespace."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


def read_info(path: str, timeout: float = 60.0) -> str:
    """Waits for :func:`write_info`'s file and returns its text."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"receiver did not start ({path})")
        time.sleep(0.01)
    with open(path) as f:
        return f.read()


# ---- receivers (run in another process or namespace) -------------------------------------


def engine_sink(listen: str, nbytes: int, info_path: str, backend: str = "tcp",
                engine_kwargs: dict | None = None, raw_info_path: str | None = None) -> list[tuple[int, float, float]]:
    """Registers ``nbytes``, publishes address and descriptor, records latency probes
    (phase, sent, arrived) until an ``exit`` message. ``engine_kwargs``: more TransferEngine
    arguments (TLS, certificates) beside the run's token. With ``raw_info_path``, also serves
    :func:`raw_receive` into the same registered buffer and publishes its port there."""
    from pddcore.transfer import TransferEngine

    probes = []
    destination = bytearray(nbytes)
    if raw_info_path is not None:
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=raw_receive, args=(listener, memoryview(destination)), daemon=True).start()
        write_info(raw_info_path, str(listener.getsockname()[1]))
    with TransferEngine(backend, listen=listen, auth_token=bench_token(), **(engine_kwargs or {})) as engine:
        region = engine.register(destination, target=True)
        write_info(info_path, region.descriptor().hex())
        while True:
            for message in (m.payload for m in engine.poll_messages(timeout=1.0)):
                now = time.monotonic()
                if message == b"exit":
                    return probes
                if len(message) == PROBE.size and message[:3] == b"lat":
                    _, phase, sent = PROBE.unpack(message)
                    probes.append((phase, sent, now))


def raw_receive(listener: socket.socket, destination: memoryview) -> None:
    """The raw-socket baseline's receiver: each accepted connection, round after round,
    reads a (offset, length) span, ``recv_into``s that span of ``destination`` and
    answers one byte once all of it arrived. MSG_WAITALL lets the kernel fill the whole
    span in one call: no interpreter work (or lock) between the kernel's copies."""

    def serve(conn: socket.socket) -> None:
        with conn:
            head = bytearray(RAW_SPAN.size)
            while conn.recv_into(head, RAW_SPAN.size, socket.MSG_WAITALL) == RAW_SPAN.size:
                offset, length = RAW_SPAN.unpack(head)
                part = destination[offset:offset + length]
                got = 0
                while got < length:  # more than one call only if a signal cut one short
                    n = conn.recv_into(part[got:], length - got, socket.MSG_WAITALL)
                    if n == 0:
                        return
                    got += n
                conn.sendall(b"k")

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def desc_address(descriptor: bytes) -> str:
    from pddcore.transfer import RegionDescriptor

    return RegionDescriptor.from_bytes(descriptor).address
