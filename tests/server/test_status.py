"""`gpufleet-server status`: the terminal report of what a running server sees."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import orjson
import pytest

from gpufleet.server.status import main, render
from tests.agent.running import agent_process, server_process

JOBS = {
    "evaluated_at": 1763800600.0,
    "jobs": [
        {
            "hpc_job": "71002",
            "gpus": 16,
            "nodes": ["dgx-03", "dgx-04"],
            "utilization_ratio": 1.0,
            "sm_active_ratio": 0.55,
            "baseline_sm_active_ratio": 0.7,
            "estimated_slowdown_ratio": 0.214,
            "stragglers": [{"node": "dgx-03", "gpu": 5}],
            "comm_bound": False,
            "input_bound": False,
            "gpu_hours_lost": 3.46,
        },
        {
            "hpc_job": "71001",
            "gpus": 16,
            "nodes": ["dgx-01", "dgx-02"],
            "utilization_ratio": 1.0,
            "sm_active_ratio": 0.52,
            "baseline_sm_active_ratio": 0.69,
            "estimated_slowdown_ratio": 0.25,
            "stragglers": [],
            "comm_bound": True,
            "input_bound": False,
            "gpu_hours_lost": 0.0,
        },
        {
            "hpc_job": "80000",
            "gpus": 8,
            "nodes": ["dgx-05"],
            "utilization_ratio": None,
            "sm_active_ratio": None,
            "baseline_sm_active_ratio": None,
            "estimated_slowdown_ratio": None,
            "stragglers": [{"node": "dgx-05", "gpu": None}],
            "comm_bound": False,
            "input_bound": False,
        },
    ],
}
ALERTS = {
    "total": 2,
    "alerts": [
        {
            "severity": "critical",
            "kind": "straggler",
            "node": "dgx-03",
            "gpu": 5,
            "hpc_job": "71002",
            "started": 1763800470.0,
            "summary": "GPU 5 on dgx-03 holds back job 71002 by ~21 % per step (estimated as it fired): SM clock 61 % of max "
            "vs peers 100 %; throttled: HW slowdown or power brake, not heat (power delivery)",
        },
        {
            "severity": "warning",
            "kind": "comm_bound",
            "node": None,
            "gpu": None,
            "hpc_job": "71001",
            "started": 1763800535.0,
            "summary": "job 71001 is communication-bound",
        },
    ],
}
NODES = {
    "nodes": [{"node": f"dgx-0{i}"} for i in range(1, 6)],
    "targets": [{"target": f"10.0.0.{i}:9471", "up": i != 4} for i in range(1, 6)],
}


def test_the_report_names_each_job_what_holds_it_back_and_what_fires():
    text = render(JOBS, ALERTS, NODES, url="http://gpufleet:9472")
    lines = text.splitlines()
    assert lines[0] == (
        "gpufleet-server http://gpufleet:9472: 4 of 5 agents up, 5 nodes, evaluated at 2025-11-22 08:36:40 UTC"
    )
    rows = {line.split()[0]: line for line in lines[2:6]}
    assert rows["JOB"].split() == [
        "JOB",
        "GPUS",
        "NODES",
        "UTIL",
        "SM",
        "BASELINE",
        "SLOWER-VS-BASELINE",
        "LOST(GPU-H)",
        "NOW",
    ]
    assert rows["71001"].split() == ["71001", "16", "2", "1.00", "0.52", "0.69", "25", "%", "0.00", "comm_bound"]
    assert rows["71002"].split()[-3:] == ["3.46", "straggler", "dgx-03/5"]
    # Unknown is "-", never 0; a whole node holding its job back is named by the node alone.
    assert rows["80000"].split() == ["80000", "8", "1", "-", "-", "-", "-", "-", "straggler", "dgx-05"]
    assert [line.split()[0] for line in lines[3:6]] == ["71001", "71002", "80000"]
    assert lines[7] == "FIRING (2)"
    assert lines[8].split() == ["critical", "straggler", "dgx-03/5", "71002", "2m10s"]
    assert lines[9] == "    " + ALERTS["alerts"][0]["summary"]  # whole: the why comes at its end
    assert lines[10].split() == ["warning", "comm_bound", "-", "71001", "1m05s"]
    assert lines[11] == "    job 71001 is communication-bound"


def test_a_job_a_hair_faster_than_its_baseline_reads_0_not_minus_0():
    job = dict(JOBS["jobs"][0], estimated_slowdown_ratio=-0.004, stragglers=[])
    row = render({"evaluated_at": 1763800600.0, "jobs": [job]}, {"total": 0, "alerts": []}, NODES, url="u")
    assert row.splitlines()[3].split()[6:8] == ["0", "%"]


def test_a_server_with_nothing_yet_says_so():
    text = render(
        {"evaluated_at": None, "jobs": []},
        {"total": 0, "alerts": []},
        {"nodes": [], "targets": []},
        url="http://s:9472",
    )
    assert text.splitlines() == [
        "gpufleet-server http://s:9472: 0 of 0 agents up, 0 nodes, not evaluated yet",
        "",
        "no job attributed yet",
        "",
        "nothing firing",
    ]


def _serve(answer):
    return httpx.MockTransport(lambda request: answer(request))


@pytest.mark.parametrize(
    "answer,words",
    [
        (lambda r: httpx.Response(401), "wants credentials"),
        (lambda r: httpx.Response(200, content=b"<html>"), "did not answer JSON"),
        (lambda r: httpx.Response(200, content=b"[1]"), "did not answer a JSON object"),
        (lambda r: httpx.Response(503), "/jobs answered HTTP 503"),
        (lambda r: (_ for _ in ()).throw(httpx.ConnectError("refused")), "refused"),
    ],
)
def test_a_server_that_cannot_be_read_is_exit_1_with_why(answer, words, capsys):
    assert main(["--url", "http://s:9472"], transport=_serve(answer)) == 1
    assert words in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--url", "ftp://s"], "--url: expected an http:// or https:// URL"),
        (["--url", "http://u:p@s:9472"], "--url: no credentials in the URL"),
        (["--timeout", "0"], "--timeout: must be above 0"),
        (["--timeout", "soon"], "--timeout:"),
        (["--api.basic-auth.username", "ops"], "go together"),
        (["--api.tls.ca-file", "/nonexistent/ca.pem", "--url", "https://s"], "--api.tls.ca-file"),
        (["--api.tls.insecure-skip-verify", "true"], "mean nothing over http"),
    ],
)
def test_bad_flags_are_exit_2_naming_the_flag(argv, words, capsys):
    assert main(argv, transport=_serve(lambda r: httpx.Response(500))) == 2
    assert words in capsys.readouterr().err


def test_credentials_are_sent(tmp_path, capsys):
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    seen = []

    def answer(request):
        seen.append(request.headers.get("authorization"))
        doc = {
            "/jobs": {"evaluated_at": None, "jobs": []},
            "/alerts": {"total": 0, "alerts": []},
            "/nodes": {"nodes": [], "targets": []},
        }[request.url.path]
        return httpx.Response(200, content=orjson.dumps(doc))

    assert (
        main(
            [
                "--url",
                "http://s:9472",
                "--api.basic-auth.username",
                "ops",
                "--api.basic-auth.password-file",
                str(secret),
            ],
            transport=_serve(answer),
        )
        == 0
    )
    assert seen == ["Basic b3BzOnMzY3JldA=="] * 3
    assert "nothing firing" in capsys.readouterr().out


def test_against_a_real_server_pulling_real_agents(tmp_path):
    with (
        agent_process("--simulate", "demo", "--node", "dgx-01") as (_, port_a),
        agent_process("--simulate", "demo", "--node", "dgx-03") as (_, port_b),
        server_process(
            tmp_path,
            "--targets",
            f"127.0.0.1:{port_a},127.0.0.1:{port_b}",
            "--pull.interval",
            "1s",
            "--pull.timeout",
            "1s",
        ) as (_, port_s),
    ):
        waiter = threading.Event()
        for _ in range(120):
            done = subprocess.run(
                [sys.executable, "-m", "gpufleet.server.cli", "status", "--url", f"http://127.0.0.1:{port_s}"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert done.returncode == 0, done.stderr
            if "71001" in done.stdout and "71002" in done.stdout:
                break
            waiter.wait(0.5)
        else:
            pytest.fail(f"the server never showed both demo jobs:\n{done.stdout}")
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"gpufleet-server http://127.0.0.1:{port_s}: 2 of 2 agents up, 2 nodes, evaluated at ")
    rows = {line.split()[0]: line.split() for line in lines if line.split()[:1] in (["71001"], ["71002"])}
    assert rows["71001"][1:3] == ["8", "1"] and rows["71002"][1:3] == ["8", "1"]
