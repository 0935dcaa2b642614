"""How the server proves itself to what it calls: agents, Prometheus, Alertmanager, a webhook receiver.

One ClientAuth per peer says which CAs to trust, which client certificate to show, which credentials
to send (basic auth or a bearer token, read from files: a flag would show in `ps`), and which extra
headers (a tenant id). An Outbound turns it
into what httpx takes, and reads the files again when they change, as Prometheus does for its own
clients: cert-manager renews certificates and Kubernetes rewrites Secrets in place, and neither should
take a restart of the server.
"""

from __future__ import annotations

import base64
import logging
import ssl
import tempfile
import time
from pathlib import Path
from typing import Callable, Generator

import httpx

from gpufleet.webconfig import error_reason, files_stamp
from gpufleet.server.settings import ClientAuth

log = logging.getLogger(__name__)


class Outbound:
    """The TLS context and Authorization header for one peer, following their files.

    `ssl_context` and `auth` go to every httpx client of the peer. httpx runs `auth` before each request:
    that is where a change of the files is noticed (at most once every `min_interval` seconds), in time
    for the request itself. Files that changed but cannot be used (a half-written pair, an empty secret)
    are logged and the last good ones kept. A CA added to ca_file is trusted from then on; one removed
    stays trusted until a restart (OpenSSL adds to a context's trust store, it never takes away).
    """

    def __init__(
        self, auth: ClientAuth, prefix: str, *, clock: Callable[[], float] = time.monotonic, min_interval: float = 1.0
    ) -> None:
        self.settings = auth
        self.prefix = prefix
        self._clock = clock
        self._min_interval = min_interval
        self._secret_file = auth.basic_auth_password_file or auth.bearer_token_file
        self._stamp = self._files_stamp()
        self._failed: dict[int, tuple] = {}  # first index of a part of the stamp -> its unusable state
        self._checked = clock()
        self.ssl_context = self._build_context()
        self.header = self._authorization(self._read_secret()) if self._secret_file else None
        self.auth = _Authorization(self)
        self.reloads = 0

    def refresh(self) -> None:
        """Take up changed files (see the class): the certificate pair, the CA file and the secret each on
        their own, so that a half-written pair holds back neither a renewed password nor a new CA."""
        now = self._clock()
        if now - self._checked < self._min_interval:
            return
        self._checked = now
        stamp = self._files_stamp()
        if stamp == self._stamp:
            return
        s = self.settings
        taken = list(self._stamp)
        for what, part, load in (
            ("client certificate", slice(0, 2), self._reload_cert_chain if s.cert_file and s.key_file else None),
            ("CA file", slice(2, 3), self._load_ca if s.ca_file else None),
            ("secret", slice(3, 4), self._reload_secret if self._secret_file else None),
        ):
            if load is None or stamp[part] == self._stamp[part] or stamp[part] == self._failed.get(part.start):
                continue
            try:
                load()
            except ValueError as exc:
                self._failed[part.start] = stamp[part]
                log.warning(
                    "client credentials changed but cannot be used; keeping the last good ones",
                    extra={"peer": self.prefix, "file": what, "reason": str(exc)},
                )
                continue
            self._failed.pop(part.start, None)
            taken[part] = stamp[part]
            self.reloads += 1
            log.info("client credentials reloaded", extra={"peer": self.prefix, "file": what})
        self._stamp = tuple(taken)

    def _reload_secret(self) -> None:
        self.header = self._authorization(self._read_secret())

    def _files_stamp(self) -> tuple:
        s = self.settings
        return files_stamp(s.cert_file, s.key_file, s.ca_file, self._secret_file)

    def _build_context(self) -> ssl.SSLContext:
        s = self.settings
        try:
            ctx = ssl.create_default_context(cafile=s.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"{self.prefix}.tls.ca-file {s.ca_file}: cannot load it ({error_reason(exc)})") from None
        if s.cert_file and s.key_file:
            try:
                ctx.load_cert_chain(s.cert_file, s.key_file)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(self._pair_error(exc)) from None
        if s.insecure_skip_verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx

    def _reload_cert_chain(self) -> None:
        """Load the renewed pair into the live context, from one copy of the files tried first on a scratch
        context: a failed load_cert_chain can leave a context holding the new certificate without a key."""
        s = self.settings
        assert s.cert_file and s.key_file
        try:
            cert, key = Path(s.cert_file).read_bytes(), Path(s.key_file).read_bytes()
        except OSError as exc:
            raise ValueError(self._pair_error(exc)) from None
        with tempfile.TemporaryDirectory(prefix="gpufleet-tls-") as tmp:
            cert_copy, key_copy = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
            cert_copy.write_bytes(cert)
            key_copy.write_bytes(key)
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert_copy, key_copy)
            except ssl.SSLError as exc:
                raise ValueError(self._pair_error(exc)) from None
            self.ssl_context.load_cert_chain(cert_copy, key_copy)

    def _load_ca(self) -> None:
        try:
            self.ssl_context.load_verify_locations(cafile=self.settings.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"{self.prefix}.tls.ca-file {self.settings.ca_file}: cannot load it ({error_reason(exc)})"
            ) from None

    def _pair_error(self, exc: BaseException) -> str:
        s = self.settings
        return (
            f"{self.prefix}.tls.cert-file {s.cert_file} / {self.prefix}.tls.key-file {s.key_file}: "
            f"cannot load them ({error_reason(exc)})"
        )

    def _read_secret(self) -> str:
        """The secret file's first line (the newline `echo` leaves is not part of it)."""
        flag = "basic-auth.password-file" if self.settings.basic_auth_password_file else "bearer-token-file"
        path = self._secret_file
        try:
            with open(str(path), encoding="utf-8") as fh:
                secret = fh.readline().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.prefix}.{flag} {path}: cannot read it ({error_reason(exc)})") from None
        if not secret:
            raise ValueError(f"{self.prefix}.{flag} {path} is empty")
        return secret

    def _authorization(self, secret: str) -> str:
        user = self.settings.basic_auth_username
        if user is None:
            return f"Bearer {secret}"
        return "Basic " + base64.b64encode(f"{user}:{secret}".encode()).decode("ascii")


class _Authorization(httpx.Auth):
    """Picks up changed files, then sets the peer's Authorization header, if it has one, and its extra
    headers."""

    def __init__(self, outbound: Outbound) -> None:
        self._outbound = outbound

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        self._outbound.refresh()
        request.headers.update(self._outbound.settings.headers)
        if self._outbound.header is not None:
            request.headers["Authorization"] = self._outbound.header
        yield request


def for_peer(auth: ClientAuth, prefix: str, *, https: bool) -> Outbound:
    """One peer's TLS context and credentials; ValueError names a file that cannot be used."""
    if auth.sends_credentials() and not https:
        log.warning("credentials over plain http: they cross the network readable; use https", extra={"peer": prefix})
    return Outbound(auth, prefix)
