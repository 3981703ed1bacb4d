"""RDMA throughput against the NIC's line rate (needs an RDMA device).

The engine writes ``nbytes`` from this process into a region of an rdma engine in another
process on the same host (through the NIC's loopback), best of ``rounds``; the ratio is
goodput / the port's line rate as the kernel reports it in
``/sys/class/infiniband/<device>/ports/<port>/rate`` (e.g. "400 Gb/sec (4X NDR)").
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .results import Result

SYSFS = "/sys/class/infiniband"


def nic_line_rate(device: str | None = None, port: int = 1) -> tuple[str, float] | None:
    """(device name, line rate in Gbit/s) of the given or first RDMA device; None if none."""
    try:
        names = sorted(os.listdir(SYSFS))
    except OSError:
        return None
    if device is not None:
        names = [n for n in names if n == device]
    for name in names:
        try:
            with open(os.path.join(SYSFS, name, "ports", str(port), "rate")) as f:
                return name, float(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return None


@dataclass
class LineRateResult(Result):
    device: str
    line_gbit: float
    nbytes: int
    chunk_bytes: int
    qps: int
    goodput_gbit: float

    @property
    def ratio(self) -> float:
        return self.goodput_gbit / self.line_gbit


def rdma_vs_line_rate(nbytes: int = 1 << 30, rounds: int = 3, chunk_bytes: int = 16 << 20,
                      qps: int = 4) -> LineRateResult:
    from .transfer_cases import loopback_matrix

    nic = nic_line_rate()
    if nic is None:
        raise RuntimeError("no RDMA device: the line-rate benchmark needs a NIC")
    (r,) = loopback_matrix(nbytes, rounds, (chunk_bytes,), (qps,), backend="rdma")
    return LineRateResult(nic[0], nic[1], nbytes, chunk_bytes, qps, r.engine_gbps * 8)
