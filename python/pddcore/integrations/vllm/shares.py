"""Who a producer's staged copy of a request is for: one :class:`Share` per consumer, keyed by
the consumer engine's ``engine_id`` and its request id (a push is one share, :data:`PUSH_SHARE`).
The copy goes once as many shares are complete as the request named consumers.

Example (a consumer of TP 2 whose both ranks read this rank; one answered so far)::

    share = Share(expected=2)
    share.answered.add("10.0.0.2:7100")
    share.complete      # False until "10.0.0.2:7101" is answered too, or the consumer drops it
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Share", "PUSH_SHARE"]

PUSH_SHARE = ("push", "")


@dataclass
class Share:
    """One consumer's part in a staged copy: how many of its ranks read from this rank, and
    those answered (a pull's reply address, or a push target's address)."""

    expected: int
    answered: set[str] = field(default_factory=set)
    dropped: bool = False        # the consumer needs nothing (more) from this rank
    superseded: bool = False     # a failed push: the consumer pulls instead, under its own share

    @property
    def complete(self) -> bool:
        return self.dropped or len(self.answered) >= self.expected
