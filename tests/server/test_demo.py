"""The demo: readable alert lines, and one short end-to-end run with real agent processes."""

from __future__ import annotations

import io
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import replace

import httpx
import pytest

from gpufleet.server.alerts import AlertKind, AlertState, Severity, Transition
from gpufleet.server.demo import (
    Scenario,
    TerminalPrinter,
    incident_subject,
    loss_summary,
    main,
    server_socket,
    subject,
    timeline,
)
from tests.server.live_fakes import make_alert


def test_subject_names_gpu_node_or_job() -> None:
    assert subject(make_alert(1, node="dgx-03", gpu=5, hpc_job="71001")) == "dgx-03 GPU 5 (job 71001)"
    assert subject(make_alert(1, node="dgx-02", gpu=None, hpc_job=None)) == "dgx-02"
    assert subject(make_alert(1, kind=AlertKind.COMM_BOUND, node=None, gpu=None, hpc_job="7")) == "job 7"


def test_printer_shows_every_change_of_state_and_no_refresh() -> None:
    out = io.StringIO()
    printer = TerminalPrinter(epoch=1000.0, out=out)
    alert = make_alert(1, kind=AlertKind.THERMAL_THROTTLE, node="dgx-03", gpu=5, hpc_job="71001")  # started 1011
    printer.submit(
        [
            Transition(replace(alert, state=AlertState.PENDING, started=None), None),
            Transition(alert, AlertState.PENDING),
            Transition(alert, AlertState.FIRING),  # refresh: no line
            Transition(replace(alert, state=AlertState.RESOLVED, resolved=1100.0), AlertState.FIRING),
            Transition(
                replace(make_alert(2), state=AlertState.RESOLVED, started=None), AlertState.PENDING
            ),  # never fired
        ]
    )
    lines = out.getvalue().splitlines()
    assert [line.split(") ", 1)[1].split()[:2] for line in lines] == [
        ["PENDING", "thermal_throttle"],
        ["FIRING", "thermal_throttle"],
        ["RESOLVED", "thermal_throttle"],
        ["CLEARED", "straggler"],
    ]
    assert "(+   11s) FIRING   thermal_throttle" in lines[1] and "dgx-03 GPU 5 (job 71001): alert 1" in lines[1]
    assert "(+  100s) RESOLVED thermal_throttle" in lines[2]
    assert (printer.fired_total, printer.resolved_total) == (1, 1)


def test_printer_shows_a_severity_change_while_firing() -> None:
    out = io.StringIO()
    printer = TerminalPrinter(epoch=1000.0, out=out)
    warning = make_alert(1, kind=AlertKind.STRAGGLER, node="dgx-03", gpu=2, hpc_job="71002")
    critical = replace(warning, severity=Severity.CRITICAL, updated=1040.0)
    printer.submit([Transition(warning, AlertState.PENDING)])
    printer.submit([Transition(warning, AlertState.FIRING)])  # a refresh: no line
    printer.submit([Transition(critical, AlertState.FIRING)])
    printer.submit([Transition(replace(critical, updated=1045.0), AlertState.FIRING)])  # a refresh: no line
    printer.submit([Transition(replace(warning, updated=1090.0), AlertState.FIRING)])
    lines = out.getvalue().splitlines()
    assert [line.split(") ", 1)[1].split()[:3] for line in lines] == [
        ["FIRING", "straggler", "warning"],
        ["RAISED", "straggler", "critical"],
        ["LOWERED", "straggler", "warning"],
    ]
    assert "(+   40s) RAISED   straggler        critical dgx-03 GPU 2 (job 71002)" in lines[1]
    assert (printer.fired_total, printer.sent_total) == (1, 3)


def _through_the_agent_command(scenario) -> Scenario:
    """A simulator scenario as the demo sees it: the agent's --print-scenario JSON, read back."""
    import orjson

    from gpufleet.agent.sim.scenario import timetable

    return Scenario.from_json(orjson.loads(orjson.dumps(timetable(scenario))))


def test_timeline_lists_the_demo_incidents_in_order_with_what_to_expect() -> None:
    demo = Scenario.from_json(
        __import__("orjson").loads(
            subprocess.run(
                [sys.executable, "-m", "gpufleet.agent.cli", "--simulate", "demo", "--print-scenario"],
                capture_output=True,
                check=True,
                timeout=60,
            ).stdout
        )
    )
    lines = timeline(demo, epoch=1000.0)
    incidents = sorted(demo.incidents, key=lambda i: i.start_s)
    assert len(lines) == len(incidents) + 1
    for line, inc in zip(lines, incidents):
        assert line.lstrip().startswith(f"+{inc.start_s:.0f}s (") and f"until +{inc.end_s:.0f}s" in line
    cooling, slow, comm = lines[:3]
    assert "cooling failure on dgx-02 GPU 5 (job 71001)" in cooling and "expect thermal_throttle" in cooling
    assert "silently slow GPU on dgx-03 GPU 2 (job 71002)" in slow and "expect straggler" in slow
    assert "communication slowdown on job 71002" in comm and "expect comm_bound" in comm
    last_end = max(i.end_s for i in incidents)
    assert "all calm by about +" in lines[-1]
    assert float(lines[-1].split("all calm by about +")[1].split("s")[0]) > last_end


def test_incident_subject_for_several_gpus_and_whole_nodes() -> None:
    from gpufleet.agent.sim import parse_scenario

    scenario = _through_the_agent_command(
        parse_scenario(
            {
                "nodes": [{"name": "a"}, {"name": "b"}],
                "jobs": [{"id": "9", "nodes": ["a"]}],
                "incidents": [
                    {"kind": "slow_gpu", "node": "a", "gpus": [0, 1], "start_s": 1},
                    {"kind": "nvml_init_failure", "node": "b", "start_s": 1},
                    {"kind": "xid", "node": "b", "gpu": 3, "code": 79, "start_s": 1},
                ],
            }
        )
    )
    several, node, unattributed = scenario.incidents
    assert incident_subject(scenario, several) == "a GPUs 0,1 (job 9)"
    assert incident_subject(scenario, node) == "b"
    assert incident_subject(scenario, unattributed) == "b GPU 3"
    assert "XID errors on b GPU 3" in timeline(scenario, 0.0)[2]


