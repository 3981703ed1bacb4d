"""Shared pytest hooks.

PDDCORE_REQUIRE_GPU=1 (set by tests/gpu/run.sh) turns the skip of a test marked `gpu` into a
failure: on a machine that has the GPU, a GPU test that skips has not checked anything.
"""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("PDDCORE_REQUIRE_GPU") == "1" and item.get_closest_marker("gpu"):
        report.outcome = "failed"
        report.longrepr = f"PDDCORE_REQUIRE_GPU=1 but this GPU test skipped: {report.longrepr}"
