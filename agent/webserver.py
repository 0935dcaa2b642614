"""The agent's HTTP endpoints on the stdlib ThreadingHTTPServer; every answer comes from the store, never NVML."""

from __future__ import annotations

import errno
import io
import logging
import math
import socket
import ssl
import sys
import threading
import time
import zlib
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
# Each request must arrive whole (request line, headers, body) within this long of its connection going
# idle, the first request of a connection included; an idle or trickling client is then disconnected.
IDLE_TIMEOUT_SECONDS = 30.0
# Connections served at once, one thread each; more wait in the listen backlog (costing the process no
# descriptor) until one ends. A node is scraped by a handful of clients: this leaves room for a burst
# while keeping threads and descriptors bounded (systemd's LimitNOFILE for the agent is set above it).
MAX_CONNECTIONS = 64
LISTEN_BACKLOG = max(128, socket.SOMAXCONN)
MAX_REQUEST_LINE_BYTES = 8192
# Requests carry no body; a small one is read and discarded so keep-alive stays in step, a larger one
# (or a chunked one) is answered and its connection closed.
MAX_BODY_BYTES = 65536
GZIP_LEVEL = 1  # scrape text is repetitive: level 1 gets most of level 6's ratio for a fraction of the CPU
LOG_EVERY_SECONDS = 60.0
ACCEPT_RETRY_SECONDS = 0.1
_MAX_SOCKET_TIMEOUT = 3600.0
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
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout_seconds: float = IDLE_TIMEOUT_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
        pause: Callable[[float], None] = time.sleep,
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
        self.gzip = GzipCache()
        self.limits = _Limits(max_connections, idle_timeout_seconds, monotonic, pause, poll_interval)
        self._httpd = _make_server((host, port), self, web.tls, self.limits)
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
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": self._poll_interval},
            name="gpufleet-http",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the socket (idempotent)."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    # --- responses: (status, content type, body) --------------------------------------------------------

    def metrics(self, gzip: bool = False) -> tuple[int, str, bytes]:
        """Pre-rendered exposition plus the per-scrape age family; gzipped on request."""
        pub = self.store.latest()
        if pub is None:
            return _error(HTTPStatus.SERVICE_UNAVAILABLE, "starting", "no sample published yet")
        age = exposition.render_age(self.clock(), pub.snapshot if pub.health.nvml_up else None, pub.health.node)
        body = self.gzip.compress(pub.metrics, age) if gzip else pub.metrics + age
        return HTTPStatus.OK, exposition.CONTENT_TYPE, body

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
        now = self.clock()
        # Retention counts back from now: a ring kept through an NVML outage is not served as recent.
        bodies = self.store.since(since, now=now)
        # The answer's own time lets the server measure this node's clock against its own (a node whose
        # clock runs behind would otherwise deliver every sample after the server judged its bin).
        head = (
            b'{"schema":1,"node":' + orjson.dumps(node) + b',"time":' + orjson.dumps(round(now, 3)) + b',"snapshots":['
        )
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
        detail: dict = {"node": pub.health.node, "nvml_up": pub.health.nvml_up, "stale_after_seconds": self.stale_after}
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


