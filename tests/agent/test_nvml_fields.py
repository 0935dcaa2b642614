"""The field-value batch: entries, scopes, per-entry decoding, dropping unsupported entries."""

from __future__ import annotations

import pynvml
import pytest

from gpufleet.agent.nvml_fields import ALL_LINKS, FieldBatch, FieldEntry, batch_entries, decode, fetch, read_link_count
from tests.agent.fake_nvml import FakeNvml, h100


def test_entries_without_and_with_per_link():
    fake = FakeNvml()
    base = batch_entries(fake, link_count=18, per_link=False)
    assert {e.reading for e in base} >= {"power_watts", "nvlink_tx_bytes_total", "throttle_seconds_total.sync_boost"}
    assert [e.scope for e in base if e.reading in ("nvlink_tx_bytes_total", "nvlink_rx_bytes_total")] == [
        ALL_LINKS,
        ALL_LINKS,
    ]
    links = batch_entries(fake, link_count=2, per_link=True)
    extra = [(e.reading, e.scope) for e in links if e not in base]
    assert extra == [
        ("nvlink_link_tx_bytes_total.0", 0),
        ("nvlink_link_rx_bytes_total.0", 0),
        ("nvlink_link_tx_bytes_total.1", 1),
        ("nvlink_link_rx_bytes_total.1", 1),
    ]


def test_field_ids_missing_from_this_pynvml_are_skipped():
    class OldPynvml:
        NVML_FI_DEV_POWER_INSTANT = 186

    assert batch_entries(OldPynvml(), link_count=0, per_link=True) == (FieldEntry("power_watts", 186, 0),)


@pytest.mark.parametrize(
    ("value_type", "member", "value"),
    [
        (0, "dVal", 1.5),
        (1, "uiVal", 7),
        (2, "ulVal", 8),
        (3, "ullVal", 2**63),
        (4, "sllVal", -3),
        (5, "siVal", -4),
        (6, "usVal", 9),
    ],
)
def test_decode_each_value_type(value_type, member, value):
    slot = pynvml.c_nvmlFieldValue_t()
    slot.valueType = value_type
    setattr(slot.value, member, value)
    assert decode(slot) == value


def test_decode_unknown_type_is_none():
    slot = pynvml.c_nvmlFieldValue_t()
    slot.valueType = 42
    assert decode(slot) is None


def test_fetch_keeps_each_entry_code_and_pads_missing_answers():
    fake = FakeNvml([h100(0)])
    fake.initialized = True
    fake.gpus[0].field_codes[(pynvml.NVML_FI_DEV_POWER_INSTANT, 0)] = pynvml.NVML_ERROR_NO_PERMISSION
    entries = batch_entries(fake, link_count=0, per_link=False)
    results = fetch(fake, fake.handle(0), entries)
    by_reading = {r.entry.reading: r for r in results}
    assert (by_reading["power_watts"].code, by_reading["power_watts"].raw) == (pynvml.NVML_ERROR_NO_PERMISSION, None)
    assert (by_reading["memory_temperature_celsius"].code, by_reading["memory_temperature_celsius"].raw) == (0, 78)

    class Short(FakeNvml):
        def nvmlDeviceGetFieldValues(self, handle, ids):
            return super().nvmlDeviceGetFieldValues(handle, ids[:1])

    short = Short([h100(0)])
    short.initialized = True
    results = fetch(short, short.handle(0), entries)
    assert len(results) == len(entries) and results[1].code is None


def test_batch_drops_unsupported_and_reuses_request():
    fake = FakeNvml([h100(0)])
    fake.initialized = True
    batch = FieldBatch(batch_entries(fake, link_count=0, per_link=False))
    batch.drop(["memory_temperature_celsius"])
    batch.fetch(fake, fake.handle(0))
    batch.fetch(fake, fake.handle(0))
    (_, first), (_, second) = fake.field_requests
    assert (pynvml.NVML_FI_DEV_MEMORY_TEMP, 0) not in first and first == second


def test_read_link_count():
    fake = FakeNvml([h100(0, links=18)])
    fake.initialized = True
    assert read_link_count(fake, fake.handle(0)) == 18
    del fake.gpus[0].fields[(pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT, 0)]
    assert read_link_count(fake, fake.handle(0)) is None
