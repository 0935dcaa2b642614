"""Reading NVIDIA dcgm-exporter's series from Prometheus: its names, labels and units become contract readings,
a GPU an agent also reports is read once (from the agent), what stock counters lack is said once, and a
source that finds nothing usable says so within the cycle."""

from __future__ import annotations

import logging

import pytest

from gpufleet.server.ingest.dcgm import READINGS
from gpufleet.server.ingest.prometheus import selector
from tests.server.test_prometheus_source import FakePrometheus, gpu_series, make_source, run

MODEL = "NVIDIA H100 80GB HBM3"
# dcgm-exporter's stock counters (etc/default-counters.csv), as (metric, value in its own unit)
STOCK = {
    "DCGM_FI_DEV_SM_CLOCK": 1980.0,
    "DCGM_FI_DEV_MEM_CLOCK": 2619.0,
    "DCGM_FI_DEV_MEMORY_TEMP": 61.0,
    "DCGM_FI_DEV_GPU_TEMP": 71.0,
    "DCGM_FI_DEV_POWER_USAGE": 652.5,
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 7.5e9,
    "DCGM_FI_DEV_GPU_UTIL": 97.0,
    "DCGM_FI_DEV_MEM_COPY_UTIL": 40.0,
    "DCGM_FI_DEV_XID_ERRORS": 0.0,
    "DCGM_FI_DEV_FB_FREE": 1200.0,
    "DCGM_FI_DEV_FB_USED": 80000.0,
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0.0,
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 0.0,
}


def dcgm_labels(host: str, gpu: int, name: str, **extra: str) -> dict:
    """The labels dcgm-exporter 4.x puts on a GPU's series, with the target labels Prometheus adds."""
    return {
        "__name__": name,
        "gpu": str(gpu),
        "UUID": f"GPU-{host}-{gpu}",
        "pci_bus_id": f"00000000:{gpu + 0x18:02X}:00.0",
        "device": f"nvidia{gpu}",
        "modelName": MODEL,
        "Hostname": host,
        "DCGM_FI_DRIVER_VERSION": "550.90.07",
        "instance": f"{host}:9400",
        "job": "dcgm-exporter",
        **extra,
    }


def dcgm_series(
    host: str, gpu: int, times: list[float], values: dict[str, float] | None = None, **extra: str
) -> list[dict]:
    """What Prometheus holds for one GPU scraped from dcgm-exporter at `times` (only the metrics it reads)."""
    out = []
    for name, value in {**STOCK, **(values or {})}.items():
        if name in READINGS:
            out.append({"metric": dcgm_labels(host, gpu, name, **extra), "values": [[t, repr(value)] for t in times]})
    return out


def test_a_mig_instances_series_are_not_taken_for_the_gpus() -> None:
    # dcgm-exporter labels the series of a MIG GPU instance GPU_I_ID, beside the GPU's own, same gpu and UUID.
    prom = FakePrometheus()
    whole, instance = {"DCGM_FI_PROF_SM_ACTIVE": 0.9}, {"DCGM_FI_PROF_SM_ACTIVE": 0.3}
    prom.stored = dcgm_series("node-a", 0, [990.0], whole) + [
        s
        for s in dcgm_series("node-a", 0, [990.0], instance, GPU_I_ID="7", GPU_I_PROFILE="1g.10gb")
        if s["metric"]["__name__"] in instance
    ]
    src, _ = make_source(prom)

    (sample,) = run(src.pull_once()).samples

    assert sample.value(0, "sm_active_ratio") == pytest.approx(0.9)


