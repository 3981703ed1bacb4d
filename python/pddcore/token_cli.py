"""`pddcore token`: prints a new auth token for TransferEngine(auth_token=...), the
adapters' ``auth_token`` and ``PDDCORE_AUTH_TOKEN``: 256 bits from the operating system's
CSPRNG as 64 hex characters. Give every engine of a deployment the same one.

Example::

    export PDDCORE_AUTH_TOKEN=$(pddcore token)
"""

from __future__ import annotations

import argparse

from .auth_token import new_auth_token


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: a token is always 256 bits."""


def run(args: argparse.Namespace) -> int:
    print(new_auth_token())
    return 0
