"""`gpufleet-server serve`: settings precedence, config errors (exit 2), and the wired pipeline."""

from __future__ import annotations

import asyncio
import re

import httpx
import orjson
import pytest

from gpufleet.server.serve import build_runtime, main
from gpufleet.server.settings import FLAGS, ConfigError, ServerSettings, load_settings, parse_duration
from gpufleet.server.store import AlertQuery
from tests.agent.running import server_process
from tests.server.live_fakes import StubEngine, envelope, job_gpu, parse_dict, snapshot


def test_defaults() -> None:
    s = load_settings([], env={})
    assert (s.listen_address, s.pull_interval_seconds, s.storage_path) == (":9472", 5.0, "gpufleet.db")
    assert s.alertmanager_resend_interval_seconds == 60.0 and s.targets == ()


def test_precedence_flag_over_env_over_file(tmp_path) -> None:
    config = tmp_path / "server.yaml"
    config.write_text("pull.interval: 30s\npull.timeout: 1.5\ntargets: [a:1, b:2]\nengine: {x: 1}\n")
    env = {"GPUFLEET_SERVER_PULL_INTERVAL": "10s", "GPUFLEET_SERVER_WEB_LISTEN_ADDRESS": "127.0.0.1:1"}
    s = load_settings(["--config.file", str(config), "--pull.interval", "2s"], env=env)
    assert s.pull_interval_seconds == 2.0 and s.pull_timeout_seconds == 1.5
    assert s.listen_address == "127.0.0.1:1" and s.targets == ("a:1", "b:2") and s.engine == {"x": 1}
    assert load_settings(["--config.file", str(config)], env=env).pull_interval_seconds == 10.0
    assert load_settings(["--config.file", str(config)], env={}).pull_interval_seconds == 30.0


@pytest.mark.parametrize("text,seconds", [("5s", 5), ("1m", 60), ("250ms", 0.25), ("2", 2), (1.5, 1.5), ("1d", 86400)])
def test_durations(text, seconds) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "argv,env,needle",
    [
        (["--pull.interval", "soon"], {}, "--pull.interval"),
        (["--pull.interval", "0s"], {}, "--pull.interval"),
        (["--web.listen-address", "nowhere"], {}, "--web.listen-address"),
        (["--targets", "a:1,b:http"], {}, "--targets"),
        (["--pull.interval", "5s", "--pull.timeout", "10s"], {}, "pull.timeout"),
        (["--alertmanager.url", "am:9093"], {}, "--alertmanager.url"),
        (["--alertmanager.url", "http://am:9093,http://am:9093"], {}, "the same URL twice"),
        (["--alertmanager.url", " , "], {}, "at least one"),
        (["--alertmanager.url", "http://am-0:9093,https://gpufleet:s3cret@am-1:9093"], {}, "no credentials in the URL"),
        (["--ingest.prometheus-url", "https://reader:s3cret@prom:9090"], {}, "basic-auth"),
        (["--log.level", "loud"], {}, "--log.level"),
        (["--pull.max-bytes", "lots"], {}, "--pull.max-bytes"),
        ([], {"GPUFLEET_SERVER_PULL_TIMEOUT": "-1"}, "GPUFLEET_SERVER_PULL_TIMEOUT"),
        (["--no-such-flag"], {}, "--no-such-flag"),
    ],
)
def test_bad_values_name_the_setting(argv, env, needle) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_settings(argv, env=env)


