"""MIG: the simulator answers the MIG calls as NVML does, and the agent's real reader, sampler and both
expositions turn a node with GPUs in MIG mode into per-instance series and snapshot objects."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pynvml
import pytest

from gpufleet.agent.dcgm_names import DcgmFamilies, load_counters
from gpufleet.agent.exposition import Renderer, render, render_reference
from gpufleet.agent.mig import MIG_UNIT, REDISCOVER_SECONDS, profile_of
from gpufleet.agent.nvml_reader import NvmlReader
from gpufleet.agent.sampler import Sampler
from gpufleet.agent.sim import ScenarioError, SimNvml, load_scenario, parse_scenario
from gpufleet.agent.sim.costs import CALL_COST_US
from gpufleet.agent.store import SnapshotStore
from tests.agent.fakes import FakeClock

NODE = "mig-01"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def sim(scenario: str = "mig", clock: FakeClock | None = None) -> SimNvml:
    clock = clock or FakeClock()
    spec = load_scenario(scenario)
    # Two minutes in: the job's memory has ramped up.
    return SimNvml(spec, spec.nodes[0], clock=clock.time, epoch=clock.now - 120, block_on_events=False)


def code(call: Any, *args: Any) -> int:
    with pytest.raises(pynvml.NVMLError) as raised:
        call(*args)
    return raised.value.value


class Counting:
    """A pynvml-compatible object that counts the calls made through it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if not name.startswith("nvml") or not callable(value) or isinstance(value, type):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return value(*args, **kwargs)

        return call


# --- the simulator's MIG calls -------------------------------------------------------------------------


def test_the_simulator_answers_mig_calls_with_nvmls_values_and_errors():
    nvml = sim()
    nvml.nvmlInit()
    whole, split = nvml.nvmlDeviceGetHandleByIndex(2), nvml.nvmlDeviceGetHandleByIndex(0)
    assert nvml.nvmlDeviceGetMigMode(split) == [pynvml.NVML_DEVICE_MIG_ENABLE] * 2
    assert nvml.nvmlDeviceGetMigMode(whole) == [pynvml.NVML_DEVICE_MIG_DISABLE] * 2
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(split) == 7
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(whole) == 0
    # An index with no instance (any, with MIG off) is NotFound; beyond the maximum, InvalidArgument.
    assert code(nvml.nvmlDeviceGetMigDeviceHandleByIndex, split, 3) == pynvml.NVML_ERROR_NOT_FOUND
    assert code(nvml.nvmlDeviceGetMigDeviceHandleByIndex, split, 7) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert code(nvml.nvmlDeviceGetMigDeviceHandleByIndex, whole, 0) == pynvml.NVML_ERROR_NOT_FOUND
    handles = [nvml.nvmlDeviceGetMigDeviceHandleByIndex(split, i) for i in range(3)]
    assert [nvml.nvmlDeviceGetGpuInstanceId(h) for h in handles] == [1, 3, 4]
    assert [nvml.nvmlDeviceGetComputeInstanceId(h) for h in handles] == [0, 0, 0]
    assert nvml.nvmlDeviceGetName(handles[0]) == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    assert nvml.nvmlDeviceGetUUID(handles[0]).startswith("MIG-")
    assert nvml.nvmlDeviceIsMigDeviceHandle(handles[0]) and not nvml.nvmlDeviceIsMigDeviceHandle(split)
    memory = [nvml.nvmlDeviceGetMemoryInfo(h) for h in handles]
    parent = nvml.nvmlDeviceGetMemoryInfo(split, version=pynvml.nvmlMemory_v2)
    assert sum(m.total for m in memory) <= parent.total - parent.reserved
    assert 0 < sum(m.used for m in memory) <= parent.used
    assert memory[0].total == 2 * memory[1].total  # 4 memory slices against 2


