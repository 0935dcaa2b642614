"""The server's clients against the real thing behind an exporter-toolkit web config (HTTPS, client
certificates required, basic auth): Alertmanager receiving our alerts, Prometheus read by
`--ingest.prometheus-url`, and our own server read by `gpufleet-server status`. All take the same web
config file format as our agent."""

from __future__ import annotations

import asyncio
import ssl
import threading

import pytest

from gpufleet.server.alerts import Transition
from gpufleet.server.ingest.prometheus import PrometheusSource
from gpufleet.server.notify.alertmanager import AlertmanagerNotifier
from gpufleet.server.serve import build_notifiers, build_source
from gpufleet.server.settings import load_settings
from gpufleet.server.status import main as status
from tests.agent.running import (
    agent_process,
    alertmanager_process,
    prometheus_process,
    requires_alertmanager,
    requires_prometheus,
    server_process,
)
from tests.server.live_fakes import make_alert
from tests.tlsfiles import make_pki, needs_openssl, web_config_file

USER, PASSWORD = "gpufleet", "s3cret"
DEADLINE_SECONDS = 60.0
POLL_SECONDS = 0.5


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def client_options(pki) -> dict:
    """httpx options that get past web_config_file: for the test's own look at the binary."""
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    ctx.load_cert_chain(pki.client_cert, pki.client_key)
    return {"verify": ctx, "auth": (USER, PASSWORD)}


def flags(prefix: str, pki, tmp_path, password: str = PASSWORD) -> list[str]:
    secret = tmp_path / f"{prefix}-{password}"  # one file per password: a changed file is read again
    secret.write_text(password + "\n")
    return [
        f"--{prefix}.tls.ca-file",
        str(pki.ca_cert),
        f"--{prefix}.tls.cert-file",
        str(pki.client_cert),
        f"--{prefix}.tls.key-file",
        str(pki.client_key),
        f"--{prefix}.basic-auth.username",
        USER,
        f"--{prefix}.basic-auth.password-file",
        str(secret),
    ]


@requires_alertmanager
@needs_openssl
def test_alerts_reach_an_alertmanager_behind_mutual_tls_and_basic_auth(pki, tmp_path):
    import httpx

    options = client_options(pki)
    web = web_config_file(tmp_path / "web.yml", pki, USER, PASSWORD)
    with alertmanager_process(tmp_path, web, options) as (_, port, log_path):
        url = f"https://127.0.0.1:{port}"
        (good,) = build_notifiers(
            load_settings(["--alertmanager.url", url, *flags("alertmanager", pki, tmp_path)], env={})
        )
        (bad,) = build_notifiers(
            load_settings(["--alertmanager.url", url, *flags("alertmanager", pki, tmp_path, password="guess")], env={})
        )
        no_cert = AlertmanagerNotifier(url, attempts=1, verify=ssl.create_default_context(cafile=str(pki.ca_cert)))
        assert isinstance(good, AlertmanagerNotifier)

        async def deliver() -> tuple[bool, ...]:
            alert = make_alert(1)
            notifiers = (good, bad, no_cert)
            try:
                for notifier in notifiers:
                    notifier.submit([Transition(alert, None)])
                return tuple([await notifier.step() for notifier in notifiers])
            finally:
                for notifier in notifiers:
                    await notifier.aclose()

        delivered, refused, unproven = asyncio.run(deliver())
        assert delivered and good.sent_total == 1, log_path.read_text(errors="replace")[-2000:]
        assert not refused and bad.failed_total == 1  # 401: not retried, counted
        assert not unproven and no_cert.failed_total == 1  # a TLS alert, counted rather than raised
        stored = httpx.get(f"{url}/api/v2/alerts", **options).json()
    assert [a["labels"]["alertname"] for a in stored] == ["GpufleetStraggler"]
    assert stored[0]["labels"]["node"] == make_alert(1).node and stored[0]["status"]["state"] == "active"


@requires_prometheus
@needs_openssl
def test_the_pipeline_reads_a_prometheus_behind_mutual_tls_and_basic_auth(pki, tmp_path):
    web = web_config_file(tmp_path / "web.yml", pki, USER, PASSWORD)
    with (
        agent_process("--simulate", "demo", "--node", "dgx-01") as (_, agent_port),
        prometheus_process(tmp_path, [agent_port], web_config=web, client=client_options(pki)) as (
            prom,
            prom_port,
            log_path,
        ),
    ):
        url = f"https://127.0.0.1:{prom_port}"
        source = build_source(
            load_settings(
                [
                    "--ingest.prometheus-url",
                    url,
                    "--pull.interval",
                    "1s",
                    "--pull.timeout",
                    "1s",
                    *flags("ingest.prometheus", pki, tmp_path),
                ],
                env={},
            )
        )
        wrong = build_source(
            load_settings(
                [
                    "--ingest.prometheus-url",
                    url,
                    "--pull.interval",
                    "1s",
                    "--pull.timeout",
                    "1s",
                    *flags("ingest.prometheus", pki, tmp_path, password="guess"),
                ],
                env={},
            )
        )
        assert isinstance(source, PrometheusSource)
        waiter = threading.Event()

        async def until_samples() -> list:
            try:
                for _ in range(int(DEADLINE_SECONDS / POLL_SECONDS)):
                    assert prom.poll() is None, log_path.read_text(errors="replace")[-2000:]
                    samples = (await source.pull_once()).samples
                    if samples:
                        await wrong.pull_once()
                        return samples
                    await asyncio.to_thread(waiter.wait, POLL_SECONDS)
                return []
            finally:
                await source.aclose()
                await wrong.aclose()

        samples = asyncio.run(until_samples())
    assert samples and {s.node for s in samples} == {"dgx-01"}, dict(source.errors)
    assert not source.errors
    assert {reason for _, reason in wrong.errors} == {"http_status"}


@needs_openssl
def test_status_reads_a_server_behind_mutual_tls_and_basic_auth(pki, tmp_path, capsys):
    web = web_config_file(tmp_path / "web.yml", pki, USER, PASSWORD)
    no_agents_yet = tmp_path / "agents.yml"
    no_agents_yet.write_text("[]\n")
    with server_process(tmp_path, "--web.config.file", str(web), "--targets.file-sd", str(no_agents_yet)) as (_, port):
        url = f"https://127.0.0.1:{port}"
        assert status(["--url", url, *flags("api", pki, tmp_path)]) == 0
        out, _ = capsys.readouterr()
        assert out.startswith(f"gpufleet-server {url}: 0 of 0 agents up") and "nothing firing" in out
        assert status(["--url", url, *flags("api", pki, tmp_path, password="guess")]) == 1
        assert "wants credentials" in capsys.readouterr().err
        no_cert = flags("api", pki, tmp_path)[:2] + flags("api", pki, tmp_path)[6:]  # CA and credentials only
        assert "--api.tls.cert-file" not in no_cert and "--api.basic-auth.username" in no_cert
        assert status(["--url", url, *no_cert]) == 1
        assert f"cannot read {url}" in capsys.readouterr().err
