"""The agent's HTTP endpoints on the stdlib ThreadingHTTPServer; every answer comes from the store, never NVML."""

from __future__ import annotations

import logging
import math
import socket
import ssl
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Mapping
from urllib.parse import parse_qs, urlsplit

import orjson

from gpufleet.agent import exposition
from gpufleet.agent.store import Publication, SnapshotStore
from gpufleet.webconfig import OPEN_PATHS, WebConfig

log = logging.getLogger(__name__)

JSON = "application/json"
# An idle keep-alive connection is dropped after this long, so stuck clients cannot pile up threads.
IDLE_TIMEOUT_SECONDS = 30.0
MIN_STALE_SECONDS = 10.0


class AgentHttpServer:
    """Serves /metrics, /snapshot, /snapshots and /healthz from a SnapshotStore on its own thread."""

    def __init__(
        self,
        store: SnapshotStore,
        *,
        host: str = "",
        port: int = 9471,
        interval: float = 1.0,
        clock: Callable[[], float] = time.time,
        poll_interval: float = 0.5,
        web: WebConfig | None = None,
    ) -> None:
        self.store = store
        web = web or WebConfig()
        self.tls = web.tls is not None
        self.auth = web.authenticator()
        self.headers: Mapping[str, str] = dict(web.headers)
        # How often the serve loop checks for shutdown; a few wakeups a second cost nothing measurable.
        self._poll_interval = poll_interval
        self.clock = clock
        # Stale after three missed samples, but never quicker than 10 s: a GC pause is not an outage.
        self.stale_after = max(3 * interval, MIN_STALE_SECONDS)
        self._httpd = _make_server((host, port), self, web.tls)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return self._httpd.server_address[1]

    @property
    def host(self) -> str:
        """The bound address."""
        return self._httpd.server_address[0]

    def start(self) -> None:
        """Serve in a daemon thread."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": self._poll_interval},
                                        name="gpufleet-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the socket (idempotent)."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    # --- responses: (status, content type, body) --------------------------------------------------------

    def metrics(self) -> tuple[int, str, bytes]:
        """Pre-rendered exposition plus the per-scrape age family."""
        pub = self.store.latest()
        if pub is None:
            return _error(HTTPStatus.SERVICE_UNAVAILABLE, "starting", "no sample published yet")
        age = exposition.render_age(self.clock(), pub.snapshot if pub.health.nvml_up else None, pub.health.node)
        return HTTPStatus.OK, exposition.CONTENT_TYPE, pub.metrics + age

    def snapshot(self) -> tuple[int, str, bytes]:
        """The newest snapshot."""
        pub = self.store.latest()
        if pub is None or pub.snapshot_json is None:
            return _error(HTTPStatus.SERVICE_UNAVAILABLE, "no_snapshot", "no snapshot taken yet")
        return HTTPStatus.OK, JSON, pub.snapshot_json

    def snapshots(self, query: str) -> tuple[int, str, bytes]:
        """Buffered snapshots newer than ?since= and, with ?span=, within that many seconds of the newest
        (what a server pulling for the first time asks for), oldest first."""
        params = parse_qs(query, keep_blank_values=True)
        since, span = _query_number(params, "since"), _query_number(params, "span")
        if since is not None and not math.isfinite(since):
            return _error(HTTPStatus.BAD_REQUEST, "bad_since", "since must be unix seconds, e.g. 1763800000.5")
        if span is not None and not (math.isfinite(span) and span > 0):
            return _error(HTTPStatus.BAD_REQUEST, "bad_span", "span must be positive seconds, e.g. 120")
        pub = self.store.latest()
        if span is not None and pub is not None and pub.snapshot is not None:
            floor = pub.snapshot.time - span
            since = floor if since is None else max(since, floor)
        node = pub.health.node if pub is not None else ""
        bodies = self.store.since(since)
        # The answer's own time lets the server measure this node's clock against its own (a node whose
        # clock runs behind would otherwise deliver every sample after the server judged its bin).
        head = (b'{"schema":1,"node":' + orjson.dumps(node) + b',"time":' + orjson.dumps(round(self.clock(), 3))
                + b',"snapshots":[')
        return HTTPStatus.OK, JSON, head + b",".join(bodies) + b"]}"

    def healthz(self) -> tuple[int, str, bytes]:
        """200 while fresh samples flow; 503 with the reason otherwise."""
        pub = self.store.latest()
        status, detail = self._health_status(pub)
        code = HTTPStatus.OK if status == "ok" else HTTPStatus.SERVICE_UNAVAILABLE
        return code, JSON, orjson.dumps({"status": status, **detail})

    def _health_status(self, pub: Publication | None) -> tuple[str, dict]:
        if pub is None:
            return "starting", {}
        detail: dict = {"node": pub.health.node, "nvml_up": pub.health.nvml_up,
                        "stale_after_seconds": self.stale_after}
        if pub.snapshot is not None:
            detail["age_seconds"] = round(max(0.0, self.clock() - pub.snapshot.time), 3)
            detail["gpus"] = len(pub.snapshot.gpus)
        if not pub.health.nvml_up:
            detail["error"] = pub.health.nvml_error
            detail["detail"] = pub.health.nvml_error_detail
            return ("nvml_down" if pub.health.nvml_error else "starting"), detail
        if pub.snapshot is None:
            return "starting", detail
        if detail["age_seconds"] > self.stale_after:
            return "stale", detail
        return "ok", detail


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "gpufleet-agent"
    timeout = IDLE_TIMEOUT_SECONDS
    # Headers and body go out as separate writes; with Nagle on, a keep-alive client's delayed ACK
    # would hold the body back ~40 ms.
    disable_nagle_algorithm = True

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(send_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(send_body=False)

    def _not_allowed(self) -> None:
        if self._authorized(urlsplit(self.path).path, True):
            self._send(*_error(HTTPStatus.METHOD_NOT_ALLOWED, "method_not_allowed", "use GET"), True,
                       {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed  # noqa: N815

    def _answer(self, send_body: bool) -> None:
        app: AgentHttpServer = self.server.app  # type: ignore[attr-defined]
        url = urlsplit(self.path)
        if not self._authorized(url.path, send_body):
            return
        try:
            if url.path == "/metrics":
                response = app.metrics()
            elif url.path == "/snapshot":
                response = app.snapshot()
            elif url.path == "/snapshots":
                response = app.snapshots(url.query)
            elif url.path == "/healthz":
                response = app.healthz()
            else:
                response = _error(HTTPStatus.NOT_FOUND, "not_found",
                                  "endpoints: /metrics /snapshot /snapshots?since= /healthz")
        except Exception:  # a bug must cost one request, not the server thread
            log.exception("request failed", extra={"path": url.path})
            response = _error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal", "internal error")
        self._send(*response, send_body)

    def _authorized(self, path: str, send_body: bool) -> bool:
        """Basic auth where the web config asks for it; answers 401 itself when it fails."""
        auth = self.server.app.auth  # type: ignore[attr-defined]
        if auth is None or path in OPEN_PATHS or auth.allows(self.headers.get("Authorization")):
            return True
        self._send(*_error(HTTPStatus.UNAUTHORIZED, "unauthorized", "valid basic auth credentials required"),
                   send_body, {"WWW-Authenticate": 'Basic realm="gpufleet-agent", charset="UTF-8"'})
        return False

    def _send(self, status: int, content_type: str, body: bytes, send_body: bool,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        for key, value in self.server.app.headers.items():  # type: ignore[attr-defined]
            self.send_header(key, value)
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - signature from http.server
        # Scrapes every few seconds would flood the journal; access lines only at debug level.
        if log.isEnabledFor(logging.DEBUG):
            log.debug("http " + format % args, extra={"client": self.client_address[0]})

    def log_error(self, format: str, *args: object) -> None:  # noqa: A002
        log.debug("http error " + format % args, extra={"client": self.client_address[0]})


def _query_number(params: dict[str, list[str]], name: str) -> float | None:
    """The query's last value of `name` as a float (NaN when it is not a number); None when absent."""
    values = params.get(name)
    if not values:
        return None
    try:
        return float(values[-1])
    except ValueError:
        return math.nan


