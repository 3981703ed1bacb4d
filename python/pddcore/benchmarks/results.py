"""How a benchmark result becomes an entry of ``results.json``, in one place, and the
facts about the machine that ``results.json`` records beside the results.

A result is a dataclass of what was measured; every figure derived from those (a ratio to
the baseline, a rate, a median) is a property of it. :class:`Result` gives such a class
``as_dict()``: its fields, then each property under its own name, with nested results
(one result, or a list, tuple or dict of them) turned into their own ``as_dict()``.

Example::

    @dataclass
    class CopyResult(Result):
        engine_gbps: float
        memcpy_gbps: float

        @property
        def ratio(self) -> float:
            return self.engine_gbps / self.memcpy_gbps

    CopyResult(3.0, 12.0).as_dict()   # {"engine_gbps": 3.0, "memcpy_gbps": 12.0, "ratio": 0.25}
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
from typing import Any

__all__ = ["Result", "machine_info"]


class Result:
    """Mixin for a benchmark result dataclass; see the module docstring."""

    def as_dict(self) -> dict:
        out = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        out.update((name, _plain(getattr(self, name))) for name in _derived(type(self)))
        return out


@functools.cache
def _derived(cls: type) -> tuple[str, ...]:
    """The properties of ``cls`` (its own and inherited), in definition order."""
    names: dict[str, None] = {}
    for klass in reversed(cls.__mro__):
        names.update((name, None) for name, value in vars(klass).items() if isinstance(value, property))
    return tuple(names)


def _plain(value: Any) -> Any:
    if isinstance(value, Result):
        return value.as_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def machine_info() -> dict:
    """pddcore.info.collect() plus the CPU model and the kernel."""
    from ..info import collect

    facts = collect()
    facts["cpu_model"] = _cpu_model()
    facts["platform"] = platform.platform()
    facts["usable_cpus"] = len(os.sched_getaffinity(0))
    facts["loadavg"] = os.getloadavg()  # others' load on a shared machine shows up in the tails
    return facts


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
