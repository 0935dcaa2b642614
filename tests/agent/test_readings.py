"""The reading table: every row a GpuSample field, readable through pynvml, documented; what derives from it."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import orjson
import pynvml
import pytest

from gpufleet.agent import nvml_calls, nvml_fields, tiers
from gpufleet.agent.exposition import TABLE_FAMILIES, render
from gpufleet.agent.gpm import GPM_APART, GPM_METRICS
from gpufleet.agent.health import AgentHealth
from gpufleet.agent.model import GpuSample, NodeSnapshot
from gpufleet.agent.nvml_reader import NvmlReader
from gpufleet.agent.nvml_values import RULES
from gpufleet.agent.readings import (
    BY_NAME,
    FAMILIES,
    READINGS,
    FieldValue,
    GpmMetric,
    NvmlCall,
    Family,
    Own,
    PerLinkField,
    exported_families,
    family_name,
)
from gpufleet.agent.sim import SimNvml, load_scenario
from tests.agent.fake_nvml import FakeNvml

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = Path(__file__).parent / "expected"
# Snapshot fields that are no NVML reading: identity, attribution, the XID watcher's detail, bookkeeping.
NOT_READINGS = {
    "index",
    "uuid",
    "model",
    "up",
    "hpc_job",
    "kubernetes_namespace",
    "kubernetes_pod",
    "pci_bus_id",
    "serial",
    "vbios_version",
    "xid_errors_by_code",
    "last_xid",
    "counter_resets",
    "slow_readings_age_seconds",
    # MIG instances and compute processes: parts of their own (agent.sample_parts), not per-GPU readings.
    "mig_enabled",
    "mig_instances",
    "processes",
}


def test_every_reading_is_a_sample_field_and_every_sample_field_a_reading_or_named_otherwise():
    fields = [f.name for f in dataclasses.fields(GpuSample)]
    assert len(BY_NAME) == len(READINGS)
    assert set(BY_NAME) == set(fields) - NOT_READINGS
    assert NOT_READINGS <= set(fields)


def test_units_are_in_the_names():
    units = ("_ratio", "_bytes", "_celsius", "_watts", "_hertz", "_reasons", "_total", "_correctable")
    units += ("_per_second", "_state")  # a rate; a P-state's number is its unit
    for r in READINGS:
        assert r.name.endswith(units) or r.rule.flag or r.name.startswith("remapped_rows_"), r.name
        assert r.rule.counter == r.name.endswith("_total"), r.name


def test_every_source_names_what_the_installed_pynvml_defines():
    for r in READINGS:
        source = r.source
        if isinstance(source, (FieldValue, PerLinkField)):
            assert isinstance(getattr(pynvml, source.field_id), int), r.name
        elif isinstance(source, GpmMetric):
            assert isinstance(getattr(pynvml, source.metric_id), int), r.name
        elif isinstance(source, NvmlCall):
            assert callable(getattr(pynvml, source.function)), r.name
            for name in source.args + tuple(v for _, v in source.kwargs):
                assert hasattr(pynvml, name), (r.name, name)
        else:
            assert isinstance(source, Own), r.name


def test_every_family_carries_readings_and_every_series_has_a_family():
    families = exported_families()
    names = [f.name for f in families]
    assert len(set(names)) == len(names) and families[: len(FAMILIES)] == FAMILIES
    carried = {family_name(r) for r in READINGS if r.family is not None}
    assert carried == set(names)
    assert [name for name, *_ in TABLE_FAMILIES] == names
    for family in families:
        values = [r.label_value for r in READINGS if family_name(r) == family.name]
        assert len(set(values)) == len(values), family.name
        assert all(values) if family.label else values == [""], family.name
        assert family.kind == "counter" or not any(BY_NAME[r].rule.counter for _, r in _series(family.name))


def _series(family: str) -> tuple[tuple[str, str], ...]:
    return next(fields for name, _, _, _, fields in TABLE_FAMILIES if name == family)


def test_every_family_is_in_the_docs_metrics_table():
    doc = (ROOT / "docs" / "agent.md").read_text()
    rows = {m for line in doc.splitlines() if line.startswith("|") for m in re.findall(r"`(gpufleet_\w+)`", line)}
    for family in exported_families():
        assert family.name + ("_total" if family.kind == "counter" else "") in rows, family.name


def test_what_derives_from_the_table():
    assert RULES == {r.name: r.rule for r in READINGS}
    assert tiers.FAST_READINGS == {r.name for r in READINGS if r.fast}
    gpm = [r for r in READINGS if isinstance(r.source, GpmMetric)]
    assert [name for name, _ in GPM_METRICS] == [r.name for r in gpm if not r.source.apart]
    assert [name for name, _ in GPM_APART] == [r.name for r in gpm if r.source.apart]
    assert [name for name, _ in GPM_METRICS] == ["sm_active_ratio", "sm_occupancy_ratio"]  # the detectors' call
    polled = [name for call in nvml_calls.POLLED for name in call.readings]
    static = [name for call in nvml_calls.STATIC for name in call.readings]
    at_open = {r.name: r.source.at_open for r in READINGS if isinstance(r.source, NvmlCall)}
    assert polled == [name for name, once in at_open.items() if not once]
    assert static == [name for name, once in at_open.items() if once]
    entries = nvml_fields.batch_entries(FakeNvml(), link_count=1, per_link=True)
    for r in READINGS:
        if isinstance(r.source, FieldValue):
            assert (getattr(pynvml, r.source.field_id), r.source.scope) in {
                (e.field_id, e.scope) for e in entries if e.reading == r.name
            }
        elif isinstance(r.source, PerLinkField):
            assert [e.scope for e in entries if e.reading == f"{r.name}.0"] == [0]


def test_a_call_with_several_rows_is_made_once_and_split_by_part():
    fake = FakeNvml()
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    by_first = {call.readings[0]: call for call in nvml_calls.POLLED}
    memory = ("memory_used_bytes", "memory_total_bytes", "memory_free_bytes", "memory_reserved_bytes")
    assert by_first["memory_used_bytes"].readings == memory
    used, total, free, reserved = by_first["memory_used_bytes"].fetch(fake, handle)
    gpu = fake.gpus[0]
    assert (used, total, reserved) == (gpu.memory_used, gpu.memory_total, 0) and 0 < free < total
    assert by_first["remapped_rows_correctable"].fetch(fake, handle) == gpu.remapped_rows
    assert by_first["utilization_ratio"].fetch(fake, handle) == gpu.utilization
    assert by_first["temperature_celsius"].fetch(fake, handle) == (gpu.temperature,)
    # A call answering a list (percent, sampling period) gives its first item.
    assert by_first["encoder_utilization_ratio"].fetch(fake, handle) == (gpu.encoder_percent,)


def test_a_row_may_declare_a_family_of_its_own():
    own = Family("gpufleet_gpu_x", "counter", "X.")
    row = dataclasses.replace(BY_NAME["pcie_tx_bytes_total"], family=own)
    assert family_name(row) == "gpufleet_gpu_x" and family_name(BY_NAME["power_watts"]) == "gpufleet_gpu_power_watts"
    assert family_name(BY_NAME["xid_errors_total"]) is None


def test_a_call_whose_rows_do_not_all_name_a_part_is_refused():
    spec = NvmlCall("nvmlDeviceGetMemoryInfo")
    with pytest.raises(ValueError):
        nvml_calls._fetch(spec, (None, "total"))


# -- the simulator's node through the same code path, against files written before the table existed ---


def simulated(cycles: int = 3) -> tuple[bytes, bytes]:
    """The JSON snapshot and /metrics body of an HGX H100 node after a few cycles, slow tiers included."""
    epoch = 1_763_800_000.0
    scenario = load_scenario("hgx-h100")
    node = next(iter(scenario.nodes))
    now = [epoch + 30.0]
    nvml = SimNvml(scenario, node, clock=lambda: now[0], epoch=epoch, seed=0, block_on_events=False)
    # A budget no plan fits: every read at its longest period, whatever the reads cost on this machine.
    reader = NvmlReader(nvml, per_link_nvlink=True, cpu_budget=1e-9, clock=lambda: now[0])
    reader.open()
    try:
        for _ in range(cycles):
            now[0] += 1.0
            snap = NodeSnapshot(node=node, time=now[0], gpus=reader.read())
        health = AgentHealth(
            node=node,
            version="0.0.0",
            nvml_up=True,
            errors=reader.errors,
            capabilities=reader.capabilities,
            cycles_total=cycles,
            reading_periods=reader.reading_periods,
        )
        return orjson.dumps(snap.to_dict(), option=orjson.OPT_INDENT_2) + b"\n", render(snap, health)
    finally:
        reader.close()


def test_a_simulated_node_gives_the_expected_snapshot_and_metrics_byte_for_byte():
    snapshot, metrics = simulated()
    files = (EXPECTED / "sim_hgx_h100_snapshot.json", EXPECTED / "sim_hgx_h100.prom")
    if os.environ.get("GPUFLEET_UPDATE_EXPECTED"):
        for path, body in zip(files, (snapshot, metrics)):
            path.write_bytes(body)
    assert snapshot == files[0].read_bytes()
    assert metrics == files[1].read_bytes()
