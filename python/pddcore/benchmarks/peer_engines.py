"""The engines the ``peers`` bench case (:mod:`pddcore.benchmarks.peer_cases`) puts side by
side on the WAN leg, and how each writes a plan of pieces (``(source offset, destination
offset, bytes)``) into a region registered at the other end:

- ``pddcore``: ``TransferEngine(streams=4, chunk_bytes=1 MiB)`` as in the ``wan`` and
  ``loss`` cases; pieces in ``write_batch`` calls of 1024.
- ``mooncake``: Mooncake Transfer Engine (``pip install 'pddcore[peers]'``), TCP transport,
  P2P handshake (no metadata server); pieces in ``batch_transfer_async_write`` calls of
  1024, then ``get_batch_transfer_status``. Twice: with its defaults and with the knobs
  of :data:`MOONCAKE_TUNED` (environment variables, set at both ends).
- ``nixl``: NIXL with its UCX backend restricted to TCP over the link's device (UCX would
  otherwise use shared memory between the two namespaces, which share one host);
  pieces in WRITE requests of 1024 descriptors.

A contender gives two context managers, each run inside a namespace:
``target(address, nbytes)`` yields (the registered buffer as uint8 numpy, text for the
sender), ``source(address, text, data)`` yields ``write(plan)``, which returns once every
piece has landed.

Example::

    print([c.name for c in peers() if c.unavailable_reason() is None])   # installed peers
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .auth import bench_token
from .sink import desc_address

BATCH = 1024  # pieces per submitted call, for every contender

# What a user who knows Mooncake's TCP transport sets for a long path: a lane (a connection
# to the peer) carries one write at a time and waits for its acknowledgement, so the most
# lanes it allows (16; default 4). Its slice size, MC_TCP_SLICE_SIZE, changed nothing
# measurable on this path.
MOONCAKE_TUNED = {"MC_TCP_LANES_PER_PEER": "16"}
# Both Mooncake configurations: room for every piece in the per-peer queue (with the
# default 1024, writes beyond it fail), no transfer cut off by the default timeout on a
# slow path, and only warnings and errors in the log. None of these changes speed.
_MOONCAKE_COMMON = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535", "MC_TRANSFER_TIMEOUT": "900",
                    "MC_LOG_LEVEL": "WARNING"}


def _batches(plan: list[tuple[int, int, int]]) -> Iterator[list[tuple[int, int, int]]]:
    for start in range(0, len(plan), BATCH):
        yield plan[start:start + BATCH]


@dataclass(frozen=True)
class Contender:
    name: str
    module: str  # what must import for this contender to run
    knobs: dict[str, str]  # environment both ends set before their engine starts
    target: Callable
    source: Callable

    def unavailable_reason(self) -> str | None:
        """None when ``module`` imports, else the import's last error line. The import runs in
        a child interpreter: the namespaces' helpers fork from this process, which therefore
        loads no peer library itself."""
        proc = subprocess.run([sys.executable, "-c", f"import {self.module}"], capture_output=True, text=True,
                              env={**os.environ, **self.knobs})
        if proc.returncode == 0:
            return None
        lines = proc.stderr.strip().splitlines()
        return f"import {self.module} failed: {lines[-1] if lines else f'exit {proc.returncode}'}"


@contextlib.contextmanager
def _pddcore_target(address: str, nbytes: int):
    from pddcore.transfer import TransferEngine

    with TransferEngine(listen=f"{address}:0", auth_token=bench_token()) as engine:
        buffer = np.zeros(nbytes, dtype=np.uint8)
        region = engine.register(buffer, target=True)
        yield buffer, region.descriptor().hex()


@contextlib.contextmanager
def _pddcore_source(address: str, text: str, data: np.ndarray):
    from pddcore.transfer import TransferEngine

    desc = bytes.fromhex(text)
    # congestion_control=None: the namespace's default, which the run sets for every contender.
    with TransferEngine(listen=f"{address}:0", streams=4, chunk_bytes=1 << 20, auth_token=bench_token(),
                        congestion_control=None) as engine:
        region = engine.register(data)
        peer = engine.connect(desc_address(desc))

        def write(plan):
            transfers = [engine.write_batch(peer, [(region, s, desc, d, n) for s, d, n in batch])
                         for batch in _batches(plan)]
            for t in transfers:
                t.wait()

        yield write


def _mooncake_engine(address: str):
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(address, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize({address!r}, P2PHANDSHAKE, tcp) failed")
    return engine


def _mooncake_register(engine, buffer: np.ndarray) -> int:
    base = buffer.ctypes.data
    if engine.register_memory(base, buffer.nbytes) != 0:
        raise RuntimeError(f"Mooncake register_memory of {buffer.nbytes} bytes failed")
    return base


@contextlib.contextmanager
def _mooncake_target(address: str, nbytes: int):
    engine = _mooncake_engine(address)
    buffer = np.zeros(nbytes, dtype=np.uint8)
    base = _mooncake_register(engine, buffer)
    yield buffer, json.dumps({"session": f"{address}:{engine.get_rpc_port()}", "base": base})
    engine.unregister_memory(base)


@contextlib.contextmanager
def _mooncake_source(address: str, text: str, data: np.ndarray):
    target = json.loads(text)
    engine = _mooncake_engine(address)
    base = _mooncake_register(engine, data)

    def write(plan):
        batch_ids = []
        for batch in _batches(plan):
            batch_id = engine.batch_transfer_async_write(target["session"], [base + s for s, _, _ in batch],
                                                         [target["base"] + d for _, d, _ in batch],
                                                         [n for _, _, n in batch])
            if batch_id <= 0:
                raise RuntimeError(f"Mooncake batch_transfer_async_write to {target['session']} failed")
            batch_ids.append(batch_id)
        if engine.get_batch_transfer_status(batch_ids) != 0:
            raise RuntimeError(f"Mooncake transfer to {target['session']} failed")

    yield write
    engine.unregister_memory(base)


def _see_namespace_devices() -> None:
    """Remounts /sys in a mount namespace of this process alone, as ``ip netns exec`` does:
    UCX finds network devices in /sys/class/net, which otherwise shows the host's devices
    and not the link's ``wan0``."""
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_slave, mnt_detach = 0x00020000, 0x4000, 0x80000, 2
    if (libc.unshare(clone_newns) != 0 or libc.mount(b"none", b"/", None, ms_rec | ms_slave, None) != 0
            or libc.umount2(b"/sys", mnt_detach) != 0 or libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None) != 0):
        err = ctypes.get_errno()
        raise OSError(err, f"remounting /sys for the network namespace: {os.strerror(err)}")


