"""The engine's modules import one another without cycles, counting every import statement: those under
`if TYPE_CHECKING:` and inside functions too, since they hide a cycle rather than remove it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "server" / "engine"
PACKAGE = "gpufleet.server.engine"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    """Engine modules one import statement names: `from pkg import sub` names the submodule, `from pkg
    import name` the package. Importing a.b.c also runs a and a.b, but every engine module sits under the
    package that imports them all, so those parents would make every module a cycle: only the module
    named counts."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & known
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    found = set()
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        if sub in known:
            found.add(sub)
        elif source in known:
            found.add(source)
    return found


def import_graph(root: Path = ENGINE) -> dict[str, set[str]]:
    """Module name -> the engine modules it imports anywhere in its source."""
    files = {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known = set(files)
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(node, module, path.name == "__init__.py", known)
        graph[module] = edges - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for nxt in sorted(graph[module]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_the_engine_has_no_import_cycle_type_checking_blocks_included():
    graph = import_graph()
    assert f"{PACKAGE}.windows" in graph and f"{PACKAGE}.detectors.straggler.nodes" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


@pytest.mark.parametrize(
    "sources",
    [
        # A cycle behind TYPE_CHECKING, through relative imports.
        {
            "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
            "b.py": "from . import a\n",
        },
        # A cycle through a function-level import and a package's __init__.
        {
            "__init__.py": "from gpufleet.server.engine.sub import c\n",
            "sub/__init__.py": "",
            "sub/c.py": "def f():\n    from gpufleet.server.engine import X\n",
        },
    ],
)
def test_the_cycle_check_sees_cycles_that_imports_hide(tmp_path, sources):
    for name, text in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert find_cycle(import_graph(tmp_path)) is not None