def real_answers() -> dict[str, str]:
    """What a real H200 (driver 580, MIG off) answered each MIG call, last answer per call."""
    out = {}
    for line in (FIXTURES / "h200-driver-580" / "migcalls.txt").read_text().splitlines()[1:]:
        name, _, _, answer = line.split(None, 3)
        out[name] = answer
    return out


def test_the_simulator_answers_as_a_real_gpu_with_mig_off():
    nvml = sim("hgx-h100")
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    sample = nvml.nvmlGpmSampleAlloc()

    def answer(name: str, *args: Any) -> str:
        try:
            return repr(getattr(nvml, name)(handle, *args))
        except pynvml.NVMLError as exc:
            return f"ERR {exc.value} {exc}"

    real = real_answers()
    assert answer("nvmlDeviceGetMigMode") == real["nvmlDeviceGetMigMode"] == "[0, 0]"
    assert answer("nvmlDeviceGetMaxMigDeviceCount") == real["nvmlDeviceGetMaxMigDeviceCount"] == "0"
    assert answer("nvmlDeviceGetMigDeviceHandleByIndex", 0) == real["nvmlDeviceGetMigDeviceHandleByIndex"]
    assert answer("nvmlDeviceGetGpuInstanceId") == real["nvmlDeviceGetGpuInstanceId"]
    assert answer("nvmlDeviceGetComputeInstanceId") == real["nvmlDeviceGetComputeInstanceId"]
    assert answer("nvmlGpmMigSampleGet", 0, sample) == real["nvmlGpmMigSampleGet"]
    assert answer("nvmlDeviceIsMigDeviceHandle") == "0" and real["nvmlDeviceIsMigDeviceHandle"] == "c_uint(0)"


def test_a_board_without_mig_says_not_supported():
    nvml = sim("pcie")
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    assert code(nvml.nvmlDeviceGetMigMode, handle) == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert nvml.nvmlDeviceGetMaxMigDeviceCount(handle) == 0
    assert code(nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, 0) == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_mig_calls_cost_what_the_table_says():
    assert CALL_COST_US["nvmlDeviceGetMigMode"] == pytest.approx(158.1)
    for call in ("nvmlGpmMigSampleGet", "nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetGpuInstanceId"):
        assert call in CALL_COST_US


@pytest.mark.parametrize(
    ("mig", "complaint"),
    [
        ([{"gpu": 0, "instances": ["5g.50gb"]}], "unknown MIG profile"),
        ([{"gpu": 0, "instances": ["4g.40gb", "4g.40gb"]}], "compute slices"),
        ([{"gpu": 0, "instances": ["3g.40gb", "3g.40gb", "1g.10gb"]}], "memory slices"),
        ([{"gpu": 9, "instances": []}], "does not exist"),
        ([{"gpu": 0, "instances": []}, {"gpu": 0, "instances": []}], "listed twice"),
    ],
)
def test_a_layout_the_board_cannot_hold_is_refused_naming_the_key(mig, complaint):
    doc = {"nodes": [{"name": "n", "model": "h100-sxm", "gpus": 2, "mig": mig}]}
    with pytest.raises(ScenarioError, match=rf"nodes\[0\]\.mig\[\d\]\..*{complaint}"):
        parse_scenario(doc)


def test_a_board_without_mig_mode_cannot_be_given_a_layout():
    doc = {"nodes": [{"name": "n", "model": "l40s", "gpus": 1, "mig": [{"gpu": 0, "instances": ["1g.5gb"]}]}]}
    with pytest.raises(ScenarioError, match="has no MIG mode"):
        parse_scenario(doc)


def test_profile_from_a_mig_device_name():
    assert profile_of("NVIDIA H100 80GB HBM3 MIG 1g.10gb") == "1g.10gb"
    assert profile_of("NVIDIA A100-SXM4-40GB MIG 1g.5gb+me") == "1g.5gb+me"
    assert profile_of("NVIDIA H100 80GB HBM3") is None
    assert profile_of(None) is None


# --- through the agent's reader and sampler ---------------------------------------------------------------


