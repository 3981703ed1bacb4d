"""`pddcore info` and the CRC32C primitive."""

import functools
import importlib.metadata
import json
import os
import platform
import random
import struct
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from pddcore import _C


def crc32c_bitwise(data: bytes, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


@functools.lru_cache(maxsize=1)
def _crc32c_byte_table() -> tuple[int, ...]:
    """The CRC of each byte value, from the bitwise definition (not pddcore's table)."""
    return tuple(crc32c_bitwise(bytes([b]), 0xFFFFFFFF) ^ 0xFFFFFFFF for b in range(256))


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    """The bitwise reference one byte at a time: fast enough for megabytes in a test."""
    table = _crc32c_byte_table()
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def elf_section_names(path: str) -> set[str]:
    """Section names of a 64-bit little-endian ELF file, read from its section header table."""
    with open(path, "rb") as f:
        elf = f.read()
    assert elf[:6] == b"\x7fELF\x02\x01", "not a 64-bit little-endian ELF file"
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]  # sh_offset of the section-name string table
    return {elf[names_at + h[0]:elf.index(b"\0", names_at + h[0])].decode() for h in headers}


IMPLEMENTATIONS = _C.crc32c_implementations()


def test_every_cpu_offers_the_table_and_the_default_is_offered():
    assert "table" in IMPLEMENTATIONS
    assert _C.crc32c_implementation() in IMPLEMENTATIONS


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_crc32c_known_vector(impl):
    assert _C.crc32c(b"123456789", implementation=impl) == 0xE3069283
    assert _C.crc32c(b"", implementation=impl) == 0


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@settings(max_examples=60, deadline=None)
@given(a=st.binary(max_size=700), b=st.binary(max_size=300))
def test_crc32c_matches_bitwise_reference_and_chains(impl, a, b):
    assert _C.crc32c(a, implementation=impl) == crc32c_bitwise(a)
    assert _C.crc32c(b, _C.crc32c(a, implementation=impl), implementation=impl) == crc32c_bitwise(a + b)


# Around the 3 x 4 KiB stripes of the interleaved path and the 256-byte rounds and
# 64-byte blocks of the folding path, at odd start offsets.
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("size", [255, 256, 257, 319, 320, 511, 577, 3 * 4096 - 1, 3 * 4096, 2 * 3 * 4096 + 13])
def test_crc32c_block_boundaries_match_reference(impl, size):
    data = random.Random(size).randbytes(size + 3)
    for offset in (0, 3):
        piece = data[offset:offset + size]
        expected = crc32c_bitwise(piece)
        assert _C.crc32c(piece, implementation=impl) == expected
        assert _C.crc32c(piece[5:], _C.crc32c(piece[:5], implementation=impl), implementation=impl) == expected


def test_byte_table_reference_matches_the_bitwise_one():
    data = random.Random(3).randbytes(1000)
    assert crc32c_reference(data, 0x12345678) == crc32c_bitwise(data, 0x12345678)


@functools.lru_cache(maxsize=1)
def _large_buffers_and_crcs() -> list[tuple[bytes, int, int]]:
    """(data, seed, reference CRC) for sizes past the implementations' block sizes."""
    rng = random.Random(7)
    out = []
    for size in (1 << 20, (1 << 20) + 191, 3 * 65536 + 64 * 3 + 17):
        data, seed = rng.randbytes(size), rng.getrandbits(32)
        out.append((data, seed, crc32c_reference(data, seed)))
    return out


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_crc32c_large_buffers_match_reference(impl):
    for data, seed, expected in _large_buffers_and_crcs():
        assert _C.crc32c(data, seed, implementation=impl) == expected


def test_crc32c_implementation_names_are_checked():
    with pytest.raises(ValueError, match="unknown CRC32C implementation 'crc64'.*'table'"):
        _C.crc32c(b"x", implementation="crc64")


def _info(*flags: str) -> str:
    return subprocess.run([sys.executable, "-m", "pddcore.cli", "info", *flags], check=True, capture_output=True,
                          text=True).stdout


def _installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_info_json_reports_build_and_runtime_facts():
    facts = json.loads(_info("--json"))
    assert facts["pddcore"] == importlib.metadata.version("pddcore")
    assert facts["python"] == platform.python_version() and facts["machine"] == platform.machine()
    assert facts["cpu_count"] == os.cpu_count()
    assert facts["crc32c"] == _C.crc32c_implementation()
    # nvcc puts the device code of the CUDA kernels into a .nv_fatbin section of the module
    assert facts["cuda_compiled"] == (".nv_fatbin" in elf_section_names(_C.__file__))
    if not facts["cuda_usable"]:
        assert facts["cuda_detail"]  # says why
    assert isinstance(facts["rdma_devices"], int) and facts["rdma_devices"] >= 0
    assert facts["torch"] == _installed_version("torch")
    assert facts["triton"] == _installed_version("triton")


def test_info_text_states_the_json_facts():
    facts = json.loads(_info("--json"))
    lines = _info().splitlines()
    fields = dict(line.strip().split(" : ", 1) for line in lines[1:])
    fields = {label.strip(): value for label, value in fields.items()}
    yes = lambda flag: "yes" if flag else "no"  # noqa: E731
    assert lines[0] == (f"pddcore {facts['pddcore']}  (python {facts['python']}, {facts['machine']}, "
                        f"{facts['cpu_count']} cores)")
    assert fields["CPU pack/unpack"] == f"yes, {facts['cpu_pack_threads']} threads"
    assert fields["CRC32C"] == f"{facts['crc32c']} (this CPU can run: {', '.join(IMPLEMENTATIONS)})"
    assert fields["CUDA compiled"] == yes(facts["cuda_compiled"])
    assert fields["CUDA usable"] == f"{yes(facts['cuda_usable'])} ({facts['cuda_detail']})"
    assert fields["ibverbs"].startswith(f"{'loaded' if facts['ibverbs_loaded'] else 'absent'}, "
                                        f"{facts['rdma_devices']} RDMA device(s)")
    assert fields["RDMA backend"].startswith("compiled (" if facts["rdma_backend_compiled"] else "compiled out")
    assert fields["torch"] == f"{facts['torch']} (CUDA available: {yes(facts['torch_cuda'])})"
    assert fields["triton"] == (facts["triton"] or "not installed")
