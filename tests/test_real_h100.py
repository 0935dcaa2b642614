"""Real hardware in the suite: one NVIDIA H100 80GB HBM3, driver 580.159.04 (tests/fixtures/h100-driver-580:
the agent's snapshot and /metrics, its 83 s trace of 15 s idle, 45 s of bf16 matmuls and 15 s idle, and
bench/hardware_report.py's summary of it). The server reads what a real agent wrote, promtool accepts it,
replay runs over it, and the simulator's H100 reads what the real one read."""

from __future__ import annotations

import gzip
import re
import subprocess
from pathlib import Path

import orjson
import pytest

from bench.hardware_report import BUSY_UTILIZATION
from gpufleet.agent.nvml_reader import NvmlReader
from gpufleet.agent.sim import SimNvml, parse_scenario
from gpufleet.server.contract import parse_lines, parse_snapshot
from gpufleet.server.replay import run_replay
from tests.agent.running import PROMTOOL

FIXTURES = Path(__file__).parent / "fixtures" / "h100-driver-580"
H100_MEMORY_BYTES = 81559 * 1024 * 1024
# Sample-to-sample noise the simulator adds to idle power (physics.gpu_bucket): +-2 %.
SIM_NOISE = 0.02


def _trace_lines() -> list[bytes]:
    with gzip.open(FIXTURES / "trace.jsonl.gz", "rb") as fh:
        return [line for line in fh.read().splitlines() if line.strip()]


