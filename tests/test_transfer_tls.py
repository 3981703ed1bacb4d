"""TLS 1.3 on the transfer engine's connections: bytes arrive identical, an on-path observer
sees no plaintext, a rewritten record is detected (and the chunk resent), and mismatched
ends refuse each other. A real proxy on loopback sits between the engines."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from pddcore.transfer import TransferEngine, TransferError

TOKEN = b"tls-test-token-5e8b2d7f9a1c4036e2d1"
MARKER = b"PLAINTEXT-MARKER-" * 4  # would be visible in the stream without encryption


class Proxy:
    """Forwards every connection to ``upstream``, records what the client sent, and flips one
    byte of the client's stream once, on the first connection numbered ``flip_from`` or later
    (0 is the control connection) that has passed ``flip_after`` bytes: whichever data stream
    carries the chunks."""

    def __init__(self, upstream: str, flip_from: int | None = None, flip_after: int = 256 << 10):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.flip_from, self.flip_after = flip_from, flip_after
        self.flipped = False
        self.seen = bytearray()
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            index, self.accepted = self.accepted, self.accepted + 1
            threading.Thread(target=self._pump, args=(client, server, index), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, None), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, index: int | None) -> None:
        passed = 0
        try:
            while data := src.recv(1 << 16):
                if index is not None:
                    with self.lock:
                        if len(self.seen) < (64 << 20):
                            self.seen += data
                        if (self.flip_from is not None and index >= self.flip_from and not self.flipped
                                and passed + len(data) > self.flip_after):
                            data = bytearray(data)
                            data[max(0, self.flip_after - passed)] ^= 0x01
                            self.flipped = True
                    passed += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def payload(nbytes: int) -> torch.Tensor:
    data = torch.frombuffer(bytearray(os.urandom(nbytes)), dtype=torch.uint8)
    data[:len(MARKER)] = torch.frombuffer(bytearray(MARKER), dtype=torch.uint8)
    return data


def write_through(proxy_for, nbytes: int = 8 << 20, **engine_kwargs) -> tuple[dict, dict, Proxy, bool]:
    """Writes ``nbytes`` from one TLS engine to another through a proxy; returns both
    engines' stats, the proxy and whether the bytes arrived identical."""
    with TransferEngine(auth_token=TOKEN, tls=True, **engine_kwargs) as receiver, \
            TransferEngine(auth_token=TOKEN, tls=True, streams=2, chunk_bytes=1 << 20, **engine_kwargs) as sender:
        proxy = proxy_for(receiver.address)
        try:
            dst = torch.zeros(nbytes, dtype=torch.uint8)
            region = receiver.register(dst, target=True)
            src = payload(nbytes)
            peer = sender.connect(proxy.address)
            sender.write(peer, sender.register(src), 0, region.descriptor(), 0, nbytes, notify=MARKER).wait(timeout=60)
            got = receiver.poll_messages(timeout=10)
            assert [m.payload for m in got] == [MARKER]
            return receiver.stats(), sender.stats(), proxy, torch.equal(src, dst)
        finally:
            proxy.close()


def test_tls_transfer_is_byte_identical_and_opaque_on_the_wire():
    receiver_stats, _, proxy, identical = write_through(Proxy)
    assert identical
    assert MARKER not in proxy.seen and TOKEN not in proxy.seen  # ciphertext only, notify included
    assert receiver_stats["tls_errors"] == 0


def test_tampered_tls_record_is_detected_and_resent():
    receiver_stats, sender_stats, proxy, identical = write_through(lambda up: Proxy(up, flip_from=1))
    assert proxy.flipped
    assert receiver_stats["tls_errors"] >= 1  # the record failed authentication: the connection dropped
    assert sender_stats["retries"] >= 1 and identical  # its chunks were resent on a fresh connection


def test_tls_ends_must_match():
    with TransferEngine(auth_token=TOKEN, tls=True, timeout_s=3) as tls_engine, \
            TransferEngine(auth_token=TOKEN, timeout_s=3) as plain, \
            TransferEngine(auth_token=b"another-tls-token-0f9e8d7c6b5a4321", tls=True, timeout_s=3) as other:
        with pytest.raises(TransferError):
            plain.connect(tls_engine.address)
        with pytest.raises(TransferError, match="TLS handshake"):
            tls_engine.connect(plain.address)
        with pytest.raises(TransferError, match="TLS handshake"):
            other.connect(tls_engine.address)  # a different key: the TLS handshake fails
        # The server side counts each failure on its connection's thread, which may finish
        # after the client has given up: wait for it (the deadline only turns a miss into a failure).
        deadline = time.monotonic() + 10
        while tls_engine.stats()["tls_errors"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tls_engine.stats()["tls_errors"] >= 2
    with pytest.raises(ValueError, match="needs an auth_token"):
        TransferEngine(tls=True)
