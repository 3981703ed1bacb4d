"""pddcore's modules import one way: no module reaches itself again through the imports of
others, counting imports made only for type checking (``if TYPE_CHECKING:``), since those
are dependencies too. For the whole package, the arrows between a package's ``__init__``
and the modules below it (its re-exports, and their ``from .. import name``) are left out:
they are how a package presents its parts, not a dependency between two parts.

The graph comes from the source (``ast``), so the engines need not be installed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pddcore

PACKAGE = "pddcore.integrations"
ROOT = Path(pddcore.__file__).parent / "integrations"


def module_name(path: Path, top: Path) -> str:
    """The dotted name of ``path`` under ``top``, the directory that holds the top package."""
    parts = path.relative_to(top).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, top: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports, wherever in the file (functions and
    ``TYPE_CHECKING`` blocks included); ``from package import name`` counts ``package.name``
    when that is a module, else ``package``."""
    name = module_name(path, top)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path, top: Path) -> dict[str, set[str]]:
    """Each module under ``root`` -> the modules under ``root`` it imports."""
    paths = sorted(root.rglob("*.py"))
    modules = {module_name(p, top) for p in paths}
    return {module_name(p, top): imported_modules(p, top, modules) for p in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules, the first repeated at the end), or None."""
    state: dict[str, str] = {}   # module -> "open" while on the path, "done" once explored
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_the_adapters_import_graph_has_no_cycle():
    graph = import_graph(ROOT, ROOT.parent.parent)
    assert f"{PACKAGE}.vllm.worker" in graph and f"{PACKAGE}.sglang.manager" in graph
    assert f"{PACKAGE}.vllm.producer" in graph[f"{PACKAGE}.vllm.push_producer"]  # the graph sees relative imports
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_pddcore_modules_import_one_way():
    root = Path(pddcore.__file__).parent
    graph = import_graph(root, root.parent)
    packages = {m for m in graph if (root.parent / m.replace(".", "/") / "__init__.py").exists()}

    def presentation(a: str, b: str) -> bool:
        return (a in packages and b.startswith(a + ".")) or (b in packages and a.startswith(b + "."))

    one_way = {m: {t for t in targets if not presentation(m, t)} for m, targets in graph.items()}
    assert "pddcore.transfer_types" in one_way["pddcore.transfer"]
    cycle = find_cycle(one_way)
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize("files, cycle", [
    ({"a.py": "from .b import B\n", "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"},
     ["a", "b", "a"]),
    ({"a.py": "from . import b\n", "b.py": "def f():\n    from .sub.c import C\n", "sub/__init__.py": "",
      "sub/c.py": "import pkg.a\n"}, ["a", "b", "sub.c", "a"]),
    ({"a.py": "from .b import B\n", "b.py": "import json\n"}, None),
])
def test_the_check_finds_cycles_through_type_checking_and_local_imports(tmp_path, files, cycle):
    """The checker itself, on packages made up here: an import under TYPE_CHECKING, one inside
    a function and a whole-module ``from . import b`` all count as arrows."""
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    found = find_cycle(import_graph(root, tmp_path))
    assert found == (None if cycle is None else [f"pkg.{m}" for m in cycle])