def test_bad_config_file_entries(tmp_path) -> None:
    bad_key = tmp_path / "a.yaml"
    bad_key.write_text("pull.intervall: 5s\n")
    with pytest.raises(ConfigError, match="unknown key 'pull.intervall'"):
        load_settings(["--config.file", str(bad_key)], env={})
    bad_value = tmp_path / "b.yaml"
    bad_value.write_text("pull.interval: never\n")
    with pytest.raises(ConfigError, match="config file .*: 'pull.interval': "):
        load_settings(["--config.file", str(bad_value)], env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(["--config.file", str(tmp_path / "missing.yaml")], env={})
    broken = tmp_path / "c.yaml"
    broken.write_text("a: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(["--config.file", str(broken)], env={})


def test_main_exits_2_with_one_line(capsys, tmp_path) -> None:
    assert main(["--pull.interval", "soon"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--pull.interval" in err and err.startswith("gpufleet-server:")
    assert main(["--frobnicate"]) == 2
    assert "--frobnicate" in capsys.readouterr().err
    assert main(["--storage.path", str(tmp_path / "no" / "dir" / "x.db"), "--targets", "a:1"]) == 2
    assert "cannot open alert store" in capsys.readouterr().err


def test_version(capsys) -> None:
    from gpufleet.server import __version__
    from gpufleet.server.cli import main as cli

    assert cli(["--version"]) == 0
    assert capsys.readouterr().out == f"gpufleet-server {__version__}\n"


def test_taken_listen_address_exits_2_before_pulling_anything(capsys, tmp_path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert (
            main(
                [
                    "--web.listen-address",
                    f"127.0.0.1:{port}",
                    "--targets",
                    "127.0.0.1:1",
                    "--storage.path",
                    str(tmp_path / "x.db"),
                ]
            )
            == 2
        )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("gpufleet-server: cannot listen on --web.listen-address")
    assert f"127.0.0.1:{port}" in err and "in use" in err


def test_port_0_is_named_by_the_port_the_kernel_gave() -> None:
    """The log line (address and url) names the bound port, not ':0'."""
    from dataclasses import replace

    from gpufleet.server.serve import bound_address, listen_socket

    with listen_socket("127.0.0.1:0") as sock:
        port = sock.getsockname()[1]
        assert port != 0 and bound_address("127.0.0.1:0", sock) == f"127.0.0.1:{port}"
        settings = replace(ServerSettings(), listen_address=bound_address(":0", sock))
        assert settings.public_url() == f"http://localhost:{port}"
        assert bound_address("127.0.0.1:9472", sock) == "127.0.0.1:9472"


def test_bad_engine_section_exits_2(capsys, tmp_path) -> None:
    engine = pytest.importorskip("gpufleet.server.engine", reason="engine not written yet")
    if not hasattr(engine, "EngineConfig"):
        pytest.skip("engine not written yet")
    config = tmp_path / "s.yaml"
    config.write_text("engine: {no_such_engine_key: 1}\n")
    argv = ["--config.file", str(config), "--targets", "127.0.0.1:1", "--storage.path", str(tmp_path / "x.db")]
    argv += ["--web.listen-address", "127.0.0.1:0"]  # not the default port, which another server may hold
    assert main(argv) == 2
    assert "no_such_engine_key" in capsys.readouterr().err


def test_wired_pipeline_with_mock_agents_and_injected_clock(tmp_path) -> None:
    """Targets -> puller -> engine.advance(clock) -> store -> notifier, through build_runtime."""
    now = [1000.0]
    temps = {"dgx-01": (60.0, 60.0), "dgx-02": (60.0, 60.0)}
    am_bodies: list[object] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "am":
            am_bodies.append(orjson.loads(request.content))
            return httpx.Response(200)
        node = {"10.0.0.1": "dgx-01", "10.0.0.2": "dgx-02"}[request.url.host]
        since = float(request.url.params.get("since", "0"))
        snaps = [snapshot(node, t, temps=temps[node]) for t in (now[0] - 1, now[0]) if t > since]
        return httpx.Response(200, content=orjson.dumps(envelope(node, snaps)))

    settings = ServerSettings(
        targets=("10.0.0.1:9471", "10.0.0.2:9471"),
        storage_path=str(tmp_path / "w.db"),
        alertmanager_urls=("http://am:9093",),
    )
    engine = StubEngine()
    runtime = build_runtime(
        settings, engine=engine, clock=lambda: now[0], transport=httpx.MockTransport(handler), parse=parse_dict
    )
    advanced: list[float] = []
    original = engine.advance
    engine.advance = lambda t: (advanced.append(t), original(t))[1]

    async def scenario():
        await runtime.cycle()
        now[0] = 1005.0
        temps["dgx-02"] = (60.0, 97.0)
        transitions = await runtime.cycle()
        await runtime.notifiers[0].step()
        now[0] = 1010.0
        temps["dgx-02"] = (60.0, 70.0)
        resolved = await runtime.cycle()
        await runtime.notifiers[0].step()
        return transitions, resolved

    transitions, resolved = asyncio.run(scenario())
    assert advanced == [1000.0, 1005.0, 1010.0]
    by_node = {n: [s["time"] for s in engine.samples if s["node"] == n] for n in temps}
    assert by_node == {n: [999.0, 1000.0, 1004.0, 1005.0, 1009.0, 1010.0] for n in temps}  # none lost, none twice
    assert [(t.alert.node, t.alert.gpu, t.alert.state.value) for t in transitions] == [("dgx-02", 1, "firing")]
    assert [t.alert.state.value for t in resolved] == ["resolved"]
    stored = runtime.store.get(transitions[0].alert.id)
    assert stored is not None and stored.state.value == "resolved" and stored.resolved == 1010.0
    assert [b[0]["labels"]["node"] for b in am_bodies] == ["dgx-02", "dgx-02"]
    assert "endsAt" in am_bodies[1][0] and am_bodies[1][0]["endsAt"].startswith("1970-01-01T00:16:50")


def test_shipped_example_config_is_valid() -> None:
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "deploy" / "server.yaml"
    s = load_settings(["--config.file", str(example)], env={})
    assert s.pull_interval_seconds == 5.0 and s.storage_retention_seconds == 7 * 86400
    assert "window_seconds" in s.engine
    # The commented-out examples must be settings too, or uncommenting one stops the server.
    commented = re.findall(r"^# ([a-z][a-z0-9.-]*): \S+$", example.read_text(), flags=re.MULTILINE)
    assert "alertmanager.basic-auth.password-file" in commented
    assert [key for key in commented if key not in FLAGS] == []


def _thermal_agents(now: list[float], hot, first_since):
    """Mock agents dgx-01 (10.0.0.1) and dgx-02 (10.0.0.2) of job 71001, 4 GPUs each, one snapshot per second
    up to now[0]; hot(node, gpu, t) says which GPU-seconds read 95 °C with the SW thermal bit."""

    def handler(request: httpx.Request) -> httpx.Response:
        node = {"10.0.0.1": "dgx-01", "10.0.0.2": "dgx-02"}[request.url.host]
        since = float(request.url.params.get("since", first_since()))
        snaps = [
            {"schema": 1, "node": node, "time": float(t), "gpus": [job_gpu(node, i, hot(node, i, t)) for i in range(4)]}
            for t in range(int(since) + 1, int(now[0]) + 1)
        ]
        return httpx.Response(200, content=orjson.dumps(envelope(node, snaps)))

    return handler


def test_real_engine_fires_thermal_alert_through_the_live_pipeline(tmp_path) -> None:
    """Mock agents -> real contract parser and engine (settle from the pull interval) -> store and /alerts view."""
    pytest.importorskip("gpufleet.server.engine", reason="engine not written yet")
    now = [10_000.0]
    start = now[0]
    handler = _thermal_agents(
        now, lambda node, i, t: node == "dgx-02" and i == 1 and t >= start + 60, first_since=lambda: start - 1
    )
    settings = ServerSettings(targets=("10.0.0.1:9471", "10.0.0.2:9471"), storage_path=str(tmp_path / "r.db"))
    runtime = build_runtime(settings, clock=lambda: now[0], transport=httpx.MockTransport(handler))

    async def scenario():
        for _ in range(40):
            now[0] += 5
            await runtime.cycle()

    asyncio.run(scenario())
    fired = [a for a in runtime.store.open_alerts() if a.kind.value == "thermal_throttle"]
    assert [(a.node, a.gpu, a.hpc_job) for a in fired] == [("dgx-02", 1, "71001")]
    assert fired[0].started is not None and start + 60 <= fired[0].started <= start + 60 + 60
    assert {n["node"] for n in runtime.view.nodes} == {"dgx-01", "dgx-02"}
    assert runtime.view.stats["samples_ingested"] == 2 * 201 * 4  # GPU-samples: every one pulled, none twice


def test_sigterm_stops_the_server_cleanly_and_sighup_does_not(tmp_path) -> None:
    """A real `serve` process: it comes up, answers /healthz, shrugs off SIGHUP (which would end a process
    that does not handle it), and exits 0 on SIGTERM."""
    import signal

    with server_process(tmp_path, "--targets", "127.0.0.1:1") as (proc, port):
        health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
        assert health.json()["targets"] in (0, 1)
        proc.send_signal(signal.SIGHUP)
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code in (200, 503)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert (tmp_path / "server.db").exists()


def test_agent_down_since_start_alerts_through_the_pipeline_and_keeps_its_alert_across_a_restart(tmp_path) -> None:
    """An agent the engine has never had a sample from raises node_unreachable from ingest, exactly once."""
    now = [1000.0]
    down = {"10.0.0.2"}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host in down:
            raise httpx.ConnectError("refused")
        node = {"10.0.0.1": "dgx-01", "10.0.0.2": "dgx-02"}[request.url.host]
        return httpx.Response(200, content=orjson.dumps(envelope(node, [snapshot(node, now[0])])))

    settings = ServerSettings(
        targets=("10.0.0.1:9471", "10.0.0.2:9471"), storage_path=str(tmp_path / "d.db"), pull_stale_after_seconds=30
    )

    def runtime_with(engine: StubEngine):
        return build_runtime(
            settings, engine=engine, clock=lambda: now[0], transport=httpx.MockTransport(handler), parse=parse_dict
        )

    async def cycles(runtime, n: int) -> list:
        out = []
        for _ in range(n):
            now[0] += 5
            out += await runtime.cycle()
        return out

    first = runtime_with(StubEngine())
    [fired] = asyncio.run(cycles(first, 7))
    assert (fired.alert.kind.value, fired.alert.node, fired.alert.started) == (
        "node_unreachable",
        "10.0.0.2:9471",
        1035.0,
    )
    assert first.store.get(fired.alert.id).state.value == "firing"
    assert [a.id for a in first.view.alerts] == [fired.alert.id]
    first.store.close()

    engine = StubEngine()
    second = runtime_with(engine)
    assert second.restore() == 1 and engine.restored == []  # ours, not the engine's
    assert asyncio.run(cycles(second, 3)) == []  # still down: same alert, no duplicate
    assert [a.id for a in second.view.alerts] == [fired.alert.id]
    down.clear()
    [resolved] = asyncio.run(cycles(second, 1))
    assert (resolved.alert.id, resolved.alert.state.value) == (fired.alert.id, "resolved")
    assert second.store.get(fired.alert.id).resolved == now[0] and second.store.open_alerts() == []
    assert second.store.target_nodes() == {"10.0.0.1:9471": "dgx-01", "10.0.0.2:9471": "dgx-02"}


def test_real_engine_keeps_an_alert_across_a_restart_and_resolves_it_under_the_same_id(tmp_path) -> None:
    """Fire with the real engine, restart on the same SQLite file (agents re-send their buffers), cool down."""
    pytest.importorskip("gpufleet.server.engine", reason="engine not written yet")
    now = [10_000.0]
    start, hot_until = now[0], [float("inf")]
    handler = _thermal_agents(
        now,
        lambda node, i, t: node == "dgx-02" and i == 1 and start + 60 <= t < hot_until[0],
        first_since=lambda: now[0] - 300,
    )  # an agent buffers 300 s

    settings = ServerSettings(targets=("10.0.0.1:9471", "10.0.0.2:9471"), storage_path=str(tmp_path / "k.db"))

    async def cycles(runtime, n: int) -> None:
        for _ in range(n):
            now[0] += 5
            await runtime.cycle()

    first = build_runtime(settings, clock=lambda: now[0], transport=httpx.MockTransport(handler))
    asyncio.run(cycles(first, 30))
    [fired] = first.store.open_alerts()
    assert (fired.kind.value, fired.node, fired.gpu, fired.state.value) == ("thermal_throttle", "dgx-02", 1, "firing")
    first.store.close()

    now[0] += 20  # down for 20 s
    second = build_runtime(settings, clock=lambda: now[0], transport=httpx.MockTransport(handler))
    assert second.restore() == 1
    asyncio.run(cycles(second, 10))
    assert [(a.id, a.state.value, a.started) for a in second.store.open_alerts()] == [
        (fired.id, "firing", fired.started)
    ]
    hot_until[0] = now[0]
    asyncio.run(cycles(second, 40))
    [after] = second.store.query(AlertQuery()).alerts
    assert (after.id, after.state.value) == (fired.id, "resolved") and after.resolved > hot_until[0]


def test_alertmanager_replicas_from_a_list_in_the_file_or_commas_in_a_flag(tmp_path) -> None:
    config = tmp_path / "server.yaml"
    config.write_text("alertmanager.url: [http://am-0:9093, 'http://am-1:9093/']\n")
    replicas = ("http://am-0:9093", "http://am-1:9093")
    assert load_settings(["--config.file", str(config)], env={}).alertmanager_urls == replicas
    assert (
        load_settings(["--alertmanager.url", "http://am-0:9093, http://am-1:9093"], env={}).alertmanager_urls
        == replicas
    )


def test_check_config_says_ok_or_names_the_first_problem(tmp_path, capsys) -> None:
    """`gpufleet-server check-config`: serve's flags, validated without starting anything."""
    from gpufleet.server.cli import main as cli

    file_sd = tmp_path / "agents.yml"
    file_sd.write_text("- targets: [dgx-01:9471, dgx-02:9471]\n")
    ok = [
        "check-config",
        "--targets",
        "dgx-03:9471",
        "--targets.file-sd",
        str(file_sd),
        "--alertmanager.url",
        "http://am-0:9093,http://am-1:9093",
        "--storage.path",
        str(tmp_path / "a.db"),
    ]
    assert cli(ok) == 0
    assert capsys.readouterr().out.startswith("config OK: reading agents, 3 listed target(s), 2 Alertmanager(s)")
    assert not (tmp_path / "a.db").exists()  # nothing opened, nothing started

    file_sd.write_text("- targets: [dgx-01:http]\n")
    empty = tmp_path / "token"
    empty.write_text("\n")
    engine = tmp_path / "server.yml"
    engine.write_text("engine: {thermal_celsius: hot}\n")
    for argv, fragment in [
        (["--targets.file-sd", str(file_sd)], "dgx-01:http"),
        (["--webhook.url", "http://hooks/x", "--webhook.bearer-token-file", str(empty)], "is empty"),
        (["--config.file", str(engine)], "thermal_celsius"),
        (["--storage.path", str(tmp_path / "missing" / "a.db")], "cannot write in"),
        (["--pull.interval", "soon"], "--pull.interval"),
    ]:
        assert cli(["check-config", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert fragment in err and err.count("\n") == 1, err
