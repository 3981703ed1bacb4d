"""Imported at start-up by every Python process of tests/sanitize/run.sh (this folder is on
PYTHONPATH there): makes ``pddcore._C`` the AddressSanitizer + UndefinedBehaviorSanitizer
build named by PDDCORE_SANITIZED_C, before pddcore imports its own, so the tests and every
process they start (spawned engines, sinks, the CLI) run the sanitized transfer engine."""

import importlib.util
import os
import sys

_path = os.environ.get("PDDCORE_SANITIZED_C")
if _path:
    _spec = importlib.util.spec_from_file_location("pddcore._C", _path)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["pddcore._C"] = _module
    _spec.loader.exec_module(_module)
