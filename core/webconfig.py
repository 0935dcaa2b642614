"""`--web.config.file`: TLS and basic auth for the HTTP endpoints, in the Prometheus exporter-toolkit format.

node_exporter, dcgm-exporter and nvidia_gpu_exporter all take this file, so a fleet's existing one (the same
certificate paths, the same bcrypt hashes) works here unchanged:

    tls_server_config:
      cert_file: /etc/gpufleet/tls.crt
      key_file: /etc/gpufleet/tls.key
      client_auth_type: RequireAndVerifyClientCert     # optional; then client_ca_file is required
      client_ca_file: /etc/gpufleet/ca.crt
      min_version: TLS12                                # optional
    basic_auth_users:
      prometheus: $2y$10$...                            # bcrypt, e.g. `htpasswd -nBC 10 "" | tr -d ':\\n'`
    http_server_config:
      headers: {Strict-Transport-Security: max-age=31536000}

What Python's ssl module cannot do is refused by name rather than ignored: asking for a client certificate
without verifying it (RequestClientCert, RequireAnyClientCert), cipher suite and curve lists, and
client_allowed_sans. A security setting silently dropped would be worse than a refusal to start.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
import re
import ssl
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import yaml

log = logging.getLogger(__name__)
_TLS_KEYS = frozenset(("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version"))
_REFUSED_TLS_KEYS = frozenset(
    ("cipher_suites", "curve_preferences", "prefer_server_cipher_suites", "client_allowed_sans")
)
_TOP_KEYS = frozenset(("tls_server_config", "basic_auth_users", "http_server_config"))
_HTTP_KEYS = frozenset(("headers", "http2"))
# exporter-toolkit's client_auth_type -> what ssl verifies; None: Python cannot do it.
_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
    "RequestClientCert": None,
    "RequireAnyClientCert": None,
}
_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
_BCRYPT_PREFIXES = (b"$2a$", b"$2b$", b"$2y$")
# Paths basic auth leaves open, on the agent and the server alike: probes (kubelet, systemd, a load
# balancer) reach them without credentials, and they tell whether the daemon is healthy, never a reading.
OPEN_PATHS = frozenset(("/healthz",))
# Answers of the bcrypt check are kept for this many (user, password) pairs: a scraper sends the same
# credentials every few seconds, and each check costs tens of milliseconds by design.
_AUTH_CACHE_SIZE = 256


class WebConfigError(ValueError):
    """A web config file that cannot be used; str() names the file and the key."""


@dataclass(frozen=True)
class WebConfig:
    """What the file asks for: a server TLS context (None: plain HTTP), users and their bcrypt hashes
    (empty: no authentication), and headers added to every answer."""

    tls: ssl.SSLContext | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    reloading: "ReloadingTls | None" = None  # what keeps `tls` following its files (None: it does not)

    def authenticator(self, check: Callable[[bytes, bytes], bool] | None = None) -> "BasicAuth | None":
        """The basic-auth check for these users (None when the file names none)."""
        return BasicAuth(self.users, check) if self.users else None


def load_web_config(path: str, *, clock: Callable[[], float] = time.monotonic) -> WebConfig:
    """Read and validate a web config file; WebConfigError says what is wrong with it. `clock` paces the
    checks for renewed certificate files (see ReloadingTls)."""
    try:
        with open(path, "rb") as fh:
            doc = yaml.safe_load(fh)
    except OSError as exc:
        raise WebConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError:
        raise WebConfigError(f"{path} is not valid YAML") from None
    if doc is None:
        return WebConfig()
    _mapping(doc, path, "the file")
    _known(doc, _TOP_KEYS, path, "")
    reloading = _tls(doc.get("tls_server_config"), path, clock)
    users = _users(doc.get("basic_auth_users"), path)
    headers = _headers(doc.get("http_server_config"), path)
    return WebConfig(reloading.front if reloading else None, users, headers, reloading)


def _mapping(value: Any, path: str, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise WebConfigError(f"{path}: {what} must be a mapping")
    return value


def _known(doc: Mapping[str, Any], keys: frozenset[str], path: str, prefix: str) -> None:
    for key in doc:
        if key not in keys:
            raise WebConfigError(f"{path}: unknown key '{prefix}{key}'")


@dataclass(frozen=True)
class _TlsSpec:
    """tls_server_config, validated: what a server context is built from, again whenever its files change."""

    path: str
    cert: str
    key: str
    ca: str | None
    mode: ssl.VerifyMode
    minimum: ssl.TLSVersion
    maximum: ssl.TLSVersion | None

    def build(self) -> ssl.SSLContext:
        """A fresh server context from the files as they are now; WebConfigError when they cannot be used."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = self.minimum
        if self.maximum is not None:
            ctx.maximum_version = self.maximum
        try:
            ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise WebConfigError(
                f"{self.path}: cannot load cert_file {self.cert} / key_file {self.key}: {error_reason(exc)}"
            ) from None
        if self.ca is not None:
            try:
                ctx.load_verify_locations(cafile=self.ca)
            except (OSError, ssl.SSLError) as exc:
                raise WebConfigError(
                    f"{self.path}: cannot load client_ca_file {self.ca}: {error_reason(exc)}"
                ) from None
            ctx.verify_mode = self.mode
        return ctx

    def stamp(self) -> tuple:
        """What says the files changed (see files_stamp)."""
        return files_stamp(self.cert, self.key, self.ca)