def test_loss_summary_names_each_job_and_what_it_lost_to() -> None:
    jobs = (
        {
            "hpc_job": "71002",
            "gpu_hours_lost": 0.2447,
            "gpu_hours_lost_by_kind": {"straggler": 0.1242, "comm_bound": 0.1205},
        },
        {"hpc_job": "71001", "gpu_hours_lost": 0.0, "gpu_hours_lost_by_kind": {}},
    )
    assert loss_summary(jobs) == (
        "GPU-hours lost while alerts fired: job 71001 0.00; job 71002 0.24 (straggler 0.12, comm_bound 0.12)"
    )
    assert loss_summary(()) == ""


def test_demo_runs_serves_what_it_prints_and_stops_by_itself() -> None:
    """Real agent processes and the real server for a few seconds: every URL the banner prints answers 200
    (the demo's own terminal notifier once broke /metrics), so does `gpufleet-server status`, and
    --duration makes it exit 0 by itself."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpufleet.server.cli",
            "demo",
            "--duration",
            "12",
            "--web.listen-address",
            "127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        banner = []
        for line in proc.stdout:
            banner.append(line)
            if "Alerts as they go pending, fire" in line:
                break
        printed = dict(re.findall(r"^  (alerts|docs|metrics|jobs): +(http://\S+)$", "".join(banner), re.M))
        assert set(printed) == {"alerts", "docs", "metrics", "jobs"}, banner
        for url in printed.values():
            assert httpx.get(url, timeout=10).status_code == 200, url
        assert "gpufleet_server_notifications_sent_total" in httpx.get(printed["metrics"], timeout=10).text
        base = printed["alerts"].removesuffix("/alerts")
        # The hint runs as printed from a shell whose PATH lacks the virtualenv's bin/.
        hint = re.search(r"in another terminal: (.+)$", "".join(banner), re.M).group(1)
        assert hint.endswith(f" status --url {base}") and not hint.startswith("gpufleet-server "), hint
        outside = {**os.environ, "PATH": "/usr/bin:/bin"}
        status = subprocess.run(shlex.split(hint), capture_output=True, text=True, timeout=60, env=outside)
        assert status.returncode == 0 and status.stdout.startswith(f"gpufleet-server {base}: "), status.stderr
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    text = "".join(banner) + out
    assert "Timeline" in text and "expect comm_bound" in text
    assert "gpufleet demo: stopped" in text


def test_taken_address_exits_2_before_any_agent_starts(capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--web.listen-address", f"127.0.0.1:{port}", "--duration", "1"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "cannot listen" in out.err and str(port) in out.err


def test_default_address_falls_back_to_a_free_port_when_9472_is_taken() -> None:
    holder = socket.socket()
    try:
        try:
            holder.bind(("127.0.0.1", 9472))
            holder.listen()
        except OSError:
            pass  # someone else holds it: just as taken
        with server_socket(None) as sock:
            host, port = sock.getsockname()[:2]
        assert host == "127.0.0.1" and port != 9472
    finally:
        holder.close()


# Runs `gpufleet-server demo` through its console entry point with one step wrapped so that the process
# sends itself a real SIGINT there (as a terminal's Ctrl-C would), and writes the pids of the agents it
# started to a file, so the test can see that none outlives the demo.
_CTRL_C_AT = r"""
import os, signal, subprocess, sys
from gpufleet.server import cli, demo, serve

step, pids = sys.argv[1], open(sys.argv[2], "w")
popen = demo.subprocess.Popen

class Popen(popen):
    def __init__(self, cmd, *args, **kwargs):
        super().__init__(cmd, *args, **kwargs)
        if "--node" in cmd:
            pids.write(f"{self.pid}\n"); pids.flush()
            if step == "second_agent" and cmd[cmd.index("--node") + 1] == "dgx-02":
                os.kill(os.getpid(), signal.SIGINT)

def at(name, real):
    def wrapped(*args, **kwargs):
        if step == name:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)
    return wrapped

demo.subprocess.Popen = Popen
demo.load_demo_scenario = at("scenario", demo.load_demo_scenario)
demo.wait_for_agents = at("wait_for_agents", demo.wait_for_agents)
serve.build_runtime = at("server_start", serve.build_runtime)
sys.exit(cli.main(["demo", "--web.listen-address", "127.0.0.1:0", "--duration", "60"]))
"""


@pytest.mark.parametrize("step", ["scenario", "second_agent", "wait_for_agents", "server_start"])
def test_ctrl_c_in_the_first_seconds_stops_cleanly(tmp_path, step) -> None:
    pids, out, err = tmp_path / "agents", tmp_path / "out", tmp_path / "err"
    with out.open("w") as stdout, err.open("w") as stderr:
        # Files, not pipes: an agent left behind would hold a pipe open, and the test would hang on it.
        proc = subprocess.Popen(
            [sys.executable, "-c", _CTRL_C_AT, step, str(pids)],
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a shell's `cmd &` would ignore it
        )
        code = proc.wait(timeout=120)
    started = [int(pid) for pid in pids.read_text().split()]
    left = [pid for pid in started if _running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert (code, err.read_text()) == (0, "")
    assert out.read_text().splitlines()[-1] == "gpufleet demo: stopped"
    assert started if step != "scenario" else not started
    assert left == []


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
