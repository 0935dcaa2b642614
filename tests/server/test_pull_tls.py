"""Pulling agents behind `--web.config.file`: the pull.scheme / pull.tls.* / pull.basic-auth.* settings, wired
by serve.build_source, against a real agent HTTP server with TLS, client certificates and basic auth on
127.0.0.1 (certificates made with the openssl command)."""

from __future__ import annotations

import asyncio

import bcrypt
import pytest

from gpufleet.agent.sampler import Sampler
from gpufleet.agent.store import SnapshotStore
from gpufleet.webconfig import load_web_config
from gpufleet.agent.webserver import AgentHttpServer
from gpufleet.server.serve import build_source
from gpufleet.server.settings import ConfigError, load_settings
from tests.agent.fakes import FakeClock, StubReader
from tests.tlsfiles import OPENSSL, make_pki

pytestmark = pytest.mark.skipif(OPENSSL is None, reason="the openssl command is needed to make test certificates")

PASSWORD = "s3cret"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture()
def agent(pki, tmp_path):
    """A real agent with one sample, serving HTTPS, wanting a client certificate and basic auth."""
    web_file = tmp_path / "web.yml"
    web_file.write_text(
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca_cert}\n"
        f"basic_auth_users:\n  gpufleet: '{bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()}'\n"
    )
    clock = FakeClock()
    store = SnapshotStore()
    Sampler(
        StubReader(), store, node="dgx-017", clock=clock.time, monotonic=clock.monotonic, jitter=lambda: 0.5
    ).run_once()
    server = AgentHttpServer(store, host="127.0.0.1", port=0, clock=clock.time, web=load_web_config(str(web_file)))
    server.start()
    yield server
    server.close()


def settings_for(server, pki, tmp_path, *extra: str, password: str = PASSWORD):
    secret = tmp_path / "password"
    secret.write_text(password + "\n")
    return load_settings(
        [
            "--targets",
            f"127.0.0.1:{server.port}",
            "--pull.scheme",
            "https",
            "--pull.tls.ca-file",
            str(pki.ca_cert),
            "--pull.basic-auth.username",
            "gpufleet",
            "--pull.basic-auth.password-file",
            str(secret),
            *extra,
        ],
        env={},
    )


def pull(settings):
    async def once():
        puller = build_source(settings)
        try:
            return await puller.pull_once(), puller.health()[0], dict(puller.errors)
        finally:
            await puller.aclose()

    return asyncio.run(once())


def test_the_server_pulls_an_agent_behind_mutual_tls_and_basic_auth(agent, pki, tmp_path):
    settings = settings_for(
        agent, pki, tmp_path, "--pull.tls.cert-file", str(pki.client_cert), "--pull.tls.key-file", str(pki.client_key)
    )
    result, health, errors = pull(settings)
    assert len(result.samples) == 1 and result.samples[0].node == "dgx-017"
    assert health.up and not errors


def test_a_wrong_password_is_a_counted_401(agent, pki, tmp_path):
    settings = settings_for(
        agent,
        pki,
        tmp_path,
        "--pull.tls.cert-file",
        str(pki.client_cert),
        "--pull.tls.key-file",
        str(pki.client_key),
        password="guess",
    )
    result, health, errors = pull(settings)
    assert not result.samples and not health.up and health.last_error == "http_status: 401"
    assert errors == {(f"127.0.0.1:{agent.port}", "http_status"): 1}


def test_without_a_client_certificate_the_agent_refuses_the_connection(agent, pki, tmp_path):
    result, health, errors = pull(settings_for(agent, pki, tmp_path))
    assert not result.samples and not health.up
    # As an alert during the first read, or as the connection closed under it: either way a counted failure.
    assert errors and set(reason for _, reason in errors) <= {"connect", "tls", "http_error"}


def test_an_agent_certificate_from_another_ca_is_not_trusted(agent, pki, tmp_path):
    settings = settings_for(
        agent, pki, tmp_path, "--pull.tls.cert-file", str(pki.client_cert), "--pull.tls.key-file", str(pki.client_key)
    )
    other = load_settings(
        [
            "--targets",
            f"127.0.0.1:{agent.port}",
            "--pull.scheme",
            "https",
            "--pull.tls.ca-file",
            str(pki.other_ca_cert),
            "--pull.tls.cert-file",
            str(pki.client_cert),
            "--pull.tls.key-file",
            str(pki.client_key),
            "--pull.basic-auth.username",
            "gpufleet",
            "--pull.basic-auth.password-file",
            settings.pull_client.basic_auth_password_file,
        ],
        env={},
    )
    result, health, errors = pull(other)
    assert not result.samples and "certificate verify failed" in health.last_error.lower()


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--pull.tls.ca-file", "{ca}"], "pull.tls.* settings need pull.scheme https"),
        (["--pull.scheme", "https", "--pull.tls.cert-file", "{ca}"], "go together"),
        (["--pull.basic-auth.username", "gpufleet"], "go together"),
        (["--pull.scheme", "ftp"], "expected one of http, https"),
        (["--pull.scheme", "https", "--pull.tls.ca-file", "/nonexistent/ca.pem"], "no readable file there"),
        (["--pull.scheme", "https", "--pull.tls.insecure-skip-verify", "maybe"], "expected true or false"),
    ],
)
def test_settings_that_do_not_fit_together_are_refused(pki, argv, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_settings([a.format(ca=pki.ca_cert) for a in argv], env={})


def test_unusable_files_are_refused_when_the_puller_is_built(pki, tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        build_source(
            load_settings(["--pull.basic-auth.username", "u", "--pull.basic-auth.password-file", str(empty)], env={})
        )
    with pytest.raises(ValueError, match="pull.tls.ca-file .* cannot load it"):
        build_source(load_settings(["--pull.scheme", "https", "--pull.tls.ca-file", str(empty)], env={}))
    with pytest.raises(ValueError, match="cannot load them"):
        build_source(
            load_settings(
                [
                    "--pull.scheme",
                    "https",
                    "--pull.tls.cert-file",
                    str(pki.client_cert),
                    "--pull.tls.key-file",
                    str(pki.server_key),
                ],
                env={},
            )
        )


def test_insecure_skip_verify_accepts_any_certificate(agent, pki, tmp_path):
    settings = load_settings(
        [
            "--targets",
            f"127.0.0.1:{agent.port}",
            "--pull.scheme",
            "https",
            "--pull.tls.insecure-skip-verify",
            "true",
            "--pull.tls.cert-file",
            str(pki.client_cert),
            "--pull.tls.key-file",
            str(pki.client_key),
            "--pull.basic-auth.username",
            "gpufleet",
            "--pull.basic-auth.password-file",
            str(_password_file(tmp_path)),
        ],
        env={},
    )
    result, health, _ = pull(settings)
    assert len(result.samples) == 1 and health.up


def _password_file(tmp_path):
    path = tmp_path / "pw"
    path.write_text(PASSWORD)
    return path
