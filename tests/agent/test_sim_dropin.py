"""The simulator as pynvml for other programs: the calls monitoring tools make, the C symbols nvitop
looks up directly, and nvitop, gpustat and nvitop-exporter as published, run unmodified under
gpufleet-sim-run."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pynvml
import pytest

from gpufleet.agent.sim import SimNvml, load_scenario, parse_scenario
from gpufleet.agent.sim.dropin import install
from gpufleet.agent.sim.run import main as sim_run

H100_TOTAL_BYTES = 81559 * 1024 * 1024
H100_RESERVED_BYTES = 535 * 1024 * 1024
EPOCH = 1_700_000_000.0
BIN = Path(sys.executable).parent


class Clock:
    def __init__(self, t: float) -> None:
        self.now = EPOCH + t

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def sim_module(monkeypatch):
    """A private copy of nvidia-ml-py with the hgx-h100 simulator (job busy at t=120 s) installed; the
    simulator itself raises the shared pynvml's errors, as it does when the shim has loaded one module."""
    spec = importlib.util.find_spec("pynvml")
    module = importlib.util.module_from_spec(spec)
    # nvidia-ml-py registers its error classes on sys.modules["pynvml"] while it loads.
    monkeypatch.setitem(sys.modules, "pynvml", module)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "pynvml", pynvml)
    clock = Clock(120.0)
    sim = SimNvml(load_scenario("hgx-h100"), node="hgx-h100-01", clock=clock, epoch=EPOCH)
    install(sim, module)
    module.nvmlInitWithFlags(0)
    return module, sim, clock


def test_the_calls_gpustat_and_nvitop_make_answer_with_nvml_types_and_units(sim_module):
    nvml, sim, _ = sim_module
    assert nvml.nvmlDeviceGetCount() == 8
    handle = nvml.nvmlDeviceGetHandleByIndex(3)
    assert nvml.nvmlDeviceGetIndex(handle) == 3
    assert nvml.nvmlDeviceGetName(handle) == "NVIDIA H100 80GB HBM3"
    busy_mw = nvml.nvmlDeviceGetPowerUsage(handle)
    assert 300_000 < busy_mw <= 700_000
    assert nvml.nvmlDeviceGetPowerManagementLimit(handle) == 700_000
    assert nvml.nvmlDeviceGetEnforcedPowerLimit(handle) == 700_000
    assert 20 < nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU) < 90
    assert nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_RX_BYTES) > 0
    assert nvml.nvmlDeviceGetEncoderUtilization(handle)[0] == 0
    assert nvml.nvmlDeviceGetDecoderUtilization(handle)[0] == 0
    assert nvml.nvmlDeviceGetMigMode(handle) == [nvml.NVML_DEVICE_MIG_DISABLE] * 2
    assert nvml.nvmlDeviceIsMigDeviceHandle(handle) == 0
    assert nvml.nvmlDeviceGetGraphicsRunningProcesses_v3(handle) == []
    (process,) = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    (sample,) = nvml.nvmlDeviceGetProcessUtilization(handle, 0)
    assert sample.pid == process.pid and sample.smUtil > 50
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.nvmlDeviceGetFanSpeed(handle)
    # gpustat's own patch: the v2 memory call with reserved memory apart.
    memory = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
    assert (memory.total, memory.reserved) == (H100_TOTAL_BYTES, H100_RESERVED_BYTES)
    assert memory.used + memory.free + memory.reserved == memory.total


def test_no_process_means_not_found_for_process_utilization():
    scenario = parse_scenario(
        {
            "name": "later",
            "duration_s": 120,
            "nodes": [{"name": "n1", "model": "h100-sxm", "gpus": 1}],
            "jobs": [{"id": "7", "nodes": ["n1"], "start_s": 60, "step_time_s": 1.0, "compute_fraction": 0.9}],
        }
    )
    clock = Clock(30.0)
    sim = SimNvml(scenario, node="n1", clock=clock, epoch=EPOCH)
    sim.nvmlInit()
    handle = sim.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotFound):
        sim.nvmlDeviceGetProcessUtilization(handle, 0)
    clock.now = EPOCH + 90.0
    (sample,) = sim.nvmlDeviceGetProcessUtilization(handle, 0)
    with pytest.raises(pynvml.NVMLError_NotFound):  # nothing newer than the last sample seen
        sim.nvmlDeviceGetProcessUtilization(handle, sample.timeStamp)


