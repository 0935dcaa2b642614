"""The dcgm-exporter form of /metrics: counters files, the field table, units, labels, absent readings."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.agent.cli import _dcgm_families, main
from gpufleet.agent.config import ConfigError, load_config
from gpufleet.agent.dcgm_names import (
    FIELDS,
    LABEL_FIELDS,
    CountersError,
    DcgmFamilies,
    load_counters,
    parse_counters,
    unservable,
)
from gpufleet.agent.exposition import Renderer
from gpufleet.agent.health import AgentHealth
from gpufleet.agent.model import GpuSample, NodeSnapshot
from tests.agent.running import PROMTOOL, requires_promtool
from tests.agent.test_exposition import EXPECTED, fixed_health, fixed_snapshot
from tests.dcgm_exposition import Fleet, Gpu

# dcgm-exporter's etc/default-counters.csv: its fields and their types, in its order.
DCGM_EXPORTER_DEFAULT = (
    ("DCGM_FI_DEV_SM_CLOCK", "gauge"),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge"),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge"),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge"),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge"),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter"),
    ("DCGM_FI_DEV_PCIE_TX_THROUGHPUT", "counter"),
    ("DCGM_FI_DEV_PCIE_RX_THROUGHPUT", "counter"),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter"),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge"),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge"),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge"),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge"),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge"),
    ("DCGM_FI_DEV_FB_FREE", "gauge"),
    ("DCGM_FI_DEV_FB_USED", "gauge"),
    ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter"),
    ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "gauge"),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter"),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge"),
)
NOT_SERVED_BY_DEFAULT = ("DCGM_FI_DEV_VGPU_LICENSE_STATUS",)  # vGPU hosts only


def dcgm_body(snap: NodeSnapshot | None, health: AgentHealth, counters=None) -> bytes:
    return Renderer(families=DcgmFamilies(counters or load_counters())).render(snap, health)


def samples(body: bytes) -> dict[str, list]:
    """Samples by family name: the parser appends _total to a counter's samples, Prometheus does not."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(body.decode()):
        out.setdefault(family.name, []).extend(family.samples)
    return out


def types(body: bytes) -> dict[str, str]:
    return {line.split()[2]: line.split()[3] for line in body.decode().splitlines() if line.startswith("# TYPE")}


# --- the counters file ------------------------------------------------------------------------------------


def test_the_default_set_is_dcgm_exporters_default_counters():
    assert tuple((c.field, c.kind) for c in load_counters()) == DCGM_EXPORTER_DEFAULT
    assert unservable(load_counters()) == NOT_SERVED_BY_DEFAULT


def test_every_field_reads_a_snapshot_reading_that_exists():
    readings = set(GpuSample.__annotations__)
    for name, field in FIELDS.items():
        assert field.reading is None or field.reading in readings, name
        assert field.zero_if is None or field.zero_if in readings, name
        assert (field.reading is None) == bool(field.lacks), f"{name}: a row without a reading says what it lacks"
    for name, where in LABEL_FIELDS.items():
        if where is not None:
            scope, attr = where
            assert attr in (NodeSnapshot.__annotations__ if scope == "node" else GpuSample.__annotations__), name


