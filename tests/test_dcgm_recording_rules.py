"""deploy/prometheus/dcgm-recording-rules.yaml under `promtool test rules`: dcgm-exporter's series recorded under
gpufleet's names, labels and units, marked so that the server does not read them twice, and nothing recorded
for a reading dcgm-exporter does not export."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.agent.running import PROMTOOL, requires_promtool

RULES = Path(__file__).resolve().parents[1] / "deploy" / "prometheus" / "dcgm-recording-rules.yaml"
DCGM = (
    'gpu="3", UUID="GPU-5e1a", pci_bus_id="00000000:4C:00.0", device="nvidia3", '
    'modelName="NVIDIA H100 80GB HBM3", Hostname="node-a", DCGM_FI_DRIVER_VERSION="550.90.07", '
    'hpc_job="71001", instance="node-a:9400", job="dcgm-exporter"'
)
OURS = (
    'gpu="3", uuid="GPU-5e1a", model="NVIDIA H100 80GB HBM3", node="node-a", hpc_job="71001", '
    'instance="node-a:9400", job="dcgm-exporter", gpufleet_recorded_from="dcgm"'
)


def run_promtool(tmp_path: Path, series: dict[str, str], expected: list[dict]) -> subprocess.CompletedProcess:
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(RULES)],
                "evaluation_interval": "1m",
                "tests": [
                    {
                        "interval": "1m",
                        "input_series": [{"series": k, "values": v} for k, v in series.items()],
                        "promql_expr_test": expected,
                    }
                ],
            }
        )
    )
    return subprocess.run(
        [PROMTOOL, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )


def at_5m(expr: str, labels: str, value: float) -> dict:
    """One expected sample at 5 m; a selector's (not a function's) keeps its metric name."""
    name = expr.split("{")[0].split(" ")[0]
    if "(" not in expr:
        labels = f'__name__="{name}", ' + labels
    return {"expr": expr, "eval_time": "5m", "exp_samples": [{"labels": "{" + labels + "}", "value": value}]}


STOCK = {
    f"DCGM_FI_DEV_GPU_TEMP{{{DCGM}}}": "71x10",
    f"DCGM_FI_DEV_MEMORY_TEMP{{{DCGM}}}": "65x10",
    f"DCGM_FI_DEV_POWER_USAGE{{{DCGM}}}": "652.5x10",
    f"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{DCGM}}}": "1000000+39150000x10",  # 652.5 W for a minute, in mJ
    f"DCGM_FI_DEV_SM_CLOCK{{{DCGM}}}": "1980x10",
    f"DCGM_FI_DEV_MEM_CLOCK{{{DCGM}}}": "2619x10",
    f"DCGM_FI_DEV_GPU_UTIL{{{DCGM}}}": "97x10",
    f"DCGM_FI_DEV_ROW_REMAP_FAILURE{{{DCGM}}}": "0x10",
}
EXPECTED = [
    at_5m("gpufleet_gpu_temperature_celsius", OURS, 71),
    at_5m("gpufleet_gpu_memory_temperature_celsius", OURS, 65),
    at_5m("gpufleet_gpu_power_watts", OURS, 652.5),
    at_5m("rate(gpufleet_gpu_energy_joules_total[3m])", OURS, 652.5),  # mJ -> J
    at_5m('gpufleet_gpu_clock_hertz{clock="sm"}', OURS + ', clock="sm"', 1.98e9),  # MHz -> Hz
    at_5m('gpufleet_gpu_clock_hertz{clock="memory"}', OURS + ', clock="memory"', 2.619e9),
    at_5m("gpufleet_gpu_utilization_ratio", OURS, 0.97),  # % -> ratio
    at_5m("gpufleet_gpu_remapped_rows_failure", OURS, 0),
    at_5m("gpufleet_gpu_up", OURS, 1),
    at_5m(
        "gpufleet_gpu_job_info",
        'node="node-a", gpu="3", uuid="GPU-5e1a", hpc_job="71001", gpufleet_recorded_from="dcgm"',
        1,
    ),
    # Not in the stock counters: nothing recorded, so the panels say what they need instead of a wrong 0.
    {"expr": "gpufleet_gpu_sm_active_ratio", "eval_time": "5m", "exp_samples": []},
    {"expr": "gpufleet_gpu_throttle_reason", "eval_time": "5m", "exp_samples": []},
    {"expr": "gpufleet_gpu_temperature_limit_celsius", "eval_time": "5m", "exp_samples": []},
    {"expr": "gpufleet_gpu_pod_info", "eval_time": "5m", "exp_samples": []},  # no pod mapping
]


@requires_promtool
def test_stock_dcgm_series_are_recorded_in_gpufleet_names_labels_and_units(tmp_path: Path) -> None:
    done = run_promtool(tmp_path, STOCK, EXPECTED)
    assert done.returncode == 0, done.stdout + done.stderr


@requires_promtool
def test_profiling_and_throttle_fields_are_recorded_where_exported(tmp_path: Path) -> None:
    series = {
        **STOCK,
        f"DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{DCGM}}}": "0.91x10",
        f"DCGM_FI_PROF_SM_ACTIVE{{{DCGM}}}": "0.74x10",
        f"DCGM_FI_DEV_CLOCKS_EVENT_REASONS{{{DCGM}}}": "72x10",  # 0x48: hw_slowdown + hw_thermal
        f"DCGM_FI_DEV_SLOWDOWN_TEMP{{{DCGM}}}": "87x10",
    }
    reason = OURS
    expected = [
        at_5m("gpufleet_gpu_utilization_ratio", OURS, 0.91),  # the finer reading wins over GPU_UTIL's 97 %
        at_5m("gpufleet_gpu_sm_active_ratio", OURS, 0.74),
        at_5m("gpufleet_gpu_temperature_limit_celsius", OURS + ', limit="slowdown"', 87),
        {
            "expr": "gpufleet_gpu_throttle_reason == 1",
            "eval_time": "5m",
            "exp_samples": [
                {
                    "labels": '{__name__="gpufleet_gpu_throttle_reason", ' + reason + ', reason="hw_slowdown"}',
                    "value": 1,
                },
                {
                    "labels": '{__name__="gpufleet_gpu_throttle_reason", ' + reason + ', reason="hw_thermal_slowdown"}',
                    "value": 1,
                },
            ],
        },
    ]
    done = run_promtool(tmp_path, series, expected)
    assert done.returncode == 0, done.stdout + done.stderr


@requires_promtool
def test_the_pod_dcgm_exporter_maps_a_gpu_to_is_recorded_for_the_kube_state_metrics_join(tmp_path: Path) -> None:
    pod = 'namespace="research", pod="llama-0", container="trainer"'
    series = {f"DCGM_FI_DEV_GPU_TEMP{{{DCGM}, {pod}}}": "71x10"}
    expected = [
        at_5m(
            "gpufleet_gpu_pod_info",
            'node="node-a", gpu="3", uuid="GPU-5e1a", namespace="research", '
            'pod="llama-0", gpufleet_recorded_from="dcgm"',
            1,
        )
    ]
    done = run_promtool(tmp_path, series, expected)
    assert done.returncode == 0, done.stdout + done.stderr


@requires_promtool
def test_dcgm_blanks_are_not_recorded(tmp_path: Path) -> None:
    series = {
        **STOCK,
        f"DCGM_FI_DEV_MEMORY_TEMP{{{DCGM}}}": "9223372036854775794x10",  # no HBM sensor
        f"DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{DCGM}}}": "140737488355328x10",
    }
    expected = [
        {"expr": "gpufleet_gpu_memory_temperature_celsius", "eval_time": "5m", "exp_samples": []},
        at_5m("gpufleet_gpu_utilization_ratio", OURS, 0.97),
        at_5m("gpufleet_gpu_temperature_celsius", OURS, 71),
    ]
    done = run_promtool(tmp_path, series, expected)
    assert done.returncode == 0, done.stdout + done.stderr


@requires_promtool
def test_a_wrong_unit_fails(tmp_path: Path) -> None:
    done = run_promtool(tmp_path, STOCK, [at_5m('gpufleet_gpu_clock_hertz{clock="sm"}', OURS + ', clock="sm"', 1980)])
    assert done.returncode != 0