def test_stock_counters_become_contract_readings_in_contract_units() -> None:
    prom = FakePrometheus()
    prom.stored = dcgm_series("node-a", 0, [990.0], hpc_job="71001") + dcgm_series("node-a", 1, [990.0])
    src, _ = make_source(prom)

    (sample,) = run(src.pull_once()).samples

    assert sample.node == "node-a" and sample.time == 990.0
    assert sample.indices == (0, 1) and sample.uuids == ("GPU-node-a-0", "GPU-node-a-1")
    assert sample.models == (MODEL, MODEL) and sample.jobs == ("71001", None)
    assert sample.value(0, "temperature_celsius") == 71.0
    assert sample.value(0, "memory_temperature_celsius") == 61.0
    assert sample.value(0, "power_watts") == 652.5
    assert sample.value(0, "energy_joules_total") == pytest.approx(7.5e6)  # mJ -> J
    assert sample.value(0, "sm_clock_hertz") == pytest.approx(1.98e9)  # MHz -> Hz
    assert sample.value(0, "utilization_ratio") == pytest.approx(0.97)  # % -> ratio
    assert sample.value(0, "remapped_rows_failure") == 0.0
    # What stock counters do not carry is unsupported (absent), never 0.
    for field in (
        "sm_active_ratio",
        "throttle_reasons",
        "slowdown_temperature_celsius",
        "sm_clock_max_hertz",
        "power_limit_watts",
        "ecc_uncorrected_errors_total",
        "memory_max_operating_temperature_celsius",
    ):
        assert sample.value(0, field) is None, field
    assert not src.errors and src.blind is None


def test_profiling_counters_are_preferred_where_exported() -> None:
    prom = FakePrometheus()
    prom.stored = dcgm_series(
        "node-a",
        0,
        [990.0],
        {
            "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.93,
            "DCGM_FI_PROF_SM_ACTIVE": 0.71,
            "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 0x40,
            "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": 0x0,
            "DCGM_FI_DEV_SLOWDOWN_TEMP": 87.0,
            "DCGM_FI_DEV_MAX_SM_CLOCK": 1980.0,
        },
    )
    src, _ = make_source(prom)

    (sample,) = run(src.pull_once()).samples

    assert sample.value(0, "utilization_ratio") == pytest.approx(0.93)  # GR engine active over GPU_UTIL's 97 %
    assert sample.value(0, "sm_active_ratio") == pytest.approx(0.71)
    assert sample.value(0, "throttle_reasons") == 0x40  # DCGM 3.3+'s name over the old one
    assert sample.value(0, "slowdown_temperature_celsius") == 87.0
    assert sample.value(0, "sm_clock_max_hertz") == pytest.approx(1.98e9)
    assert ("sm_active_ratio", "straggler") not in {(r, d) for r, d, _ in src.missing}


def test_the_last_xid_gauge_counts_each_new_code_from_the_first_sight() -> None:
    prom = FakePrometheus()
    codes = {990.0: 31.0, 995.0: 31.0, 1000.0: 79.0, 1005.0: 0.0, 1010.0: 48.0}
    for t, code in codes.items():
        prom.stored += dcgm_series("node-a", 0, [t], {"DCGM_FI_DEV_XID_ERRORS": code})
    src, now = make_source(prom)
    seen = []
    for at in (992.0, 997.0, 1002.0, 1007.0, 1012.0):
        now[0] = at
        seen += [(s.value(0, "last_xid"), s.value(0, "xid_errors_total")) for s in run(src.pull_once()).samples]

    # 31 was there before we watched: not counted. 79 and 48 are new; 0 (no XID since a reset) is not one.
    assert seen == [(31.0, 0.0), (31.0, 0.0), (79.0, 1.0), (0.0, 1.0), (48.0, 2.0)]


