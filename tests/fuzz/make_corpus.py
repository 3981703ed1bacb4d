"""Writes the fuzz targets' seed corpus, tests/fuzz/corpus/<target>/: well-formed frames and
handshakes of every kind the parsers accept, encoded here from the wire format in
csrc/include/pddcore/wire.h and csrc/transport/rdma/rdma_wire.h, so the fuzzer starts from
inputs that pass each check and mutates past them. Deterministic: tests/test_fuzz.py checks
the corpus in the tree is what this writes.

    python tests/fuzz/make_corpus.py [out_dir]
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

from pddcore import _C

HELLO_MAGIC, CHUNK_MAGIC, ACK_MAGIC, CONTROL_MAGIC, RDMA_MAGIC = 0x48444450, 0x43444450, 0x41444450, 0x4D444450, 0x52444450
VERSION = 4
# The engine ids the handshake targets give a certified peer (tests/fuzz/*_handshake.cpp).
CERTIFIED_ID = 0xCE27CE27CE27CE27


def control_frame(kind: int, payload: bytes) -> bytes:
    return struct.pack("<IBBHII", CONTROL_MAGIC, kind, 0, 0, len(payload), _C.crc32c(payload, 0)) + payload


def hello(kind: int, stream: int, engine_id: int, address: str) -> bytes:
    return struct.pack("<IHBBQ", HELLO_MAGIC, VERSION, kind, stream, engine_id) + bytes(range(16)) + \
        address.encode().ljust(64, b"\0")


def challenge(auth_required: int) -> bytes:
    return struct.pack("<IHB", HELLO_MAGIC, VERSION, auth_required) + bytes(range(16, 32))


def result(status: int, engine_id: int, reason: str = "") -> bytes:
    return struct.pack("<BQ", status, engine_id) + bytes(32) + reason.encode().ljust(96, b"\0")


def chunk_header(flags: int, seq: int, region: int, offset: int, length: int, payload_crc: int, tag: int) -> bytes:
    covered = struct.pack("<IHHQQQIII", CHUNK_MAGIC, VERSION, flags, seq, region, offset, length, payload_crc, tag)
    return covered + struct.pack("<I", _C.crc32c(covered, 0))


def ack(status: int, seq: int) -> bytes:
    return struct.pack("<IBBHQ", ACK_MAGIC, status, 0, 0, seq)


def rdma_frame(kind: int, payload: bytes) -> bytes:
    return struct.pack("<IBBHI", RDMA_MAGIC, kind, 0, 0, len(payload)) + payload


def qps(*has_gids: int) -> bytes:
    return struct.pack("<I", len(has_gids)) + b"".join(
        struct.pack("<HBBII", 7 + i, 5, g, 0x100 + i, 0x200 + i) + bytes(range(i, i + 16)) for i, g in enumerate(has_gids))


def corpus() -> dict[str, dict[str, bytes]]:
    """{target: {file name: bytes}}."""
    regions = b"".join(struct.pack("<QQQ", i, 0x7F0000000000 * i, 1 << 20) for i in (1, 2))
    tag = struct.pack("<I", 0xA5A5F00D)
    control = {
        "message": control_frame(1, b"request 17: prefill done"),
        "notify": control_frame(2, b"kv ready"),
        "ping": control_frame(3, struct.pack("<q", 123456789)),
        "pong": control_frame(4, struct.pack("<q", 123456789)),
        "region_query": control_frame(5, b""),
        "region_list": control_frame(6, regions),
        "fence": control_frame(7, tag),
        "fence_ack": control_frame(8, tag),
        "fence_busy": control_frame(9, tag),
        "three_frames": control_frame(3, bytes(8)) + control_frame(1, b"x") + control_frame(7, tag),
        "large_message": control_frame(1, bytes(range(256)) * 20),  # grows past the first 4096-byte piece
    }
    accept = {}
    for config in range(4):  # bit 0: the server has a token; bit 1: the client's certificate names CERTIFIED_ID
        for kind in range(3):
            accept[f"config{config}_kind{kind}"] = bytes([config]) + hello(kind, kind, CERTIFIED_ID, "127.0.0.1:5000") + \
                bytes(32)
    accept["long_address"] = bytes([0]) + hello(1, 15, 1, "engine-" + "a" * 50 + ":65535") + bytes(32)
    dial = {}
    for config in range(4):
        dial[f"config{config}_ok"] = bytes([config]) + challenge(config & 1) + result(0, CERTIFIED_ID)
    dial["refused"] = bytes([0]) + challenge(0) + result(2, 0, "authentication failed (wrong or missing auth token)")
    data = {
        "chunk_and_ack": chunk_header(0, 1, 3, 4096, 65536, 0x12345678, 0xBEEF) + ack(0, 1),
        "trailer_chunk_and_fenced_ack": chunk_header(1, 2, 3, 0, 1 << 20, 0, 0xBEEF) + ack(7, 2),
    }
    rdma = {
        "qp_request": rdma_frame(1, qps(0)),
        "qp_reply_with_gids": rdma_frame(2, qps(1, 0, 1)),
        "region_query": rdma_frame(3, struct.pack("<QQQ", 5, 4096, 65536)),
        "region_reply": rdma_frame(4, struct.pack("<BBHQQIQ", 0, 0, 0, 5, 0x7F0000001000, 0xABCD, 1 << 30)),
        "error": rdma_frame(5, b"malformed QP request"),
        "retire": rdma_frame(6, struct.pack("<III", 2, 0x100, 0x101)),
        "setup_session": rdma_frame(1, qps(1, 1)) + rdma_frame(3, bytes(24)) + rdma_frame(6, struct.pack("<II", 1, 7)),
    }
    return {"control_frame": control, "accept_handshake": accept, "dial_handshake": dial, "data_headers": data,
            "rdma_setup": rdma}


def write(out_dir: Path) -> None:
    for target, seeds in corpus().items():
        (out_dir / target).mkdir(parents=True, exist_ok=True)
        for name, data in seeds.items():
            (out_dir / target / name).write_bytes(data)


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "corpus")
