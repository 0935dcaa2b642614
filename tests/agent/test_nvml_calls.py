"""The call table: only documented, current NVML functions; string and version helpers."""

from __future__ import annotations

import pathlib
import re

import pynvml

from gpufleet.agent.nvml_calls import IDENTITY, POLLED, STATIC, cuda_version_text, text
from gpufleet.agent.model import GpuSample

DEPRECATED = (
    "nvmlDeviceGetTemperature(",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetViolationStatus",
    "nvmlDeviceGetNvLinkUtilizationCounter",
    "nvmlDeviceGetPcieThroughput",
    "nvmlDeviceGetDetailedEccErrors",
)


def test_readings_are_sample_fields():
    names = {r for call in IDENTITY + STATIC + POLLED for r in call.readings}
    assert names - {"uuid", "model"} <= set(GpuSample.__slots__)


def test_no_deprecated_function_in_the_agent():
    agent = pathlib.Path(__file__).resolve().parents[2] / "agent"
    for name in ("readings.py", "nvml_calls.py", "nvml_reader.py", "nvml_fields.py", "gpm.py", "xid.py"):
        source = (agent / name).read_text()
        assert not [d for d in DEPRECATED if d in source], name


def deprecated_in_installed_pynvml() -> set[str]:
    """Functions and field ids the installed nvidia-ml-py itself marks deprecated, in its comments."""
    source = pathlib.Path(pynvml.__file__).read_text()
    # "# DEPRECATED: Use ... instead" on the lines (comments or decorators) right above the def.
    functions = re.findall(r"^#[^\n]*deprecated[^\n]*\n(?:[#@][^\n]*\n)*def (nvml\w+)", source, re.I | re.M)
    # "NVML_FI_DEV_... = 205 # Deprecated, do not use"
    constants = re.findall(r"^(NVML_\w+)\s*=[^#\n]*#[^\n]*deprecated", source, re.I | re.M)
    return set(functions) | set(constants)


def test_no_name_the_installed_pynvml_deprecates_is_used_by_the_agent():
    deprecated = deprecated_in_installed_pynvml()
    assert deprecated, "no deprecation marker found in pynvml.py: has its comment style changed?"
    agent = pathlib.Path(__file__).resolve().parents[2] / "agent"
    for path in agent.glob("*.py"):  # the reader's side; agent/sim/ only answers these calls
        used = set(re.findall(r"\b(nvml[A-Z]\w*|NVML_\w+)", path.read_text()))
        assert not used & deprecated, path.name


def test_text_and_cuda_version():
    assert text(b"NVIDIA H100\x00") == "NVIDIA H100" and text("x") == "x"
    assert cuda_version_text(12040) == "12.4" and cuda_version_text(11080) == "11.8"
    assert cuda_version_text(0) is None and cuda_version_text(None) is None and cuda_version_text(True) is None
