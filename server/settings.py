"""Server settings from flags, environment and a YAML file (precedence: flag > env > file > default).

Flag names are dotted like Prometheus exporters' (`--pull.interval`); the same names without the
dashes are the config file's keys, and GPUFLEET_SERVER_PULL_INTERVAL style names the environment's.
The config file may also hold an `engine:` mapping handed to EngineConfig.from_mapping. How values are
spelled (booleans, durations, sizes, addresses) and how the layers combine is gpufleet.config, shared
with the agent.
"""

from __future__ import annotations

import argparse
import os
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from gpufleet.config import (
    ConfigError,
    OneLineParser,
    format_address,
    layered,
    parse_bool,
    parse_duration,
    parse_listen_address,
    parse_size,
    read_config_file,
)

from gpufleet.server.shard import JOBLESS_MODES, Shard

if TYPE_CHECKING:
    from gpufleet.server.ingest.base import SourceKind

ENV_PREFIX = "GPUFLEET_SERVER_"


def parse_duration_or_off(text: Any) -> float:
    """A duration, or zero ("0", "0s") for off."""
    return parse_duration(text, allow_zero=True)


def parse_listen(text: Any) -> str:
    """ "HOST:PORT", ":PORT" (all interfaces) or "[v6]:PORT", spelled back as HOST:PORT."""
    return format_address(*parse_listen_address(text))


def parse_url(text: Any) -> str:
    """An http(s) URL without credentials in it."""
    value = str(text).strip()
    if not re.match(r"^https?://[^/\s]+", value):
        raise ValueError("expected an http:// or https:// URL")
    if "@" in value.split("/")[2]:
        raise ValueError(
            "no credentials in the URL (they would show in ps and in logs): use the "
            "basic-auth.* or bearer-token-file settings"
        )
    return value.rstrip("/")


def parse_urls(text: Any) -> tuple[str, ...]:
    """One or more http(s) URLs: a comma-separated string or a list."""
    items = str(text).split(",") if isinstance(text, str) else list(text)
    urls = tuple(parse_url(item) for item in items if str(item).strip())
    if not urls:
        raise ValueError("expected at least one http:// or https:// URL")
    if len(set(urls)) != len(urls):
        raise ValueError("the same URL twice")
    return urls


# What a URL copied from Alertmanager's API documentation ends in; the notifier adds /api/v2/alerts itself.
_ALERTMANAGER_API_PATH = re.compile(r"/api/v[12](?:/alerts)?$")


def parse_alertmanager_urls(text: Any) -> tuple[str, ...]:
    """Alertmanager base URLs, refusing one that names the API path (it would be posted to twice over,
    as /api/v2/alerts/api/v2/alerts, and every notification refused with a 404)."""
    urls = parse_urls(text)
    for url in urls:
        found = _ALERTMANAGER_API_PATH.search(url)
        if found:
            raise ValueError(
                f"{url} ends in the API path {found.group(0)}: give the base URL {url[: found.start()]} "
                "(the server adds /api/v2/alerts)"
            )
    return urls


def parse_shard(text: Any) -> Shard:
    """INDEX/COUNT, such as 2/16 (index from 0)."""
    return Shard.parse(str(text))


def parse_peers(text: Any) -> tuple[str, ...]:
    """The other shards' URLs: http(s) URLs, comma-separated (a list in the file); `dns+` before one
    (`dns+http://gpufleet-shards:9472`, as Thanos spells it) asks every address its name resolves to."""
    items = [str(item).strip() for item in (str(text).split(",") if isinstance(text, str) else list(text))]
    out = []
    for item in filter(None, items):
        dns = item.startswith("dns+")
        out.append(("dns+" if dns else "") + parse_url(item[4:] if dns else item))
    if not out:
        raise ValueError("expected at least one http:// or https:// URL")
    if len(set(out)) != len(out):
        raise ValueError("the same URL twice")
    return tuple(out)


def parse_external_labels(text: Any) -> dict[str, str]:
    """NAME=value pairs (comma-separated, or a mapping in the file) with Prometheus label names."""
    from gpufleet.server.routing import RESERVED_LABELS

    pairs = (
        list(text.items())
        if isinstance(text, Mapping)
        else [item.partition("=")[::2] for item in str(text).split(",") if item.strip()]
    )
    labels: dict[str, str] = {}
    for name, value in pairs:
        name, value = str(name).strip(), str(value).strip()
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", name) or name.startswith("__"):
            raise ValueError(f"{name!r} is not a label name (letters, digits and _, not starting with __)")
        if name in RESERVED_LABELS:
            raise ValueError(f"{name!r} is a label the server sets itself")
        if not value:
            raise ValueError(f"label {name!r} has no value")
        labels[name] = value
    return labels


