"""How the server proves itself to agents behind `--web.config.file`: its TLS context and basic-auth user."""

from __future__ import annotations

import ssl


def client_context(ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
                   insecure_skip_verify: bool = False) -> ssl.SSLContext:
    """A client context checking the agents' certificates against ca_file (the system store when None),
    presenting cert_file where an agent asks for a client certificate; ValueError names a file it cannot use."""
    try:
        ctx = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"pull.tls.ca-file {ca_file}: cannot load it ({_reason(exc)})") from None
    if cert_file and key_file:
        try:
            ctx.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"pull.tls.cert-file {cert_file} / pull.tls.key-file {key_file}: cannot load them "
                             f"({_reason(exc)})") from None
    if insecure_skip_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def read_password(path: str) -> str:
    """The first line of a password file (a trailing newline, as `echo` writes one, is not part of it)."""
    try:
        with open(path, encoding="utf-8") as fh:
            password = fh.readline().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"pull.basic-auth.password-file {path}: cannot read it ({_reason(exc)})") from None
    if not password:
        raise ValueError(f"pull.basic-auth.password-file {path} is empty")
    return password


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc) or exc.__class__.__name__
