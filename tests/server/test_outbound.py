"""gpufleet.server.outbound: the TLS context and credentials the server shows Prometheus, Alertmanager, a webhook
receiver and the agents, their settings, and how renewed files are taken up without a restart."""

from __future__ import annotations

import asyncio
import base64
import logging
import shutil
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from gpufleet.server.alerts import Transition
from gpufleet.server.outbound import Outbound
from gpufleet.server.serve import build_notifiers, build_source
from gpufleet.server.settings import ClientAuth, ConfigError, load_settings
from tests.agent.fakes import FakeClock
from tests.server.live_fakes import make_alert
from tests.tlsfiles import OPENSSL, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if OPENSSL is None:
        pytest.skip("the openssl command is needed to make test certificates")
    return make_pki(tmp_path_factory.mktemp("pki"))


def headers_sent(outbound: Outbound, n: int = 1) -> list[str | None]:
    """The Authorization header of n requests through a client configured as the server configures its own."""
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200)

    with httpx.Client(transport=httpx.MockTransport(handler), auth=outbound.auth) as client:
        for _ in range(n):
            client.get("http://peer/")
    return seen


def secret_file(tmp_path, text: str, name: str = "secret"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_basic_auth_and_bearer_headers(tmp_path):
    basic = Outbound(
        ClientAuth(basic_auth_username="gpufleet", basic_auth_password_file=str(secret_file(tmp_path, "pa:ss word\n"))),
        "alertmanager",
    )
    assert headers_sent(basic) == ["Basic " + base64.b64encode(b"gpufleet:pa:ss word").decode()]
    bearer = Outbound(ClientAuth(bearer_token_file=str(secret_file(tmp_path, "tok.en\r\nsecond line", "t"))), "webhook")
    assert headers_sent(bearer) == ["Bearer tok.en"]
    assert headers_sent(Outbound(ClientAuth(), "webhook")) == [None]


def test_a_rotated_secret_is_sent_once_noticed_and_a_broken_one_is_not(tmp_path, caplog):
    clock = FakeClock()
    path = secret_file(tmp_path, "old\n")
    out = Outbound(ClientAuth(bearer_token_file=str(path)), "ingest.prometheus", clock=clock.monotonic)
    path.write_text("new-and-longer\n")
    assert headers_sent(out) == ["Bearer old"]  # files are looked at no more than once a second
    clock.advance(1.0)
    assert headers_sent(out, 2) == ["Bearer new-and-longer"] * 2
    assert out.reloads == 1

    path.write_text("")  # a Secret caught half-written
    clock.advance(1.0)
    with caplog.at_level(logging.WARNING, logger="gpufleet.server.outbound"):
        assert headers_sent(out) == ["Bearer new-and-longer"]
    assert "cannot be used" in caplog.text and "is empty" in caplog.records[-1].reason

    path.write_text("fixed\n")
    clock.advance(1.0)
    assert headers_sent(out) == ["Bearer fixed"] and out.reloads == 2


def test_unusable_files_are_refused_at_start_naming_the_setting(tmp_path, pki):
    empty = secret_file(tmp_path, "\n")
    with pytest.raises(ValueError, match=r"webhook\.bearer-token-file .* is empty"):
        Outbound(ClientAuth(bearer_token_file=str(empty)), "webhook")
    with pytest.raises(ValueError, match=r"alertmanager\.tls\.ca-file .* cannot load it"):
        Outbound(ClientAuth(ca_file=str(empty)), "alertmanager")
    with pytest.raises(ValueError, match=r"ingest\.prometheus\.tls\.cert-file .* cannot load them"):
        Outbound(ClientAuth(cert_file=str(pki.client_cert), key_file=str(pki.server_key)), "ingest.prometheus")


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--alertmanager.tls.ca-file", "{ca}"], "alertmanager.* settings need alertmanager.url"),
        (
            ["--webhook.url", "http://hooks:8080/x", "--webhook.tls.ca-file", "{ca}"],
            "webhook.tls.* settings need an https:// webhook.url",
        ),
        (
            ["--ingest.prometheus-url", "https://prom:9090", "--ingest.prometheus.basic-auth.username", "u"],
            "go together",
        ),
        (["--alertmanager.url", "https://am:9093", "--alertmanager.tls.key-file", "{ca}"], "go together"),
        (
            [
                "--alertmanager.url",
                "https://am:9093",
                "--alertmanager.basic-auth.username",
                "u",
                "--alertmanager.basic-auth.password-file",
                "{ca}",
                "--alertmanager.bearer-token-file",
                "{ca}",
            ],
            "exclude each other",
        ),
        (["--pull.bearer-token-file", "{ca}"], "unrecognized arguments"),
        (["--webhook.url", "https://hooks", "--webhook.bearer-token-file", "/nonexistent"], "no readable file there"),
    ],
)
def test_client_settings_that_do_not_fit_together_are_refused(pki, argv, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_settings([a.format(ca=pki.ca_cert) for a in argv], env={})


def test_client_settings_come_from_flags_environment_and_the_config_file(tmp_path, pki):
    token = secret_file(tmp_path, "t\n")
    config = tmp_path / "server.yml"
    config.write_text(f"alertmanager.url: https://am:9093\nalertmanager.tls.ca-file: {pki.ca_cert}\n")
    settings = load_settings(
        ["--config.file", str(config), "--alertmanager.bearer-token-file", str(token)],
        env={"GPUFLEET_SERVER_ALERTMANAGER_TLS_INSECURE_SKIP_VERIFY": "true"},
    )
    assert settings.alertmanager_client == ClientAuth(
        ca_file=str(pki.ca_cert), insecure_skip_verify=True, bearer_token_file=str(token)
    )
    assert settings.webhook_client == settings.pull_client == ClientAuth()


@pytest.mark.parametrize("kind", ["alertmanager", "webhook"])
def test_notifiers_send_their_credentials_and_headers(tmp_path, kind):
    token = secret_file(tmp_path, "hunter2\n")
    seen: list[tuple[str | None, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.headers.get("authorization"), request.headers.get("x-scope-orgid")))
        return httpx.Response(200)

    settings = load_settings(
        [
            f"--{kind}.url",
            f"http://{kind}:9093",
            f"--{kind}.bearer-token-file",
            str(token),
            f"--{kind}.http-headers",
            "X-Scope-OrgID=gpu-team",
        ],
        env={},
    )
    (notifier,) = build_notifiers(settings, transport=httpx.MockTransport(handler))

    async def deliver():
        notifier.submit([Transition(make_alert(1), None)])
        await notifier.step()
        await notifier.aclose()

    asyncio.run(deliver())
    assert seen == [("Bearer hunter2", "gpu-team")]


def test_the_prometheus_source_sends_its_credentials_and_headers(tmp_path):
    password = secret_file(tmp_path, "pw\n")
    seen: list[tuple[str | None, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/prometheus/api/v1/query"  # Mimir's prefix kept
        seen.append((request.headers.get("authorization"), request.headers.get("x-scope-orgid")))
        return httpx.Response(200, json={"status": "success", "data": {"resultType": "vector", "result": []}})

    config = tmp_path / "server.yml"
    config.write_text("ingest.prometheus.http-headers: {X-Scope-OrgID: 'team-a|team-b'}\n")
    settings = load_settings(
        [
            "--config.file",
            str(config),
            "--ingest.prometheus-url",
            "http://mimir:8080/prometheus",
            "--ingest.prometheus.basic-auth.username",
            "reader",
            "--ingest.prometheus.basic-auth.password-file",
            str(password),
        ],
        env={},
    )
    source = build_source(settings, transport=httpx.MockTransport(handler))

    async def once():
        try:
            await source.pull_once()
        finally:
            await source.aclose()

    asyncio.run(once())
    assert seen and set(seen) == {("Basic " + base64.b64encode(b"reader:pw").decode(), "team-a|team-b")}


def test_headers_from_flags_environment_and_file():
    settings = load_settings(
        ["--alertmanager.url", "http://am:9093", "--alertmanager.http-headers", " X-Scope-OrgID = a , X-Extra=b=c "],
        env={"GPUFLEET_SERVER_PULL_HTTP_HEADERS": "X-Forwarded-Proto=https"},
    )
    assert settings.alertmanager_client.headers == (("X-Scope-OrgID", "a"), ("X-Extra", "b=c"))
    assert settings.pull_client.headers == (("X-Forwarded-Proto", "https"),)
    assert headers_sent(Outbound(settings.pull_client, "pull")) == [None]  # no Authorization of its own
    with pytest.raises(ConfigError, match=r"webhook\.\* settings need webhook\.url"):
        load_settings(["--webhook.http-headers", "X-A=1"], env={})


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("X-Scope-OrgID", "is not Name=value"),
        ("Bad Name=x", "is not a header name"),
        ("Authorization=Bearer x", "set by the server \\(use basic-auth"),
        ("host=elsewhere", "set by the server"),
        ("X-A=", "printable ASCII value"),
        ("X-A=\u00e9t\u00e9", "printable ASCII value"),
        ("X-A=1,x-a=2", "twice"),
        (",", "at least one"),
    ],
)
def test_bad_headers_are_refused_naming_the_setting(value, fragment):
    with pytest.raises(ConfigError, match=r"ingest\.prometheus\.http-headers.*" + fragment):
        load_settings(
            ["--ingest.prometheus-url", "http://prom:9090", "--ingest.prometheus.http-headers", value], env={}
        )


class _WhoAmI(BaseHTTPRequestHandler):
    """Answers with the common name of the client certificate, and closes: every request is a new handshake."""

    def do_GET(self) -> None:
        subject = dict(pair for rdn in self.connection.getpeercert()["subject"] for pair in rdn)
        body = subject["commonName"].encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.send_header("connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def mtls_server(pki):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki.server_cert, pki.server_key)
    ctx.load_verify_locations(cafile=pki.ca_cert)
    ctx.verify_mode = ssl.CERT_REQUIRED
    server = ThreadingHTTPServer(("127.0.0.1", 0), _WhoAmI)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def test_a_renewed_client_certificate_is_shown_without_a_restart(pki, tmp_path, mtls_server, caplog):
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(pki.client_cert, cert)
    shutil.copy(pki.client_key, key)
    clock = FakeClock()
    out = Outbound(
        ClientAuth(ca_file=str(pki.ca_cert), cert_file=str(cert), key_file=str(key)), "pull", clock=clock.monotonic
    )
    with httpx.Client(verify=out.ssl_context, auth=out.auth) as client:
        assert client.get(mtls_server).text == "client"

        shutil.copy(pki.next_client_cert, cert)  # cert-manager writes the certificate first...
        clock.advance(1.0)
        with caplog.at_level(logging.WARNING, logger="gpufleet.server.outbound"):
            assert client.get(mtls_server).text == "client"  # ...a pair that does not match is not taken
        assert "cannot load them" in caplog.records[-1].reason

        shutil.copy(pki.next_client_key, key)  # ...then the key
        clock.advance(1.0)
        assert client.get(mtls_server).text == "client-next"
        assert out.reloads == 1


def test_a_half_written_certificate_pair_does_not_hold_back_a_renewed_secret(pki, tmp_path, caplog):
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(pki.client_cert, cert)
    shutil.copy(pki.client_key, key)
    token = secret_file(tmp_path, "first\n")
    clock = FakeClock()
    out = Outbound(
        ClientAuth(cert_file=str(cert), key_file=str(key), bearer_token_file=str(token)),
        "webhook",
        clock=clock.monotonic,
    )
    shutil.copy(pki.next_client_cert, cert)  # the key is still the old one
    token.write_text("second\n")
    clock.advance(1.0)
    with caplog.at_level(logging.WARNING, logger="gpufleet.server.outbound"):
        assert headers_sent(out) == ["Bearer second"]
    (warning,) = [r for r in caplog.records if r.levelname == "WARNING"]
    assert warning.file == "client certificate" and out.reloads == 1

    shutil.copy(pki.next_client_key, key)
    clock.advance(1.0)
    assert headers_sent(out) == ["Bearer second"] and out.reloads == 2  # the pair, now whole
