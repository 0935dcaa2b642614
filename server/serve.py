"""`gpufleet-server serve`: wire settings into source -> engine -> store -> notifiers, and serve the API."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import socket
import ssl
import sys
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

import uvicorn

from gpufleet.logs import configure_logging
from gpufleet.webconfig import WebConfigError, load_web_config
from gpufleet.server.connections import (
    AnswerLimit,
    bounded_protocol,
    limit_accept_error_logs,
    raise_descriptor_limit,
)
from gpufleet.server.ingest.base import SampleSource, SourceKind, Wiring
from gpufleet.server.ingest.owned import ShardedSource
from gpufleet.server.published import Publication, PublishedEngine
from gpufleet.server.ingest.targets import TargetError, parse_file_sd
from gpufleet.server.notify import Notifier
from gpufleet.server.outbound import Outbound, for_peer
from gpufleet.server.routing import AlertRouting
from gpufleet.server.runtime import Runtime
from gpufleet.server.settings import ClientAuth, ConfigError, ServerSettings, load_settings, sample_sources
from gpufleet.server.store import StoreError
from gpufleet.server.store_check import REFUSE, damage, open_checked

log = logging.getLogger(__name__)


def build_engine(settings: ServerSettings) -> Any:
    """The detection engine, configured from the config file's `engine:` mapping."""
    from gpufleet.server.engine import Engine, EngineConfig

    mapping = dict(settings.engine)
    # Live samples reach the engine up to one pull interval (plus a slow pull) after they were taken;
    # a time bin is only evaluated once that lag has passed, unless the config file says otherwise.
    mapping.setdefault("settle_seconds", settings.pull_interval_seconds + settings.pull_timeout_seconds)
    return Engine(EngineConfig.from_mapping(mapping))


def build_notifiers(settings: ServerSettings, *, transport: Any = None) -> list[Notifier]:
    """Alertmanager and webhook notifiers, where configured."""
    from gpufleet.server.notify.alertmanager import AlertmanagerNotifier
    from gpufleet.server.notify.webhook import WebhookNotifier

    out: list[Notifier] = []
    if settings.alertmanager_urls:
        # The replicas of one HA cluster share their web config, so one context and one credential serve them all.
        am = for_peer(settings.alertmanager_client, "alertmanager", https=_https(*settings.alertmanager_urls))
        out.extend(
            AlertmanagerNotifier(
                url,
                external_url=settings.public_url(),
                resend_interval_seconds=settings.alertmanager_resend_interval_seconds,
                transport=transport,
                verify=am.ssl_context,
                auth=am.auth,
            )
            for url in settings.alertmanager_urls
        )
    if settings.webhook_url:
        hook = for_peer(settings.webhook_client, "webhook", https=_https(settings.webhook_url))
        out.append(WebhookNotifier(settings.webhook_url, transport=transport, verify=hook.ssl_context, auth=hook.auth))
    return out


def source_kind(settings: ServerSettings, kinds: Sequence[SourceKind] | None = None) -> SourceKind:
    """The first kind of sample source the settings select (of `kinds`, settings.sample_sources() by default)."""
    for kind in sample_sources() if kinds is None else kinds:
        if kind.selected(settings):
            return kind
    raise ConfigError("no sample source: the settings select none")


def build_source(
    settings: ServerSettings,
    *,
    clock: Callable[[], float] = time.time,
    transport: Any = None,
    parse: Callable[[Any], Any] | None = None,
    kinds: Sequence[SourceKind] | None = None,
) -> SampleSource:
    """Where samples come from: the agents themselves, Prometheus's scrapes of them, or another kind; a
    shard's (--shard) gives the engine only the part it owns."""
    source = source_kind(settings, kinds).build(settings, Wiring(clock=clock, transport=transport, parse=parse))
    return source if settings.shard.whole else ShardedSource(source, settings.shard)


def build_runtime(
    settings: ServerSettings,
    *,
    engine: Any = None,
    clock: Callable[[], float] = time.time,
    transport: Any = None,
    parse: Callable[[Any], Any] | None = None,
    extra_notifiers: Sequence[Notifier] = (),
    source_kinds: Sequence[SourceKind] | None = None,
) -> Runtime:
    """The whole pipeline; engine, clock, HTTP transport, snapshot parser and the kinds of sample source
    to choose from are injectable for tests."""
    engine = engine if engine is not None else build_engine(settings)
    source = build_source(settings, clock=clock, transport=transport, parse=parse, kinds=source_kinds)
    notifiers = build_notifiers(settings, transport=transport) + list(extra_notifiers)
    # Last: the store creates its file, which a start refused for any other reason must not leave behind.
    store = open_checked(
        settings.storage_path,
        on_corruption=settings.storage_on_corruption,
        retention_seconds=settings.storage_retention_seconds,
    )
    if isinstance(source, ShardedSource) and settings.shard.reads_every_jobless:
        engine = PublishedEngine(engine, Publication(settings.shard, lambda: source.parts))
    return Runtime(
        engine=engine,
        source=source,
        store=store,
        notifiers=notifiers,
        pull_interval_seconds=settings.pull_interval_seconds,
        clock=clock,
        routing=AlertRouting(settings.alert_external_labels, settings.alert_runbook_url),
        removed_grace_seconds=settings.targets_removed_grace_seconds,
        shard=settings.shard,
    )


