"""What a request's sender (prefill) and receiver (decode) share: the ``KVPoll`` states that
end a request, the error a failed one raises, and the per-request state this backend does
not move.

Example::

    state in TERMINAL                       # Success or Failed: poll() will not change again
    state_indices_reason([None, None])      # None: nothing but KV pages and aux data to move
"""

from __future__ import annotations

from typing import Optional

from sglang.srt.disaggregation.base.conn import KVPoll

__all__ = ["TERMINAL", "PDDTransferError", "state_indices_reason"]

TERMINAL = (KVPoll.Success, KVPoll.Failed)


class PDDTransferError(Exception):
    """A request's KV transfer failed; ``bootstrap_room`` names the request."""

    def __init__(self, bootstrap_room: int, reason: str):
        super().__init__(f"room {bootstrap_room}: {reason}")
        self.bootstrap_room = bootstrap_room
        self.reason = reason


def state_indices_reason(state_indices: Optional[list]) -> str | None:
    """Why a request with these ``state_indices`` cannot be served, or None when it has none."""
    if state_indices is not None and any(s is not None for s in state_indices):
        return ("the pddcore backend moves KV pages and aux data only; this model's per-request state "
                "(state_indices: Mamba/SWA/DSA) needs another transfer backend")
    return None
