"""The shipped systemd units score at most 2.0 ("OK") on `systemd-analyze security`, judged offline from
the files alone, with the agent still allowed the GPU device nodes and the /proc reads attribution needs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[1] / "deploy" / "systemd"
MAX_EXPOSURE = 2.0
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def _offline_security_supported() -> bool:
    if SYSTEMD_ANALYZE is None:
        return False
    version = subprocess.run([SYSTEMD_ANALYZE, "--version"], capture_output=True, text=True, timeout=30).stdout
    match = re.match(r"systemd (\d+)", version)
    return bool(match) and int(match.group(1)) >= 250  # --offline and --threshold came with 250


requires_analyzer = pytest.mark.skipif(
    not _offline_security_supported(),
    reason="systemd-analyze (systemd 250 or newer) is not installed; .ci/run installs the systemd package",
)


def service_section(unit: str) -> dict[str, list[str]]:
    """Every directive of [Service], repeated ones in order."""
    values: dict[str, list[str]] = {}
    for line in (UNITS / unit).read_text().splitlines():
        line = line.strip()
        if line.startswith("[") or not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        values.setdefault(key, []).append(value)
    return values


@requires_analyzer
@pytest.mark.parametrize("unit", ["gpufleet-agent.service", "gpufleet-server.service"])
def test_the_unit_is_hardened_to_at_most_2(unit):
    result = subprocess.run(
        [
            SYSTEMD_ANALYZE,
            "security",
            "--offline=yes",
            f"--threshold={round(MAX_EXPOSURE * 10)}",
            "--no-pager",
            str(UNITS / unit),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= MAX_EXPOSURE and result.returncode == 0, result.stdout
    # A misspelt directive is ignored by systemd with only a warning, and would silently weaken the unit.
    assert "Unknown key" not in result.stderr, result.stderr


def test_the_agent_reaches_the_gpus_through_a_device_allow_list_not_an_exemption():
    agent = service_section("gpufleet-agent.service")
    assert agent["DevicePolicy"] == ["closed"] and "PrivateDevices" not in agent
    assert {"/dev/nvidiactl rw", "char-nvidia-frontend rw"} <= set(agent["DeviceAllow"])
    # Attribution reads other users' /proc/PID/environ and enters /proc/PID/root: these two and no more.
    caps = {"CAP_DAC_READ_SEARCH", "CAP_SYS_PTRACE"}
    assert set(agent["CapabilityBoundingSet"][0].split()) == caps == set(agent["AmbientCapabilities"][0].split())
    assert agent["ProtectProc"] == ["ptraceable"] and agent.get("ProcSubset", ["all"]) == ["all"]


def test_the_server_keeps_no_capability():
    server = service_section("gpufleet-server.service")
    assert server["CapabilityBoundingSet"] == [""] and "AmbientCapabilities" not in server
