"""Entry point of every deployment process: ``python -m pddcore.deploy.launch ROLE CONFIG``
(CONFIG: a JSON file). The process dies with the one that started it (PR_SET_PDEATHSIG),
so a killed demo leaves no role behind."""

from __future__ import annotations

import ctypes
import importlib
import json
import signal
import sys

ROLES = {"front": "pddcore.deploy.front", "P": "pddcore.deploy.prefill", "RLD": "pddcore.deploy.relay_decode",
         "MD": "pddcore.deploy.main_decode", "client": "pddcore.deploy.client"}


def main(argv: list[str]) -> int:
    role, config_path = argv
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with open(config_path) as f:
        config = json.load(f)
    importlib.import_module(ROLES[role]).serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
