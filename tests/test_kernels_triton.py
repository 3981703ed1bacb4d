"""Runs the "triton" cases of test_kernels.py in Triton's interpreter.

Triton picks interpreting over compiling when it is imported, so the cases need a
process started with TRITON_INTERPRET=1; this test is that process's parent. Where this
process already interprets Triton (or has a GPU) the cases ran in test_kernels.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def test_triton_kernels_in_interpreter():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        pytest.skip("test_kernels.py ran its Triton cases in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("PDDCORE_FORCE_TRITON", None)
    here = Path(__file__).resolve().parent
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here / "test_kernels.py"), "-k", "triton"],
        env=env, cwd=here.parent, capture_output=True, text=True,
    )
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"Triton cases failed in the interpreter:\n{report}"
    assert " passed" in proc.stdout, report
    assert "subprocess of test_kernels_triton.py" not in proc.stdout, f"the Triton cases were skipped:\n{report}"
