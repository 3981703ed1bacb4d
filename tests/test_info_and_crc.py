"""`pddcore info` and the CRC32C primitive."""

import json
import os
import random
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


def test_crc32c_known_vector():
    assert _C.crc32c(b"123456789") == 0xE3069283
    assert _C.crc32c(b"") == 0


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=40))
def test_crc32c_matches_bitwise_reference_and_chains(a, b):
    assert _C.crc32c(a) == crc32c_bitwise(a)
    assert _C.crc32c(b, _C.crc32c(a)) == _C.crc32c(a + b)


@pytest.mark.parametrize("size", [3 * 4096 - 1, 3 * 4096, 2 * 3 * 4096 + 13])
def test_crc32c_interleaved_path_matches_reference(size):
    # Sizes around the 3 x 4 KiB stripes of the interleaved hardware path.
    data = bytes(random.Random(size).getrandbits(8) for _ in range(size))
    assert _C.crc32c(data) == crc32c_bitwise(data)
    assert _C.crc32c(data[5:], _C.crc32c(data[:5])) == _C.crc32c(data)


def test_info_json_reports_build_and_runtime_facts():
    out = subprocess.run([sys.executable, "-m", "pddcore.cli", "info", "--json"], check=True, capture_output=True,
                         text=True, env={**os.environ}).stdout
    facts = json.loads(out)
    assert facts["cpu_count"] == os.cpu_count()
    assert facts["cuda_compiled"] == _C.cuda_compiled()
    if not facts["cuda_usable"]:
        assert facts["cuda_detail"]  # says why
    assert isinstance(facts["rdma_devices"], int) and facts["rdma_devices"] >= 0
    assert facts["torch"].startswith("2.")


def test_info_text_mentions_every_part():
    out = subprocess.run([sys.executable, "-m", "pddcore.cli", "info"], check=True, capture_output=True,
                         text=True).stdout
    for word in ("CUDA compiled", "CUDA usable", "ibverbs", "torch", "triton", "CRC32C"):
        assert word in out
