"""Activity counters: ratios integrated over sampled time, so any two scrapes give the exact mean."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.agent.activity import ActivityIntegrator
from gpufleet.agent.exposition import render, render_reference
from gpufleet.agent.health import AgentHealth
from gpufleet.agent.model import GpuSample, NodeSnapshot


def snap(t: float, *gpus: GpuSample) -> NodeSnapshot:
    return NodeSnapshot(node="n1", time=t, gpus=gpus)


def gpu(index: int = 0, *, util: float | None = 1.0, sm: float | None = 0.5) -> GpuSample:
    return GpuSample(
        index=index, uuid=f"GPU-{index}", model="NVIDIA H100 80GB HBM3", utilization_ratio=util, sm_active_ratio=sm
    )


def test_each_sample_adds_its_ratio_times_the_time_since_the_previous_one() -> None:
    integ = ActivityIntegrator(max_step_seconds=2.0)
    first = integ.update(snap(100.0, gpu(sm=0.5)))
    integ.update(snap(101.0, gpu(sm=0.2)))
    last = integ.update(snap(102.5, gpu(sm=0.6)))

    assert first["GPU-0"]["sm_active"] == (0.0, 0.0)  # the first sample stands for no time yet
    active, sampled = last["GPU-0"]["sm_active"]
    assert sampled == pytest.approx(2.5)
    assert active == pytest.approx(0.2 * 1.0 + 0.6 * 1.5)
    assert last["GPU-0"]["utilization"] == pytest.approx((2.5, 2.5))


def test_a_gap_counts_at_most_max_step_and_a_clock_step_back_counts_nothing() -> None:
    integ = ActivityIntegrator(max_step_seconds=2.0)
    integ.update(snap(100.0, gpu()))
    after_gap = integ.update(snap(400.0, gpu(sm=1.0)))  # NVML was down for 5 minutes
    after_step_back = integ.update(snap(390.0, gpu(sm=1.0)))

    assert after_gap["GPU-0"]["sm_active"] == pytest.approx((2.0, 2.0))
    assert after_step_back["GPU-0"]["sm_active"] == pytest.approx((2.0, 2.0))


def test_a_missing_reading_adds_to_neither_sum_and_an_unsupported_one_has_none() -> None:
    integ = ActivityIntegrator(max_step_seconds=2.0)
    integ.update(snap(100.0, gpu(0, sm=0.4), gpu(1, sm=None)))
    integ.update(snap(101.0, gpu(0, sm=None), gpu(1, sm=None)))  # a failed GPM read on GPU 0
    totals = integ.update(snap(102.0, gpu(0, sm=0.4), gpu(1, sm=None)))

    assert totals["GPU-0"]["sm_active"] == pytest.approx((0.4, 1.0))
    assert "sm_active" not in totals["GPU-1"]  # unsupported: absent, not 0
    assert totals["GPU-1"]["utilization"] == pytest.approx((2.0, 2.0))


def test_out_of_range_ratios_are_clamped_and_nan_is_absent() -> None:
    integ = ActivityIntegrator(max_step_seconds=2.0)
    integ.update(snap(100.0, gpu(util=1.0)))
    integ.update(snap(101.0, gpu(util=1.2, sm=-0.1)))
    totals = integ.update(snap(102.0, gpu(util=float("nan"))))

    assert totals["GPU-0"]["utilization"] == pytest.approx((1.0, 1.0))
    assert totals["GPU-0"]["sm_active"] == pytest.approx((0.0 + 0.5, 2.0))  # -0.1 counts as 0


def test_totals_are_immutable_and_bad_step_is_refused() -> None:
    totals = ActivityIntegrator(max_step_seconds=1.0).update(snap(1.0, gpu()))
    with pytest.raises(TypeError):
        totals["GPU-0"]["sm_active"] = (1.0, 1.0)  # type: ignore[index]
    with pytest.raises(ValueError):
        ActivityIntegrator(max_step_seconds=0.0)


def test_exposition_exports_both_counters_per_reading_as_the_reference_writer_does() -> None:
    integ = ActivityIntegrator(max_step_seconds=2.0)
    integ.update(snap(100.0, gpu(0), gpu(1, sm=None)))
    last = snap(101.0, gpu(0), gpu(1, sm=None))
    totals = integ.update(last)
    health = AgentHealth(node="n1", version="test", nvml_up=True)

    body = render(last, health, totals)

    assert body == render_reference(last, health, totals)
    found = {
        (s.name, s.labels["gpu"], s.labels["reading"]): s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
        if s.name.startswith("gpufleet_gpu_active_")
    }
    assert found == {
        ("gpufleet_gpu_active_seconds_total", "0", "sm_active"): 0.5,
        ("gpufleet_gpu_active_sampled_seconds_total", "0", "sm_active"): 1.0,
        ("gpufleet_gpu_active_seconds_total", "0", "utilization"): 1.0,
        ("gpufleet_gpu_active_sampled_seconds_total", "0", "utilization"): 1.0,
        ("gpufleet_gpu_active_seconds_total", "1", "utilization"): 1.0,
        ("gpufleet_gpu_active_sampled_seconds_total", "1", "utilization"): 1.0,
    }
    assert b"gpufleet_gpu_active" not in render(last, health)  # no totals, no series
