"""The WAN link estimate from the engines' own transfer counters, where they serve them.

A reference engine (``pddcore engine``) serves its transfer engine's per-peer counters in
``/pdd/state`` (``transfer_peers``, as :meth:`pddcore.TransferEngine.stats` gives them: the
bytes the path set the pace for and for how long, the priority lane's RTT) and, in
``/pdd/info``, the address its transfer engine is dialled at. :class:`LinkFollower` polls
every P for its connections to each MD and feeds the counters, summed over the P engines,
to the gateway's :class:`pddcore.router.BandwidthEstimator`; an MD whose link has samples
from them is no longer timed per pull. vLLM serves no such counters over HTTP, so in front
of it the gateway times MD's pulls (:meth:`pddcore.serve.Gateway.link_source` says which).

Example::

    follower = LinkFollower(gateway, interval_s=1.0)
    task = asyncio.ensure_future(follower.run())
"""

from __future__ import annotations

import asyncio
import time

from .upstream import UpstreamError

__all__ = ["LinkFollower"]

_SUMMED = ("path_limited_bytes", "path_limited_seconds", "bytes_sent", "seconds_busy")


class LinkFollower:
    def __init__(self, gateway, interval_s: float = 1.0):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.gateway, self.interval_s = gateway, interval_s
        self.addresses: dict[str, str] = {}  # MD URL -> the address P engines dial its transfer engine at

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.interval_s)

    async def poll(self) -> list[str]:
        """One round: returns the MD URLs whose link estimate got a throughput sample."""
        gw = self.gateway
        for md in gw.main:
            if md.url not in self.addresses:
                try:
                    self.addresses[md.url] = str((await md.get_json("/pdd/info"))["transfer_address"])
                except (UpstreamError, KeyError):
                    continue  # not reachable now, or an engine that does not say: try again next round
        mds = {address: url for url, address in self.addresses.items()}
        links: dict[str, dict] = {}
        for p in gw.prefill:
            try:
                peers = (await p.get_json("/pdd/state")).get("transfer_peers") or {}
            except UpstreamError:
                continue
            for address, entry in peers.items():
                if address in mds:
                    _add(links.setdefault(mds[address], {}), entry)
        sampled = gw.estimator.update_from_stats({"peers": links}, now=time.monotonic())
        gw.counted_links.update(sampled)
        return sampled


def _add(total: dict, entry: dict) -> None:
    """Sums one P's counters for an MD into ``total``; the RTT is the lowest measured one."""
    for key in _SUMMED:
        if key in entry:
            total[key] = total.get(key, 0.0) + float(entry[key])
    rtt = float(entry.get("rtt_s") or 0.0)
    if rtt > 0:
        total["rtt_s"] = min(total.get("rtt_s") or rtt, rtt)
