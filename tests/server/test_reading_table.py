"""The reading table (server/readings.py) is the one list: the contract, the windows and both Prometheus
mappings agree with it, and a row added to it reaches every one of them."""

from __future__ import annotations

import re
from dataclasses import fields, replace

import msgspec
import pytest

from gpufleet.agent.exposition import render
from gpufleet.agent.health import AgentHealth
from gpufleet.agent.model import GpuSample, NodeSnapshot
from gpufleet.server import contract
from gpufleet.server.contract import COLUMN, FIELDS, ContractError, parse_snapshot
from gpufleet.server.engine import windows
from gpufleet.server.engine.windows import N_BINNED, ROW, ROWS, Windows
from gpufleet.server.ingest import dcgm, prometheus
from gpufleet.server.readings import READINGS, AgentSeries, DcgmField, Kind, Reading, Window, check
from tests.server.engine_samples import T0, healthy, sample

# The exercise of CONTRIBUTING.md ("Add a reading"), as the server's one row.
NVLINK_CRC = Reading(
    "nvlink_crc_errors_total",
    "errors",
    Kind.COUNTER,
    (0.0, 1e18),
    Window.EVENTS,
    event="nvlink_crc",
    agent=AgentSeries("gpufleet_gpu_nvlink_crc_errors_total"),
    dcgm=(DcgmField("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", shipped=False),),
)
EXTENDED = READINGS + (NVLINK_CRC,)


def _payload(**gpu: object) -> dict:
    base = {"index": 0, "uuid": "GPU-0", "model": "NVIDIA H100", **gpu}
    return {"schema": 1, "node": "n0", "time": T0, "gpus": [base]}


def _inside(r: Reading) -> float | bool:
    """A value every row accepts as it is: its low limit, or True for a flag."""
    return True if r.limits is None else r.limits[0]


# -- the contract -------------------------------------------------------------------------------------


def test_the_contracts_columns_are_the_tables_rows_in_order():
    assert FIELDS == tuple(r.name for r in READINGS)
    assert dict(COLUMN) == {r.name: i for i, r in enumerate(READINGS)}


def test_every_reading_decodes_into_its_own_column():
    values = {r.name: _inside(r) for r in READINGS}
    s = parse_snapshot(_payload(**values))
    assert s.values.shape == (1, len(READINGS))
    for r in READINGS:
        assert s.values[0, COLUMN[r.name]] == float(values[r.name]), r.name


@pytest.mark.parametrize("r", [r for r in READINGS if r.limits is not None], ids=lambda r: r.name)
def test_each_readings_limits_are_the_decoders_range_check(r: Reading):
    assert r.limits is not None
    low, high = r.limits
    assert parse_snapshot(_payload(**{r.name: high})).value(0, r.name) == min(high, r.clamp or high)
    for outside in (low - abs(low) * 0.01 - 1.0, high * 1.01 + 1.0):
        with pytest.raises(ContractError, match=r.name):
            parse_snapshot(_payload(**{r.name: outside}))


@pytest.mark.parametrize("r", [r for r in READINGS if r.kind is Kind.FLAG], ids=lambda r: r.name)
def test_a_flag_decodes_as_a_bool_and_refuses_a_number(r: Reading):
    assert parse_snapshot(_payload(**{r.name: True})).value(0, r.name) == 1.0
    with pytest.raises(ContractError, match=r.name):
        parse_snapshot(_payload(**{r.name: 0.5}))


def test_a_clamped_reading_is_read_no_higher_than_its_clamp_and_no_other_is():
    clamped = {r.name: r.clamp for r in READINGS if r.clamp is not None}
    assert clamped  # the ratios a driver rounds over 1
    for r in READINGS:
        if r.limits is not None and r.limits[1] > 1.0:
            want = clamped.get(r.name, 1.25)
            assert parse_snapshot(_payload(**{r.name: 1.25})).value(0, r.name) == want, r.name


