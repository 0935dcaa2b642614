"""The layout the imports must keep: core at the bottom, agent and server beside each other on it, bench and
tests above, and within bench the doc generators under the evaluation harness under the benchmarks; and the
package list pyproject.toml installs matches the folders."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# repository folder -> the import name it installs as
FOLDERS = {"core": "gpufleet", "agent": "gpufleet.agent", "server": "gpufleet.server"}
# what each layer must never import (either spelling: the installed name, or the bare folder name)
FORBIDDEN = {
    "core": ("gpufleet.agent", "gpufleet.server", "agent", "server", "bench", "tests"),
    "agent": ("gpufleet.server", "server", "agent", "bench", "tests"),
    "server": ("gpufleet.agent", "agent", "server", "bench", "tests"),
    "bench": ("tests", "agent", "server"),
}
# Within bench/, by purpose: the doc generators stand alone, the evaluation harness builds on them, and the
# benchmarks (bench/*.py) on both; a folder imports from bench only what this lists for it.
BENCH_MAY_IMPORT = {
    "bench/docgen": ("bench.docgen",),
    "bench/evaluation": ("bench.docgen", "bench.evaluation"),
    "bench": ("bench",),
}


def imports(path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, module, imported names) of every import in a file, in functions and TYPE_CHECKING blocks too."""
    out = []
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, tuple(alias.name for alias in node.names)))
    return out


def modules(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_import_crosses_the_layers(folder):
    assert modules(folder), folder
    crossings = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in modules(folder)
        for line, module, _ in imports(path)
        if any(within(module, bad) for bad in FORBIDDEN[folder])
    ]
    assert not crossings, "\n".join(crossings)


def test_the_checker_sees_imports_inside_functions_and_type_checking(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gpufleet.agent.sim import X\n"
        "def f():\n    import gpufleet.agent.cli\n"
    )
    assert [m for _, m, _ in imports(sample)] == ["typing", "gpufleet.agent.sim", "gpufleet.agent.cli"]


def test_bench_uses_only_public_functions_of_gpufleet():
    private = [
        f"{path.relative_to(ROOT)}:{line} imports {name} from {module}"
        for path in modules("bench")
        for line, module, names in imports(path)
        if within(module, "gpufleet")
        for name in names
        if name.startswith("_")
    ]
    assert not private, "\n".join(private)


def bench_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every bench module a file imports; `from bench.x import y` may name a module y."""
    out = []
    for line, module, names in imports(path):
        if within(module, "bench"):
            out.extend((line, f"{module}.{name}") for name in names or ("",))
    return [(line, module.rstrip(".")) for line, module in out]


@pytest.mark.parametrize("folder", sorted(BENCH_MAY_IMPORT))
def test_bench_folders_import_only_what_lies_below_them(folder):
    allowed = BENCH_MAY_IMPORT[folder]
    paths = modules(folder) if folder != "bench" else sorted((ROOT / "bench").glob("*.py"))
    assert paths, folder
    crossings = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in paths
        for line, module in bench_imports(path)
        if not any(within(module, ok) for ok in allowed)
    ]
    assert not crossings, "\n".join(crossings)


def test_the_trace_generator_is_imported_from_its_home_only():
    old_homes = ("bench.tracegen", "bench.scenarios", "tests.server.tracegen")
    stale = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for folder in ("bench", "tests")
        for path in modules(folder)
        for line, module in bench_imports(path) + [(n, m) for n, m, _ in imports(path)]
        if any(within(module, old) for old in old_homes)
    ]
    assert not stale, "\n".join(stale)


def test_pyproject_lists_every_package_folder_and_nothing_else():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {name: folder for folder, name in FOLDERS.items()}
    on_disk = set()
    for folder, name in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            on_disk.add(".".join((name, *parts)))
    # A folder holding only package data (the simulator's scenarios) is listed too, or `python -m build`
    # warns that Python would import it while setuptools leaves it out.
    data_only = {name for name in config["package-data"] if name not in on_disk}
    for name in data_only:
        top = max((n for n in FOLDERS.values() if name.startswith(n + ".")), key=len)
        home = next(folder for folder, n in FOLDERS.items() if n == top)
        folder = ROOT / home / Path(*name[len(top) + 1 :].split("."))
        assert folder.is_dir() and not list(folder.glob("*.py")), name
    assert sorted(config["packages"]) == sorted(on_disk | data_only)
    assert not any(p.split(".")[0] in ("agent", "server") for p in config["packages"])