def test_a_gpu_with_both_an_agent_and_dcgm_exporter_is_read_once_from_its_agent() -> None:
    prom = FakePrometheus()
    agent = gpu_series("dgx-01", 0, [990.0])
    for s in agent:
        s["metric"]["uuid"] = "GPU-shared"
    twin = dcgm_series("dgx-01", 0, [990.5])
    for s in twin:
        s["metric"]["UUID"] = "GPU-shared"
    prom.stored = agent + twin + dcgm_series("dgx-02", 0, [991.0])
    src, _ = make_source(prom)

    samples = run(src.pull_once()).samples

    assert [(s.node, s.uuids) for s in samples] == [("dgx-01", ("GPU-shared",)), ("dgx-02", ("GPU-dgx-02-0",))]
    assert samples[0].value(0, "temperature_celsius") == 70.0  # the agent's, not dcgm's 71
    assert samples[1].value(0, "temperature_celsius") == 71.0


def test_a_schema_asks_for_its_own_series_only_and_recorded_copies_never() -> None:
    assert "DCGM_FI_DEV_GPU_TEMP" not in selector("gpufleet") and "gpufleet_gpu_up" in selector("gpufleet")
    assert "DCGM_FI_DEV_GPU_TEMP" in selector("dcgm") and "gpufleet_gpu_up" not in selector("dcgm")
    assert "DCGM_FI_DEV_GPU_TEMP" in selector("auto") and "gpufleet_gpu_up" in selector("auto")
    for schema in ("auto", "gpufleet", "dcgm"):
        assert selector(schema).endswith(', gpufleet_recorded_from=""}')
    prom = FakePrometheus()
    src, _ = make_source(prom, schema="dcgm")
    run(src.pull_once())
    assert prom.queries[0][0].startswith(selector("dcgm"))
    with pytest.raises(ValueError, match="schema"):
        make_source(prom, schema="nvidia")


def test_what_stock_counters_lack_is_said_once_per_detector(caplog) -> None:
    prom = FakePrometheus()
    prom.stored = dcgm_series("node-a", 0, [990.0, 995.0])
    src, now = make_source(prom)

    with caplog.at_level(logging.WARNING):
        run(src.pull_once())
        now[0] = 1005.0
        prom.stored += dcgm_series("node-a", 0, [1000.0])
        run(src.pull_once())

    lacking = {(r, d) for r, d, _ in src.missing}
    assert {
        ("throttle_reasons", "thermal_throttle"),
        ("slowdown_temperature_celsius", "thermal_throttle"),
        ("sm_clock_max_hertz", "straggler"),
        ("sm_active_ratio", "straggler"),
    } <= lacking
    logged = [
        (r.reading, r.detector) for r in caplog.records if r.getMessage() == "dcgm-exporter source lacks a reading"
    ]
    assert sorted(logged) == sorted(lacking)  # once each, not once per cycle
    (throttle,) = [
        r for r in caplog.records if getattr(r, "reading", None) == "throttle_reasons" and r.detector == "straggler"
    ]
    assert "DCGM_FI_DEV_CLOCKS_EVENT_REASONS" in throttle.export  # what to add to the counters file


def test_no_matching_series_is_blind_within_the_first_cycle(caplog) -> None:
    prom = FakePrometheus()
    prom.stored = [{"metric": {"__name__": "node_load1", "instance": "n:9100"}, "values": [[990.0, "1"]]}]
    prom.stored = []
    src, _ = make_source(prom)

    with caplog.at_level(logging.WARNING):
        result = run(src.pull_once())

    assert not result.samples
    assert src.blind is not None and src.blind.reason == "no_series"
    assert "DCGM_FI_" in src.blind.looked_for and "no series" in src.blind.found
    (record,) = [r for r in caplog.records if r.getMessage().startswith("ingest is blind")]
    assert record.reason == "no_series"
    assert src.blind_cycles == {"no_series": 1}
    # Series appear: no longer blind.
    prom.stored = dcgm_series("node-a", 0, [999.0])
    run(src.pull_once())
    assert src.blind is None and src.blind_cycles == {"no_series": 1}