def parse_runbook_url(text: Any) -> str:
    """An http(s) URL template with the placeholders routing.RUNBOOK_FIELDS."""
    from gpufleet.server.routing import check_runbook_template

    value = str(text).strip()
    if not re.match(r"^https?://[^/\s]+", value):
        raise ValueError("expected an http:// or https:// URL")
    return check_runbook_template(value)


def parse_targets(text: Any) -> tuple[str, ...]:
    """A comma-separated string or a list of HOST:PORT."""
    from gpufleet.server.ingest.targets import StaticTargets, TargetError

    try:
        addresses = StaticTargets.parse(text if isinstance(text, str) else [str(t) for t in text]).addresses
    except TargetError as exc:
        raise ValueError(str(exc)) from None
    # The same agent twice is pulled once: the second is most likely a typo for another node.
    twice = sorted(address for address, n in Counter(addresses).items() if n > 1)
    if twice:
        raise ValueError(f"{', '.join(twice)} listed twice")
    return addresses


# RFC 9110 token characters: what a header name may hold.
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# Set by the server itself, or by the credential settings (a secret does not belong in a flag).
_RESERVED_HEADERS = frozenset(
    ("authorization", "host", "content-length", "content-type", "transfer-encoding", "connection", "user-agent")
)


def parse_headers(value: Any) -> tuple[tuple[str, str], ...]:
    """Extra request headers: a mapping (config file) or "Name=value,Name=value" (flag, environment)."""
    if isinstance(value, Mapping):
        pairs = [(str(k), "" if v is None else str(v)) for k, v in value.items()]
    else:
        pairs = []
        for item in str(value).split(","):
            if item.strip():
                name, sep, text = item.partition("=")
                if not sep:
                    raise ValueError(f"{item.strip()!r} is not Name=value")
                pairs.append((name, text))
    out: dict[str, tuple[str, str]] = {}
    for name, text in pairs:
        name, text = name.strip(), text.strip()
        if not _HEADER_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a header name")
        if name.lower() in _RESERVED_HEADERS:
            raise ValueError(
                f"{name} is set by the server"
                + (" (use basic-auth.* or bearer-token-file)" if name.lower() == "authorization" else "")
            )
        if not text or not text.isprintable() or not text.isascii():
            raise ValueError(f"header {name} needs a printable ASCII value")
        if name.lower() in out:
            raise ValueError(f"header {name} twice")
        out[name.lower()] = (name, text)
    if not out:
        raise ValueError("expected at least one Name=value")
    return tuple(out.values())


def parse_positive_int(text: Any) -> int:
    """A positive integer."""
    value = int(str(text))
    if value <= 0:
        raise ValueError("expected a positive integer")
    return value


def parse_file(text: Any) -> str:
    """The path of a readable file."""
    path = str(text)
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise ValueError("no readable file there")
    return path


def _choice(*options: str) -> Callable[[Any], str]:
    """A parser accepting one of `options`."""

    def parse(text: Any) -> str:
        if str(text) not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return str(text)

    return parse