def _error(status: HTTPStatus, code: str, message: str) -> tuple[int, str, bytes]:
    return status, JSON, orjson.dumps({"error": code, "message": message})


def _make_server(address: tuple[str, int], app: AgentHttpServer,
                 tls: ssl.SSLContext | None = None) -> ThreadingHTTPServer:
    """Bind; an empty host listens on every interface, IPv6 too where the kernel allows dual stack. With
    a TLS context every connection is wrapped in its own handler thread, so a client stalling in the
    handshake holds up only itself, never the accept loop."""
    host, port = address
    family = socket.AF_INET
    if host == "" and socket.has_dualstack_ipv6():
        host, family = "::", socket.AF_INET6
    elif ":" in host:
        family = socket.AF_INET6

    class Server(ThreadingHTTPServer):
        address_family = family
        daemon_threads = True
        # Dropping IPV6_V6ONLY makes "::" accept IPv4 too (as http.server's own CLI does).
        def server_bind(self) -> None:
            if self.address_family == socket.AF_INET6 and host == "::":
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            super().server_bind()

        def finish_request(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
            if tls is None:
                super().finish_request(request, client_address)
                return
            request.settimeout(IDLE_TIMEOUT_SECONDS)
            try:
                conn = tls.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError) as exc:
                # A plain-HTTP client, a bad or missing client certificate, a port scanner.
                log.debug("tls handshake failed", extra={"client": client_address[0], "reason": str(exc)})
                return
            try:
                super().finish_request(conn, client_address)
            finally:
                conn.close()

    server = Server((host or "0.0.0.0", port), _Handler)
    server.app = app  # type: ignore[attr-defined]
    return server