def test_a_sites_own_file_chooses_the_set_its_types_and_help(tmp_path):
    path = tmp_path / "counters.csv"
    path.write_text(
        "# profiling and the driver\n"
        "DCGM_FI_PROF_SM_ACTIVE, gauge, SM activity, 0-1.\n"
        "DCGM_FI_DEV_GPU_TEMP ,gauge,Die temperature, in C.\n"
        "\n"
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL, counter, Uncorrected ECC errors.\n"
        "DCGM_FI_DRIVER_VERSION, label, Driver version\n"
        "DCGM_FI_DEV_POWER_VIOLATION, counter, Power throttling (us).\n"
        "DCGM_FI_DEV_BRAND, label, Brand\n"
    )
    counters = load_counters(str(path))
    assert [c.help for c in counters][:2] == ["SM activity, 0-1.", "Die temperature, in C."]
    assert unservable(counters) == ("DCGM_FI_DEV_POWER_VIOLATION", "DCGM_FI_DEV_BRAND")
    body = dcgm_body(fixed_snapshot(), fixed_health(), counters)
    assert {n for n in types(body) if n.startswith("DCGM")} == {
        "DCGM_FI_PROF_SM_ACTIVE",
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    }
    assert types(body)["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"] == "counter"
    assert b"# HELP DCGM_FI_DEV_GPU_TEMP Die temperature, in C.\n" in body
    temps = samples(body)["DCGM_FI_DEV_GPU_TEMP"]
    assert {s.labels["DCGM_FI_DRIVER_VERSION"] for s in temps} == {fixed_snapshot().driver_version}


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("DCGM_FI_DEV_GPU_TEMP gauge GPU temperature\n", "line 1: want 'DCGM FIELD, prometheus type, help'"),
        ("# c\nDCGM_FI_DEV_GPU_TEMP, histogram, t\n", "line 2: type must be gauge, counter, label"),
        ("gpu_temp, gauge, t\n", "line 1: 'gpu_temp' is not a DCGM field name"),
        (
            "DCGM_FI_DEV_GPU_TEMP, gauge, a\nDCGM_FI_DEV_GPU_TEMP, gauge, b\n",
            "line 2: DCGM_FI_DEV_GPU_TEMP is listed twice",
        ),
        ("# only comments\n\n", "lists no gauge or counter"),
        ("DCGM_FI_DRIVER_VERSION, label, v\n", "lists no gauge or counter"),
    ],
)
def test_a_bad_file_is_refused_with_the_line(text, fragment):
    with pytest.raises(CountersError) as err:
        parse_counters(text, "site.csv")
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("content", ["DCGM_FI_DEV_GPU_TEMP, gauges, t\n", None, b"\xff\xfe\x00"])
def test_a_bad_file_stops_the_agent_at_start_with_one_line_and_exit_2(capsys, tmp_path, content):
    path = tmp_path / "counters.csv"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    args = ["--once", "--simulate", "hgx-h100", "--metrics.names", "dcgm", "--metrics.dcgm-counters", str(path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpufleet-agent: error: --metrics.dcgm-counters: ") and err.count("\n") == 1, err


def test_a_counters_file_without_the_dcgm_names_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="needs --metrics.names dcgm"):
        load_config(["--metrics.dcgm-counters", str(tmp_path / "c.csv")], environ={})
    assert load_config(["--metrics.names", "DCGM"], environ={}).metrics_names == "dcgm"
    with pytest.raises(ConfigError):
        load_config(["--metrics.names", "nvidia"], environ={})


def test_fields_the_agent_cannot_serve_are_logged_once_at_start(caplog):
    config = load_config(["--metrics.names", "dcgm"], environ={})
    with caplog.at_level(logging.INFO, logger="gpufleet.agent.cli"):
        families = _dcgm_families(config)
        families(fixed_snapshot(), fixed_health())
        families(fixed_snapshot(), fixed_health())
    records = [r for r in caplog.records if "does not serve" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert records[0].counters == list(NOT_SERVED_BY_DEFAULT)  # type: ignore[attr-defined]


# --- the exposition -------------------------------------------------------------------------------------


def test_matches_expected_file():
    body = dcgm_body(fixed_snapshot(), fixed_health())
    expected = EXPECTED / "dcgm_snapshot.prom"
    if os.environ.get("GPUFLEET_UPDATE_EXPECTED"):
        expected.write_bytes(body)
    assert body == expected.read_bytes()


def test_dcgm_exporters_labels_and_units():
    snap = fixed_snapshot()
    by_name = samples(dcgm_body(snap, fixed_health()))
    g0 = snap.gpus[0]
    (clock,) = [s for s in by_name["DCGM_FI_DEV_SM_CLOCK"] if s.labels["gpu"] == "0"]
    assert clock.labels == {
        "gpu": "0",
        "UUID": g0.uuid,
        "pci_bus_id": g0.pci_bus_id,
        "device": "nvidia0",
        "modelName": g0.model,
        "Hostname": snap.node,
        "hpc_job": "4242",
        "namespace": "research",
        "pod": "llama-worker-3",
    }
    assert clock.value == pytest.approx(g0.sm_clock_hertz / 1e6)  # MHz
    value = {n: [s.value for s in by_name[n] if s.labels["gpu"] == "0"][0] for n in by_name if n.startswith("DCGM")}
    assert value["DCGM_FI_DEV_GPU_UTIL"] == pytest.approx(g0.utilization_ratio * 100)  # %
    assert value["DCGM_FI_DEV_FB_USED"] == pytest.approx(g0.memory_used_bytes / 2**20)  # MiB
    assert value["DCGM_FI_DEV_FB_FREE"] == pytest.approx(g0.memory_free_bytes / 2**20)
    assert value["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] == pytest.approx(g0.energy_joules_total * 1e3)  # mJ
    assert value["DCGM_FI_DEV_POWER_USAGE"] == g0.power_watts
    assert value["DCGM_FI_DEV_ROW_REMAP_FAILURE"] == float(g0.remapped_rows_failure)
    # Counters keep dcgm-exporter's names: no _total appended.
    assert types(dcgm_body(snap, fixed_health()))["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] == "counter"


def test_absent_readings_give_no_series():
    snap = fixed_snapshot()  # GPU 1 has no HBM sensor; GPU 2 is lost (every reading None)
    by_name = samples(dcgm_body(snap, fixed_health()))
    assert sorted(s.labels["gpu"] for s in by_name["DCGM_FI_DEV_MEMORY_TEMP"]) == ["0"]
    assert all(s.labels["gpu"] != "2" for name in by_name if name.startswith("DCGM") for s in by_name[name])
    # A field no GPU has leaves no HELP or TYPE either; a field the agent does not read, nothing at all.
    bare = dataclasses.replace(
        snap, gpus=tuple(dataclasses.replace(g, memory_temperature_celsius=None) for g in snap.gpus)
    )
    body = dcgm_body(bare, fixed_health())
    assert b"DCGM_FI_DEV_MEMORY_TEMP" not in body and b"DCGM_FI_DEV_ENC_UTIL" not in body


def test_the_last_xid_reads_0_until_one_comes_and_is_absent_without_xid_events():
    snap = fixed_snapshot()
    g0 = snap.gpus[0]
    cases = {"none yet": (None, 0, 0.0), "one came": (79, 1, 79.0), "no events": (None, None, None)}
    for name, (last, total, want) in cases.items():
        g = dataclasses.replace(g0, last_xid=last, xid_errors_total=total)
        got = samples(dcgm_body(dataclasses.replace(snap, gpus=(g,)), fixed_health())).get("DCGM_FI_DEV_XID_ERRORS")
        assert (got[0].value if got else None) == want, name


def test_nvml_down_serves_the_agents_health_alone():
    health = AgentHealth(node="n", version="0.1.0", nvml_up=False, nvml_error="NvmlUnavailable")
    body = dcgm_body(fixed_snapshot(), health)
    assert b"gpufleet_agent_nvml_up" in body and b"DCGM_" not in body and b"gpufleet_gpu_" not in body


# --- promtool -------------------------------------------------------------------------------------------


def promtool_findings(body: bytes) -> set[str]:
    """promtool check metrics' lint findings, each less its metric name; fails on a parse error."""
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=60)  # type: ignore[list-item]
    out = (done.stdout + done.stderr).decode()
    assert done.returncode in (0, 3), out  # 3: lint findings; anything else: the text does not parse
    return {line.split(" ", 1)[1] for line in out.splitlines() if line.strip()}


@requires_promtool
def test_promtool_finds_nothing_but_what_dcgm_exporters_own_names_carry():
    """dcgm-exporter's names are not lint-clean (`modelName` is camelCase, counters lack `_total`), and
    dashboards depend on them: the agent's dcgm form carries those two findings and nothing else, the same
    two that dcgm-exporter's own exposition carries (which has a third: DCGM_FI_DEV_PCIE_REPLAY_COUNTER's
    name holds its type)."""
    inherent = {
        "label names should be written in 'snake_case' not 'camelCase'",
        'counter metrics should have "_total" suffix',
    }
    agent = promtool_findings(dcgm_body(fixed_snapshot(), fixed_health()))
    dcgm_exporter = promtool_findings(Fleet({"node-a": "1"}, 2, lambda *_: Gpu()).scrape(0.0, 1.0, "node-a").encode())
    assert agent == inherent
    assert inherent < dcgm_exporter


def test_the_docs_tables_say_what_the_field_table_serves():
    """docs/agent.md lists every field of FIELDS once, served or "not yet" as FIELDS says, and the default
    set's table in the shipped file's order."""
    doc = (Path(__file__).parents[2] / "docs" / "agent.md").read_text()
    rows = [line.split("|")[1:-1] for line in doc.splitlines() if line.startswith("| `DCGM_FI_")]
    said = [(cells[0].strip().strip("`"), [c.strip() for c in cells]) for cells in rows]
    assert sorted(name for name, _ in said) == sorted(FIELDS)
    for name, cells in said:
        assert ("not yet" in cells or "no" in cells) == (FIELDS[name].reading is None), name
    default = [(name, cells[1]) for name, cells in said if len(cells) == 4]
    assert tuple(default) == DCGM_EXPORTER_DEFAULT