def test_c_symbols_answer_with_c_conventions(sim_module):
    """What nvitop's libnvml does with pynvml._nvmlGetFunctionPointer, byte for byte."""
    nvml, sim, _ = sim_module
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    lookup = nvml._nvmlGetFunctionPointer

    memory = nvml.c_nvmlMemory_v2_t()
    memory.version = nvml.nvmlMemory_v2
    assert lookup("nvmlDeviceGetMemoryInfo_v2")(handle, ctypes.byref(memory)) == nvml.NVML_SUCCESS
    assert (memory.total, memory.reserved) == (H100_TOTAL_BYTES, H100_RESERVED_BYTES)

    temperature = ctypes.c_uint(0)
    fn = lookup("nvmlDeviceGetTemperature")
    assert fn(handle, ctypes.c_uint(nvml.NVML_TEMPERATURE_GPU), ctypes.byref(temperature)) == nvml.NVML_SUCCESS
    assert temperature.value == sim.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
    assert fn(handle, ctypes.c_uint(99), ctypes.byref(temperature)) == nvml.NVML_ERROR_INVALID_ARGUMENT

    values = (nvml.c_nvmlFieldValue_t * 3)()  # one spare entry, as nvitop allocates
    values[0].fieldId = nvml.NVML_FI_DEV_POWER_INSTANT
    values[1].fieldId = nvml.NVML_FI_DEV_NVLINK_LINK_COUNT
    assert lookup("nvmlDeviceGetFieldValues")(handle, ctypes.c_int32(2), ctypes.byref(values)) == 0
    assert values[0].nvmlReturn == values[1].nvmlReturn == nvml.NVML_SUCCESS
    assert values[0].value.uiVal > 300_000 and values[1].value.uiVal == 18

    count = ctypes.c_uint(0)
    fn = lookup("nvmlDeviceGetComputeRunningProcesses_v3")
    assert fn(handle, ctypes.byref(count), None) == nvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 1
    processes = (nvml.c_nvmlProcessInfo_v3_t * 4)()
    count.value = 4
    assert fn(handle, ctypes.byref(count), processes) == nvml.NVML_SUCCESS
    assert count.value == 1
    assert processes[0].pid == sim.nvmlDeviceGetComputeRunningProcesses(handle)[0].pid
    assert processes[0].usedGpuMemory > 50 * 2**30
    count.value = 0
    graphics = lookup("nvmlDeviceGetGraphicsRunningProcesses_v3")
    assert graphics(handle, ctypes.byref(count), None) == nvml.NVML_SUCCESS and count.value == 0


def test_symbols_the_simulator_lacks_are_missing_as_in_an_older_driver(sim_module):
    nvml, _, _ = sim_module
    with pytest.raises(nvml.NVMLError_FunctionNotFound):
        nvml._nvmlGetFunctionPointer("nvmlDeviceGetRunningProcessDetailList")
    with pytest.raises(nvml.NVMLError_FunctionNotFound):
        nvml.nvmlDeviceGetBAR1MemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0))


def test_errors_come_back_as_return_codes(sim_module):
    nvml, _, _ = sim_module
    memory = nvml.c_nvmlMemory_v2_t()
    memory.version = nvml.nvmlMemory_v2
    bogus = ctypes.cast(ctypes.c_void_p(0x1234), nvml.c_nvmlDevice_t)
    fn = nvml._nvmlGetFunctionPointer("nvmlDeviceGetMemoryInfo_v2")
    assert fn(bogus, ctypes.byref(memory)) == nvml.NVML_ERROR_INVALID_ARGUMENT
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    nvml.nvmlShutdown()
    temperature = ctypes.c_uint(0)
    fn = nvml._nvmlGetFunctionPointer("nvmlDeviceGetTemperature")
    assert fn(handle, ctypes.c_uint(0), ctypes.byref(temperature)) == nvml.NVML_ERROR_UNINITIALIZED


# --- gpufleet-sim-run ---------------------------------------------------------------------------------


