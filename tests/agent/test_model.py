"""GpuSample.to_dict: the snapshot contract's GPU object, built without per-field type checks."""

from __future__ import annotations

from dataclasses import fields
from types import MappingProxyType
from typing import Mapping

from tests.agent.fakes import gpu


def reference(sample) -> dict:
    """The straightforward conversion to_dict must agree with, key order included."""
    out = {}
    for f in fields(sample):
        value = getattr(sample, f.name)
        if isinstance(value, Mapping):
            value = {str(k): v for k, v in value.items()}
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def test_to_dict_agrees_with_the_plain_conversion_in_order():
    sample = gpu(
        0,
        nvlink_link_tx_bytes_total=(1, None),
        counter_resets=("energy_joules_total",),
        xid_errors_by_code=MappingProxyType({79: 2}),
        slow_readings_age_seconds=MappingProxyType({"energy_joules_total": 37.0}),
    )
    out = sample.to_dict()
    assert out == reference(sample) and list(out) == list(reference(sample))
    assert out["xid_errors_by_code"] == {"79": 2} and out["nvlink_link_tx_bytes_total"] == [1, None]
    assert out["slow_readings_age_seconds"] == {"energy_joules_total": 37.0}


def test_empty_mappings_and_tuples_are_empty_json_containers():
    out = gpu(1, throttle_seconds_total={}, counter_resets=()).to_dict()
    assert (
        out["throttle_seconds_total"] == {} and out["counter_resets"] == [] and out["slow_readings_age_seconds"] == {}
    )
