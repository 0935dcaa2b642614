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
import ssl
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import yaml

_TLS_KEYS = frozenset(("cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version"))
_REFUSED_TLS_KEYS = frozenset(("cipher_suites", "curve_preferences", "prefer_server_cipher_suites",
                               "client_allowed_sans"))
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
_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1, "TLS12": ssl.TLSVersion.TLSv1_2,
             "TLS13": ssl.TLSVersion.TLSv1_3}
_BCRYPT_PREFIXES = (b"$2a$", b"$2b$", b"$2y$")
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

    def authenticator(self, check: Callable[[bytes, bytes], bool] | None = None) -> "BasicAuth | None":
        """The basic-auth check for these users (None when the file names none)."""
        return BasicAuth(self.users, check) if self.users else None


def load_web_config(path: str) -> WebConfig:
    """Read and validate a web config file; WebConfigError says what is wrong with it."""
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
    tls = _tls_context(doc.get("tls_server_config"), path)
    users = _users(doc.get("basic_auth_users"), path)
    headers = _headers(doc.get("http_server_config"), path)
    return WebConfig(tls, users, headers)


def _mapping(value: Any, path: str, what: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise WebConfigError(f"{path}: {what} must be a mapping")
    return value


def _known(doc: Mapping[str, Any], keys: frozenset[str], path: str, prefix: str) -> None:
    for key in doc:
        if key not in keys:
            raise WebConfigError(f"{path}: unknown key '{prefix}{key}'")


def _tls_context(section: Any, path: str) -> ssl.SSLContext | None:
    """The server context for tls_server_config (None when the section is absent or empty)."""
    if not section:
        return None
    _mapping(section, path, "tls_server_config")
    for key in section:
        if key in _REFUSED_TLS_KEYS:
            raise WebConfigError(f"{path}: tls_server_config.{key} is not supported by gpufleet (Python's ssl "
                                 "module); remove it or terminate TLS in front of the agent")
    _known(section, _TLS_KEYS, path, "tls_server_config.")
    cert, key = section.get("cert_file"), section.get("key_file")
    if not cert or not key:
        raise WebConfigError(f"{path}: tls_server_config needs both cert_file and key_file")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _version(section.get("min_version", "TLS12"), path, "min_version")
    if "max_version" in section:
        ctx.maximum_version = _version(section["max_version"], path, "max_version")
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise WebConfigError(f"{path}: cannot load cert_file {cert} / key_file {key}: {_reason(exc)}") from None
    auth = section.get("client_auth_type", "NoClientCert")
    if auth not in _CLIENT_AUTH:
        raise WebConfigError(f"{path}: tls_server_config.client_auth_type {auth!r} is not one of "
                             f"{', '.join(_CLIENT_AUTH)}")
    mode = _CLIENT_AUTH[auth]
    if mode is None:
        raise WebConfigError(f"{path}: client_auth_type {auth} (a client certificate asked for but not verified) "
                             "is not supported; use VerifyClientCertIfGiven or RequireAndVerifyClientCert")
    ca = section.get("client_ca_file")
    if mode != ssl.CERT_NONE:
        if not ca:
            raise WebConfigError(f"{path}: client_auth_type {auth} needs client_ca_file")
        try:
            ctx.load_verify_locations(cafile=str(ca))
        except (OSError, ssl.SSLError) as exc:
            raise WebConfigError(f"{path}: cannot load client_ca_file {ca}: {_reason(exc)}") from None
        ctx.verify_mode = mode
    elif ca:
        raise WebConfigError(f"{path}: client_ca_file is set but client_auth_type is NoClientCert: set "
                             "client_auth_type: RequireAndVerifyClientCert (or VerifyClientCertIfGiven)")
    return ctx


def _version(value: Any, path: str, key: str) -> ssl.TLSVersion:
    if value not in _VERSIONS:
        raise WebConfigError(f"{path}: tls_server_config.{key} {value!r} is not one of {', '.join(_VERSIONS)}")
    return _VERSIONS[value]


def _reason(exc: BaseException) -> str:
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
            raise WebConfigError(f"{path}: basic_auth_users.{user} must be a bcrypt hash ($2y$...), "
                                 "not a plain password")
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
    import bcrypt        # only where basic auth is configured

    return bcrypt.checkpw(password, hashed)


# Checked against when the user is unknown, so a wrong user name costs what a wrong password does.
_DUMMY_HASH = b"$2b$10$FV9eR.BzSzWyKfk.znaVtu0lNqfdEdvTEUdRcGFcLM.5T4TUB07ru"


class BasicAuth:
    """Checks an Authorization header against the configured users; answers are cached per credentials."""

    def __init__(self, users: Mapping[str, bytes], check: Callable[[bytes, bytes], bool] | None = None) -> None:
        self._users = dict(users)
        self._check = check or _bcrypt_check
        self._cache: OrderedDict[bytes, bool] = OrderedDict()
        self._lock = threading.Lock()

    def allows(self, header: str | None) -> bool:
        """Whether `Authorization: Basic ...` names a configured user with the right password."""
        if not header:
            return False
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            user, sep, password = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        if not sep:
            return False
        # The cache key holds no password, only a digest of it together with the user.
        key = hashlib.sha256(user.encode() + b"\0" + password.encode()).digest()
        with self._lock:
            known = self._cache.get(key)
            if known is not None:
                self._cache.move_to_end(key)
                return known
        hashed = self._users.get(user)
        try:
            ok = self._check(password.encode(), hashed or _DUMMY_HASH) and hashed is not None
        except ValueError:            # a malformed hash cannot match anything
            ok = False
        with self._lock:
            self._cache[key] = ok
            while len(self._cache) > _AUTH_CACHE_SIZE:
                self._cache.popitem(last=False)
        return ok
