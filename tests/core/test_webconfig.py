"""--web.config.file: the exporter-toolkit format read and refused, basic auth, and TLS / mutual TLS on a real
agent server bound to 127.0.0.1 (certificates made with the openssl command)."""

from __future__ import annotations

import base64
import http.client
import shutil
import ssl

import bcrypt
import orjson
import pytest

from gpufleet.agent.cli import main
from gpufleet.agent.sampler import Sampler
from gpufleet.agent.store import SnapshotStore
from gpufleet.webconfig import BasicAuth, WebConfig, WebConfigError, load_web_config
from gpufleet.agent.webserver import AgentHttpServer
from tests.agent.fakes import FakeClock, StubReader
from tests.tlsfiles import OPENSSL, make_pki, needs_openssl

# Cost 4, the lowest bcrypt takes: the format is the same, the test stays fast.
HASH = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()


def creds(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if OPENSSL is None:
        pytest.skip("the openssl command is needed to make test certificates")
    return make_pki(tmp_path_factory.mktemp("pki"))


def write(tmp_path, text: str) -> str:
    path = tmp_path / "web.yml"
    path.write_text(text)
    return str(path)


# --- reading the file -------------------------------------------------------------------------------------


def test_an_empty_file_asks_for_nothing(tmp_path):
    web = load_web_config(write(tmp_path, ""))
    assert web.tls is None and not web.users and not web.headers and web.authenticator() is None


def test_users_and_headers_are_read(tmp_path):
    web = load_web_config(
        write(
            tmp_path,
            f"basic_auth_users:\n  prometheus: '{HASH}'\nhttp_server_config:\n  headers:\n    X-Frame-Options: deny\n",
        )
    )
    assert web.users == {"prometheus": HASH.encode()} and web.headers == {"X-Frame-Options": "deny"}
    assert web.tls is None


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("tls_server_config: {cert_file: a}\n", "needs both cert_file and key_file"),
        ("basic_auth_users: {prometheus: hunter2}\n", "must be a bcrypt hash"),
        ("basic_auth_users: {'a:b': '" + HASH + "'}\n", "not a valid user name"),
        ("basic_auth: {}\n", "unknown key 'basic_auth'"),
        ("http_server_config: {headers: {'X-A': \"a\\r\\nb\"}}\n", "bad header"),
        ("http_server_config: {compression: true}\n", "unknown key 'http_server_config.compression'"),
        ("- a list\n", "must be a mapping"),
        ("tls_server_config: [\n", "not valid YAML"),
    ],
)
def test_a_bad_file_is_refused_by_name(tmp_path, text, fragment):
    with pytest.raises(WebConfigError, match=fragment.replace("(", r"\(")):
        load_web_config(write(tmp_path, text))


def test_an_unreadable_file_is_refused(tmp_path):
    with pytest.raises(WebConfigError, match="cannot read"):
        load_web_config(str(tmp_path / "missing.yml"))


@needs_openssl
@pytest.mark.parametrize(
    "extra, fragment",
    [
        ("  cipher_suites: [TLS_AES_128_GCM_SHA256]\n", "cipher_suites is not supported"),
        ("  client_auth_type: RequireAnyClientCert\n", "asked for but not verified"),
        ("  client_auth_type: Sometimes\n", "is not one of"),
        ("  client_auth_type: RequireAndVerifyClientCert\n", "needs client_ca_file"),
        ("  client_ca_file: {ca}\n", "client_auth_type is NoClientCert"),
        ("  min_version: SSL3\n", "min_version 'SSL3' is not one of"),
        ("  session_tickets: false\n", "unknown key 'tls_server_config.session_tickets'"),
    ],
)
def test_tls_settings_that_cannot_be_honoured_are_refused(tmp_path, pki, extra, fragment):
    text = f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n" + extra.format(
        ca=pki.ca_cert
    )
    with pytest.raises(WebConfigError, match=fragment):
        load_web_config(write(tmp_path, text))


@needs_openssl
def test_a_key_that_does_not_match_its_certificate_is_refused(tmp_path, pki):
    text = f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.client_key}\n"
    with pytest.raises(WebConfigError, match="cannot load cert_file"):
        load_web_config(write(tmp_path, text))


