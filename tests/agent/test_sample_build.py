"""GpuSamples built and copied through their slots are equal to the dataclass's own, for every field."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest

from gpufleet.agent.model import GpuSample
from gpufleet.agent.nvml_reader import _resting_schedule
from gpufleet.agent.sample_build import build_sample, replace_sample
from gpufleet.agent.tiers import INTEGRATED, due
from tests.agent.test_reader_with_sim import read_twice


def _fields(sample: GpuSample) -> dict:
    return {f.name: getattr(sample, f.name) for f in dataclasses.fields(GpuSample)}


def test_a_sample_built_through_its_slots_equals_the_constructors_for_every_field():
    samples, _ = read_twice("hgx-h100")  # per-link on: tuples, mappings and counters all filled
    for sample in samples:
        values = _fields(sample)
        built = build_sample(values)
        assert type(built) is GpuSample and built == GpuSample(**values)
        assert _fields(built) == values


def test_fields_left_out_take_their_defaults_and_factories():
    built = build_sample({"index": 3, "uuid": "GPU-x", "model": "H100"})
    assert built == GpuSample(index=3, uuid="GPU-x", model="H100")
    assert built.throttle_seconds_total == {} and built.counter_resets == () and built.up is True


@pytest.mark.parametrize(
    "values",
    [{"index": 0, "uuid": "GPU-x"}, {"index": 0, "uuid": "GPU-x", "model": "H100", "no_such_reading": 1}],
)
def test_a_missing_or_unknown_field_fails_as_the_constructor_does(values):
    with pytest.raises(TypeError):
        build_sample(values)


def test_a_replaced_sample_equals_dataclasses_replace():
    samples, _ = read_twice("hgx-h100")
    changes = {"hpc_job": "train-7", "kubernetes_namespace": "ml", "kubernetes_pod": "worker-0"}
    for sample in samples:
        assert replace_sample(sample, changes) == dataclasses.replace(sample, **changes)
    with pytest.raises(TypeError):
        replace_sample(samples[0], {"no_such_reading": 1})


def test_mappings_stay_read_only():
    sample = build_sample({"index": 0, "uuid": "u", "model": "m", "throttle_seconds_total": MappingProxyType({})})
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample.index = 1  # type: ignore[misc]


@pytest.mark.parametrize("offset", [0, 1, 5, 7])
def test_the_worked_out_schedule_rests_exactly_the_units_the_tiers_do_not_run(offset):
    periods = {"power": 1, "util": 2, "energy": 60, "pcie": 4, "sync_boost": INTEGRATED}
    schedule = _resting_schedule(periods, offset)
    assert len(schedule) == 60
    for cycle in range(180):
        resting = schedule[cycle % len(schedule)]
        assert {k for k, p in periods.items() if not due(p, cycle, offset)} == resting


def test_a_plan_that_reads_everything_every_cycle_needs_no_schedule():
    assert _resting_schedule({"power": 1, "util": 1}, 3) == ()