def _real_ranges() -> dict[str, dict[str, tuple[float, float]]]:
    """report.txt's table: reading -> {"idle": (low, high), "busy": (low, high)}; '-' rows left out."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for line in (FIXTURES / "report.txt").read_text().splitlines():
        parts = line.split()
        if len(parts) != 4 or not re.fullmatch(r"\d+/\d+", parts[1]) or "-" in (parts[2], parts[3]):
            continue
        ranges = {}
        for phase, text in (("idle", parts[2]), ("busy", parts[3])):
            low, _, high = text.partition("..")
            ranges[phase] = (float(low), float(high or low))
        out[parts[0]] = ranges
    return out


# --- the server reads a real agent ----------------------------------------------------------------------


def test_the_contract_parses_the_real_snapshot():
    payload = orjson.loads((FIXTURES / "snapshot.json").read_bytes())
    sample = parse_snapshot(payload)
    gpu = payload["gpus"][0]
    assert sample.node == "vm" and sample.models == ("NVIDIA H100 80GB HBM3",)
    for field in (
        "power_watts",
        "temperature_celsius",
        "sm_clock_hertz",
        "sm_clock_max_hertz",
        "power_limit_watts",
        "energy_joules_total",
        "memory_temperature_celsius",
        "throttle_reasons",
    ):
        assert sample.value(0, field) == pytest.approx(gpu[field]), field
    assert sample.value(0, "xid_errors_total") == 0.0
    # The one reading a one-GPU virtual machine lacks is absent, not 0.
    assert gpu["nvlink_tx_bytes_total"] is None


def test_the_contract_parses_every_line_of_the_real_trace():
    results = [r for _, r in parse_lines(_trace_lines())]
    assert len(results) == 84 and all(not isinstance(r, Exception) for r in results)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian package prometheus)")
@pytest.mark.parametrize("name", ["metrics-idle.txt", "metrics-load.txt"])
def test_promtool_accepts_the_real_metrics(name):
    result = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=(FIXTURES / name).read_bytes(), capture_output=True, timeout=60
    )
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
    assert b"gpufleet_gpu_power_watts{" in (FIXTURES / name).read_bytes()


def test_replay_over_the_real_trace_raises_no_alert():
    """One GPU alone (no peer to straggle behind), 61 C at most, SW_POWER_CAP at its 700 W limit while
    busy: nothing the engine should flag."""
    assert run_replay(_trace_lines()) == []


# --- the simulator reads what the real H100 read -------------------------------------------------------


def _sim_run() -> tuple[list, list, list]:
    """The real run on the simulator: one H100, 15 s idle, 45 s of matmuls on 0.95 GiB, 15 s idle, in a
    room at 30 C; the agent's own reader samples it every second. Dense bf16 matmuls want more power than
    a training step (compute_intensity 1.43 against 0.95: about 960 W at 1.98 GHz)."""
    scenario = parse_scenario(
        {
            "name": "h100-matmul",
            "duration_s": 75,
            "ambient_c": 30,
            "nodes": [{"name": "vm", "model": "h100-sxm", "gpus": 1}],
            "jobs": [
                {
                    "id": "matmul",
                    "nodes": ["vm"],
                    "start_s": 15,
                    "end_s": 60,
                    "step_time_s": 0.5,
                    "compute_fraction": 0.99,
                    "compute_intensity": 1.43,
                    "memory_used_gib": 0.95,
                    "ramp_up_s": 0,
                    "wind_down_s": 0,
                }
            ],
        }
    )
    epoch = 1_795_699_500.0
    now = [epoch]
    reader = NvmlReader(SimNvml(scenario, node="vm", clock=lambda: now[0], epoch=epoch))
    reader.open()
    samples = []
    try:
        for second in range(76):
            now[0] = epoch + second
            samples.append((second, reader.read()[0]))
    finally:
        reader.close()
    # Busy as report.txt counts it, within the job's span: the simulator's utilization is the past second's
    # mean, so the sample one second after the job ended still reads busy, with the memory freed.
    busy = [g for s, g in samples if (g.utilization_ratio or 0.0) > BUSY_UTILIZATION and s < 60]
    idle_before = [g for s, g in samples if s < 15]
    after = [g for s, g in samples if s > 60]
    return idle_before, busy, after


def _within(values: list[float], low: float, high: float, slack: float = 0.0) -> bool:
    return all(low * (1 - slack) <= v <= high * (1 + slack) for v in values)


def test_simulated_h100_idle_reads_in_the_real_idle_ranges():
    real = _real_ranges()
    idle, _, _ = _sim_run()
    assert len(idle) == 15
    assert _within([g.power_watts for g in idle], *real["power_watts"]["idle"], slack=SIM_NOISE)
    assert _within([g.temperature_celsius for g in idle], *real["temperature_celsius"]["idle"])
    assert _within([g.sm_clock_hertz for g in idle], *real["sm_clock_hertz"]["idle"])
    assert _within([g.memory_clock_hertz for g in idle], *real["memory_clock_hertz"]["idle"])
    assert _within([g.memory_used_bytes for g in idle], *real["memory_used_bytes"]["idle"])
    assert _within([g.power_limit_watts for g in idle], *real["power_limit_watts"]["idle"])
    assert _within([g.shutdown_temperature_celsius for g in idle], *real["shutdown_temperature_celsius"]["idle"])


def test_simulated_h100_busy_reads_in_the_real_busy_ranges():
    real = _real_ranges()
    _, busy, _ = _sim_run()
    assert len(busy) == 44
    low, high = real["memory_total_bytes"]["busy"]  # report.txt prints 4 significant digits
    assert (
        all(g.memory_total_bytes == H100_MEMORY_BYTES for g in busy)
        and low * 0.999 <= H100_MEMORY_BYTES <= high * 1.001
    )
    assert _within([g.memory_used_bytes for g in busy], *real["memory_used_bytes"]["busy"], slack=0.01)
    assert _within([g.memory_clock_hertz for g in busy], *real["memory_clock_hertz"]["busy"])
    assert _within([g.utilization_ratio for g in busy], *real["utilization_ratio"]["busy"])
    assert _within([g.sm_clock_max_hertz for g in busy], *real["sm_clock_max_hertz"]["busy"])
    assert _within([busy[-1].temperature_celsius], *real["temperature_celsius"]["busy"])


def test_simulated_h100_full_load_is_power_capped_like_the_real_one():
    """The load wants more than the 700 W limit: the governor lowers the SM clock until the power sits at
    it, says so with SW_POWER_CAP (0x4, and nothing else, as the real one read), and the driver's counter of
    time spent power-capped advances a second per second."""
    real = _real_ranges()
    _, busy, _ = _sim_run()
    assert _within([g.power_watts for g in busy], *real["power_watts"]["busy"])
    assert _within([g.sm_clock_hertz for g in busy], *real["sm_clock_hertz"]["busy"])
    real_reasons = int(real["throttle_reasons"]["busy"][0])
    assert real_reasons == 0x4 and {g.throttle_reasons for g in busy} == {real_reasons}
    capped = [g.throttle_seconds_total["sw_power_cap"] for g in busy]
    assert capped[-1] - capped[0] == pytest.approx(len(busy) - 1, abs=0.01)


def test_simulated_h100_heats_as_fast_as_the_real_one():
    """In the real busy range from the first second of load (the die heats within a second, as the real
    one did) to the last (the heatsink heats over minutes), and back in the real idle range, which holds
    the readings just after the load, within the first three seconds after it."""
    real = _real_ranges()
    _, busy, after = _sim_run()
    assert _within([g.temperature_celsius for g in busy], *real["temperature_celsius"]["busy"])
    assert _within([g.temperature_celsius for g in after[:3]], *real["temperature_celsius"]["idle"])
