"""The call table: only documented, current NVML functions; string and version helpers."""

from __future__ import annotations

import pathlib

from agent.nvml_calls import IDENTITY, POLLED, STATIC, cuda_version_text, text
from agent.model import GpuSample

DEPRECATED = ("nvmlDeviceGetTemperature(", "nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlDeviceGetViolationStatus",
              "nvmlDeviceGetNvLinkUtilizationCounter", "nvmlDeviceGetPcieThroughput", "nvmlDeviceGetDetailedEccErrors")


def test_readings_are_sample_fields():
    names = {r for call in IDENTITY + STATIC + POLLED for r in call.readings}
    assert names - {"uuid", "model"} <= set(GpuSample.__slots__)


def test_no_deprecated_function_in_the_agent():
    agent = pathlib.Path(__file__).resolve().parents[2] / "agent"
    for name in ("nvml_calls.py", "nvml_reader.py", "nvml_fields.py", "gpm.py", "xid.py"):
        source = (agent / name).read_text()
        assert not [d for d in DEPRECATED if d in source], name


def test_text_and_cuda_version():
    assert text(b"NVIDIA H100\x00") == "NVIDIA H100" and text("x") == "x"
    assert cuda_version_text(12040) == "12.4" and cuda_version_text(11080) == "11.8"
    assert cuda_version_text(0) is None and cuda_version_text(None) is None and cuda_version_text(True) is None