def test_series_without_usable_labels_are_blind_and_say_what_was_found() -> None:
    prom = FakePrometheus()
    prom.stored = dcgm_series("node-a", 0, [990.0])
    for s in prom.stored:
        del s["metric"]["Hostname"], s["metric"]["UUID"]
    src, _ = make_source(prom)

    run(src.pull_once())

    assert src.blind.reason == "no_series" and src.blind.found.startswith(f"{len(prom.stored)} series, none")


def test_every_snapshot_rejected_is_blind() -> None:
    prom = FakePrometheus()
    prom.stored = dcgm_series("node-a", 0, [990.0], {"DCGM_FI_DEV_GPU_TEMP": 900.0})  # beyond any GPU
    src, _ = make_source(prom)

    result = run(src.pull_once())

    assert result.rejected_snapshots == 1 and src.blind.reason == "all_rejected"


def test_prometheus_down_is_blind() -> None:
    import httpx

    prom = FakePrometheus()
    prom.override = httpx.ConnectError("refused")
    src, _ = make_source(prom)

    run(src.pull_once())

    assert src.blind.reason == "source_down"


def test_a_scrape_interval_longer_than_the_cycle_is_not_blind_until_stale_after() -> None:
    prom = FakePrometheus()
    prom.stored = dcgm_series("node-a", 0, [990.0])  # scraped every 30 s: ranges of 15 s fall between
    src, now = make_source(prom, interval_seconds=5.0, stale_after_seconds=30.0)
    run(src.pull_once())
    blind = []
    for at in (1010.0, 1015.0, 1020.0, 1025.0, 1030.0, 1035.0):
        now[0] = at
        run(src.pull_once())
        blind.append(src.blind.reason if src.blind else None)
    assert blind == [None, None, None, None, None, "no_series"]  # 35 s without a usable series


def test_settings_choose_the_schema_and_refuse_it_without_a_prometheus(tmp_path) -> None:
    from gpufleet.server.serve import build_source
    from gpufleet.server.settings import ConfigError, load_settings

    settings = load_settings(
        [
            "--ingest.prometheus-url",
            "http://prom:9090",
            "--ingest.prometheus-schema",
            "dcgm",
            "--storage.path",
            str(tmp_path / "a.db"),
        ],
        env={},
    )
    source = build_source(settings)
    assert source.schema == "dcgm"
    run(source.aclose())
    assert load_settings(["--ingest.prometheus-url", "http://prom:9090"], env={}).prometheus_schema == "auto"
    with pytest.raises(ConfigError, match="ingest.prometheus-schema"):
        load_settings(["--ingest.prometheus-url", "http://prom:9090", "--ingest.prometheus-schema", "nvidia"], env={})
    with pytest.raises(ConfigError, match="set ingest.prometheus-url too"):
        load_settings(["--ingest.prometheus-schema", "dcgm", "--targets", "a:9471"], env={})


def test_dcgm_blanks_are_unsupported_readings_not_values() -> None:
    # A GPU without an HBM sensor: DCGM's "not supported" for a 64-bit field, as dcgm-exporter prints it;
    # a profiling field's double blank (2**47); a 32-bit field's blank.
    prom = FakePrometheus()
    prom.stored = dcgm_series(
        "node-a",
        0,
        [990.0],
        {
            "DCGM_FI_DEV_MEMORY_TEMP": 9223372036854775794.0,
            "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 140737488355328.0,
            "DCGM_FI_DEV_SM_CLOCK": float(0x7FFFFFF2),
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 2.5e12,
        },
    )
    src, _ = make_source(prom)

    result = run(src.pull_once())

    (sample,) = result.samples  # the snapshot is not refused for them
    assert sample.value(0, "memory_temperature_celsius") is None
    assert sample.value(0, "sm_clock_hertz") is None
    assert sample.value(0, "utilization_ratio") == pytest.approx(0.97)  # GPU_UTIL, the blank finer one aside
    assert sample.value(0, "energy_joules_total") == pytest.approx(2.5e9)  # a counter past 32 bits is a value
    assert sample.value(0, "temperature_celsius") == 71.0
