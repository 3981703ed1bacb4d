"""The loopback transfer benchmark's raw-socket baseline moves the same bytes into the same
destination buffer as the engine, on the congestion control the engine's connections ran."""

import socket
import threading

import numpy as np

from pddcore.benchmarks.sink import raw_receive
from pddcore.benchmarks.transfer_cases import RawSockets, loopback_matrix


def test_raw_sockets_fill_the_destination_span_by_span():
    nbytes = (3 << 20) + 5  # not a multiple of the streams: the last one takes the rest
    destination = bytearray(nbytes)
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=raw_receive, args=(listener, memoryview(destination)), daemon=True).start()
    raw = RawSockets(listener.getsockname()[1], streams=3)
    try:
        for seed in (1, 2):  # kept connections carry round after round
            data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
            assert raw.move(memoryview(data)) > 0
            assert bytes(destination) == data.tobytes()
    finally:
        raw.close()


def test_raw_sockets_run_the_congestion_control_they_are_given():
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=raw_receive, args=(listener, memoryview(bytearray(16))), daemon=True).start()
    raw = RawSockets(listener.getsockname()[1], streams=2)
    try:
        raw.run("cubic")
        for c in raw.conns:
            assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0") == b"cubic"
        assert raw.congestion_control == "cubic"
    finally:
        raw.close()


def test_loopback_matrix_compares_on_the_engines_algorithm():
    (r,) = loopback_matrix(nbytes=4 << 20, rounds=1, chunk_sizes=(1 << 20,), streams_list=(2,))
    assert (r.chunk_bytes, r.streams, r.rounds) == (1 << 20, 2, 1)
    assert r.congestion_control == "cubic"  # "auto" on loopback (test_transfer_congestion.py)
    assert r.engine_gbps > 0 and r.raw_gbps > 0