# --- basic auth -------------------------------------------------------------------------------------------


class CountingCheck:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, password: bytes, hashed: bytes) -> bool:
        self.calls += 1
        return bcrypt.checkpw(password, hashed)


def test_basic_auth_takes_the_right_password_only():
    # htpasswd writes $2y$ hashes, exporter-toolkit's documentation too.
    auth = BasicAuth({"prometheus": HASH.encode(), "grafana": b"$2y$" + HASH.encode()[4:]})
    assert auth.allows(creds("prometheus", "s3cret")) and auth.allows(creds("grafana", "s3cret"))
    assert not auth.allows(creds("prometheus", "s3cret "))
    assert not auth.allows(creds("nobody", "s3cret"))


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer abc",
        "Basic !!!",
        "Basic " + base64.b64encode(b"no-colon").decode(),
        "Basic " + base64.b64encode(b"\xff:\xfe").decode(),
    ],
)
def test_malformed_authorization_headers_are_refused(header):
    assert not BasicAuth({"prometheus": HASH.encode()}).allows(header)


def test_an_answer_is_kept_so_scrapes_do_not_pay_bcrypt_each_time():
    check = CountingCheck()
    auth = BasicAuth({"prometheus": HASH.encode()}, check)
    for _ in range(3):
        assert auth.allows(creds("prometheus", "s3cret"))
        assert not auth.allows(creds("prometheus", "wrong"))
    assert check.calls == 2


def test_an_unknown_user_costs_a_bcrypt_check_too():
    check = CountingCheck()
    assert not BasicAuth({"prometheus": HASH.encode()}, check).allows(creds("admin", "s3cret"))
    assert check.calls == 1


def test_an_unknown_user_is_checked_at_the_highest_configured_cost():
    # bcrypt's time doubles per cost step: a dummy hash cheaper than the real ones would tell, by the time
    # of the answer, which user names exist.
    seen: list[bytes] = []

    def check(password: bytes, hashed: bytes) -> bool:
        seen.append(hashed)
        return bcrypt.checkpw(password, hashed)

    users = {"prometheus": HASH.encode(), "grafana": bcrypt.hashpw(b"x", bcrypt.gensalt(6))}
    assert not BasicAuth(users, check).allows(creds("admin", "s3cret"))
    assert seen[0].startswith(b"$2b$06$") and len(seen[0]) == 60  # a well-formed hash at cost 6
    assert not BasicAuth({"prometheus": HASH.encode()}, check).allows(creds("admin", ""))
    assert seen[1].startswith(b"$2b$04$")


# --- a real server ----------------------------------------------------------------------------------------


@pytest.fixture()
def serve():
    servers = []

    def start(web: WebConfig) -> AgentHttpServer:
        clock = FakeClock()
        store = SnapshotStore()
        Sampler(
            StubReader(), store, node="dgx-017", clock=clock.time, monotonic=clock.monotonic, jitter=lambda: 0.5
        ).run_once()
        server = AgentHttpServer(store, host="127.0.0.1", port=0, interval=1.0, clock=clock.time, web=web)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def request(server, path, *, context=None, headers=None, method="GET"):
    if context is None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", server.port, timeout=10, context=context)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def client_context(pki, cert=False, ca=None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca or pki.ca_cert))
    if cert:
        ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    return ctx


def test_basic_auth_guards_every_endpoint_but_healthz(serve):
    server = serve(WebConfig(users={"prometheus": HASH.encode()}, headers={"X-Frame-Options": "deny"}))
    status, headers, body = request(server, "/metrics")
    assert status == 401 and headers["WWW-Authenticate"].startswith('Basic realm="gpufleet-agent"')
    assert orjson.loads(body)["error"] == "unauthorized"
    assert request(server, "/snapshots", headers={"Authorization": creds("prometheus", "nope")})[0] == 401
    assert request(server, "/snapshots", method="POST")[0] == 401
    status, headers, body = request(server, "/metrics", headers={"Authorization": creds("prometheus", "s3cret")})
    assert status == 200 and b"gpufleet_gpu_utilization_ratio{" in body and headers["X-Frame-Options"] == "deny"
    assert request(server, "/healthz")[0] == 200


