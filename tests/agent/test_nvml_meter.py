"""The per-function NVML CPU counter: thread CPU summed per function, everything else untouched."""

from __future__ import annotations

import pynvml

from gpufleet.agent.nvml_meter import MeteredNvml
from tests.agent.fake_nvml import FakeNvml


def test_counts_each_function_it_hands_out():
    fake = FakeNvml()
    metered = MeteredNvml(fake)
    metered.nvmlInit()
    for _ in range(3):
        metered.nvmlDeviceGetCount()
    assert set(metered.seconds) == {"nvmlInit", "nvmlDeviceGetCount"}
    assert fake.called("nvmlDeviceGetCount") == 3
    assert all(v >= 0 for v in metered.seconds.values())


def test_a_failing_call_is_counted_and_still_raises():
    fake = FakeNvml()
    metered = MeteredNvml(fake)
    try:
        metered.nvmlDeviceGetCount()  # not initialised
    except pynvml.NVMLError:
        pass
    assert "nvmlDeviceGetCount" in metered.seconds


def test_calls_the_function_the_object_holds_now():
    fake = FakeNvml()
    metered = MeteredNvml(fake)
    metered.nvmlInit()
    assert metered.nvmlDeviceGetCount() == 1
    fake.nvmlDeviceGetCount = lambda: 7
    assert metered.nvmlDeviceGetCount() == 7


def test_a_batch_call_can_be_split_among_its_parts():
    fake = FakeNvml()
    metered = MeteredNvml(fake)
    metered.nvmlInit()
    metered.nvmlDeviceGetCount()
    spent = metered.last_call_ns("nvmlDeviceGetCount")
    assert spent > 0 and metered.last_call_ns("nvmlDeviceGetCount") == 0  # read once
    metered.attribute("nvmlDeviceGetCount", {"a": spent // 2, "b": spent - spent // 2})
    seconds = metered.seconds
    assert seconds["nvmlDeviceGetCount"] == 0 and seconds["nvmlDeviceGetCount/a"] + seconds["nvmlDeviceGetCount/b"] > 0


def test_constants_and_types_pass_through():
    metered = MeteredNvml(FakeNvml())
    assert metered.NVML_FI_DEV_POWER_INSTANT == pynvml.NVML_FI_DEV_POWER_INSTANT
    assert metered.c_nvmlFieldValue_t is pynvml.c_nvmlFieldValue_t