class _DeadlineReader(io.RawIOBase):
    """A socket's read side under one deadline per request: a client that trickles its request a byte at a
    time (slowloris) is cut off when the deadline passes, not kept alive by every byte it sends."""

    def __init__(self, sock: socket.socket, monotonic: Callable[[], float]) -> None:
        self._sock = sock
        self._monotonic = monotonic
        self.deadline = float("inf")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def, override]
        remaining = self.deadline - self._monotonic()
        if remaining <= 0:
            raise TimeoutError("request not received in time")
        self._sock.settimeout(min(remaining, _MAX_SOCKET_TIMEOUT))
        return self._sock.recv_into(buffer)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Answers to requests whose version is missing or unusable still carry headers (HTTP/0.9 has none).
    default_request_version = "HTTP/1.1"
    server_version = "gpufleet-agent"
    # Headers and body go out as separate writes; with Nagle on, a keep-alive client's delayed ACK
    # would hold the body back ~40 ms.
    disable_nagle_algorithm = True

    def setup(self) -> None:
        self.timeout = self.server.idle_timeout  # type: ignore[attr-defined]
        super().setup()
        self.rfile.close()
        self._reader = _DeadlineReader(self.connection, self.server.monotonic)  # type: ignore[attr-defined]
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        """Read one request within the idle timeout, drain its body, answer; any method but GET and HEAD
        is 405 JSON. A request that breaks the limits is answered (where possible) and its connection closed."""
        server = self.server
        self.close_connection = True
        self.command, self.requestline, self.request_version = "", "", self.default_request_version
        self._reader.deadline = server.monotonic() + server.idle_timeout  # type: ignore[attr-defined]
        try:
            self.raw_requestline = self.rfile.readline(MAX_REQUEST_LINE_BYTES + 1)
            if not self.raw_requestline:
                return
            if len(self.raw_requestline) > MAX_REQUEST_LINE_BYTES:
                self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG)
                return
            if not self.parse_request():
                return  # parse_request has answered (400, 431, 505)
            drained = self._drain_body()
            if drained is None:
                return
            self.connection.settimeout(server.idle_timeout)  # type: ignore[attr-defined]
            if not drained:
                self.close_connection = True  # the unread body would be taken for the next request
            if self.command not in ("GET", "HEAD"):
                self._not_allowed()
            elif not drained:
                self._send(
                    *_error(
                        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                        "body_too_large",
                        f"request bodies are not used; at most {MAX_BODY_BYTES} bytes are read",
                    ),
                    self.command == "GET",
                )
            else:
                self._answer(send_body=self.command == "GET")
            self.wfile.flush()
        except TimeoutError:
            # An idle keep-alive connection, or a request that did not arrive in time: drop it quietly.
            self.close_connection = True
            log.debug("http connection timed out", extra={"client": self.client_address[0]})

    def _drain_body(self) -> bool | None:
        """Reads and discards a declared body, so the next request on the connection starts where it should:
        True when drained (or none), False when too large or chunked (the connection closes after the
        answer), None when the framing is invalid (answered 400 here)."""
        lengths = self.headers.get_all("Content-Length") or []
        if self.headers.get("Transfer-Encoding") is not None:
            if lengths:  # both: a request smuggling attempt, never valid (RFC 9112 6.3)
                self.send_error(HTTPStatus.BAD_REQUEST, "Content-Length with Transfer-Encoding")
                return None
            return False
        if not lengths:
            return True
        values = {value.strip() for value in lengths}
        if len(values) != 1 or not next(iter(values)).isdigit():
            self.send_error(HTTPStatus.BAD_REQUEST, "invalid Content-Length")
            return None
        length = int(next(iter(values)))
        if length > MAX_BODY_BYTES:
            return False
        while length > 0:
            chunk = self.rfile.read(min(length, 65536))
            if not chunk:
                raise ConnectionResetError("client closed the connection inside a request body")
            length -= len(chunk)
        return True

    def _not_allowed(self) -> None:
        send_body = self.command != "HEAD"
        if self._authorized(urlsplit(self.path).path, send_body):
            self._send(
                *_error(HTTPStatus.METHOD_NOT_ALLOWED, "method_not_allowed", "use GET"),
                send_body,
                {"Allow": "GET, HEAD"},
            )

    def _answer(self, send_body: bool) -> None:
        app: AgentHttpServer = self.server.app  # type: ignore[attr-defined]
        url = urlsplit(self.path)
        if not self._authorized(url.path, send_body):
            return
        headers: dict[str, str] = {}
        try:
            if url.path == "/metrics":
                headers["Vary"] = "Accept-Encoding"
                if _accepts_gzip(self.headers.get_all("Accept-Encoding") or []):
                    response = app.metrics(gzip=True)
                    if response[0] == HTTPStatus.OK:
                        headers["Content-Encoding"] = "gzip"
                else:
                    response = app.metrics()
            elif url.path == "/snapshot":
                response = app.snapshot()
            elif url.path == "/snapshots":
                response = app.snapshots(url.query)
            elif url.path == "/healthz":
                response = app.healthz()
            else:
                response = _error(
                    HTTPStatus.NOT_FOUND, "not_found", "endpoints: /metrics /snapshot /snapshots?since= /healthz"
                )
        except Exception:  # a bug must cost one request, not the server thread
            log.exception("request failed", extra={"path": url.path})
            response, headers = _error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal", "internal error"), {}
        self._send(*response, send_body, headers)

    def _authorized(self, path: str, send_body: bool) -> bool:
        """Basic auth where the web config asks for it; answers 401 itself when it fails."""
        auth = self.server.app.auth  # type: ignore[attr-defined]
        if auth is None or path in OPEN_PATHS or auth.allows(self.headers.get("Authorization")):
            return True
        self._send(
            *_error(HTTPStatus.UNAUTHORIZED, "unauthorized", "valid basic auth credentials required"),
            send_body,
            {"WWW-Authenticate": 'Basic realm="gpufleet-agent", charset="UTF-8"'},
        )
        return False

    def _send(
        self, status: int, content_type: str, body: bytes, send_body: bool, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        for key, value in self.server.app.headers.items():  # type: ignore[attr-defined]
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (bad request line, too many headers, bad version) as JSON, like ours."""
        status = HTTPStatus(code)
        self.close_connection = True
        self._send(
            *_error(status, status.phrase.lower().replace(" ", "_").replace("-", "_"), message or status.description),
            self.command != "HEAD",
        )

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - signature from http.server
        # Scrapes every few seconds would flood the journal; access lines only at debug level.
        if log.isEnabledFor(logging.DEBUG):
            log.debug("http " + format % args, extra={"client": self.client_address[0]})

    def log_error(self, format: str, *args: object) -> None:  # noqa: A002
        log.debug("http error " + format % args, extra={"client": self.client_address[0]})


def _accepts_gzip(values: list[str]) -> bool:
    """Whether Accept-Encoding lists gzip (or *) with a non-zero q."""
    for value in values:
        for item in value.split(","):
            name, _, params = item.partition(";")
            if name.strip().lower() not in ("gzip", "x-gzip", "*"):
                continue
            q = 1.0
            for param in params.split(";"):
                key, _, raw = param.partition("=")
                if key.strip().lower() == "q":
                    try:
                        q = float(raw)
                    except ValueError:
                        q = 0.0
            if q > 0:
                return True
    return False


class GzipCache:
    """gzip of the current /metrics body, compressed once however often it is scraped: the compressor that
    has taken the body is kept, and each scrape copies it to add only its own lines (the sample age)."""

    def __init__(self, level: int = GZIP_LEVEL) -> None:
        self._level = level
        self._lock = threading.Lock()
        self._source: bytes | None = None
        self._head = b""
        self._compressor = zlib.compressobj(level, zlib.DEFLATED, 31)
        self.compressions = 0

    def compress(self, body: bytes, tail: bytes = b"") -> bytes:
        """One gzip member holding body + tail."""
        with self._lock:
            if self._source is not body and self._source != body:
                compressor = zlib.compressobj(self._level, zlib.DEFLATED, 31)
                self._head = compressor.compress(body)
                self._source, self._compressor = body, compressor
                self.compressions += 1
            head, compressor = self._head, self._compressor.copy()
        return head + compressor.compress(tail) + compressor.flush()


class RateLimitedLog:
    """Logs the first of a kind of event at once, then at most once per interval with how many there were,
    so a failure that repeats thousands of times a second (accept failing with EMFILE) costs a line a minute."""

    def __init__(
        self, logger: logging.Logger, interval_seconds: float, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self._log = logger
        self._interval = interval_seconds
        self._monotonic = monotonic
        self._last: dict[str, float] = {}
        self._pending: dict[str, int] = {}
        self.totals: dict[str, int] = {}

    def __call__(self, kind: str, message: str, **context: object) -> None:
        self.totals[kind] = self.totals.get(kind, 0) + 1
        self._pending[kind] = self._pending.get(kind, 0) + 1
        now = self._monotonic()
        if now - self._last.get(kind, float("-inf")) < self._interval:
            return
        self._last[kind] = now
        count = self._pending.pop(kind)
        self._log.warning(message, extra={"kind": kind, "count": count, "interval_seconds": self._interval, **context})


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


def _make_server(
    address: tuple[str, int], app: AgentHttpServer, tls: ssl.SSLContext | None, limits: _Limits
) -> ThreadingHTTPServer:
    """Bind; an empty host listens on every interface, IPv6 too where the kernel allows dual stack. Each
    connection gets its own thread, at most `limits.max_connections` at once; with a TLS context the
    handshake runs in that thread too, so a client stalling in it holds up only itself, never the accept loop."""
    host, port = address
    family = socket.AF_INET
    if host == "" and socket.has_dualstack_ipv6():
        host, family = "::", socket.AF_INET6
    elif ":" in host:
        family = socket.AF_INET6

    class Server(ThreadingHTTPServer):
        address_family = family
        daemon_threads = True
        # A scrape fleet (several Prometheus replicas, the server, ad-hoc curls) may connect at once; the
        # kernel caps this at net.core.somaxconn.
        request_queue_size = LISTEN_BACKLOG
        idle_timeout = limits.idle_timeout_seconds
        monotonic = staticmethod(limits.monotonic)

        # Dropping IPV6_V6ONLY makes "::" accept IPv4 too (as http.server's own CLI does).
        def server_bind(self) -> None:
            if self.address_family == socket.AF_INET6 and host == "::":
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            super().server_bind()

        def get_request(self):  # type: ignore[no-untyped-def]
            if not limits.acquire():
                # Every worker is busy: the connection waits in the kernel's backlog, costing this process
                # neither a thread nor a descriptor, until one is free (checked again on the next loop).
                limits.warn(
                    "connections:limit",
                    "connection limit reached; new connections wait in the backlog",
                    max_connections=limits.max_connections,
                )
                limits.saturated.set()
                raise _AllBusy()
            try:
                return super().get_request()
            except OSError as exc:
                limits.release()
                if exc.errno in _CLIENT_GONE:
                    log.debug("http client left before accept", extra={"error": str(exc)})
                    raise
                code = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
                limits.warn(f"accept:{code}", "cannot accept connections", error=str(exc))
                if exc.errno in _OUT_OF_RESOURCES:
                    # The listening socket stays readable while the process is out of descriptors or
                    # memory; without a pause the accept loop would spin a core.
                    limits.pause(ACCEPT_RETRY_SECONDS)
                raise

        def process_request(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
            try:
                super().process_request(request, client_address)  # holds the slot get_request took
            except BaseException:
                limits.release()
                raise

        def process_request_thread(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
            try:
                super().process_request_thread(request, client_address)
            finally:
                limits.release()

        def finish_request(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
            if tls is None:
                super().finish_request(request, client_address)
                return
            request.settimeout(limits.idle_timeout_seconds)
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

        def handle_error(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
            exc = sys.exc_info()[1]
            if isinstance(exc, OSError):
                # A client that reset or dropped the connection, a TLS peer gone mid-record: normal on a
                # network, one structured line at debug level (http.server would print a traceback).
                log.debug(
                    "http client connection lost",
                    extra={"client": client_address[0], "error": type(exc).__name__, "detail": str(exc)[:200]},
                )
                return
            log.error("http connection failed", exc_info=exc, extra={"client": client_address[0]})

    server = Server((host or "0.0.0.0", port), _Handler)
    server.app = app  # type: ignore[attr-defined]
    return server


_OUT_OF_RESOURCES = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
# A client that reset its connection while it waited in the backlog: its business, not the agent's.
_CLIENT_GONE = frozenset((errno.ECONNABORTED, errno.EPROTO))


class _AllBusy(OSError):
    """Raised by get_request instead of accepting; socketserver's loop takes any OSError as "try again"."""


class _Limits:
    """The connection bound and what the accept loop needs besides: a counting slot per connection, a
    rate-limited warning, and the pause after running out of descriptors."""

    def __init__(
        self,
        max_connections: int,
        idle_timeout_seconds: float,
        monotonic: Callable[[], float],
        pause: Callable[[float], None],
        wait_seconds: float,
    ) -> None:
        self.max_connections = max_connections
        self.idle_timeout_seconds = idle_timeout_seconds
        self.monotonic = monotonic
        self.pause = pause
        self.warn = RateLimitedLog(log, LOG_EVERY_SECONDS, monotonic)
        # Set the first time a connection had to wait for a worker (tests wait on it).
        self.saturated = threading.Event()
        # How long the accept loop waits for a free worker before it looks for shutdown again.
        self._wait_seconds = wait_seconds
        self._active = 0
        self._changed = threading.Condition()

    def acquire(self) -> bool:
        with self._changed:
            if not self._changed.wait_for(lambda: self._active < self.max_connections, self._wait_seconds):
                return False
            self._active += 1
            return True

    def release(self) -> None:
        with self._changed:
            self._active -= 1
            self._changed.notify_all()

    def wait_for(self, at_most: int, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._active <= at_most, timeout)
