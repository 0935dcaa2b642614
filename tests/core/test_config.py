"""One configuration syntax: the agent and the server read booleans, durations, sizes and listen addresses
alike, through gpufleet.config, and layer flags over environment over config file the same way."""

from __future__ import annotations

import pytest

from gpufleet.agent.config import load_config
from gpufleet.config import (
    ConfigError,
    format_address,
    layered,
    parse_bool,
    parse_duration,
    parse_listen_address,
    parse_size,
    read_config_file,
)
from gpufleet.server.settings import load_settings


@pytest.mark.parametrize(
    "text,value",
    [
        ("true", True),
        ("yes", True),
        ("on", True),
        ("1", True),
        ("ON", True),
        (True, True),
        ("false", False),
        ("no", False),
        ("off", False),
        ("0", False),
        ("Off", False),
        (False, False),
    ],
)
def test_booleans(text, value):
    assert parse_bool(text) is value


@pytest.mark.parametrize("text", ["maybe", "", "2", None])
def test_bad_booleans(text):
    with pytest.raises(ValueError, match="true or false"):
        parse_bool(text)


@pytest.mark.parametrize(
    "text,seconds",
    [
        ("1m30s", 90),
        ("500ms", 0.5),
        ("30", 30),
        ("2.5", 2.5),
        (2.5, 2.5),
        (3, 3),
        ("5s", 5),
        ("1h", 3600),
        ("1d", 86400),
        ("1w", 7 * 86400),
        ("1h30m", 5400),
        ("1m0s500ms", 60.5),
        ("0.5s", 0.5),
    ],
)
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["soon", "", "30s1m", "1m1m", "5 s", "-1", "1.5.2", "nan", "inf", "0", "0s", True])
def test_bad_durations(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_zero_duration_only_where_it_means_off():
    assert parse_duration("0s", allow_zero=True) == 0.0
    assert parse_duration("0", allow_zero=True) == 0.0


@pytest.mark.parametrize(
    "text,size",
    [
        ("4MiB", 4 * 1024**2),
        ("4MB", 4_000_000),
        ("4194304", 4194304),
        (512, 512),
        ("1GiB", 1024**3),
        ("10KB", 10_000),
        ("7B", 7),
    ],
)
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "0", "4 XB", "-1", "1.5MiB", True])
def test_bad_sizes(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize(
    "text,address",
    [
        (":9471", ("", 9471)),
        ("127.0.0.1:80", ("127.0.0.1", 80)),
        ("[::1]:9000", ("::1", 9000)),
        ("node.example:0", ("node.example", 0)),
    ],
)
def test_listen_addresses(text, address):
    assert parse_listen_address(text) == address
    assert parse_listen_address(format_address(*address)) == address


@pytest.mark.parametrize("text", ["9471", "::1:80", ":70000", "host:", "[]:80", "http://host:80"])
def test_bad_listen_addresses(text):
    with pytest.raises(ValueError):
        parse_listen_address(text)


def test_layers_flag_over_env_over_file_and_name_the_origin():
    parsers = {"pull.interval": parse_duration}
    assert layered(
        parsers,
        flags={"pull.interval": "1s"},
        environ={"X_PULL_INTERVAL": "2s"},
        env_prefix="X_",
        file_values={"pull.interval": "3s"},
        file_path="f.yaml",
    ) == {"pull.interval": 1.0}
    assert layered(
        parsers,
        flags={},
        environ={"X_PULL_INTERVAL": "2s"},
        env_prefix="X_",
        file_values={"pull.interval": "3s"},
        file_path="f.yaml",
    ) == {"pull.interval": 2.0}
    assert layered(parsers, flags={}, environ={}, env_prefix="X_", file_values={}, file_path=None) == {}
    for flags, environ, file_values, origin in (
        ({"pull.interval": "x"}, {}, {}, "--pull.interval: "),
        ({}, {"X_PULL_INTERVAL": "x"}, {}, "X_PULL_INTERVAL: "),
        ({}, {}, {"pull.interval": "x"}, "config file f.yaml: 'pull.interval': "),
    ):
        with pytest.raises(ConfigError) as info:
            layered(parsers, flags=flags, environ=environ, env_prefix="X_", file_values=file_values, file_path="f.yaml")
        assert str(info.value).startswith(origin)


def test_config_file_errors_are_one_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("a: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_config_file(str(f), ["a"])
    f.write_text("b: 1\n")
    with pytest.raises(ConfigError, match="unknown key 'b'"):
        read_config_file(str(f), ["a"])


# The two programs, through their own loaders: the same spellings mean the same things.


@pytest.mark.parametrize("word,value", [("on", True), ("off", False), ("yes", True), ("0", False)])
def test_both_programs_read_the_same_booleans(word, value):
    agent = load_config([], environ={"GPUFLEET_AGENT_NVLINK_PER_LINK": word})
    server = load_settings(["--pull.scheme", "https"], env={"GPUFLEET_SERVER_PULL_TLS_INSECURE_SKIP_VERIFY": word})
    assert agent.nvlink_per_link is value and server.pull_client.insecure_skip_verify is value


def test_both_programs_read_the_same_durations():
    agent = load_config(["--sample.interval", "1m30s", "--snapshots.retention", "1h"], environ={})
    server = load_settings(["--pull.interval", "1m30s", "--storage.retention", "1h"], env={})
    assert agent.sample_interval == server.pull_interval_seconds == 90.0
    assert agent.snapshots_retention == server.storage_retention_seconds == 3600.0
    assert load_config(["--sample.interval", "500ms"], environ={}).sample_interval == 0.5


def test_both_programs_read_the_same_listen_addresses():
    agent = load_config(["--web.listen-address", "[::1]:9000"], environ={})
    server = load_settings(["--web.listen-address", "[::1]:9000"], env={})
    assert (agent.listen_host, agent.listen_port) == ("::1", 9000)
    assert server.listen_address == "[::1]:9000"
    for bad in ("::1:9000", "9000"):
        with pytest.raises(ConfigError, match="--web.listen-address"):
            load_config(["--web.listen-address", bad], environ={})
        with pytest.raises(ConfigError, match="--web.listen-address"):
            load_settings(["--web.listen-address", bad], env={})


def test_both_programs_word_a_bad_file_value_alike(tmp_path):
    agent_file = tmp_path / "agent.yaml"
    agent_file.write_text("sample.interval: soon\n")
    server_file = tmp_path / "server.yaml"
    server_file.write_text("pull.interval: soon\n")
    with pytest.raises(ConfigError) as agent:
        load_config(["--config.file", str(agent_file)], environ={})
    with pytest.raises(ConfigError) as server:
        load_settings(["--config.file", str(server_file)], env={})
    assert str(agent.value).startswith(f"config file {agent_file}: 'sample.interval': ")
    assert str(server.value).startswith(f"config file {server_file}: 'pull.interval': ")


def test_agent_config_does_not_load_the_simulator():
    import subprocess
    import sys

    code = (
        "import sys, gpufleet.agent.config as c; c.load_config([], environ={}); "
        "sys.exit(any(m.startswith('gpufleet.agent.sim') for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