def sampled(scenario: str = "mig", cycles: int = 2, nvml: Any = None) -> tuple[Any, Sampler, NvmlReader]:
    clock = FakeClock()
    nvml = nvml or sim(scenario, clock)
    # A whole core's budget: every read every cycle, whatever the reads cost on this machine.
    reader = NvmlReader(nvml, clock=clock.time, cpu_budget=1.0)
    sampler = Sampler(reader, SnapshotStore(), node=load_scenario(scenario).nodes[0], clock=clock.time)
    snap = None
    for _ in range(cycles):
        snap = sampler.run_once()
        clock.advance(1.0)
    return snap, sampler, reader


def test_the_agent_reads_each_gpu_instance_and_keeps_the_parents_readings():
    snap, sampler, _ = sampled()
    sampler.stop()
    split, sevens, whole = snap.gpus[0], snap.gpus[1], snap.gpus[2]
    assert (split.mig_enabled, sevens.mig_enabled, whole.mig_enabled) == (True, True, False)
    assert [(i.gpu_instance_id, i.profile) for i in split.mig_instances] == [
        (1, "3g.40gb"),
        (3, "2g.20gb"),
        (4, "2g.20gb"),
    ]
    assert [i.profile for i in sevens.mig_instances] == ["1g.10gb"] * 7
    assert whole.mig_instances == ()
    for instance in split.mig_instances + sevens.mig_instances:
        assert instance.uuid.startswith("MIG-") and instance.compute_instance_id == 0
        assert 0 < instance.memory_used_bytes < instance.memory_total_bytes
        # GPM per instance: two samples a cycle apart give a value.
        assert 0 < instance.activity["sm_active_ratio"] <= 1
        assert 0 < instance.activity["sm_occupancy_ratio"] <= 1
    # The instances differ (each runs its own share of work), and the parent GPU reads as a whole GPU does.
    assert len({i.activity["sm_active_ratio"] for i in split.mig_instances}) == 3
    for field in ("memory_used_bytes", "utilization_ratio", "sm_active_ratio", "power_watts", "temperature_celsius"):
        assert getattr(split, field) is not None and getattr(whole, field) is not None, field
    assert split.memory_used_bytes >= sum(i.memory_used_bytes for i in split.mig_instances)


def test_the_snapshot_json_carries_the_instances():
    snap, sampler, _ = sampled()
    sampler.stop()
    gpu = orjson.loads(orjson.dumps(snap.to_dict()))["gpus"][0]
    assert gpu["mig_enabled"] is True
    first = gpu["mig_instances"][0]
    assert first["gpu_instance_id"] == 1 and first["compute_instance_id"] == 0 and first["profile"] == "3g.40gb"
    assert first["memory_used_bytes"] > 0 and first["memory_total_bytes"] > first["memory_used_bytes"]
    assert 0 < first["sm_active_ratio"] <= 1


def test_a_board_without_mig_has_none_and_says_the_reading_is_unsupported():
    snap, sampler, reader = sampled("pcie")
    health = sampler.health()
    sampler.stop()
    assert all(g.mig_enabled is None and g.mig_instances == () for g in snap.gpus)
    assert health.capabilities[0]["mig_mode"] is False
    body = render(snap, health).decode()
    assert 'gpufleet_gpu_reading_unsupported{gpu="0"' in body and 'reading="mig_mode"' in body
    assert "gpufleet_gpu_mig_enabled" not in body and "gpufleet_mig_" not in body


def test_a_pynvml_without_mig_calls_reads_as_no_mig():
    class Older(Counting):
        def __getattr__(self, name: str) -> Any:
            if "Mig" in name or "InstanceId" in name:
                raise AttributeError(name)
            return super().__getattr__(name)

    snap, sampler, reader = sampled(nvml=Older(sim()))
    sampler.stop()
    assert all(g.mig_enabled is None and g.mig_instances == () for g in snap.gpus)
    assert not any(reading.startswith("mig") for reading, _ in reader.errors)


