"""Configuration: precedence flag > env > file > default, validation with a one-line error and exit 2."""

from __future__ import annotations


import pytest

from gpufleet.agent.cli import main
from gpufleet.agent.config import AgentConfig, ConfigError, default_node, env_name, load_config


# main() points the root logger at stderr with its own level (see conftest.py).
pytestmark = pytest.mark.usefixtures("restore_logging")


def test_defaults():
    cfg = load_config([], environ={})
    assert cfg == AgentConfig()
    assert (cfg.listen_host, cfg.listen_port, cfg.sample_interval, cfg.snapshots_retention) == ("", 9471, 1.0, 300.0)
    assert cfg.procfs == "/proc" and cfg.log_format == "json" and not cfg.once and not cfg.nvlink_per_link


def test_env_name_spelling():
    assert env_name("web.listen-address") == "GPUFLEET_AGENT_WEB_LISTEN_ADDRESS"
    assert env_name("nvlink.per-link") == "GPUFLEET_AGENT_NVLINK_PER_LINK"


def test_precedence_flag_over_env_over_file(tmp_path):
    f = tmp_path / "agent.yaml"
    f.write_text(
        "sample.interval: 5\nnode: from-file\nlog.level: debug\nnvlink.per-link: true\n"
        "web.listen-address: '127.0.0.1:9500'\n"
    )
    env = {"GPUFLEET_AGENT_SAMPLE_INTERVAL": "2.5", "GPUFLEET_AGENT_NODE": "from-env"}
    cfg = load_config(["--config.file", str(f), "--node", "from-flag"], environ=env)
    assert cfg.node == "from-flag"
    assert cfg.sample_interval == 2.5
    assert cfg.log_level == "debug" and cfg.nvlink_per_link is True
    assert (cfg.listen_host, cfg.listen_port) == ("127.0.0.1", 9500)
    assert cfg.config_file == str(f)


def test_config_file_from_env(tmp_path):
    f = tmp_path / "a.yaml"
    f.write_text("snapshots.retention: 600\n")
    assert load_config([], environ={"GPUFLEET_AGENT_CONFIG_FILE": str(f)}).snapshots_retention == 600


def test_bool_flags_and_env():
    assert load_config(["--once", "--nvlink.per-link"], environ={}).once
    assert load_config([], environ={"GPUFLEET_AGENT_ONCE": "yes"}).once
    assert not load_config([], environ={"GPUFLEET_AGENT_NVLINK_PER_LINK": "0"}).nvlink_per_link


def test_job_variables_from_flag_environment_and_file(tmp_path):
    assert load_config([], environ={}).hpc_job_env_vars == ("SLURM_JOB_ID", "GPUFLEET_JOB")
    flag = load_config(["--hpc-job-env-vars", "TEAM_JOB, SLURM_JOB_ID,TEAM_JOB"], environ={})
    assert flag.hpc_job_env_vars == ("TEAM_JOB", "SLURM_JOB_ID")  # order kept, repeats dropped
    env = load_config([], environ={"GPUFLEET_AGENT_HPC_JOB_ENV_VARS": "GPUFLEET_JOB"})
    assert env.hpc_job_env_vars == ("GPUFLEET_JOB",)
    f = tmp_path / "agent.yaml"
    f.write_text("hpc-job-env-vars: [GPUFLEET_JOB, SLURM_JOB_ID]\n")
    assert load_config(["--config.file", str(f)], environ={}).hpc_job_env_vars == ("GPUFLEET_JOB", "SLURM_JOB_ID")


