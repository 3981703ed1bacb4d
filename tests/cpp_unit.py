"""Builds and runs the C++ unit tests under tests/cpp: one binary per test file, one case
per run (`binary <case>`; with no argument the binary lists its cases). Each case's test id
starts with ``cpp-``, so one command runs them all, and ``PDDCORE_SANITIZE=1`` builds them
with AddressSanitizer and UndefinedBehaviorSanitizer (any report fails the case)::

    PDDCORE_SANITIZE=1 python -m pytest tests -k cpp-
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SANITIZE = (["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g"]
            if os.environ.get("PDDCORE_SANITIZE") == "1" else [])


def build(out_dir: Path, name: str, sources: list[str], libs: tuple[str, ...] = ()) -> Path:
    """Compiles ``sources`` (paths from the repository root) into ``out_dir/name``."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler to build the C++ unit tests")
    out = out_dir / name
    subprocess.run([compiler, "-std=c++17", "-O1", *SANITIZE, "-Icsrc/include", "-Icsrc", "-Itests/cpp", *sources, "-o",
                    str(out), "-pthread", *libs], cwd=ROOT, check=True)
    return out


def cases(binary: Path) -> list[str]:
    return subprocess.run([str(binary)], capture_output=True, text=True, check=True).stdout.split()


def run_case(binary: Path, case: str) -> tuple[int, str]:
    """Runs one case: (exit status, the last line it printed, or its error output)."""
    run = subprocess.run([str(binary), case], capture_output=True, text=True)
    lines = run.stdout.strip().splitlines()
    return run.returncode, (lines[-1] if run.returncode == 0 and lines else run.stdout + run.stderr)


_BUILT: dict[str, Path] = {}


def case_test(name: str, sources: list[str], case_names: list[str], libs: tuple[str, ...] = ()):
    """A pytest test running each case of the C++ unit test binary ``name`` built from
    ``sources`` (once per session), after checking the binary has exactly ``case_names``, so
    every C++ case runs. Assign it to a ``test_...`` name in a test module."""

    @pytest.mark.parametrize("case", case_names, ids=[f"cpp-{case}" for case in case_names])
    def test(case, tmp_path_factory):
        if name not in _BUILT:
            binary = build(tmp_path_factory.mktemp(name), name, sources, libs)
            assert sorted(cases(binary)) == sorted(case_names)
            _BUILT[name] = binary
        status, said = run_case(_BUILT[name], case)
        assert (status, said) == (0, f"ok {case}"), f"exit status {status}: {said}"

    return test