def listen_socket(address: str) -> socket.socket:
    """A listening TCP socket on "HOST:PORT" (":PORT" = every IPv4 interface); OSError when it cannot be had.

    Bound here, before the pipeline starts, so that a taken port or a foreign address is a one-line
    error and exit 2 rather than uvicorn's exit 3 after the first pulls have already gone out.
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
        sock.listen(2048)  # a fleet's scrapers and browsers may all connect in one instant
    except OSError:
        sock.close()
        raise
    return sock


def bound_address(address: str, sock: socket.socket) -> str:
    """`address` with the port the socket was given, when it asked for port 0."""
    host, _, port = address.rpartition(":")
    return f"{host}:{sock.getsockname()[1]}" if port == "0" else address


def uvicorn_server(settings: ServerSettings, app: Any, tls: ssl.SSLContext | None = None) -> uvicorn.Server:
    """A uvicorn server for the app that leaves logging and signals to us (HTTPS with `tls`)."""
    host, _, port = settings.listen_address.rpartition(":")
    protocol = bounded_protocol(settings.web_max_connections, settings.web_read_header_timeout_seconds)
    # The protocol bounds connections; uvicorn's limit_concurrency (answering 503 beyond it) bounds the
    # requests in progress, with room for connections that are being closed to make way for new ones.
    config = uvicorn.Config(
        AnswerLimit(app, "/docs", settings.web_max_large_answers, settings.web_read_header_timeout_seconds),
        host=host or "0.0.0.0",
        port=int(port),
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
        http=protocol,
        limit_concurrency=settings.web_max_requests,
        # uvicorn takes whole seconds; a shorter timeout rounds up to one.
        timeout_keep_alive=max(1, math.ceil(settings.web_keep_alive_timeout_seconds)),
        h11_max_incomplete_event_size=settings.web_max_header_bytes,
    )
    if tls is not None:
        # The context from --web.config.file as it is (minimum version, client CA): uvicorn's own options
        # cannot say all of that. serve() loads a config only once, so this one stands.
        config.load()
        config.ssl = tls
    server = uvicorn.Server(config)
    # Older uvicorn installs its own handlers through this; newer ones have no such method (they hold SIGINT
    # and SIGTERM only during serve() and raise them again after it returns).
    server.install_signal_handlers = lambda: None  # type: ignore[attr-defined,method-assign,unused-ignore]
    return server


async def serve_until_signalled(server: uvicorn.Server, sockets: list[socket.socket] | None = None) -> None:
    """Run uvicorn (on `sockets` when given) until SIGINT/SIGTERM, then shut down gracefully."""
    loop = asyncio.get_running_loop()

    def stop() -> None:
        log.info("shutting down")
        server.should_exit = True

    def hangup() -> None:
        # By default SIGHUP would end the server, which systemd counts as a clean exit and does not restart.
        log.info("SIGHUP: nothing to reload; target, TLS and credential files are re-read when they change")

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    loop.add_signal_handler(signal.SIGHUP, hangup)
    try:
        await server.serve(sockets=sockets)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(sig)


def check_config(argv: Sequence[str] | None = None) -> int:
    """`gpufleet-server check-config [serve's flags]`: everything serve would refuse at start, without starting:
    settings, the web config, the engine's settings, the file_sd file, every TLS and credential file, the
    storage folder, and the store file's integrity where a damaged one would be refused. Exit 0 with one
    summary line, or 2 with the first problem, as `promtool check config`."""
    try:
        settings = load_settings(sys.argv[1:] if argv is None else argv, prog="gpufleet-server check-config")
        if settings.web_config_file:
            try:
                load_web_config(settings.web_config_file)
            except WebConfigError as exc:
                raise ConfigError(f"--web.config.file: {exc}") from None
        build_engine(settings)
        for auth, prefix in _peers(settings):
            Outbound(auth, prefix)
        check_storage_folder(settings)
        targets = len(check_targets(settings, lenient_file=False))
        if settings.storage_on_corruption == REFUSE and (problem := damage(settings.storage_path)):
            raise ConfigError(f"alert store {settings.storage_path} is damaged ({problem}): serve would refuse it")
    except (ConfigError, TargetError, StoreError, ValueError) as exc:
        print(f"gpufleet-server: {exc}", file=sys.stderr)
        return 2
    print(
        f"config OK: reading {source_kind(settings).name}, {targets} listed target(s)"
        f"{' and ' + settings.targets_dns if settings.targets_dns else ''}, "
        f"{len(settings.alertmanager_urls)} Alertmanager(s), webhook {'on' if settings.webhook_url else 'off'}, "
        f"TLS {'on' if settings.web_config_file else 'off'} for the API"
        + ("" if settings.shard.whole else f", shard {settings.shard} with {len(settings.shard_peers)} peer URL(s)")
        + (", every GPU of no job read" if settings.shard.reads_every_jobless else "")
    )
    return 0


def check_targets(settings: ServerSettings, *, lenient_file: bool) -> list[str]:
    """The agents --targets and the file_sd file list; ConfigError when nothing says where the GPUs are, or
    when both list the same agent. With lenient_file (serve) a file_sd file that cannot be read yet is
    left to the runtime, which re-reads it when it changes; check-config names the problem."""
    if not (settings.targets or settings.targets_file_sd or settings.targets_dns or settings.prometheus_url):
        raise ConfigError("no targets: set --targets, --targets.file-sd, --targets.dns or --ingest.prometheus-url")
    listed = list(settings.targets)
    if settings.targets_file_sd:
        try:
            with open(settings.targets_file_sd, "rb") as fh:
                content = fh.read()
        except OSError as exc:
            if lenient_file:
                return listed
            raise ConfigError(f"--targets.file-sd {settings.targets_file_sd}: {exc.strerror or exc}") from None
        try:
            in_file = parse_file_sd(content, name=settings.targets_file_sd)
        except TargetError:
            if lenient_file:
                return listed
            raise
        both = sorted(set(listed) & set(in_file))
        if both:
            raise ConfigError(f"{', '.join(both)} in both --targets and --targets.file-sd {settings.targets_file_sd}")
        listed += in_file
    return listed


def check_storage_folder(settings: ServerSettings) -> None:
    """ConfigError unless the alert store's file can be created (or opened) where --storage.path says."""
    folder = os.path.dirname(os.path.abspath(settings.storage_path))
    if not os.path.isdir(folder):
        raise ConfigError(
            f"cannot open alert store --storage.path {settings.storage_path}: "
            f"cannot write in {folder}: it does not exist"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot open alert store --storage.path {settings.storage_path}: cannot write in {folder}")


def _peers(settings: ServerSettings) -> list[tuple[ClientAuth, str]]:
    """The settings and prefix of every peer the server will call."""
    peer = source_kind(settings).peer
    out = [] if peer is None else [peer(settings)]
    if settings.alertmanager_urls:
        out.append((settings.alertmanager_client, "alertmanager"))
    if settings.webhook_url:
        out.append((settings.webhook_client, "webhook"))
    return out


def _https(*urls: str | None) -> bool:
    return all(url is not None and url.startswith("https://") for url in urls)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse settings, build the pipeline and serve until SIGTERM; exit 2 on bad configuration."""
    from gpufleet.server.api import create_app

    try:
        settings = load_settings(sys.argv[1:] if argv is None else argv)
        try:
            web = load_web_config(settings.web_config_file) if settings.web_config_file else None
        except WebConfigError as exc:
            raise ConfigError(f"--web.config.file: {exc}") from None
        configure_logging(settings.log_level, settings.log_format)
        limit_accept_error_logs()
        raise_descriptor_limit()
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per pull would drown the log
        check_storage_folder(settings)
        check_targets(settings, lenient_file=True)
    except (ConfigError, TargetError, StoreError, ValueError) as exc:
        print(f"gpufleet-server: {exc}", file=sys.stderr)
        return 2
    # Settings first, then the port, then the pipeline and its store: a refused start (a bad setting, a
    # taken port) creates nothing, not even the SQLite file.
    try:
        sock = listen_socket(settings.listen_address)
    except OSError as exc:
        print(
            f"gpufleet-server: cannot listen on --web.listen-address {settings.listen_address!r}: "
            f"{exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    # Port 0 asks the kernel for one: the log and notification links name the port it gave.
    settings = replace(settings, listen_address=bound_address(settings.listen_address, sock))
    if web is not None and web.tls is not None and not settings.external_url:
        settings = replace(settings, external_url=settings.public_url().replace("http://", "https://", 1))
    try:
        runtime = build_runtime(settings)
    except (ConfigError, TargetError, StoreError, ValueError) as exc:
        sock.close()
        print(f"gpufleet-server: {exc}", file=sys.stderr)
        return 2
    app = create_app(settings, runtime=runtime, web=web)
    log.info(
        "gpufleet-server listening",
        extra={
            "address": settings.listen_address,
            "storage": settings.storage_path,
            "url": settings.public_url(),
            "shard": str(settings.shard),
            "shard_jobless": settings.shard.jobless,
        },
    )
    with sock:
        asyncio.run(serve_until_signalled(uvicorn_server(settings, app, web.tls if web else None), [sock]))
    return 0
