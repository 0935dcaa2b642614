"""GpmSampler: two reused buffers, first poll None, per-metric codes, failures."""

from __future__ import annotations

import pynvml
import pytest

from gpufleet.agent.gpm import GPM_APART, GPM_READINGS, GPM_SHARED, GpmSampler
from tests.agent.fake_nvml import FakeNvml, h100


@pytest.fixture
def fake():
    nvml = FakeNvml([h100(0)])
    nvml.initialized = True
    return nvml


def test_first_sample_none_then_metrics(fake):
    sampler = GpmSampler(fake, fake.handle(0))
    assert sampler.sample() is None
    first, second = sampler.sample(), sampler.sample()
    assert first == second == {"sm_active_ratio": (0, 81.0), "sm_occupancy_ratio": (0, 40.5)}
    assert set(first) == set(GPM_SHARED)
    apart = sampler.sample(apart=True)
    assert set(apart) == set(GPM_READINGS) and apart["tensor_active_ratio"] == (0, 0.0)  # no value in the fake
    assert fake.called("nvmlGpmSampleAlloc") == 2
    sampler.free()
    sampler.free()
    assert len(fake.freed_gpm_samples) == 2


def test_failed_sample_means_no_metric_next_poll(fake):
    sampler = GpmSampler(fake, fake.handle(0))
    sampler.sample()
    fake.inject("nvmlGpmSampleGet", pynvml.NVML_ERROR_TIMEOUT, index=0, times=1)
    with pytest.raises(pynvml.NVMLError_Timeout):
        sampler.sample()
    assert sampler.sample() is None
    assert sampler.sample() is not None


def test_failed_metrics_call_keeps_the_new_sample(fake):
    sampler = GpmSampler(fake, fake.handle(0))
    sampler.sample()
    fake.inject("nvmlGpmMetricsGet", pynvml.NVML_ERROR_UNKNOWN, times=1)
    with pytest.raises(pynvml.NVMLError_Unknown):
        sampler.sample()
    assert sampler.sample() is not None


def test_drop_metric(fake):
    sampler = GpmSampler(fake, fake.handle(0))
    sampler.drop(frozenset({"sm_occupancy_ratio"}))
    sampler.sample()
    result = sampler.sample()
    assert result["sm_active_ratio"] == (0, 81.0) and "sm_occupancy_ratio" not in result


def test_metrics_apart_are_asked_in_a_call_of_their_own_only_when_wanted(fake):
    fake.gpus[0].gpm_values[pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL] = 97.0
    sampler = GpmSampler(fake, fake.handle(0))
    sampler.sample()
    calls = fake.called("nvmlGpmMetricsGet")
    assert "graphics_active_ratio" not in sampler.sample()
    assert fake.called("nvmlGpmMetricsGet") == calls + 1
    assert sampler.sample(apart=True)["graphics_active_ratio"] == (0, 97.0)
    assert fake.called("nvmlGpmMetricsGet") == calls + 3


def test_timing_the_metrics_apart_leaves_the_next_poll_without_a_previous_sample(fake):
    sampler = GpmSampler(fake, fake.handle(0))
    assert sampler.time_apart() >= 0.0
    assert sampler.sample(apart=True) is None
    assert sampler.sample(apart=True) is not None
    fake.inject("nvmlGpmMetricsGet", pynvml.NVML_ERROR_UNKNOWN, times=1)
    assert sampler.time_apart() >= 0.0  # timing only: the polls handle a failure
    assert sampler.sample(apart=True) is None
    sampler.drop(frozenset({"graphics_active_ratio"}))
    assert "graphics_active_ratio" not in sampler.sample(apart=True)
    sampler.drop(frozenset(r for r, _ in GPM_APART))
    assert not sampler.has_apart and sampler.time_apart() == 0.0
    assert set(sampler.sample(apart=True)) == set(GPM_SHARED)


def test_alloc_failure_frees_what_was_allocated(fake):
    class SecondAllocFails(FakeNvml):
        allocs = 0

        def nvmlGpmSampleAlloc(self):
            self.allocs += 1
            if self.allocs == 2:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_MEMORY)
            return super().nvmlGpmSampleAlloc()

    nvml = SecondAllocFails([h100(0)])
    nvml.initialized = True
    with pytest.raises(pynvml.NVMLError_Memory):
        GpmSampler(nvml, nvml.handle(0))
    assert len(nvml.freed_gpm_samples) == 1