def test_the_mode_is_read_at_open_and_then_once_a_minute_not_every_cycle():
    nvml = Counting(sim())
    cycles = int(2 * REDISCOVER_SECONDS)
    _, sampler, reader = sampled(nvml=nvml, cycles=cycles)
    sampler.stop()
    gpus = 4
    assert nvml.calls["nvmlDeviceGetMigMode"] == gpus + gpus * cycles // int(REDISCOVER_SECONDS)
    # The instances' memory is a read unit of the tiers; the whole-core budget reads it every cycle.
    assert reader.reading_periods[MIG_UNIT] == 1.0
    assert nvml.calls["nvmlDeviceGetMemoryInfo"] >= 10 * cycles


def test_instances_an_operator_removes_are_gone_after_the_next_rediscovery():
    clock = FakeClock()
    nvml = sim(clock=clock)
    reader = NvmlReader(nvml, clock=clock.time)
    reader.open()
    try:
        assert len(reader.read()[1].mig_instances) == 7
        # Five 1g.10gb instances destroyed (`nvidia-smi mig -dci`, `-dgi`): their handles answer no more.
        gone = nvml._mig[1][2:]
        nvml._mig[1] = nvml._mig[1][:2]
        nvml._mig_handles = {a: i for a, i in nvml._mig_handles.items() if i not in gone}
        for _ in range(int(REDISCOVER_SECONDS)):
            clock.advance(1.0)
            gpus = reader.read()
        assert [i.gpu_instance_id for i in gpus[1].mig_instances] == [7, 8]
        # Until then the instances gone fail their reads (counted); after it, nothing more fails.
        failed = dict(reader.errors)
        for _ in range(3):
            clock.advance(1.0)
            reader.read()
        assert dict(reader.errors) == failed
    finally:
        reader.close()


# --- the expositions ----------------------------------------------------------------------------------------


def test_gpufleet_names_label_each_instance_by_id_and_profile():
    snap, sampler, _ = sampled()
    health = sampler.health()
    sampler.stop()
    body = render(snap, health)
    assert body == render_reference(snap, health)
    text = body.decode()
    assert text.count("gpufleet_mig_memory_used_bytes{") == 10
    assert text.count("gpufleet_mig_sm_active_ratio{") == 10
    line = next(ln for ln in text.splitlines() if ln.startswith("gpufleet_mig_memory_total_bytes{") and 'gpu="0"' in ln)
    for label in ('gpu_instance="1"', 'compute_instance="0"', 'profile="3g.40gb"', 'mig_uuid="MIG-', 'uuid="GPU-'):
        assert label in line
    assert text.count("gpufleet_gpu_mig_enabled{") == 4
    assert 'gpufleet_gpu_mig_enabled{gpu="2"' in text and text.count("gpufleet_gpu_memory_used_bytes{") == 4


def test_dcgm_names_add_dcgm_exporters_per_instance_series_and_keep_the_gpus():
    snap, sampler, _ = sampled()
    health = sampler.health()
    sampler.stop()
    text = Renderer(families=DcgmFamilies(load_counters())).render(snap, health).decode()
    used = [ln for ln in text.splitlines() if ln.startswith("DCGM_FI_DEV_FB_USED{")]
    per_instance = [ln for ln in used if "GPU_I_ID=" in ln]
    assert len(used) == 4 + 10 and len(per_instance) == 10
    assert any('GPU_I_ID="3"' in ln and 'GPU_I_PROFILE="2g.20gb"' in ln and 'gpu="0"' in ln for ln in per_instance)
    assert all('UUID="GPU-' in ln and 'modelName="' in ln and 'Hostname="mig-01"' in ln for ln in per_instance)
    # A reading an instance does not have of its own (temperature, power) stays per GPU.
    assert not any("GPU_I_ID" in ln for ln in text.splitlines() if ln.startswith("DCGM_FI_DEV_GPU_TEMP{"))
