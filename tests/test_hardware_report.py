"""bench/hardware_report.py: what it says of a recorded trace, the report docs/hardware.md is written from."""

from __future__ import annotations

import json

from bench.hardware_report import capabilities, read_trace, report


def gpu(t: int, **readings) -> dict:
    base = {
        "index": 0,
        "uuid": "GPU-0",
        "model": "NVIDIA H100",
        "utilization_ratio": 0.0,
        "sm_active_ratio": 0.0,
        "energy_joules_total": 100.0 + t,
        "throttle_reasons": 0,
        "temperature_celsius": 40.0,
    }
    return {**base, **readings}


def lines_of(*gpus: dict) -> list[str]:
    return [
        json.dumps({"node": "n", "time": float(t), "driver_version": "580.1", "gpus": [g]}) for t, g in enumerate(gpus)
    ]


def test_a_clean_trace_lists_readings_and_what_was_never_present() -> None:
    text = "\n".join(
        report(
            read_trace(
                lines_of(
                    gpu(0),
                    gpu(
                        1,
                        utilization_ratio=0.9,
                        sm_active_ratio=0.7,
                        temperature_celsius=71.0,
                        hpc_job="n/localhost:29555",
                    ),
                )
            )
        )
    )
    assert "2 snapshots, 1 GPU(s)" in text and "driver 580.1" in text
    assert "job while busy: n/localhost:29555 (1/1 busy samples attributed)" in text
    assert "1 busy" in text and "PROBLEM" not in text
    temperature = next(line for line in text.splitlines() if line.startswith("temperature_celsius"))
    assert temperature.split()[1:] == ["2/2", "40", "71"]  # present, idle range, busy range
    never = next(line for line in text.splitlines() if line.startswith("never present")).split(": ")[1].split(", ")
    assert "power_watts" in never and "temperature_celsius" not in never


def test_broken_physics_is_called_out() -> None:
    text = "\n".join(
        report(
            read_trace(
                lines_of(
                    gpu(0, utilization_ratio=1.2),
                    gpu(1, utilization_ratio=0.8, sm_active_ratio=0.95, energy_joules_total=5.0, throttle_reasons=0x24),
                )
                + ["not json"]
            )
        )
    )
    assert "line 3: not JSON, skipped" in text
    assert "PROBLEM utilization_ratio outside 0-1: [1.2]" in text
    assert "PROBLEM sm_active_ratio above utilization_ratio in 1 busy sample(s)" in text
    assert "energy_joules_total went backwards 1 time(s)" in text
    assert "throttle reasons seen: SW_POWER_CAP, SW_THERMAL_SLOWDOWN" in text


def test_the_probe_verdicts_come_from_metrics() -> None:
    metrics = (
        "# TYPE gpufleet_gpu_reading_unsupported gauge\n"
        'gpufleet_gpu_reading_unsupported{gpu="0",reading="sm_active_ratio"} 1\n'
    )
    assert capabilities(metrics) == ["probe, GPU 0: unsupported sm_active_ratio"]
    assert capabilities("") == ["probe: every reading supported (no gpufleet_gpu_reading_unsupported series)"]


def test_the_probe_verdicts_of_an_older_agent() -> None:
    metrics = (
        "# TYPE gpufleet_gpu_reading_supported gauge\n"
        'gpufleet_gpu_reading_supported{gpu="0",reading="sm_active_ratio"} 0\n'
        'gpufleet_gpu_reading_supported{gpu="0",reading="power_watts"} 1\n'
    )
    assert capabilities(metrics) == ["probe, GPU 0: unsupported sm_active_ratio"]


def test_the_cost_report_says_whether_the_budget_holds() -> None:
    from bench.hardware_cost import budget

    # One real H100: 0.78 % of a core at 1 Hz for one GPU is far over 0.5 % for eight.
    assert budget({"gpus": 1, "idle_cpu_pct": 0.783}).endswith("0.5 % budget DOES NOT HOLD on this machine")
    assert "at most 6.264 % scaled to 8 GPUs" in budget({"gpus": 1, "idle_cpu_pct": 0.783})
    assert budget({"gpus": 8, "idle_cpu_pct": 0.466}).endswith("0.5 % budget HOLDS on this machine")
    assert budget({"name": "gpufleet-agent", "error": "never answered /metrics"}).startswith("budget: not measured")
