"""The command lines as a newcomer meets them: help that finds every subcommand, one line (and exit 2) for a
missing extra, a bad setting or a taken port, nothing created by a refused start, and replay refusing
input with no valid snapshot."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpufleet.server.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
SERVER = [sys.executable, "-m", "gpufleet.server.cli"]
AGENT = [sys.executable, "-m", "gpufleet.agent.cli"]


def run(
    cmd: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, stdin=subprocess.DEVNULL, check=False
    )


def one_line(err: str) -> str:
    """The stderr of a refused command: exactly one line, no traceback."""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


# --- help -----------------------------------------------------------------------------------------------


def test_server_help_lists_every_subcommand_with_one_line():
    proc = run([*SERVER, "--help"])
    assert proc.returncode == 0, proc.stderr
    for name in ("serve", "demo", "replay", "check-config", "status"):
        (line,) = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith(name + " ")]
        assert COMMANDS[name] in line


@pytest.mark.parametrize("sub", ["serve", "demo", "replay", "check-config", "status"])
def test_each_subcommand_help_is_its_own(sub):
    proc = run([*SERVER, sub, "--help"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: gpufleet-server {sub} "), proc.stdout[:200]


def test_serve_stays_the_default_command(tmp_path):
    proc = run([*SERVER, "--pull.interval", "soon"], cwd=tmp_path)
    assert proc.returncode == 2 and "--pull.interval" in one_line(proc.stderr)


# --- missing extras ---------------------------------------------------------------------------------------


def without(tmp_path: Path, *modules: str) -> dict[str, str]:
    """An environment whose Python cannot import `modules`, as an install without their extra: a
    sitecustomize on PYTHONPATH puts a finder first that refuses them (child processes inherit it)."""
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(
        textwrap.dedent(f"""
        import sys

        class _Missing:
            blocked = {tuple(modules)!r}

            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in self.blocked:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, _Missing())
        """)
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(folder), env.get("PYTHONPATH"))))
    return env


def test_the_blocker_really_blocks(tmp_path):
    proc = run([sys.executable, "-c", "import pynvml"], env=without(tmp_path, "pynvml"))
    assert proc.returncode == 1 and "ModuleNotFoundError" in proc.stderr


@pytest.mark.parametrize("argv", [["--help"], ["--simulate", "demo", "--once"]])
def test_agent_on_a_server_only_install_names_the_agent_extra(tmp_path, argv):
    proc = run([*AGENT, *argv], env=without(tmp_path, "pynvml"))
    line = one_line(proc.stderr)
    assert proc.returncode == 2
    assert line.startswith("gpufleet-agent: error: nvidia-ml-py is missing") and "[agent]" in line
    assert "pip install '.[agent]'" in line and ".whl[agent]" in line


def test_demo_on_a_server_only_install_names_the_agent_extra(tmp_path):
    proc = run(
        [*SERVER, "demo", "--duration", "1", "--web.listen-address", "127.0.0.1:0"], env=without(tmp_path, "pynvml")
    )
    line = one_line(proc.stderr)
    assert proc.returncode == 2 and line.startswith("gpufleet-server demo: gpufleet-agent: error: nvidia-ml-py")
    assert "[agent]" in line and proc.stdout == ""


@pytest.mark.parametrize("missing", ["uvicorn", "numpy"])
@pytest.mark.parametrize("argv", [["--help"], ["replay", "x.jsonl"], []])
def test_server_on_an_agent_only_install_names_the_server_extra(tmp_path, missing, argv):
    proc = run([*SERVER, *argv], env=without(tmp_path, missing), cwd=tmp_path)
    line = one_line(proc.stderr)
    assert proc.returncode == 2
    assert line.startswith(f"gpufleet-server: error: {missing} is missing") and "[server]" in line
    assert not (tmp_path / "gpufleet.db").exists()


# --- replay -----------------------------------------------------------------------------------------------


def test_replay_of_input_without_a_valid_snapshot_exits_1_saying_so(tmp_path):
    once = run([*AGENT, "--simulate", "hgx-h100", "--once"])
    assert once.returncode == 0, once.stderr
    inputs = {
        "once.json": once.stdout.encode(),  # --once pretty-prints across lines: none is a snapshot
        "garbage.jsonl": b'hello\nworld\n{"schema": 1}\n',
        "binary.bin": bytes(range(256)) * 8,
    }
    for name, content in inputs.items():
        path = tmp_path / name
        path.write_bytes(content)
        proc = run([*SERVER, "replay", str(path), "--log.level", "error"])
        line = one_line(proc.stderr)
        assert proc.returncode == 1 and proc.stdout == ""
        assert "no valid snapshot read" in line and "malformed line(s) skipped" in line
        skipped = int(line.rsplit("; ", 1)[1].split()[0])
        assert skipped >= 1


def test_replay_of_a_recorded_trace_still_exits_0(tmp_path):
    trace = tmp_path / "t.jsonl"
    once = run([*AGENT, "--simulate", "hgx-h100", "--once", "--record", str(trace)])
    assert once.returncode == 0, once.stderr
    proc = run([*SERVER, "replay", str(trace), "--log.level", "error"])
    assert proc.returncode == 0 and proc.stderr == ""


# --- targets ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["http://127.0.0.1:9471", "https://node:9471", "node:9471/metrics", "http://node"])
def test_url_shaped_targets_are_refused_alike_by_serve_and_check_config(tmp_path, target):
    lines = []
    for sub in ("serve", "check-config"):
        proc = run([*SERVER, sub, "--targets", target, "--web.listen-address", "127.0.0.1:0"], cwd=tmp_path)
        assert proc.returncode == 2
        lines.append(one_line(proc.stderr))
    assert lines[0] == lines[1] and "--targets" in lines[0] and target in lines[0]
    assert ":9471:9471" not in lines[0]
    assert not (tmp_path / "gpufleet.db").exists()


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        ([], "no targets: set --targets, --targets.file-sd, --targets.dns or --ingest.prometheus-url"),
        (["--targets", ""], "no targets"),
        (["--targets", "dgx-01:9471,dgx-02:9471,dgx-01:9471"], "--targets: dgx-01:9471 listed twice"),
        (["--targets", "dgx-01,dgx-01:9471"], "dgx-01:9471 listed twice"),  # the agent's default port
        (["--targets", "dgx-01:9471", "--targets.file-sd", "agents.yml"], "dgx-01:9471 in both --targets and"),
    ],
)
def test_no_targets_or_the_same_target_twice_are_refused_alike_by_serve_and_check_config(tmp_path, argv, fragment):
    (tmp_path / "agents.yml").write_text("- targets: [dgx-01:9471, dgx-02:9471]\n")
    lines = []
    for sub in ("serve", "check-config"):
        proc = run([*SERVER, sub, *argv, "--web.listen-address", "127.0.0.1:0"], cwd=tmp_path)
        assert proc.returncode == 2
        lines.append(one_line(proc.stderr))
    assert lines[0] == lines[1] and fragment in lines[0]
    assert not (tmp_path / "gpufleet.db").exists()


# --- Alertmanager -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "api"),
    [("http://am:9093/api/v2/alerts", "/api/v2/alerts"), ("https://am.example.com/am/api/v2", "/api/v2")],
)
def test_an_alertmanager_url_with_the_api_path_is_refused_alike_by_serve_and_check_config(tmp_path, url, api):
    """The server adds /api/v2/alerts: posting to /api/v2/alerts/api/v2/alerts would fail every notification."""
    lines = []
    for sub in ("serve", "check-config"):
        proc = run(
            [
                *SERVER,
                sub,
                "--targets",
                "127.0.0.1:1",
                "--alertmanager.url",
                url,
                "--web.listen-address",
                "127.0.0.1:0",
            ],
            cwd=tmp_path,
        )
        assert proc.returncode == 2
        lines.append(one_line(proc.stderr))
    base = url.removesuffix(api)
    assert lines[0] == lines[1]
    assert f"--alertmanager.url: {url} ends in the API path {api}: give the base URL {base}" in lines[0]
    assert not (tmp_path / "gpufleet.db").exists()


def test_an_alertmanager_base_url_behind_a_path_prefix_passes_check_config(tmp_path):
    proc = run(
        [
            *SERVER,
            "check-config",
            "--targets",
            "127.0.0.1:1",
            "--alertmanager.url",
            "https://ops.example.com/alertmanager/",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0 and "1 Alertmanager(s)" in proc.stdout, proc.stderr


# --- nothing created by a refused start ---------------------------------------------------------------


def test_a_taken_port_creates_no_alert_store(tmp_path, taken_port):
    proc = run([*SERVER, "--web.listen-address", f"127.0.0.1:{taken_port}", "--targets", "127.0.0.1:1"], cwd=tmp_path)
    assert proc.returncode == 2 and "cannot listen" in one_line(proc.stderr)
    assert list(tmp_path.iterdir()) == []


def test_a_bad_setting_creates_no_alert_store(tmp_path):
    proc = run(
        [
            *SERVER,
            "--web.listen-address",
            "127.0.0.1:0",
            "--pull.scheme",
            "https",
            "--pull.tls.ca-file",
            str(tmp_path / "missing.pem"),
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "--pull.tls.ca-file" in one_line(proc.stderr)
    assert list(tmp_path.iterdir()) == []


# --- the agent's start ------------------------------------------------------------------------------------


def test_agent_exits_2_when_it_cannot_bind(taken_port):
    proc = run([*AGENT, "--simulate", "hgx-h100", "--web.listen-address", f"127.0.0.1:{taken_port}"])
    assert proc.returncode == 2
    assert one_line(proc.stderr).startswith("gpufleet-agent: error: --web.listen-address: cannot listen")


@pytest.mark.parametrize("where,fragment", [("missing/trace.jsonl", "does not exist"), ("folder", "is a folder")])
def test_agent_checks_the_record_file_at_start(tmp_path, where, fragment):
    (tmp_path / "folder").mkdir()
    proc = run(
        [*AGENT, "--simulate", "hgx-h100", "--web.listen-address", "127.0.0.1:0", "--record", str(tmp_path / where)]
    )
    assert proc.returncode == 2
    line = one_line(proc.stderr)
    assert line.startswith("gpufleet-agent: error: --record: ") and fragment in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder anyway")
def test_agent_refuses_a_record_folder_it_cannot_write(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        proc = run([*AGENT, "--simulate", "hgx-h100", "--record", str(folder / "t.jsonl")])
    finally:
        folder.chmod(0o700)
    assert proc.returncode == 2 and "cannot create a file in" in one_line(proc.stderr)
