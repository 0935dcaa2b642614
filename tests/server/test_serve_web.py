"""The server's own `--web.config.file`: basic auth and headers on the API (in process), and a real `serve`
process answering HTTPS on 127.0.0.1 (certificates made with the openssl command)."""

from __future__ import annotations

import signal
import ssl

import bcrypt
import httpx
import pytest
from fastapi.testclient import TestClient

from gpufleet.webconfig import WebConfig
from gpufleet.server.api import create_app
from gpufleet.server.ingest.puller import Puller
from gpufleet.server.ingest.targets import StaticTargets
from gpufleet.server.runtime import Runtime
from gpufleet.server.serve import main
from gpufleet.server.settings import ServerSettings
from gpufleet.server.store import AlertStore
from tests.agent.running import server_process
from tests.server.live_fakes import StubEngine, parse_dict
from tests.tlsfiles import OPENSSL, make_pki

HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4))


@pytest.fixture
def client(tmp_path):
    settings = ServerSettings(storage_path=str(tmp_path / "api.db"))
    transport = httpx.MockTransport(lambda r: httpx.Response(200, content=b'{"schema":1,"snapshots":[]}'))
    puller = Puller(StaticTargets(("a:1",)), transport=transport, parse=parse_dict, clock=lambda: 5000.0)
    runtime = Runtime(engine=StubEngine(), source=puller, store=AlertStore(settings.storage_path), clock=lambda: 5000.0)
    web = WebConfig(users={"grafana": HASH}, headers={"X-Content-Type-Options": "nosniff"})
    return TestClient(create_app(settings, runtime=runtime, run_pipeline=False, web=web))


@pytest.mark.parametrize("path", ["/alerts", "/jobs", "/nodes", "/metrics", "/openapi.json"])
def test_every_route_but_healthz_wants_credentials(client, path):
    refused = client.get(path)
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith(
        'Basic realm="gpufleet-server"'
    )
    assert refused.headers["x-content-type-options"] == "nosniff"
    assert client.get(path, auth=("grafana", "wrong")).status_code == 401
    answered = client.get(path, auth=("grafana", "s3cret"))
    assert answered.status_code == 200 and answered.headers["x-content-type-options"] == "nosniff"


def test_healthz_stays_open_for_probes(client):
    # 503 here: the pipeline is not started in process; what matters is that no credentials were asked for.
    health = client.get("/healthz")
    assert health.status_code == 503 and "targets" in health.json()


def test_a_bad_web_config_exits_2_with_one_line(tmp_path, capsys):
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config: {cert_file: /nonexistent.crt}\n")
    assert main(["--web.config.file", str(web), "--storage.path", str(tmp_path / "s.db")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpufleet-server: --web.config.file:") and "key_file" in err and "\n" not in err


@pytest.mark.skipif(OPENSSL is None, reason="the openssl command is needed to make test certificates")
def test_a_real_server_answers_https_with_basic_auth_and_stops_on_sigterm(tmp_path):
    pki = make_pki(tmp_path)
    web = tmp_path / "web.yml"
    web.write_text(
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
        f"basic_auth_users:\n  grafana: '{HASH.decode()}'\n"
    )
    with server_process(tmp_path, "--web.config.file", str(web), "--targets", "127.0.0.1:1") as (proc, port):
        with httpx.Client(verify=ssl.create_default_context(cafile=str(pki.ca_cert)), timeout=10) as http:
            assert "targets" in http.get(f"https://127.0.0.1:{port}/healthz").json()
            assert http.get(f"https://127.0.0.1:{port}/alerts").status_code == 401
            assert http.get(f"https://127.0.0.1:{port}/alerts", auth=("grafana", "s3cret")).json()["alerts"] == []
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