def test_sim_run_refuses_bad_input_with_one_line_and_exit_2(capsys):
    assert sim_run(["no-such-scenario", "--", "true"]) == 2
    assert sim_run(["hgx-h100"]) == 2
    assert sim_run(["hgx-h100", "--node", "nope", "--", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("gpufleet-sim-run: error: ") for line in err)
    assert "nodes: hgx-h100-01" in err[2]


def test_sim_run_returns_the_programs_exit_code_and_127_when_it_cannot_start(capsys):
    code = "import pynvml, sys; pynvml.nvmlInit(); sys.exit(pynvml.nvmlDeviceGetCount())"
    pcie = load_scenario("pcie")
    assert sim_run(["pcie", "--", sys.executable, "-c", code]) == pcie.node(pcie.nodes[0]).gpu_count
    assert sim_run(["hgx-h100", "--", "/nonexistent/program"]) == 127
    assert "cannot run '/nonexistent/program'" in capsys.readouterr().err


def _run(*command: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpufleet.agent.sim.run", *command],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TERM": "dumb"},
    )


def _tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{name} is not installed in this environment (pip install -e '.[test]')")
    return str(path)


def test_gpustat_as_published_shows_the_simulated_node():
    done = _run("hgx-h100", "--", _tool("gpustat"), "--json")
    assert done.returncode == 0, done.stderr
    gpus = json.loads(done.stdout)["gpus"]
    assert [g["index"] for g in gpus] == list(range(8))
    assert {g["name"] for g in gpus} == {"NVIDIA H100 80GB HBM3"}
    assert {g["memory.total"] for g in gpus} == {81559}
    assert all(g["enforced.power.limit"] == 700 and g["power.draw"] > 0 for g in gpus)
    assert {g["fan.speed"] for g in gpus} == {None}


def test_nvitop_api_as_published_sees_the_simulated_gpus():
    _tool("nvitop")
    script = (
        "import json; from nvitop import Device; "
        "print(json.dumps([[d.index, d.name(), d.memory_total(), d.memory_used(), d.power_limit(), "
        "d.temperature(), d.cuda_compute_capability(), d.mig_mode()] for d in Device.all()]))"
    )
    # Two minutes into the scenario: the job has its memory.
    done = _run("--epoch", str(time.time() - 120), "a100", "--", sys.executable, "-c", script)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    a100 = load_scenario("a100")
    assert len(rows) == a100.node(a100.nodes[0]).gpu_count
    for _, name, total, used, limit, temperature, capability, mig in rows:
        assert name == "NVIDIA A100-SXM4-80GB"
        assert total == 81920 * 1024 * 1024 and 0 < used < total
        assert limit == 400_000 and 20 < temperature < 95
        assert capability == [8, 0] and mig == "Disabled"
    assert "ERROR" not in done.stderr


def test_nvitop_once_as_published_prints_the_simulated_gpus():
    done = _run("hgx-h100", "--", _tool("nvitop"), "--once")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("H100 80GB HBM3") == 8
    assert "79.65GiB" in done.stdout  # 81559 MiB
    assert "Traceback" not in done.stderr and "ERROR" not in done.stderr


def test_nvitop_exporter_as_published_scraped_once():
    exporter = _tool("nvitop-exporter")
    with socket.socket() as s:  # the exporter cannot report a port 0 choice: take a free one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpufleet.agent.sim.run",
            "hgx-h100",
            "--",
            exporter,
            "--bind-address",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        lines = []
        for line in child.stderr:  # ends when the exporter exits; it says when it serves
            lines.append(line)
            if "Start the exporter" in line:
                break
        assert any("Start the exporter" in line for line in lines), "".join(lines)
        # It serves before its first collection: scrape until the GPU series are there (bounded).
        for _ in range(500):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
                text = response.read().decode()
            totals = [line for line in text.splitlines() if line.startswith("gpu_memory_total_MiB{")]
            powers = [line for line in text.splitlines() if line.startswith("gpu_power_usage_W{")]
            if len(totals) == len(powers) == 8:
                break
    finally:
        child.terminate()
        child.wait(timeout=30)
    assert len(totals) == len(powers) == 8
    assert all(line.endswith(" 81559.0") for line in totals)
    assert all('devicename="NVIDIA H100 80GB HBM3"' in line for line in totals)
    assert all(float(line.rsplit(" ", 1)[1]) > 0 for line in powers)