def _nixl_agent(name: str, buffer: np.ndarray):
    import nixl_cu12._api as api  # the CUDA 12 build, as 'pddcore[peers]' installs it; it runs without CUDA

    _see_namespace_devices()
    agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    agent.register_memory([(buffer.ctypes.data, buffer.nbytes, 0, "")], "DRAM")
    return agent


@contextlib.contextmanager
def _nixl_target(address: str, nbytes: int):
    buffer = np.zeros(nbytes, dtype=np.uint8)
    agent = _nixl_agent("pddcore-bench-target", buffer)
    yield buffer, json.dumps({"metadata": agent.get_agent_metadata().hex(), "base": buffer.ctypes.data})


@contextlib.contextmanager
def _nixl_source(address: str, text: str, data: np.ndarray):
    target = json.loads(text)
    agent = _nixl_agent("pddcore-bench-source", data)
    remote = agent.add_remote_agent(bytes.fromhex(target["metadata"]))
    base = data.ctypes.data

    def write(plan):
        handles = []
        for batch in _batches(plan):
            local = agent.get_xfer_descs([(base + s, n, 0) for s, _, n in batch], "DRAM")
            far = agent.get_xfer_descs([(target["base"] + d, n, 0) for _, d, n in batch], "DRAM")
            handle = agent.initialize_xfer("WRITE", local, far, remote)
            if agent.transfer(handle) == "ERR":
                raise RuntimeError("NIXL transfer could not be posted")
            handles.append(handle)
        for handle in handles:
            while (state := agent.check_xfer_state(handle)) == "PROC":
                time.sleep(0.0005)
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer ended in state {state}")
            handle.release()

    yield write


PDDCORE = Contender("pddcore", "pddcore.transfer", {}, _pddcore_target, _pddcore_source)


def peers() -> tuple[Contender, ...]:
    """The peer engines, each with the environment both of its ends run under."""
    mooncake = dict(module="mooncake.engine", target=_mooncake_target, source=_mooncake_source)
    return (Contender("mooncake", knobs=dict(_MOONCAKE_COMMON), **mooncake),
            Contender("mooncake-tuned", knobs={**_MOONCAKE_COMMON, **MOONCAKE_TUNED}, **mooncake),
            Contender("nixl", "nixl_cu12._api", {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "wan0",
                                                  "NIXL_LOG_LEVEL": "WARN"}, _nixl_target, _nixl_source))