def files_stamp(*paths: str | None) -> tuple:
    """What says files changed: each one's inode, size and modification time (None: missing or unnamed).
    The inode matters because Kubernetes swaps a Secret's files by renaming a directory link."""
    out = []
    for name in paths:
        try:
            st = os.stat(name) if name else None
        except OSError:
            st = None
        out.append(None if st is None else (st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class ReloadingTls:
    """The server context for tls_server_config, following its files: cert-manager and its kind renew a
    certificate in place every few weeks, and that must not need a restart of every agent.

    The servers hold one front context for good (uvicorn binds its context at start). Its SNI callback,
    which OpenSSL calls in every handshake (with a name or without), hands the connection the newest
    context, rebuilt at most once every `min_interval` seconds when a file's inode, size or time
    changed. A rebuild that fails (a half-written pair, a key from another certificate) is logged and
    the last good context stays."""

    def __init__(
        self, spec: _TlsSpec, *, clock: Callable[[], float] = time.monotonic, min_interval: float = 1.0
    ) -> None:
        self._spec = spec
        self._clock = clock
        self._min_interval = min_interval
        self._lock = threading.Lock()
        self._stamp = spec.stamp()
        self._checked = clock()
        self._failed_stamp: tuple | None = None
        self.front = spec.build()
        self.front.sni_callback = self._switch
        # Until the files change the front context serves as it is (switching a connection to it is a no-op).
        self._current = self.front
        self.reloads = 0

    def current(self) -> ssl.SSLContext:
        """The newest good context."""
        now = self._clock()
        if now - self._checked < self._min_interval:
            return self._current
        with self._lock:
            if now - self._checked >= self._min_interval:
                self._checked = now
                self._reload_if_changed()
            return self._current

    def _reload_if_changed(self) -> None:
        stamp = self._spec.stamp()
        if stamp == self._stamp or stamp == self._failed_stamp:
            return
        try:
            ctx = self._spec.build()
        except WebConfigError as exc:
            self._failed_stamp = stamp
            log.warning("tls files changed but cannot be used; keeping the last good ones", extra={"reason": str(exc)})
            return
        self._current, self._stamp, self._failed_stamp = ctx, stamp, None
        self.reloads += 1
        log.info("tls certificate reloaded", extra={"cert_file": self._spec.cert})

    def _switch(self, conn: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, ctx: ssl.SSLContext) -> None:
        try:
            conn.context = self.current()
        except Exception:  # a reload bug must not fail handshakes: the front context still serves
            log.exception("tls context switch failed")


def _tls(section: Any, path: str, clock: Callable[[], float]) -> ReloadingTls | None:
    """tls_server_config checked and loaded (None when the section is absent or empty)."""
    if not section:
        return None
    _mapping(section, path, "tls_server_config")
    for key in section:
        if key in _REFUSED_TLS_KEYS:
            raise WebConfigError(
                f"{path}: tls_server_config.{key} is not supported by gpufleet (Python's ssl "
                "module); remove it or terminate TLS in front of the agent"
            )
    _known(section, _TLS_KEYS, path, "tls_server_config.")
    cert, key = section.get("cert_file"), section.get("key_file")
    if not cert or not key:
        raise WebConfigError(f"{path}: tls_server_config needs both cert_file and key_file")
    auth = section.get("client_auth_type", "NoClientCert")
    if auth not in _CLIENT_AUTH:
        raise WebConfigError(
            f"{path}: tls_server_config.client_auth_type {auth!r} is not one of {', '.join(_CLIENT_AUTH)}"
        )
    mode = _CLIENT_AUTH[auth]
    if mode is None:
        raise WebConfigError(
            f"{path}: client_auth_type {auth} (a client certificate asked for but not verified) "
            "is not supported; use VerifyClientCertIfGiven or RequireAndVerifyClientCert"
        )
    ca = section.get("client_ca_file")
    if mode != ssl.CERT_NONE and not ca:
        raise WebConfigError(f"{path}: client_auth_type {auth} needs client_ca_file")
    if mode == ssl.CERT_NONE and ca:
        raise WebConfigError(
            f"{path}: client_ca_file is set but client_auth_type is NoClientCert: set "
            "client_auth_type: RequireAndVerifyClientCert (or VerifyClientCertIfGiven)"
        )
    maximum = _version(section["max_version"], path, "max_version") if "max_version" in section else None
    spec = _TlsSpec(
        path,
        str(cert),
        str(key),
        str(ca) if ca else None,
        mode,
        _version(section.get("min_version", "TLS12"), path, "min_version"),
        maximum,
    )
    return ReloadingTls(spec, clock=clock)


def _version(value: Any, path: str, key: str) -> ssl.TLSVersion:
    if value not in _VERSIONS:
        raise WebConfigError(f"{path}: tls_server_config.{key} {value!r} is not one of {', '.join(_VERSIONS)}")
    return _VERSIONS[value]


def error_reason(exc: BaseException) -> str:
    """A loading error in a few words: the OS's for a file, the library's message otherwise."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or exc.__class__.__name__


def _users(section: Any, path: str) -> dict[str, bytes]:
    """basic_auth_users, each hash checked to be bcrypt (a plain password there is a mistake to refuse)."""
    if not section:
        return {}
    _mapping(section, path, "basic_auth_users")
    users = {}
    for user, hashed in section.items():
        if not isinstance(user, str) or not user or ":" in user:
            raise WebConfigError(f"{path}: basic_auth_users: {user!r} is not a valid user name")
        raw = str(hashed or "").encode()
        if not raw.startswith(_BCRYPT_PREFIXES) or len(raw) != 60:
            raise WebConfigError(
                f"{path}: basic_auth_users.{user} must be a bcrypt hash ($2y$...), not a plain password"
            )
        users[user] = raw
    return users


def _headers(section: Any, path: str) -> dict[str, str]:
    if not section:
        return {}
    _mapping(section, path, "http_server_config")
    _known(section, _HTTP_KEYS, path, "http_server_config.")
    headers = section.get("headers") or {}
    _mapping(headers, path, "http_server_config.headers")
    out = {}
    for name, value in headers.items():
        text = str(value)
        if not str(name).strip() or any(c in str(name) + text for c in "\r\n"):
            raise WebConfigError(f"{path}: http_server_config.headers: bad header {name!r}")
        out[str(name)] = text
    return out


def _bcrypt_check(password: bytes, hashed: bytes) -> bool:
    import bcrypt  # only where basic auth is configured

    return bcrypt.checkpw(password, hashed)


# Checked against when the user is unknown, so a wrong user name costs what a wrong password does. Its
# cost is set to the highest among the configured hashes (dummy_hash): bcrypt's time doubles with each
# step, and a cheaper dummy would tell unknown user names from known ones by the time of the answer.
_DUMMY_SALT_AND_DIGEST = b"FV9eR.BzSzWyKfk.znaVtu0lNqfdEdvTEUdRcGFcLM.5T4TUB07ru"
_DEFAULT_COST = 10
_BCRYPT_COST = re.compile(rb"\$2[abxy]?\$(\d\d)\$")


def dummy_hash(hashes: Iterable[bytes]) -> bytes:
    """A bcrypt hash matching no password, at the highest cost among `hashes` (10 when none says)."""
    costs = [int(m.group(1)) for m in map(_BCRYPT_COST.match, hashes) if m and 4 <= int(m.group(1)) <= 31]
    return b"$2b$%02d$" % max(costs, default=_DEFAULT_COST) + _DUMMY_SALT_AND_DIGEST


class BasicAuth:
    """Checks an Authorization header against the configured users; answers are cached per credentials."""

    def __init__(self, users: Mapping[str, bytes], check: Callable[[bytes, bytes], bool] | None = None) -> None:
        self._users = dict(users)
        self._dummy = dummy_hash(self._users.values())
        self._check = check or _bcrypt_check
        self._cache: OrderedDict[bytes, bool] = OrderedDict()
        self._lock = threading.Lock()

    def allows(self, header: str | None) -> bool:
        """Whether `Authorization: Basic ...` names a configured user with the right password."""
        creds = _credentials(header)
        if creds is None:
            return False
        key, user, password = creds
        known = self._known(key)
        if known is not None:
            return known
        hashed = self._users.get(user)
        try:
            ok = self._check(password.encode(), hashed or self._dummy) and hashed is not None
        except ValueError:  # a malformed hash cannot match anything
            ok = False
        with self._lock:
            self._cache[key] = ok
            while len(self._cache) > _AUTH_CACHE_SIZE:
                self._cache.popitem(last=False)
        return ok

    def cached(self, header: str | None) -> bool | None:
        """allows() where that needs no bcrypt check (a malformed header, credentials seen before); None
        where it does, so an event loop can hand only those to a thread."""
        creds = _credentials(header)
        return False if creds is None else self._known(creds[0])

    def _known(self, key: bytes) -> bool | None:
        with self._lock:
            known = self._cache.get(key)
            if known is not None:
                self._cache.move_to_end(key)
            return known


def _credentials(header: str | None) -> tuple[bytes, str, str] | None:
    """(cache key, user, password) of a basic Authorization header; None when it is not one. The key
    holds no password, only a digest of it together with the user."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, sep, password = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    if not sep:
        return None
    return hashlib.sha256(user.encode() + b"\0" + password.encode()).digest(), user, password
