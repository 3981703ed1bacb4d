"""The auth token of one benchmark run, shared by the processes it starts.

Benchmark engines listen in network namespaces the run creates, but they are set up as
deployments should be: with a token. It is drawn when this module is first imported and
kept in the environment, so worker processes started afterwards (spawned or forked) and
importing it again find the same one.
"""

from __future__ import annotations

import os
import secrets

_VARIABLE = "PDDCORE_BENCH_TOKEN"
os.environ.setdefault(_VARIABLE, secrets.token_hex(16))


def bench_token() -> bytes:
    return os.environ[_VARIABLE].encode()
