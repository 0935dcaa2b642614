"""Where the agents are: a static list, a Prometheus file_sd file, or a DNS name with many addresses.

Every source answers `targets()` with a sorted list of "host:port" strings; the puller asks again
on each cycle, so file edits and DNS changes (pods coming and going) take effect without a restart.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol, Sequence

import yaml

log = logging.getLogger(__name__)

Resolver = Callable[[str], Sequence[str]]
# gpufleet-agent's default --web.listen-address port: a target given as a bare host means an agent there.
AGENT_PORT = 9471


class TargetError(ValueError):
    """A target specification that cannot be used (bad address, unreadable file_sd content)."""


class TargetSource(Protocol):
    """Anything that can list the agents to pull right now."""

    def targets(self) -> list[str]: ...


def parse_address(text: str, *, default_port: int | None = None) -> str:
    """Normalise "host:port" (IPv6 as "[::1]:9471"); raises TargetError naming the bad address."""
    raw = text.strip()
    if "://" in raw:
        # Taken as HOST:PORT, "http://a:9471" would become "http://a:9471:9471" and fail every pull.
        raise TargetError(f"target {text!r} is a URL: give HOST:PORT (the scheme is pull.scheme, one for every agent)")
    if any(c in raw for c in "/@?# "):
        raise TargetError(f"target {text!r} is not HOST:PORT (no path, user or spaces)")
    host, sep, port = raw.rpartition(":")
    if not sep or (host.count(":") and not host.startswith("[")):
        if default_port is None:
            raise TargetError(f"target {text!r} is not HOST:PORT")
        host, port = raw, str(default_port)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TargetError(f"target {text!r} is not HOST:PORT")
    return f"{host}:{int(port)}"


@dataclass(frozen=True)
class StaticTargets:
    """A fixed list given on the command line or in the config file."""

    addresses: tuple[str, ...]

    @classmethod
    def parse(cls, text: str | Iterable[str]) -> "StaticTargets":
        """Build from "a:1,b:2" or a list of addresses; TargetError on a malformed one."""
        items = text.split(",") if isinstance(text, str) else list(text)
        return cls(tuple(parse_address(item, default_port=AGENT_PORT) for item in items if item.strip()))

    def targets(self) -> list[str]:
        """The configured addresses, sorted and de-duplicated."""
        return sorted(set(self.addresses))


def parse_file_sd(content: bytes, *, name: str = "file_sd") -> list[str]:
    """Addresses from Prometheus file_sd content (JSON or YAML list of {targets: [...], labels: {...}})."""
    try:
        groups = json.loads(content) if content.lstrip()[:1] in (b"[", b"{") else yaml.safe_load(content)
    except (ValueError, yaml.YAMLError) as exc:
        raise TargetError(f"{name}: not valid JSON or YAML ({exc.__class__.__name__})") from None
    if groups is None:
        return []
    if not isinstance(groups, list):
        raise TargetError(f"{name}: expected a list of target groups")
    out: list[str] = []
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or not isinstance(group.get("targets", []), list):
            raise TargetError(f"{name}: group {i} must be a mapping with a 'targets' list")
        out.extend(parse_address(str(t), default_port=AGENT_PORT) for t in group.get("targets", []))
    return sorted(set(out))


class FileSdTargets:
    """A file_sd file, re-read when its mtime, size or content changes; a bad edit keeps the last good list."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int] | None = None
        self._content: bytes | None = None
        self._targets: list[str] = []

    def targets(self) -> list[str]:
        """Current addresses; reloads the file only when it changed since the last call."""
        try:
            st = self.path.stat()
        except OSError as exc:
            log.warning("file_sd unreadable, keeping last targets", extra={"path": str(self.path), "error": str(exc)})
            return list(self._targets)
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._reload(stamp)
        return list(self._targets)

    def _reload(self, stamp: tuple[int, int]) -> None:
        """Read and parse the file; logs and keeps the previous list when it is invalid."""
        try:
            content = self.path.read_bytes()
        except OSError as exc:
            log.warning("file_sd unreadable, keeping last targets", extra={"path": str(self.path), "error": str(exc)})
            return
        self._stamp = stamp
        if content == self._content:
            return
        self._content = content
        try:
            self._targets = parse_file_sd(content, name=str(self.path))
        except TargetError as exc:
            log.error("file_sd invalid, keeping last targets", extra={"path": str(self.path), "error": str(exc)})
            return
        log.info("file_sd loaded", extra={"path": str(self.path), "targets": len(self._targets)})


def system_resolver(host: str) -> list[str]:
    """Every IPv4/IPv6 address the system resolver returns for a name."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class DnsTargets:
    """A name that resolves to many addresses (a Kubernetes headless Service), one target per address."""

    def __init__(self, spec: str, *, resolver: Resolver = system_resolver) -> None:
        address = parse_address(spec, default_port=AGENT_PORT)
        host, _, port = address.rpartition(":")
        self.host, self.port = host, int(port)
        self._resolver = resolver
        self._targets: list[str] = []

    def targets(self) -> list[str]:
        """Resolve now; on a resolver failure keep the last answer so a DNS blip does not drop the fleet."""
        try:
            addresses = self._resolver(self.host)
        except OSError as exc:
            log.warning("dns resolution failed, keeping last targets", extra={"dns_name": self.host, "error": str(exc)})
            return list(self._targets)
        self._targets = sorted({_join(a, self.port) for a in addresses})
        return list(self._targets)


def _join(address: str, port: int) -> str:
    """host:port with IPv6 literals bracketed."""
    return f"[{address}]:{port}" if ":" in address and not address.startswith("[") else f"{address}:{port}"


class CombinedTargets:
    """The union of several sources."""

    def __init__(self, sources: Sequence[TargetSource]) -> None:
        self.sources = tuple(sources)

    def targets(self) -> list[str]:
        """Every source's addresses, sorted and de-duplicated."""
        out: set[str] = set()
        for source in self.sources:
            out.update(source.targets())
        return sorted(out)