@dataclass(frozen=True)
class ClientAuth:
    """What the server shows one peer: the settings `PREFIX.tls.*`, `PREFIX.basic-auth.*`,
    `PREFIX.bearer-token-file` and `PREFIX.http-headers`."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure_skip_verify: bool = False
    basic_auth_username: str | None = None
    basic_auth_password_file: str | None = None
    bearer_token_file: str | None = None
    # Sent with every request, e.g. the tenant (X-Scope-OrgID) of a multi-tenant Mimir, Cortex or Thanos.
    headers: tuple[tuple[str, str], ...] = ()

    def uses_tls(self) -> bool:
        """Whether any TLS setting is made (they mean nothing over plain http)."""
        return bool(self.ca_file or self.cert_file or self.key_file or self.insecure_skip_verify)

    def sends_credentials(self) -> bool:
        return bool(self.basic_auth_password_file or self.bearer_token_file)

    def problem(self, prefix: str) -> str | None:
        """What does not fit together, worded for a one-line error (None: nothing)."""
        if bool(self.cert_file) != bool(self.key_file):
            return f"{prefix}.tls.cert-file and {prefix}.tls.key-file go together"
        if bool(self.basic_auth_username) != bool(self.basic_auth_password_file):
            return f"{prefix}.basic-auth.username and {prefix}.basic-auth.password-file go together"
        if self.basic_auth_password_file and self.bearer_token_file:
            return f"{prefix}.basic-auth.* and {prefix}.bearer-token-file exclude each other: pick one"
        return None


@dataclass(frozen=True)
class ServerSettings:
    """Everything `gpufleet-server serve` can be told."""

    listen_address: str = ":9472"
    targets: tuple[str, ...] = ()
    targets_file_sd: str | None = None
    targets_dns: str | None = None
    targets_removed_grace_seconds: float = 300.0
    targets_identity_ttl_seconds: float = 86400.0
    prometheus_url: str | None = None
    prometheus_schema: str = "auto"
    pull_interval_seconds: float = 5.0
    pull_timeout_seconds: float = 4.0
    pull_max_bytes: int = 32 * 1024 * 1024
    pull_concurrency: int = 256
    pull_first_concurrency: int = 8
    pull_max_entries: int = 1_000_000
    pull_max_snapshots: int = 3600
    pull_max_gpus: int = 256
    pull_max_nodes: int = 10_000
    pull_stale_after_seconds: float = 30.0
    pull_clock_offset_min_seconds: float = 10.0
    pull_scheme: str = "http"
    pull_client: ClientAuth = ClientAuth()
    prometheus_client: ClientAuth = ClientAuth()
    storage_path: str = "gpufleet.db"
    storage_retention_seconds: float = 7 * 86400.0
    storage_on_corruption: str = "move-aside"
    alertmanager_urls: tuple[str, ...] = ()
    alertmanager_resend_interval_seconds: float = 60.0
    alertmanager_client: ClientAuth = ClientAuth()
    webhook_url: str | None = None
    webhook_client: ClientAuth = ClientAuth()
    external_url: str | None = None
    alert_external_labels: Mapping[str, str] = field(default_factory=dict)
    alert_runbook_url: str | None = None
    web_config_file: str | None = None
    web_max_connections: int = 1024
    web_read_header_timeout_seconds: float = 5.0
    web_keep_alive_timeout_seconds: float = 5.0
    web_max_requests: int = 2048
    web_max_header_bytes: int = 16384
    web_max_large_answers: int = 32
    log_level: str = "info"
    log_format: str = "json"
    shard: Shard = Shard()
    shard_peers: tuple[str, ...] = ()
    shard_peer_timeout_seconds: float = 2.0
    shard_jobless: str = "node"
    engine: Mapping[str, Any] = field(default_factory=dict)

    def public_url(self) -> str:
        """The URL people and Alertmanager links use to reach this server."""
        if self.external_url:
            return self.external_url
        host, _, port = self.listen_address.rpartition(":")
        return f"http://{host if host not in ('', '0.0.0.0', '::') else 'localhost'}:{port}"


def client_flags(
    prefix: str, dest: str, peer: str, *, bearer: bool = True
) -> dict[str, tuple[str, Callable[[Any], Any], str]]:
    """The TLS and credential flags of one peer the server connects to; their dests are `dest.FIELD`."""
    flags: dict[str, tuple[str, Callable[[Any], Any], str]] = {
        "tls.ca-file": (
            "ca_file",
            parse_file,
            f"CA certificate(s) to check the TLS certificates of {peer} against (default: the system store)",
        ),
        "tls.cert-file": ("cert_file", parse_file, f"client certificate, for {peer} wanting one"),
        "tls.key-file": ("key_file", parse_file, "the client certificate's key"),
        "tls.insecure-skip-verify": (
            "insecure_skip_verify",
            parse_bool,
            f"do not check the certificates of {peer} (testing only; default false)",
        ),
        "basic-auth.username": ("basic_auth_username", str, f"user, for {peer} behind basic auth"),
        "basic-auth.password-file": (
            "basic_auth_password_file",
            parse_file,
            "file holding that user's password (first line; read again when it changes)",
        ),
    }
    if bearer:
        flags["bearer-token-file"] = (
            "bearer_token_file",
            parse_file,
            f"file holding a bearer token for {peer} (first line; read again when it changes)",
        )
    flags["http-headers"] = (
        "headers",
        parse_headers,
        f"extra headers for every request to {peer}, Name=value[,Name=value] (a mapping "
        "in the file), e.g. X-Scope-OrgID=team-a",
    )
    return {f"{prefix}.{name}": (f"{dest}.{field_}", parse, doc) for name, (field_, parse, doc) in flags.items()}


# flag name -> (settings field, parser, help); a field `a.b` is field b of the ClientAuth in field a
FLAGS: dict[str, tuple[str, Callable[[Any], Any], str]] = {
    "web.listen-address": ("listen_address", parse_listen, "address for the API and /metrics (default :9472)"),
    "web.external-url": ("external_url", parse_url, "URL this server is reached at, for links in notifications"),
    "web.config.file": (
        "web_config_file",
        parse_file,
        "TLS and basic auth for the API and /metrics: a Prometheus exporter-toolkit web config",
    ),
    "web.max-connections": (
        "web_max_connections",
        parse_positive_int,
        "most open API connections; more are closed at once (default 1024, less the "
        "file descriptors the server needs beside them)",
    ),
    "web.read-header-timeout": (
        "web_read_header_timeout_seconds",
        parse_duration,
        "close an API connection that has not sent its request head within this (default 5s)",
    ),
    "web.keep-alive-timeout": (
        "web_keep_alive_timeout_seconds",
        parse_duration,
        "close an idle keep-alive API connection after this (uvicorn's --timeout-keep-alive; default 5s)",
    ),
    "web.max-requests": (
        "web_max_requests",
        parse_positive_int,
        "open connections or requests in progress at which a new request is answered 503 (uvicorn's "
        "--limit-concurrency); more than web.max-connections (default 2048)",
    ),
    "web.max-header-bytes": (
        "web_max_header_bytes",
        parse_size,
        "most bytes of an unfinished request head held per connection; beyond, 400 and closed (default 16KiB)",
    ),
    "web.max-large-answers": (
        "web_max_large_answers",
        parse_positive_int,
        "/docs files sent at once, bounding the memory slow readers hold; more wait for one to finish, "
        "then are answered 503 after web.read-header-timeout (default 32)",
    ),
    "targets": ("targets", parse_targets, "comma-separated agent addresses HOST:PORT"),
    "targets.file-sd": ("targets_file_sd", str, "Prometheus file_sd JSON/YAML file of agents, reloaded on change"),
    "targets.dns": ("targets_dns", str, "NAME:PORT resolving to every agent (e.g. a headless Service)"),
    "targets.removed-grace": (
        "targets_removed_grace_seconds",
        parse_duration,
        "resolve the alerts of a node whose agent left discovery, and forget it, after "
        "this long without it (default 5m)",
    ),
    "targets.identity-ttl": (
        "targets_identity_ttl_seconds",
        parse_duration,
        "a node name not answered for this long is no longer pinned to its GPUs, and any target may take it "
        "(default 24h)",
    ),
    "ingest.prometheus-url": (
        "prometheus_url",
        parse_url,
        "read the agents' series from this Prometheus instead of pulling the agents",
    ),
    "ingest.prometheus-schema": (
        "prometheus_schema",
        _choice("auto", "gpufleet", "dcgm"),
        "which series to read: gpufleet (the agents'), dcgm (NVIDIA dcgm-exporter's) or "
        "auto (both; a GPU with both is read from its agent) (default auto)",
    ),
    **client_flags("ingest.prometheus", "prometheus_client", "Prometheus"),
    "pull.interval": ("pull_interval_seconds", parse_duration, "how often to pull every agent (default 5s)"),
    "pull.timeout": ("pull_timeout_seconds", parse_duration, "timeout of one pull (default 4s)"),
    "pull.max-bytes": ("pull_max_bytes", parse_size, "largest accepted /snapshots answer (default 32MiB)"),
    "pull.concurrency": ("pull_concurrency", parse_positive_int, "pulls in flight at once (default 256)"),
    "pull.first-concurrency": (
        "pull_first_concurrency",
        parse_positive_int,
        "first pulls of targets (the engine's warm-up span each) read at once (default 8)",
    ),
    "pull.max-entries": (
        "pull_max_entries",
        parse_positive_int,
        "most JSON values in one /snapshots answer, counted before decoding (default 1000000)",
    ),
    "pull.max-snapshots": (
        "pull_max_snapshots",
        parse_positive_int,
        "most snapshots in one /snapshots answer (default 3600)",
    ),
    "pull.max-gpus": (
        "pull_max_gpus",
        parse_positive_int,
        "most GPUs in one snapshot, and distinct GPU indices per node (default 256)",
    ),
    "pull.max-nodes": ("pull_max_nodes", parse_positive_int, "most nodes tracked at once (default 10000)"),
    "pull.stale-after": (
        "pull_stale_after_seconds",
        parse_duration,
        "mark an agent stale when it sends no new sample for this long (default 30s)",
    ),
    "pull.clock-offset-min": (
        "pull_clock_offset_min_seconds",
        parse_duration_or_off,
        "take an agent's clock offset out of its sample times once it is this large (default 10s; 0s: never)",
    ),
    "pull.scheme": ("pull_scheme", _choice("http", "https"), "http or https, for every agent (default http)"),
    **client_flags("pull", "pull_client", "the agents", bearer=False),
    "storage.path": ("storage_path", str, "SQLite file for alerts (default gpufleet.db)"),
    "storage.retention": ("storage_retention_seconds", parse_duration, "keep resolved alerts this long (default 7d)"),
    "storage.on-corruption": (
        "storage_on_corruption",
        _choice("move-aside", "refuse"),
        "a store file SQLite finds damaged at start: move-aside (renamed to <file>.damaged-<time>, named in "
        "the log, and a fresh store started) or refuse (exit 2) (default move-aside)",
    ),
    "alertmanager.url": (
        "alertmanager_urls",
        parse_alertmanager_urls,
        "Alertmanager base URL, e.g. http://alertmanager:9093; comma-separated for every replica "
        "of an HA cluster (each gets every alert, as from Prometheus)",
    ),
    "alertmanager.resend-interval": (
        "alertmanager_resend_interval_seconds",
        parse_duration,
        "re-send firing alerts this often (default 1m)",
    ),
    **client_flags("alertmanager", "alertmanager_client", "Alertmanager"),
    "webhook.url": ("webhook_url", parse_url, "URL receiving a JSON POST per alert state change"),
    **client_flags("webhook", "webhook_client", "the webhook receiver"),
    "alert.external-labels": (
        "alert_external_labels",
        parse_external_labels,
        "labels added to every alert (Alertmanager, webhook, REST, /metrics), "
        "NAME=value[,NAME=value] (a mapping in the file), e.g. cluster=eu-1,site=ams",
    ),
    "alert.runbook-url": (
        "alert_runbook_url",
        parse_runbook_url,
        "runbook link template for every alert, with {kind}, {alertname}, {cause}, {id}, {node}, "
        "{gpu}, {hpc_job}, e.g. https://wiki.example.com/gpu/{kind}",
    ),
    "shard": (
        "shard",
        parse_shard,
        "judge only shard INDEX/COUNT of the fleet, e.g. 2/16 (index from 0, as a StatefulSet ordinal): "
        "the jobs whose id hashes to INDEX, and the GPUs of no job by their node (default 0/1: all)",
    ),
    "shard.peers": (
        "shard_peers",
        parse_peers,
        "the shards' URLs, comma-separated, or dns+http://NAME:PORT for every address of a headless "
        "Service: /alerts, /incidents, /jobs, /nodes and / with ?scope=fleet ask each and show the whole fleet",
    ),
    "shard.peer-timeout": (
        "shard_peer_timeout_seconds",
        parse_duration,
        "how long a fleet view waits for each peer shard's answer (default 2s)",
    ),
    "shard.jobless": (
        "shard_jobless",
        _choice(*JOBLESS_MODES),
        "node|fleet: GPUs of no job read by a shard: its nodes' (node, the default: the read follows its share), "
        "or the whole fleet's, so that jobs inferred among them are judged whole (fleet)",
    ),
    "log.level": ("log_level", _choice("debug", "info", "warning", "error"), "debug|info|warning|error"),
    "log.format": ("log_format", _choice("json", "text"), "json|text"),
}


def sample_sources() -> tuple[SourceKind, ...]:
    """Where samples can come from, in the order they are tried: the first kind the settings select reads
    them, and the agents, pulled, need no setting and come last. A source's module holds its kind and its
    flags are above; the modules load here, when a server is built, not when settings are read."""
    from gpufleet.server.ingest import prometheus, puller

    return (prometheus.SOURCE, puller.SOURCE)


def build_parser(prog: str = "gpufleet-server serve") -> argparse.ArgumentParser:
    """The serve command's flags; every value is a raw string, validated in load_settings."""
    description = (
        "Check serve's settings and the files they name without starting; exit 0 with one summary "
        "line, or 2 with the first problem."
        if prog.endswith("check-config")
        else "Pull gpufleet agents, detect stragglers, serve alerts."
    )
    parser = OneLineParser(prog=prog, description=description, allow_abbrev=False)
    parser.add_argument("--config.file", dest="config.file", metavar="FILE", help="YAML config file")
    for flag, (_, _, doc) in FLAGS.items():
        parser.add_argument(f"--{flag}", dest=flag, metavar="VALUE", help=doc)
    return parser


