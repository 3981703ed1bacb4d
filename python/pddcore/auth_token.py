"""Auth tokens: the shared secret every engine of a deployment holds (``TransferEngine(auth_token=...)``).

An auth token keys the handshake's HMAC and the TLS PSK: one captured handshake lets an
attacker test guesses offline, as fast as they can compute HMACs. Only a token with at
least 128 random bits stands that. pddcore cannot see how random a token is, so it refuses
what is certainly too weak: fewer than 32 bytes (128 random bits written as hex) or fewer
than 8 distinct bytes (a repeated word), and :func:`new_auth_token` / ``pddcore token`` make one.

Example::

    from pddcore.auth_token import check_auth_token, new_auth_token

    token = new_auth_token()           # 64 hex characters
    check_auth_token(token.encode())   # passes; b"secret" would raise ValueError
"""

from __future__ import annotations

import secrets

__all__ = ["MIN_AUTH_TOKEN_BYTES", "new_auth_token", "check_auth_token"]

MIN_AUTH_TOKEN_BYTES = 32
_MIN_AUTH_TOKEN_DISTINCT_BYTES = 8


def new_auth_token() -> str:
    """A new auth token: 32 bytes from the operating system's CSPRNG as 64 hex characters
    (256 bits). Give every engine of a deployment the same one."""
    return secrets.token_hex(32)


def check_auth_token(token: bytes) -> None:
    """Raises ValueError for a token that certainly holds fewer than 128 random bits."""
    if len(token) < MIN_AUTH_TOKEN_BYTES or len(set(token)) < _MIN_AUTH_TOKEN_DISTINCT_BYTES:
        raise ValueError(f"auth_token must hold at least 128 random bits: at least {MIN_AUTH_TOKEN_BYTES} bytes "
                         f"(128 bits as hex) of at least {_MIN_AUTH_TOKEN_DISTINCT_BYTES} distinct values, got "
                         f"{len(token)} bytes of {len(set(token))}; `pddcore token` (or "
                         "pddcore.transfer.new_auth_token()) prints a new 256-bit one")