def tls_context(tmp_path, pki, extra: str = "") -> ssl.SSLContext:
    tls = load_web_config(
        write(tmp_path, f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n{extra}")
    ).tls
    assert tls is not None
    return tls


@needs_openssl
def test_tls_serves_https_and_nothing_in_the_clear(serve, pki, tmp_path):
    server = serve(WebConfig(tls=tls_context(tmp_path, pki)))
    status, _, body = request(server, "/snapshot", context=client_context(pki))
    assert status == 200 and orjson.loads(body)["node"] == "dgx-017"
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        request(server, "/snapshot")
    with pytest.raises(ssl.SSLCertVerificationError):
        request(server, "/snapshot", context=client_context(pki, ca=pki.other_ca_cert))
    # A failed handshake costs its own connection only.
    assert request(server, "/healthz", context=client_context(pki))[0] == 200


@needs_openssl
def test_mutual_tls_wants_a_client_certificate_from_the_ca(serve, pki, tmp_path):
    tls = tls_context(
        tmp_path, pki, f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca_cert}\n"
    )
    server = serve(WebConfig(tls=tls))
    assert request(server, "/snapshot", context=client_context(pki, cert=True))[0] == 200
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
        request(server, "/snapshot", context=client_context(pki))


@pytest.mark.usefixtures("restore_logging")
def test_the_agent_refuses_a_bad_web_config_in_one_line(tmp_path, capsys):
    path = write(tmp_path, "basic_auth_users: {prometheus: hunter2}\n")
    assert main(["--simulate", "hgx-h100", "--web.listen-address", "127.0.0.1:0", "--web.config.file", path]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpufleet-agent: error: --web.config.file:") and "bcrypt" in err and "\n" not in err


# --- renewed certificates ---------------------------------------------------------------------------------


def renewable(pki, tmp_path):
    """The server's certificate and key copied where a renewal can overwrite them, a hand-moved clock, and
    a web config serving them."""
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(pki.server_cert, cert)
    shutil.copy(pki.server_key, key)
    now = [0.0]
    web = load_web_config(
        write(tmp_path, f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"), clock=lambda: now[0]
    )
    return cert, key, now, web


def peer_name(server, pki) -> str:
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
        with client_context(pki).wrap_socket(raw, server_hostname="127.0.0.1") as conn:
            return dict(item[0] for item in conn.getpeercert()["subject"])["commonName"]


@needs_openssl
def test_a_renewed_certificate_is_served_without_a_restart(serve, pki, tmp_path):
    cert, key, now, web = renewable(pki, tmp_path)
    server = serve(web)
    assert peer_name(server, pki) == "server"
    # cert-manager writes the pair anew: the key first, so for a moment it does not match the certificate.
    shutil.copy(pki.next_key, key)
    now[0] += 5
    assert peer_name(server, pki) == "server" and web.reloading.reloads == 0
    shutil.copy(pki.next_cert, cert)
    assert peer_name(server, pki) == "server"  # checked at most once a second
    now[0] += 5
    assert peer_name(server, pki) == "server-next" and web.reloading.reloads == 1


@needs_openssl
def test_an_asyncio_server_holding_the_context_serves_the_renewed_certificate_too(pki, tmp_path):
    """uvicorn binds its context once, at start: the switch must work on asyncio's TLS as well."""
    import asyncio

    cert, key, now, web = renewable(pki, tmp_path)

    async def scenario() -> list[str]:
        async def answer(reader, writer):
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=web.tls)
        port = server.sockets[0].getsockname()[1]
        names = []
        for _ in range(2):
            _, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=client_context(pki), server_hostname="127.0.0.1"
            )
            subject = writer.get_extra_info("peercert")["subject"]
            names.append(dict(item[0] for item in subject)["commonName"])
            writer.close()
            shutil.copy(pki.next_cert, cert)
            shutil.copy(pki.next_key, key)
            now[0] += 5
        server.close()
        await server.wait_closed()
        return names

    assert asyncio.run(scenario()) == ["server", "server-next"]