def load_settings(
    argv: Sequence[str], env: Mapping[str, str] | None = None, prog: str = "gpufleet-server serve"
) -> ServerSettings:
    """Merge flags, environment and config file; raises ConfigError naming the first bad setting."""
    env = os.environ if env is None else env
    args = vars(build_parser(prog).parse_args(list(argv)))
    config_file = args.pop("config.file") or env.get(ENV_PREFIX + "CONFIG_FILE") or None
    file_values, engine = _read_config_file(config_file) if config_file else ({}, {})
    parsed = layered(
        {flag: parse for flag, (_, parse, _) in FLAGS.items()},
        flags=args,
        environ=env,
        env_prefix=ENV_PREFIX,
        file_values=file_values,
        file_path=config_file,
    )
    values: dict[str, Any] = {"engine": engine}
    for flag, value in parsed.items():
        values[FLAGS[flag][0]] = value
    for dest in [d for d in values if "." in d]:
        outer, inner = dest.split(".")
        values[outer] = replace(values.get(outer, ClientAuth()), **{inner: values.pop(dest)})
    settings = ServerSettings(**values)
    if settings.pull_timeout_seconds > settings.pull_interval_seconds:
        # As Prometheus refuses a scrape timeout above its interval: pulls would pile up behind each other.
        raise ConfigError(
            f"pull.timeout ({settings.pull_timeout_seconds:g}s) must not exceed pull.interval "
            f"({settings.pull_interval_seconds:g}s)"
        )
    if settings.pull_max_gpus > 256:
        raise ConfigError(f"pull.max-gpus ({settings.pull_max_gpus}) must not exceed 256, the snapshot contract's most")
    if settings.web_max_requests <= settings.web_max_connections:
        # uvicorn counts open connections against it too: at or below, a connection flood answers every request 503.
        raise ConfigError(
            f"web.max-requests ({settings.web_max_requests}) must exceed web.max-connections "
            f"({settings.web_max_connections})"
        )
    _check_clients(settings)
    # The shard carries how it reads GPUs of no job, so every part that reads or filters for it agrees.
    settings = replace(settings, shard=replace(settings.shard, jobless=settings.shard_jobless))
    if settings.prometheus_url and (settings.targets or settings.targets_file_sd or settings.targets_dns):
        # Two sources for the same agents would feed the engine every sample twice, under two timestamps.
        raise ConfigError(
            "ingest.prometheus-url reads the agents through Prometheus: drop targets, "
            "targets.file-sd and targets.dns, or drop ingest.prometheus-url"
        )
    if settings.prometheus_schema != "auto" and not settings.prometheus_url:
        raise ConfigError(
            "ingest.prometheus-schema chooses the series read from Prometheus: set ingest.prometheus-url too"
        )
    return settings


