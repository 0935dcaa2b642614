"""The wheel a node installs: built as README says (`python -m build --wheel`), installed into a fresh
virtualenv, it holds gpufleet, gpufleet.agent and gpufleet.server and no top-level `agent` or `server`."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

from gpufleet.extras import wheel_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FOLDERS = sorted(PYPROJECT["tool"]["setuptools"]["package-dir"].values())


def _can_build_offline() -> str | None:
    """Why the wheel cannot be built here without downloading anything (None: it can)."""
    for module in ("build", "setuptools"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install -e '.[test]')"
    return None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    reason = _can_build_offline()
    if reason:
        pytest.skip(f"cannot build the wheel offline: {reason}")
    src = tmp_path_factory.mktemp("src")
    # A copy of what the wheel is built from: building in the clone would leave build/ behind in it.
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0 and "Missing dependencies" in proc.stdout + proc.stderr:
        pytest.skip(f"cannot build the wheel offline: {(proc.stdout + proc.stderr).strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (built,) = out.glob("*.whl")
    (out / "build.log").write_text(proc.stdout + proc.stderr)
    return built


def test_the_wheel_builds_without_a_packaging_warning(wheel):
    log = (wheel.parent / "build.log").read_text()
    assert "is absent from the `packages` configuration" not in log
    assert not [line for line in log.splitlines() if line.startswith("WARNING")], log[-3000:]


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory) -> Path:
    """A virtualenv that sees nothing of this one (no system site-packages), with the wheel alone in it."""
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(root)
    python = root / "bin" / "python"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "--quiet",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def in_venv(root: Path, code: str) -> subprocess.CompletedProcess[str]:
    # From an empty folder: run from the clone, `python -c` would find its agent/ and server/ folders.
    return subprocess.run(
        [str(root / "bin" / "python"), "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=root,
        env={"PATH": "/usr/bin:/bin"},
        check=False,
    )


def test_the_wheel_is_named_as_the_docs_and_messages_say(wheel):
    assert wheel.name == wheel_name()


def test_the_wheel_holds_the_namespaced_packages_and_their_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"gpufleet"}
    for module in (
        "gpufleet/config.py",
        "gpufleet/agent/cli.py",
        "gpufleet/server/cli.py",
        "gpufleet/agent/sim/scenarios/demo.yaml",
        "gpufleet/agent/kubelet_podresources_v1_pb2.py",
        "gpufleet/agent/kubelet_podresources_v1_pb2_grpc.py",
        "gpufleet/agent/kubelet_podresources_v1.proto",
        "gpufleet/agent/dcgm-counters.csv",
    ):
        assert module in names


def test_installed_it_imports_as_gpufleet_and_nothing_top_level(fresh_venv):
    proc = in_venv(
        fresh_venv,
        "import gpufleet, gpufleet.agent, gpufleet.server, gpufleet.extras; "
        "import importlib.util as u; "
        "assert all(u.find_spec(m) for m in ('gpufleet.config', 'gpufleet.agent.cli', "
        "'gpufleet.server.cli', 'gpufleet.server.engine', 'gpufleet.agent.sim'))",
    )
    assert proc.returncode == 0, proc.stderr
    for name in ("server", "agent"):
        spec = in_venv(
            fresh_venv, f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is not None)"
        )
        assert spec.returncode == 0, f"a top-level {name!r} is importable"
        plain = in_venv(fresh_venv, f"import {name}")
        assert plain.returncode == 1 and "ModuleNotFoundError" in plain.stderr


def test_installed_without_its_extra_the_server_names_it_in_one_line(fresh_venv):
    proc = subprocess.run(
        [str(fresh_venv / "bin" / "gpufleet-server"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=fresh_venv,
        env={"PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "[server]" in proc.stderr and wheel_name() in proc.stderr


def test_the_containerfile_builds_the_same_wheel_from_every_package_folder():
    text = (ROOT / "deploy" / "Containerfile").read_text()
    for folder in FOLDERS:
        assert f"COPY {folder} /src/{folder}" in text
    assert "python -m build --wheel" in text and ".whl)[all]" in text
    assert "gpufleet[" not in text


def test_no_document_advises_installing_from_an_index():
    """gpufleet is not published: `pip install 'gpufleet[agent]'` fails for everyone who tries it."""
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "deploy").rglob("*")]
    advice = [str(p.relative_to(ROOT)) for p in files if p.is_file() and "install 'gpufleet[" in p.read_text()]
    assert not advice