def test_the_decoder_reads_the_tables_rows_in_the_order_the_agent_writes_them():
    written = [f.name for f in fields(GpuSample)]
    names = [r.name for r in READINGS]
    assert [n for n in written if n in names] == names
    assert [n for n in contract.GPU_FIELD_ORDER if n in names] == names
    assert [n for n in written if n in contract.GPU_FIELD_ORDER] == list(contract.GPU_FIELD_ORDER)


# -- the windows --------------------------------------------------------------------------------------


def test_the_windows_rows_are_the_tables_binned_readings_then_the_derived_rows():
    binned = tuple(r.name for r in READINGS if r.window is Window.ROW)
    assert ROWS == binned + windows.DERIVED_ROWS
    assert N_BINNED == len(ROWS) == len(set(ROWS))
    assert windows.HELD == tuple(r.name for r in READINGS if r.window is Window.HELD)
    assert windows.LIMIT_COLS.tolist() == [COLUMN[n] for n in windows.HELD]


def test_every_binned_reading_is_its_rows_mean_and_every_held_one_its_gpus_newest():
    w = Windows(5.0, 12)
    values = {
        "utilization_ratio": 0.5,
        "sm_active_ratio": 0.25,
        "memory_temperature_celsius": 70.0,
        "memory_max_operating_temperature_celsius": 95.0,
    }
    w.add(sample("n0", T0, [healthy(0, **values)]))
    w.add(sample("n0", T0 + 1, [healthy(0, **values)]))
    w.flush(min_bin=0)
    sent = parse_snapshot(_payload(**{**healthy(0, **values).to_dict(), "index": 0}))
    latest = w.window(int(T0 // 5), 1)[:, 0, 0]
    for r in READINGS:
        if r.window is Window.ROW and r.name != "power_watts":  # power comes from the energy counter's rate
            assert latest[ROW[r.name]] == sent.values[0, COLUMN[r.name]], r.name
        if r.window is Window.HELD:
            held = w.slot_limits[windows.HELD.index(r.name), 0]
            assert held == sent.values[0, COLUMN[r.name]], r.name


@pytest.mark.parametrize("r", [r for r in READINGS if r.window is Window.EVENTS], ids=lambda r: r.name)
def test_every_event_counters_increase_is_an_event_of_its_rows_kind(r: Reading):
    w = Windows(5.0, 12)
    w.add(sample("n0", T0, [healthy(0, **{r.name: 1})]))
    w.add(sample("n0", T0 + 5, [healthy(0, **{r.name: 4})]))
    w.flush(min_bin=0)
    assert [(e.kind, e.delta) for e in w.drain_events()] == [(r.event, 3)]


# -- Prometheus: the agents' series and dcgm-exporter's -----------------------------------------------


def test_the_agents_series_map_to_the_readings_the_table_says():
    mapped = {
        (metric, value): name
        for metric, (_, by_value) in prometheus._FIELDS.items()
        for value, name in by_value.items()
    }
    assert mapped == {(r.agent.metric, r.agent.value): r.name for r in READINGS if r.agent is not None}
    assert prometheus._BOOLS == {r.name for r in READINGS if r.kind is Kind.FLAG}
    assert prometheus._ACTIVITY_FIELDS == {r.activity: r.name for r in READINGS if r.activity}


def test_every_agent_series_of_the_table_is_one_the_agent_exports():
    values = {r.name: int(_inside(r)) if r.kind is not Kind.LEVEL else _inside(r) for r in READINGS}
    gpu = replace(healthy(0), **{k: v for k, v in values.items() if k != "up"})
    text = render(NodeSnapshot("n0", T0, (gpu,)), AgentHealth(node="n0", version="t", nvml_up=True)).decode()
    for r in READINGS:
        if r.agent is None:
            continue
        label = "" if r.agent.label is None else rf'[^}}]*\b{r.agent.label}="{r.agent.value}"'
        assert re.search(rf"^{r.agent.metric}\{{{label}[^}}]*\}} ", text, re.M), r.agent


def test_the_dcgm_metrics_map_to_the_readings_the_table_says_with_their_scale_rank_and_blank():
    want = {
        f.metric: dcgm.Reading(r.name, f.scale, f.rank, counter=r.kind is Kind.COUNTER)
        for r in READINGS
        for f in r.dcgm
    }
    assert dict(dcgm.READINGS) == want
    assert dcgm.BOOLS == {r.name for r in READINGS if r.kind is Kind.FLAG}
    for r in READINGS:
        assert set(dcgm.metrics_for(r.name)) == {f.metric for f in r.dcgm}


# -- one row added reaches every derived structure ----------------------------------------------------


def test_a_row_added_to_the_table_is_decoded_range_checked_kept_and_mapped_from_both_schemas():
    gpu = msgspec.json.Decoder(contract.gpu_struct(EXTENDED))
    row = msgspec.structs.astuple(gpu.decode(b'{"index": 0, "uuid": "u", "model": "m", "nvlink_crc_errors_total": 7}'))
    assert row[contract.field_order(EXTENDED).index("nvlink_crc_errors_total")] == 7
    with pytest.raises(msgspec.ValidationError, match="nvlink_crc_errors_total"):
        gpu.decode(b'{"index": 0, "uuid": "u", "model": "m", "nvlink_crc_errors_total": -1}')
    assert windows.event_counters(EXTENDED)[-1] is NVLINK_CRC
    assert prometheus.agent_fields(EXTENDED)["gpufleet_gpu_nvlink_crc_errors_total"] == (
        None,
        {None: "nvlink_crc_errors_total"},
    )
    assert dcgm.dcgm_readings(EXTENDED)["DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"] == dcgm.Reading(
        "nvlink_crc_errors_total", counter=True
    )
    # What the server derives from the shipped table is exactly what these builders make of it.
    assert contract.GPU_FIELD_ORDER == contract.field_order(READINGS)
    assert prometheus._FIELDS == prometheus.agent_fields(READINGS)
    assert windows.ROWS == windows.binned_rows(READINGS)


@pytest.mark.parametrize(
    "bad, reason",
    [
        (READINGS + (READINGS[1],), "listed twice"),
        ((Reading("x_ratio", "ratio", Kind.LEVEL),), "no limits"),
        ((Reading("x", "", Kind.FLAG, (0.0, 1.0)),), "no limits"),
        ((Reading("x_total", "errors", Kind.COUNTER, (0.0, 1.0), Window.EVENTS),), "event kind"),
        ((Reading("x_ratio", "ratio", Kind.LEVEL, (0.0, 1.0), Window.EVENTS, event="x"),), "counter"),
        ((Reading("x_ratio", "ratio", Kind.LEVEL, (0.0, 1.0), clamp=2.0),), "clamp"),
        ((replace(NVLINK_CRC, name="a"), replace(NVLINK_CRC, name="b")), "dcgm-exporter metric listed twice"),
    ],
)
def test_a_table_that_cannot_be_derived_from_is_refused_naming_why(bad: tuple[Reading, ...], reason: str):
    with pytest.raises(ValueError, match=reason):
        check(bad)


def test_an_agent_metric_told_apart_by_two_labels_is_refused():
    a = replace(NVLINK_CRC, agent=AgentSeries("m", "type", "a"))
    b = replace(NVLINK_CRC, name="other_total", dcgm=(), agent=AgentSeries("m", "kind", "b"))
    with pytest.raises(ValueError, match="told apart"):
        prometheus.agent_fields((a, b))


def test_units_are_in_the_names():
    for r in READINGS:
        assert not r.unit or r.unit in r.name.split("_"), r.name
        assert r.name.endswith("_total") == (r.kind is Kind.COUNTER), r.name
