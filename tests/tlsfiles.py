"""Test PKI made with the openssl command: a CA, a server certificate for 127.0.0.1 and a client one."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

OPENSSL = shutil.which("openssl")
needs_openssl = pytest.mark.skipif(OPENSSL is None, reason="the openssl command is needed to make test certificates")


@dataclass(frozen=True)
class Pki:
    """Paths of the PEM files."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca_cert: Path  # a CA that signed neither certificate
    next_cert: Path  # the server's renewed certificate (CN server-next), as cert-manager would write it
    next_key: Path
    next_client_cert: Path  # the client's renewed certificate (CN client-next)
    next_client_key: Path


def make_pki(root: Path) -> Pki:
    """Every file under root (EC keys: fast to make)."""

    def run(*args: str) -> None:
        subprocess.run([OPENSSL, *args], check=True, capture_output=True, timeout=60)

    def key(name: str) -> Path:
        path = root / f"{name}.key"
        run("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))
        return path

    def ca(name: str) -> tuple[Path, Path]:
        k, cert = key(name), root / f"{name}.crt"
        run("req", "-x509", "-new", "-key", str(k), "-subj", f"/CN={name}", "-days", "2", "-out", str(cert))
        return cert, k

    def leaf(name: str, ca_cert: Path, ca_key: Path, ext: str) -> tuple[Path, Path]:
        k, csr, cert = key(name), root / f"{name}.csr", root / f"{name}.crt"
        run("req", "-new", "-key", str(k), "-subj", f"/CN={name}", "-out", str(csr))
        extfile = root / f"{name}.ext"
        extfile.write_text(ext)
        run(
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(ca_cert),
            "-CAkey",
            str(ca_key),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            str(extfile),
            "-out",
            str(cert),
        )
        return cert, k

    ca_cert, ca_key = ca("test-ca")
    server_cert, server_key = leaf(
        "server", ca_cert, ca_key, "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
    )
    client_cert, client_key = leaf("client", ca_cert, ca_key, "extendedKeyUsage=clientAuth\n")
    other_cert, _ = ca("other-ca")
    next_cert, next_key = leaf(
        "server-next", ca_cert, ca_key, "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
    )
    next_client_cert, next_client_key = leaf("client-next", ca_cert, ca_key, "extendedKeyUsage=clientAuth\n")
    return Pki(
        ca_cert,
        server_cert,
        server_key,
        client_cert,
        client_key,
        other_cert,
        next_cert,
        next_key,
        next_client_cert,
        next_client_key,
    )


def web_config_file(path: Path, pki: Pki, user: str, password: str) -> Path:
    """An exporter-toolkit web config at path: HTTPS with the server certificate, client certificates from the
    test CA required, basic auth for one user (bcrypt at its cheapest cost: these are tests)."""
    import bcrypt

    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()
    path.write_text(
        f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki.ca_cert}\n"
        f"basic_auth_users:\n  {user}: '{hashed}'\n"
    )
    return path
