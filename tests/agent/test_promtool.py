"""`promtool check metrics` (lint included) on the exposition: the fixed snapshot and a live simulated node."""

from __future__ import annotations

import subprocess

import pytest

from gpufleet.agent.exposition import render, render_age, render_reference
from gpufleet.agent.health import AgentHealth
from gpufleet.agent.nvml_reader import NvmlReader
from gpufleet.agent.sampler import Sampler
from gpufleet.agent.sim import SimNvml, load_scenario
from gpufleet.agent.store import SnapshotStore
from tests.agent.fakes import FakeClock
from tests.agent.running import PROMTOOL, requires_promtool
from tests.agent.test_exposition import fixed_health, fixed_snapshot

pytestmark = requires_promtool


def promtool(body: bytes) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=60)


def assert_clean(body: bytes) -> None:
    result = promtool(body)
    problems = (result.stdout + result.stderr).decode()
    assert result.returncode == 0 and not problems.strip(), problems


def test_promtool_flags_a_bad_exposition():
    # Guards the guard: promtool must actually complain about lint problems here.
    result = promtool(b'gpufleet_bad_total{a="b"} 1\n')
    assert result.returncode != 0 and b"no help text" in result.stdout + result.stderr


def test_fixed_snapshot_passes():
    snap = fixed_snapshot()
    assert_clean(render(snap, fixed_health()) + render_age(snap.time + 1, snap, "dgx-017"))


def test_health_only_exposition_passes():
    assert_clean(
        render(
            None,
            AgentHealth(
                node="n",
                version="0.1.0",
                nvml_up=False,
                nvml_error="NvmlUnavailable",
                errors={("nvml_init", "driver_not_loaded"): 3},
            ),
        )
    )


@pytest.mark.parametrize("scenario", ["hgx-h100", "a100", "pcie"])
def test_simulated_node_passes(scenario):
    clock = FakeClock()
    spec = load_scenario(scenario)
    nvml = SimNvml(spec, node=spec.nodes[0], clock=clock.time, epoch=clock.now - 60, block_on_events=True)
    store = SnapshotStore()
    reader = NvmlReader(nvml, per_link_nvlink=True)
    sampler = Sampler(reader, store, node=spec.nodes[0], clock=clock.time)
    try:
        sampler.run_once()
        clock.advance(1.0)
        snap = sampler.run_once()
    finally:
        sampler.stop()
    assert snap is not None
    pub = store.latest()
    assert b"gpufleet_gpu_utilization_ratio{" in pub.metrics
    # The sampler's cached renderer writes exactly what prometheus_client's generate_latest would, then the
    # agent's own process_* families.
    reference = render_reference(snap, pub.health, pub.activity)
    assert pub.metrics.startswith(reference)
    assert pub.metrics[len(reference) :].startswith(b"# HELP process_")
    assert_clean(pub.metrics + render_age(clock.now, snap, snap.node))