def _check_clients(settings: ServerSettings) -> None:
    """TLS and credential settings that only make sense together, or with a peer to use them on."""
    peers = (
        ("pull", settings.pull_client, ("https://",) if settings.pull_scheme == "https" else (), "pull.scheme"),
        ("ingest.prometheus", settings.prometheus_client, _listed(settings.prometheus_url), "ingest.prometheus-url"),
        ("alertmanager", settings.alertmanager_client, settings.alertmanager_urls, "alertmanager.url"),
        ("webhook", settings.webhook_client, _listed(settings.webhook_url), "webhook.url"),
    )
    for prefix, auth, urls, url_flag in peers:
        problem = auth.problem(prefix)
        if problem:
            raise ConfigError(problem)
        if prefix == "pull":
            if auth.uses_tls() and not urls:
                raise ConfigError("pull.tls.* settings need pull.scheme https")
            continue
        if not urls and auth != ClientAuth():
            raise ConfigError(f"{prefix}.* settings need {url_flag}")
        if auth.uses_tls() and any(not url.startswith("https://") for url in urls):
            raise ConfigError(f"{prefix}.tls.* settings need an https:// {url_flag}")


def _listed(url: str | None) -> tuple[str, ...]:
    return (url,) if url else ()


def _read_config_file(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The file's flag settings and its `engine:` mapping; unknown keys are an error."""
    doc = dict(read_config_file(path, (*FLAGS, "engine")))
    engine = doc.pop("engine", None) or {}
    if not isinstance(engine, dict):
        raise ConfigError(f"config file {path}: 'engine' must be a mapping")
    return doc, engine
