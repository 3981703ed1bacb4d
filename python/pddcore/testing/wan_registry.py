"""The registry of the WAN links up on this machine, behind `pddcore wan up/down/status`:
each link's recorded configuration and owner (a JSON file per link in :func:`state_dir`),
its delay-line counters, who is still alive, and the teardown of a link whoever built it.
:class:`~pddcore.testing.wan.WanLink` records itself here; a link whose owner died is
removed by the next link that starts (:func:`cleanup_stale`).

Example::

    for name in list_links():
        print(name, read_state(name), "alive" if link_alive(name) else "stale")
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from contextlib import contextmanager
from typing import Iterator

from . import delay_line, netns
from .netns import NamespaceError

NS_PREFIX = "pddwan-"


def namespace(name: str, side: str) -> str:
    """The network namespace of link `name` on `side` ("a", "m" for the middle, or "b")."""
    return f"{NS_PREFIX}{name}-{side}"


def state_dir() -> str:
    """Where links record their owner and counters (/run/pddcore-wan, else under the temp dir)."""
    return "/run/pddcore-wan" if os.path.isdir("/run") and os.access("/run", os.W_OK) else os.path.join(
        tempfile.gettempdir(), "pddcore-wan")


def write_state(name: str, state: dict) -> None:
    """Records link `name`'s configuration and owner (replacing the file in one step)."""
    os.makedirs(state_dir(), exist_ok=True)
    tmp = state_path(name) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, state_path(name))


def state_path(name: str) -> str:
    """File holding link `name`'s configuration and owner (see :func:`read_state`)."""
    return os.path.join(state_dir(), f"{name}.json")


def stats_path(name: str) -> str:
    """File holding the delay-line counters of link `name` (see delay_line.read_stats)."""
    return os.path.join(state_dir(), f"{name}.stats")


@contextmanager
def state_lock() -> Iterator[None]:
    """Holds the machine-wide lock under which links are created and stale ones removed."""
    os.makedirs(state_dir(), exist_ok=True)
    with open(os.path.join(state_dir(), ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_state(name: str) -> dict | None:
    """The recorded configuration and owner of link `name`, or None."""
    try:
        with open(state_path(name)) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def list_links() -> list[str]:
    """Names of all WAN links on this machine (namespaces or state files present)."""
    names = {ns[len(NS_PREFIX):-2] for ns in netns.list_namespaces()
             if ns.startswith(NS_PREFIX) and ns[-2:] in ("-a", "-m", "-b")}
    if os.path.isdir(state_dir()):
        names |= {f[:-5] for f in os.listdir(state_dir()) if f.endswith(".json")}
    return sorted(names)


def link_alive(name: str) -> bool:
    """True while the process owning link `name` runs."""
    state = read_state(name)
    return bool(state and state.get("owner_pid") and netns.pid_alive(state["owner_pid"], state.get("owner_start")))


def teardown(name: str) -> None:
    """Removes link `name` whoever owns it: kills every process in its namespaces (the delay
    line first), deletes the namespaces (which deletes its veth and TUN devices) and its files."""
    namespaces = [namespace(name, side) for side in ("m", "a", "b")]
    for ns in namespaces:  # the delay line lives in "m"; its TUN devices vanish with it
        netns.kill_processes(netns.pids_in(ns))
    errors = []
    for ns in namespaces:
        if netns.exists(ns):
            try:
                netns.run_tool(["ip", "netns", "del", ns])
            except NamespaceError as exc:
                errors.append(str(exc))
    stats = stats_path(name)
    for path in (state_path(name), stats, delay_line.error_path(stats)):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    if errors:
        raise NamespaceError("; ".join(errors))


def cleanup_stale() -> list[str]:
    """Tears down every link whose owner process is gone (a killed run); returns their names."""
    removed = []
    with state_lock():
        for name in list_links():
            if not link_alive(name):
                teardown(name)
                removed.append(name)
    return removed
