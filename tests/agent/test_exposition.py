"""Exposition: byte-for-byte against an expected file, absent readings leave no series, health-only mode."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gpufleet.agent.exposition import render, render_age, render_reference
from gpufleet.agent.health import AgentHealth
from gpufleet.agent.model import GpuSample, NodeSnapshot
from tests.agent.fakes import gpu, snapshot

EXPECTED = Path(__file__).parent / "expected"


def fixed_snapshot() -> NodeSnapshot:
    """GPU 0 full with per-link NVLink, a job and a pod; GPU 1 partly unsupported; GPU 2 lost."""
    g0 = gpu(
        0,
        hpc_job="4242",
        kubernetes_namespace="research",
        kubernetes_pod="llama-worker-3",
        nvlink_link_tx_bytes_total=(1000, 2000),
        nvlink_link_rx_bytes_total=(3000, None),
    )
    g1 = gpu(
        1,
        sm_active_ratio=None,
        sm_occupancy_ratio=None,
        memory_temperature_celsius=None,
        memory_max_operating_temperature_celsius=None,
        throttle_seconds_total={},
        xid_errors_by_code={},
        xid_errors_total=0,
        model='Odd "model"\\name',
        serial=None,
        throttle_reasons=0x1,
    )
    g2 = GpuSample(index=2, uuid="GPU-lost", model="NVIDIA H100 80GB HBM3", up=False)
    return dataclasses.replace(snapshot(n=0), gpus=(g0, g1, g2))


def fixed_health() -> AgentHealth:
    return AgentHealth(
        node="dgx-017",
        version="0.1.0",
        nvml_up=True,
        cycles_total=42,
        errors={("power_watts", "Timeout"): 2, ("attribution", "environ:EACCES"): 1},
        capabilities={
            0: {"sm_active_ratio": True, "memory_temperature_celsius": True},
            1: {"sm_active_ratio": False, "memory_temperature_celsius": False},
        },
    )


def test_matches_expected_file():
    body = render(fixed_snapshot(), fixed_health())
    expected = EXPECTED / "node_snapshot.prom"
    if os.environ.get("GPUFLEET_UPDATE_EXPECTED"):
        expected.write_bytes(body)
    assert body == expected.read_bytes()


def test_fast_writer_is_identical_to_prometheus_client():
    assert render(fixed_snapshot(), fixed_health()) == render_reference(fixed_snapshot(), fixed_health())


def series(body: bytes) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_absent_readings_produce_no_series():
    s = series(render(fixed_snapshot(), fixed_health()))
    temps = {x.labels["gpu"] for x in s["gpufleet_gpu_memory_temperature_celsius"]}
    assert temps == {"0"}
    assert {x.labels["gpu"] for x in s["gpufleet_gpu_up"]} == {"0", "1", "2"}
    assert [x.value for x in s["gpufleet_gpu_up"] if x.labels["gpu"] == "2"] == [0.0]
    assert all(x.labels["gpu"] != "2" for x in s["gpufleet_gpu_power_watts"])
    links = {(x.labels["link"], x.labels["direction"]) for x in s["gpufleet_gpu_nvlink_link_bytes_total"]}
    assert links == {("0", "tx"), ("1", "tx"), ("0", "rx")}
    for samples in s.values():
        assert all(not math.isnan(x.value) for x in samples)


def test_families_without_any_reading_are_left_out():
    bare = NodeSnapshot(node="n", time=1.0, gpus=(GpuSample(index=0, uuid="GPU-x", model="m"),))
    body = render(bare, AgentHealth(node="n", version="0.1.0", nvml_up=True))
    names = set(series(body))
    assert "gpufleet_gpu_up" in names and "gpufleet_gpu_info" in names
    assert not any(n.startswith("gpufleet_gpu_") and n not in ("gpufleet_gpu_up", "gpufleet_gpu_info") for n in names)
    assert b"# HELP gpufleet_gpu_power_watts" not in body


def test_nan_and_infinity_are_treated_as_absent():
    snap = dataclasses.replace(snapshot(n=1), gpus=(gpu(0, power_watts=float("nan"), temperature_celsius=math.inf),))
    s = series(render(snap, AgentHealth(node="n", version="v", nvml_up=True)))
    assert "gpufleet_gpu_power_watts" not in s and "gpufleet_gpu_temperature_celsius" not in s


def test_throttle_reasons_as_mask_and_per_reason():
    s = series(render(fixed_snapshot(), fixed_health()))
    mask = {x.labels["gpu"]: x.value for x in s["gpufleet_gpu_throttle_reasons"]}
    assert mask == {"0": 0x24, "1": 0x1}
    active = {(x.labels["gpu"], x.labels["reason"]) for x in s["gpufleet_gpu_throttle_active"] if x.value == 1}
    assert active == {("0", "sw_power_cap"), ("0", "sw_thermal_slowdown"), ("1", "gpu_idle")}


def test_job_is_its_own_info_series():
    s = series(render(fixed_snapshot(), fixed_health()))
    assert [(x.labels["gpu"], x.labels["hpc_job"]) for x in s["gpufleet_gpu_job_info"]] == [("0", "4242")]
    assert all("hpc_job" not in x.labels for x in s["gpufleet_gpu_power_watts"])


def test_pod_is_its_own_info_series():
    s = series(render(fixed_snapshot(), fixed_health()))
    assert [(x.labels["gpu"], x.labels["namespace"], x.labels["pod"]) for x in s["gpufleet_gpu_pod_info"]] == [
        ("0", "research", "llama-worker-3")
    ]


def test_nvml_down_serves_only_agent_health():
    health = dataclasses.replace(fixed_health(), nvml_up=False, nvml_error="NvmlUnavailable")
    s = series(render(fixed_snapshot(), health))
    assert s["gpufleet_agent_nvml_up"][0].value == 0.0
    assert not [n for n in s if n.startswith("gpufleet_gpu_")]
    assert "gpufleet_agent_build_info" in s


def test_no_snapshot_yet():
    s = series(render(None, AgentHealth(node="n", version="v", nvml_up=False)))
    assert "gpufleet_agent_last_sample_timestamp_seconds" not in s and "gpufleet_agent_nvml_up" in s


def test_age_family():
    snap = snapshot(n=1, time=100.0)
    assert render_age(102.5, snap, "dgx-017").endswith(b'gpufleet_agent_sample_age_seconds{node="dgx-017"} 2.5\n')
    assert render_age(99.0, snap, "n").endswith(b" 0.0\n")  # a clock step back never shows a negative age
    assert render_age(100.0, None, "n") == b""


def test_xid_total_per_gpu_is_zero_from_the_start_where_xid_events_are_delivered():
    """increase() needs a 0 before the first XID; a GPU without XID events has no series at all."""
    s = series(render(fixed_snapshot(), fixed_health()))
    totals = {x.labels["gpu"]: x.value for x in s["gpufleet_gpu_xid_events_total"]}
    assert totals == {"0": 3.0, "1": 0.0}  # GPU 1: no event yet; GPU 2 (lost): no XID reading
    per_code = {(x.labels["gpu"], x.labels["xid"]) for x in s["gpufleet_gpu_xid_errors_total"]}
    assert per_code == {("0", "48"), ("0", "79")}
    quiet = dataclasses.replace(snapshot(n=1), gpus=(gpu(0, xid_errors_total=None, xid_errors_by_code={}),))
    assert "gpufleet_gpu_xid_events_total" not in series(render(quiet, fixed_health()))


def test_free_memory_is_exported_because_total_includes_reserved_memory_and_used_does_not():
    s = series(render(fixed_snapshot(), fixed_health()))
    free = {x.labels["gpu"]: x.value for x in s["gpufleet_gpu_memory_free_bytes"]}
    assert free == {"0": 37923405824.0, "1": 37923405824.0}
    body = render(fixed_snapshot(), fixed_health()).decode()
    assert "reserves" in body.split("# HELP gpufleet_gpu_memory_used_bytes", 1)[1].split("\n", 1)[0]


def test_only_unsupported_readings_have_a_series():
    s = series(render(fixed_snapshot(), fixed_health()))
    assert "gpufleet_gpu_reading_supported" not in s
    unsupported = {(x.labels["gpu"], x.labels["reading"]): x.value for x in s["gpufleet_gpu_reading_unsupported"]}
    assert unsupported == {("1", "memory_temperature_celsius"): 1.0, ("1", "sm_active_ratio"): 1.0}
    everything = dataclasses.replace(fixed_health(), capabilities={0: {"sm_active_ratio": True}})
    assert "gpufleet_gpu_reading_unsupported" not in series(render(fixed_snapshot(), everything))


def test_process_metrics_come_from_a_registry_of_the_renderers_own():
    from prometheus_client import REGISTRY

    from gpufleet.agent.exposition import Renderer

    before = set(REGISTRY._collector_to_names)
    body = Renderer(process_metrics=True).render(fixed_snapshot(), fixed_health())
    s = series(body)
    for name in (
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_start_time_seconds",
        "process_open_fds",
        "process_max_fds",
    ):
        assert len(s[name]) == 1 and s[name][0].value > 0, name
    assert set(REGISTRY._collector_to_names) == before
    assert body.startswith(render(fixed_snapshot(), fixed_health()))
    assert "process_cpu_seconds_total" not in series(Renderer().render(fixed_snapshot(), fixed_health()))


def test_nvml_cost_and_reading_periods_match_prometheus_client():
    health = dataclasses.replace(
        fixed_health(),
        nvml_seconds={"nvmlGpmSampleGet": 1.5, "nvmlDeviceGetFieldValues": 0.25},
        reading_periods={"energy_joules_total": 60.0, "utilization_ratio": 1.0},
    )
    body = render(fixed_snapshot(), health)
    assert body == render_reference(fixed_snapshot(), health)
    samples = series(body)
    assert {s.labels["call"] for s in samples["gpufleet_agent_nvml_seconds_total"]} == {
        "nvmlGpmSampleGet",
        "nvmlDeviceGetFieldValues",
    }
    assert len(samples["gpufleet_agent_reading_period_seconds"]) == 2


def test_unchanged_families_are_reused_and_changed_ones_rewritten():
    from gpufleet.agent.exposition import Renderer

    renderer = Renderer()
    first = renderer.render(fixed_snapshot(), fixed_health())
    hotter = dataclasses.replace(fixed_snapshot(), gpus=(gpu(0, temperature_celsius=99.0),))
    second = renderer.render(hotter, fixed_health())
    assert second == render(hotter, fixed_health()) and first == render(fixed_snapshot(), fixed_health())