@pytest.mark.parametrize(
    "addr,expected",
    [
        (":9471", ("", 9471)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::1]:9000", ("::1", 9000)),
        ("node1.example:80", ("node1.example", 80)),
    ],
)
def test_listen_addresses(addr, expected):
    cfg = load_config(["--web.listen-address", addr], environ={})
    assert (cfg.listen_host, cfg.listen_port) == expected


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--sample.interval", "0"], "--sample.interval"),
        (["--sample.interval", "fast"], "--sample.interval"),
        (["--sample.interval", "nan"], "--sample.interval"),
        (["--snapshots.retention", "60"], "--snapshots.retention: must be between 120"),
        (["--web.listen-address", "9471"], "--web.listen-address"),
        (["--web.listen-address", ":70000"], "--web.listen-address"),
        (["--web.listen-address", "::1:80"], "--web.listen-address"),
        (["--log.level", "loud"], "--log.level"),
        (["--log.format", "xml"], "--log.format"),
        (["--simulate.seed", "1.5"], "--simulate.seed"),
        (["--node", "two words"], "--node"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--sample.interval"], "--sample.interval"),
        (["--hpc-job-env-vars", "SLURM-JOB-ID"], "--hpc-job-env-vars: 'SLURM-JOB-ID' is not an environment variable"),
        (["--hpc-job-env-vars", "A,,B"], "--hpc-job-env-vars: must not be empty"),
        (["--hpc-job-env-vars", " "], "--hpc-job-env-vars: must not be empty"),
    ],
)
def test_bad_flags_name_themselves(argv, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(argv, environ={})
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_bad_env_names_the_variable():
    with pytest.raises(ConfigError, match="^GPUFLEET_AGENT_SAMPLE_INTERVAL: "):
        load_config([], environ={"GPUFLEET_AGENT_SAMPLE_INTERVAL": "-1"})


@pytest.mark.parametrize(
    "content,fragment",
    [
        ("sample.interval: soon\n", "'sample.interval'"),
        ("bogus.key: 1\n", "unknown key 'bogus.key'"),
        ("- a\n- b\n", "must hold a mapping"),
        ("a: [unclosed\n", "not valid YAML"),
        ("once: maybe\n", "'once'"),
        ("node: {a: 1}\n", "'node'"),
        ("hpc-job-env-vars: []\n", "'hpc-job-env-vars': must name at least one variable"),
        ("hpc-job-env-vars: [1JOB]\n", "'hpc-job-env-vars': '1JOB' is not an environment variable name"),
    ],
)
def test_bad_file_entries(tmp_path, content, fragment):
    f = tmp_path / "c.yaml"
    f.write_text(content)
    with pytest.raises(ConfigError) as info:
        load_config(["--config.file", str(f)], environ={})
    assert fragment in str(info.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="--config.file: cannot read"):
        load_config(["--config.file", str(tmp_path / "nope.yaml")], environ={})


def test_empty_config_file_is_fine(tmp_path):
    f = tmp_path / "empty.yaml"
    f.write_text("")
    assert load_config(["--config.file", str(f)], environ={}).sample_interval == 1.0


def test_main_exits_2_with_one_line(capsys):
    assert main(["--sample.interval", "-3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpufleet-agent: error: --sample.interval")


def test_main_help_exits_0(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in (
        "--web.listen-address",
        "--sample.interval",
        "--simulate.epoch",
        "--hpc-job-mapping-dir",
        "--path.procfs",
        "--nvlink.per-link",
        "--record",
        "--once",
        "--config.file",
    ):
        assert flag in out


def test_default_node_is_short_hostname():
    assert default_node(lambda: "dgx-017.cluster.local") == "dgx-017"
    assert default_node(lambda: "") == "localhost"


@pytest.mark.parametrize("value, fraction", [("0.003", 0.003), ("0.3%", 0.003), ("2%", 0.02), ("1", 1.0)])
def test_cpu_budget_as_a_fraction_or_a_percentage(value, fraction):
    assert load_config(["--sampling.cpu-budget", value], environ={}).sampling_cpu_budget == pytest.approx(fraction)


@pytest.mark.parametrize("value", ["0", "-0.1", "150%", "lots", "nan"])
def test_bad_cpu_budget_is_one_line_naming_the_flag(value):
    with pytest.raises(ConfigError, match="^--sampling.cpu-budget: ") as info:
        load_config(["--sampling.cpu-budget", value], environ={})
    assert "\n" not in str(info.value)


def test_cpu_budget_from_the_config_file_and_nvml_costs_switch(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text("sampling.cpu-budget: 0.005\nsimulate.nvml-costs: true\n")
    config = load_config(["--config.file", str(path)], environ={})
    assert config.sampling_cpu_budget == 0.005 and config.simulate_nvml_costs is True
    assert load_config([], environ={}).simulate_nvml_costs is False


def test_kubernetes_attribution_from_flag_environment_and_file(tmp_path):
    cfg = load_config([], environ={})
    assert (cfg.pod_resources_socket, cfg.pod_labels, cfg.pod_resources_refresh) == (None, "api-server", 5.0)
    f = tmp_path / "agent.yaml"
    f.write_text("kubernetes.pod-resources-socket: /run/k/kubelet.sock\nkubernetes.refresh-interval: 30s\n")
    env = {"GPUFLEET_AGENT_KUBERNETES_POD_LABELS": "pod-name", "GPUFLEET_AGENT_KUBERNETES_REFRESH_INTERVAL": "10"}
    cfg = load_config(["--config.file", str(f), "--kubernetes.refresh-interval", "1m"], environ=env)
    assert (cfg.pod_resources_socket, cfg.pod_labels, cfg.pod_resources_refresh) == (
        "/run/k/kubelet.sock",
        "pod-name",
        60.0,
    )
    with pytest.raises(ConfigError, match="kubernetes.pod-labels"):
        load_config(["--kubernetes.pod-labels", "kubelet"], environ={})
    with pytest.raises(ConfigError, match="kubernetes.refresh-interval"):
        load_config(["--kubernetes.refresh-interval", "0.1"], environ={})
