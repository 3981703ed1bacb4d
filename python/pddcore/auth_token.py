"""Auth tokens: the shared secret every engine of a deployment holds (``TransferEngine(auth_token=...)``).

An auth token keys the handshake's HMAC and the TLS PSK: one captured handshake lets an
attacker test guesses offline, as fast as they can compute HMACs. Only a token with at
least 128 random bits stands that. pddcore cannot see how random a token is, so an engine
refuses what is certainly too weak: fewer than :data:`MIN_AUTH_TOKEN_BYTES` (32) bytes,
128 random bits written as hex, or fewer than 8 distinct bytes, a repeated word (checked
with the engine's other arguments, in ``csrc/transport/engine_arguments.cpp``).
:func:`new_auth_token` and ``pddcore token`` make one.

Example::

    from pddcore.auth_token import new_auth_token

    token = new_auth_token()           # 64 hex characters; TransferEngine(auth_token=token)
"""

from __future__ import annotations

import secrets

from ._C import MIN_AUTH_TOKEN_BYTES

__all__ = ["MIN_AUTH_TOKEN_BYTES", "new_auth_token"]


def new_auth_token() -> str:
    """A new auth token: 32 bytes from the operating system's CSPRNG as 64 hex characters
    (256 bits). Give every engine of a deployment the same one."""
    return secrets.token_hex(32)
