"""The agent's HTTP endpoints: requests parsed by http.server's handler, connections held by a ConnectionGate
(agent/connections.py); every answer comes from the store, never NVML."""

from __future__ import annotations

import email.utils
import logging
import math
import socket
import socketserver
import ssl
import struct
import threading
import time
import zlib
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Callable, Mapping, NamedTuple
from urllib.parse import parse_qs, urlsplit

import orjson

from gpufleet.agent import exposition
from gpufleet.agent.connections import MAX_BODY_BYTES, ConnectionGate, ConnectionLimits
from gpufleet.agent.store import Publication, SnapshotStore
from gpufleet.webconfig import OPEN_PATHS, WebConfig

log = logging.getLogger(__name__)

JSON = "application/json"
LISTEN_BACKLOG = max(128, socket.SOMAXCONN)
MAX_REQUEST_LINE_BYTES = 8192
GZIP_LEVEL = 1  # scrape text is repetitive: level 1 gets most of level 6's ratio for a fraction of the CPU
MIN_STALE_SECONDS = 10.0
# Answers that hold a large body in memory until the client has taken it.
LARGE_ANSWERS = frozenset(("/metrics", "/snapshots"))
RETRY_AFTER_SECONDS = 1
# Over TLS, answers up to this size go out with their head in one write (copying the body costs less than
# a second write); a full /snapshots buffer is written after its head rather than copied.
ONE_WRITE_BYTES = 1 << 20


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
        web: WebConfig | None = None,
        limits: ConnectionLimits | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        pause: Callable[[float], None] = time.sleep,
    ) -> None:
        self.store = store
        web = web or WebConfig()
        self.tls = web.tls is not None
        self.auth = web.authenticator()
        self.headers: Mapping[str, str] = dict(web.headers)
        self.clock = clock
        # Stale after three missed samples, but never quicker than 10 s: a GC pause is not an outage.
        self.stale_after = max(3 * interval, MIN_STALE_SECONDS)
        self.gzip = GzipCache()
        self.limits = limits or ConnectionLimits()
        self.large_answers = threading.BoundedSemaphore(self.limits.max_large_answers)
        self.busy_answers = 0  # large answers refused for want of a slot
        self._listener = _listen(host, port)
        self.gate = ConnectionGate(
            self._listener,
            self._serve_one,
            self.limits,
            tls=web.tls,
            monotonic=monotonic,
            pause=pause,
            # Behind basic auth a scrape's check may cost a bcrypt round: a worker's job, not the gate's.
            answer_now=self.answer_now if self.auth is None else None,
        )
        self._date = (0, b"")  # the Date header's second and text
        self._started = False

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return self._listener.getsockname()[1]

    @property
    def host(self) -> str:
        """The bound address."""
        return self._listener.getsockname()[0]

    def start(self) -> None:
        """Serve on daemon threads."""
        self.gate.start()
        self._started = True

    def close(self, timeout: float = 2.0) -> None:
        """Stop serving and release the socket (idempotent); a worker still mid-answer after `timeout` is
        left behind (it is a daemon thread)."""
        if self._started:
            self.gate.close(timeout)
            self._started = False
        self._listener.close()

    def _serve_one(self, sock: socket.socket, address: tuple, data: bytes, deadline: float) -> bytes | None:
        """Answer the one request in `data` (read further up to `deadline` if it is not all there); the bytes
        after it when the connection stays open, None when it closes."""
        handler = _Handler(sock, address, self, data, deadline)
        return None if handler.close_connection else handler.reader.rest()

    def answer_now(self, request: bytes) -> tuple[tuple[bytes, ...], Callable[[], None]] | None:
        """The whole answer to a plain keep-alive `GET /metrics` whose text is rendered (and compressed, where
        gzip is asked) ahead, and what to call once it is sent; None for any other request, or when the
        answer needs work (a render, a compression, a wait for a lock), which a worker does. The same bytes
        a worker would send (tests/agent/test_scrape_at_once.py compares them)."""
        headers = plain_get(request, b"/metrics")
        if headers is None:
            return None
        pub = self.store.latest()
        text = None if pub is None else pub.ready_metrics()
        if pub is None or text is None:
            return None
        age = exposition.render_age(self.clock(), pub.snapshot if pub.health.nvml_up else None, pub.health.node)
        gzip = _accepts_gzip([v.decode("latin-1") for v in headers.get(b"accept-encoding", ())])
        parts = (text, age)
        if gzip:
            ready = self.gzip.ready(text, age)
            if ready is None:
                return None
            parts = ready
        if not self.large_answers.acquire(blocking=False):
            return None
        head = self._ok_head(sum(map(len, parts)), gzip)
        if log.isEnabledFor(logging.DEBUG):
            log.debug('http "GET /metrics HTTP/1.1" 200 -', extra={"answered_by": "gate"})
        return (head, *parts), self.large_answers.release

    def _ok_head(self, length: int, gzip: bool) -> bytes:
        """A 200 /metrics head as _Handler._send writes it."""
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, email.utils.formatdate(now, usegmt=True).encode())
        lines = [
            b"HTTP/1.1 200 OK",
            b"Server: " + _Handler.server_version.encode() + b" " + _Handler.sys_version.encode(),
            b"Date: " + self._date[1],
            b"Content-Type: " + exposition.CONTENT_TYPE.encode(),
            b"Content-Length: %d" % length,
            b"Cache-Control: no-store",
            b"Vary: Accept-Encoding",
        ]
        if gzip:
            lines.append(b"Content-Encoding: gzip")
        lines += [f"{k}: {v}".encode("latin-1", "strict") for k, v in self.headers.items()]
        return b"\r\n".join(lines) + b"\r\n\r\n"

    def prepare(self, text: bytes) -> None:
        """A /metrics text rendered ahead of its scrape: compressed now where scrapes ask for gzip, so that
        the scrape's answer is ready for the gate thread to send (answer_now)."""
        self.gzip.prepare(text)

    # --- responses: (status, content type, body) --------------------------------------------------------

    def metrics(self, gzip: bool = False) -> tuple[int, str, bytes]:
        """Pre-rendered exposition plus the per-scrape age family; gzipped on request."""
        self.gzip.wanted = gzip
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


class _RequestReader:
    """A request's bytes: those the gate read, then (rarely: a head that came whole without its body) the
    socket's, under the request's deadline, so a trickling client is cut off when it passes. What is left
    after the request is the start of the next one on the connection."""

    def __init__(self, sock: socket.socket, data: bytes, deadline: float, monotonic: Callable[[], float]) -> None:
        self._sock = sock
        self._data = bytearray(data)
        self._monotonic = monotonic
        self.deadline = deadline
        self.closed = False

    def _fill(self) -> bool:
        remaining = self.deadline - self._monotonic()
        if remaining <= 0:
            raise TimeoutError("request not received in time")
        self._sock.settimeout(remaining)
        chunk = self._sock.recv(65536)
        self._data += chunk
        return bool(chunk)

    def readline(self, limit: int = -1) -> bytes:
        """Up to and including the next newline, at most `limit` bytes."""
        while True:
            end = self._data.find(b"\n")
            if end >= 0 and (limit < 0 or end < limit):
                return self._take(end + 1)
            if (limit >= 0 and len(self._data) >= limit) or not self._fill():
                return self._take(len(self._data) if limit < 0 else min(limit, len(self._data)))

    def read(self, size: int) -> bytes:
        """`size` bytes, fewer when the client closes first."""
        while len(self._data) < size and self._fill():
            pass
        return self._take(min(size, len(self._data)))

    def _take(self, size: int) -> bytes:
        taken = bytes(self._data[:size])
        del self._data[:size]
        return taken

    def rest(self) -> bytes:
        """What was read beyond the request so far."""
        return bytes(self._data)

    def close(self) -> None:
        self.closed = True


class _Handler(BaseHTTPRequestHandler):
    """Answers exactly one request; the gate holds the connection between requests."""

    protocol_version = "HTTP/1.1"
    # Answers to requests whose version is missing or unusable still carry headers (HTTP/0.9 has none).
    default_request_version = "HTTP/1.1"
    server_version = "gpufleet-agent"

    def __init__(self, sock: socket.socket, address: tuple, app: AgentHttpServer, data: bytes, deadline: float) -> None:
        self.app = app
        self._data = data
        self._deadline = deadline
        super().__init__(sock, address, app)  # type: ignore[arg-type]

    def setup(self) -> None:
        self.connection = self.request
        self.reader = _RequestReader(self.connection, self._data, self._deadline, self.app.gate.monotonic)
        self.rfile = self.reader  # type: ignore[assignment]
        self.wfile = socketserver._SocketWriter(self.connection)  # type: ignore[attr-defined]

    def handle(self) -> None:
        self.handle_one_request()

    def finish(self) -> None:
        """The gate closes the connection or keeps it for the next request."""

    def handle_one_request(self) -> None:
        """Read one request, drain its body, answer; any method but GET and HEAD is 405 JSON. A request that
        breaks the limits is answered (where possible) and its connection closed."""
        self.close_connection = True
        self.command, self.requestline, self.request_version = "", "", self.default_request_version
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
            self.connection.settimeout(self.app.limits.write_timeout_seconds)
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
        except TimeoutError:
            # A request that did not arrive in time, or an answer the client did not take: drop it quietly.
            self.close_connection = True
            log.debug("http connection timed out", extra={"client": self.client_address[0]})
        except OSError as exc:
            # A client that reset or dropped the connection, a TLS peer gone mid-record: normal on a network.
            self.close_connection = True
            log.debug(
                "http client connection lost",
                extra={"client": self.client_address[0], "error": type(exc).__name__, "detail": str(exc)[:200]},
            )

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
        app = self.app
        url = urlsplit(self.path)
        if not self._authorized(url.path, send_body):
            return
        if url.path not in LARGE_ANSWERS:
            status, content_type, body, headers = self._respond(url.path, url.query)
            self._send(status, content_type, body, send_body, headers)
            return
        # The body is held until the client has taken it: a bounded number at once bounds the memory.
        if not app.large_answers.acquire(blocking=False):
            app.busy_answers += 1
            message = f"at most {app.limits.max_large_answers} /metrics and /snapshots answers at once; retry"
            self._send(
                *_error(HTTPStatus.SERVICE_UNAVAILABLE, "busy", message),
                send_body,
                {"Retry-After": str(RETRY_AFTER_SECONDS)},
            )
            return
        try:
            status, content_type, body, headers = self._respond(url.path, url.query)
            self._send(status, content_type, body, send_body, headers)
        finally:
            app.large_answers.release()

    def _respond(self, path: str, query: str) -> tuple[int, str, bytes, dict[str, str]]:
        app = self.app
        headers: dict[str, str] = {}
        try:
            if path == "/metrics":
                headers["Vary"] = "Accept-Encoding"
                if _accepts_gzip(self.headers.get_all("Accept-Encoding") or []):
                    response = app.metrics(gzip=True)
                    if response[0] == HTTPStatus.OK:
                        headers["Content-Encoding"] = "gzip"
                else:
                    response = app.metrics()
            elif path == "/snapshot":
                response = app.snapshot()
            elif path == "/snapshots":
                response = app.snapshots(query)
            elif path == "/healthz":
                response = app.healthz()
            else:
                response = _error(
                    HTTPStatus.NOT_FOUND, "not_found", "endpoints: /metrics /snapshot /snapshots?since= /healthz"
                )
        except Exception:  # a bug must cost one request, not the server thread
            log.exception("request failed", extra={"path": path})
            response, headers = _error(HTTPStatus.INTERNAL_SERVER_ERROR, "internal", "internal error"), {}
        return (*response, headers)

    def _authorized(self, path: str, send_body: bool) -> bool:
        """Basic auth where the web config asks for it; answers 401 itself when it fails."""
        auth = self.app.auth
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
        for key, value in self.app.headers.items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        if not send_body or self.request_version == "HTTP/0.9":
            self.end_headers()
            if send_body:
                self.wfile.write(body)
            return
        buffer: list[bytes] = self._headers_buffer  # type: ignore[attr-defined]  # http.server's, set per request
        buffer.append(b"\r\n")
        head = b"".join(buffer)
        buffer.clear()
        _send_all(self.connection, head, body)

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


def _send_all(sock: socket.socket, head: bytes, body: bytes) -> None:
    """Head and body in one system call, neither copied: one wait for the GIL after it, not two (behind a
    sampling cycle each may last a switch interval), and no second buffer the size of the answer held in
    the worker thread's heap. What a full socket buffer leaves over goes out after."""
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg over TLS
        if len(body) <= ONE_WRITE_BYTES:
            sock.sendall(head + body)
        else:
            sock.sendall(head)
            sock.sendall(body)
        return
    sent = sock.sendmsg((head, body))
    if sent < len(head):
        sock.sendall(head[sent:])
        sock.sendall(body)
    elif sent < len(head) + len(body):
        sock.sendall(memoryview(body)[sent - len(head) :])


# Fields that would make a request more than a plain GET: a worker judges those (a body, 100-continue, ...).
_NOT_PLAIN = frozenset((b"content-length", b"transfer-encoding", b"expect", b"upgrade"))
_MAX_HEADERS = 100  # http.client's bound, past which a worker answers 431


def plain_get(request: bytes, path: bytes) -> dict[bytes, list[bytes]] | None:
    """Header name (lower case) -> values of a request that is exactly `GET path HTTP/1.1`, CRLF-framed, with
    nothing to read after its head and no wish to close; None for any other request, or any doubt."""
    if not request.endswith(b"\r\n\r\n"):
        return None
    lines = request[:-4].split(b"\r\n")
    if lines[0] != b"GET " + path + b" HTTP/1.1" or len(lines) > _MAX_HEADERS:
        return None
    headers: dict[bytes, list[bytes]] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or b"\n" in line or b"\r" in line or name != name.strip() or b" " in name:
            return None
        name = name.lower()
        if name in _NOT_PLAIN:
            return None
        headers.setdefault(name, []).append(value.strip())
    if any(v.lower() != b"keep-alive" for v in headers.get(b"connection", ())):
        return None
    return headers


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


class _Compressed(NamedTuple):
    """A body's gzip header and deflate blocks, ending on a byte boundary, and the body's CRC-32."""

    source: bytes
    head: bytes
    crc: int


# The text being published and the one served until it is: a scrape between the two finds its own.
KEPT_COMPRESSIONS = 2


class GzipCache:
    """gzip of the current /metrics body, compressed once however often it is scraped. The body's deflate
    stream is flushed to a byte boundary and kept; each scrape appends only its own lines (the sample age)
    as a final stored block, and the gzip trailer from the body's CRC-32 extended over them: a few
    microseconds, where copying a compressor's state to go on compressing costs a quarter of a megabyte.

    Compressions are serialised; a reader takes what is kept without a lock (it is replaced whole, never
    changed), so a scrape never waits for the sampler compressing the next text."""

    def __init__(self, level: int = GZIP_LEVEL) -> None:
        self._level = level
        self._lock = threading.Lock()  # one compression at a time
        self._kept: tuple[_Compressed, ...] = ()  # newest first
        self.compressions = 0
        self.wanted = False  # whether the last /metrics answer was asked gzipped

    def prepare(self, body: bytes) -> None:
        """Compress a body rendered ahead of its scrape, where scrapes ask for gzip: the scrape finds its
        answer ready. The same compression the scrape would pay, on the sampler's thread."""
        if self.wanted:
            with self._lock:
                self._take(body)

    def ready(self, body: bytes, tail: bytes = b"") -> tuple[bytes, bytes] | None:
        """compress(body, tail) as two parts, when the body is compressed already; None rather than a
        compression."""
        found = self._find(body)
        if found is None:
            return None
        self.wanted = True
        return found.head, _final_stored(tail, found.crc, len(body))

    def _find(self, body: bytes) -> _Compressed | None:
        kept = self._kept
        for entry in kept:
            if entry.source is body:
                return entry
        return next((entry for entry in kept if entry.source == body), None)

    def _take(self, body: bytes) -> _Compressed:
        """Under the lock: `body`'s compression, made now if it is not kept."""
        found = self._find(body)
        if found is None:
            compressor = zlib.compressobj(self._level, zlib.DEFLATED, 31)
            head = compressor.compress(body) + compressor.flush(zlib.Z_SYNC_FLUSH)
            found = _Compressed(body, head, zlib.crc32(body))
            self._kept = (found, *self._kept[: KEPT_COMPRESSIONS - 1])
            self.compressions += 1
        return found

    def compress(self, body: bytes, tail: bytes = b"") -> bytes:
        """One gzip member holding body + tail."""
        with self._lock:
            self.wanted = True
            found = self._take(body)
        return found.head + _final_stored(tail, found.crc, len(body))


_STORED_MAX = 0xFFFF


def _final_stored(tail: bytes, crc: int, size: int) -> bytes:
    """`tail` as stored deflate blocks, the last one final (RFC 1951 3.2.4), after a stream flushed to a byte
    boundary; then the gzip trailer (RFC 1952: CRC-32 and length of everything, modulo 2**32)."""
    out = []
    for start in range(0, max(len(tail), 1), _STORED_MAX):
        chunk = tail[start : start + _STORED_MAX]
        final = start + _STORED_MAX >= len(tail)
        out.append(struct.pack("<BHH", 1 if final else 0, len(chunk), len(chunk) ^ 0xFFFF) + chunk)
    out.append(struct.pack("<II", zlib.crc32(tail, crc) & 0xFFFFFFFF, (size + len(tail)) & 0xFFFFFFFF))
    return b"".join(out)


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


def _listen(host: str, port: int) -> socket.socket:
    """Bind; an empty host listens on every interface, IPv6 too where the kernel allows dual stack."""
    if host == "" and socket.has_dualstack_ipv6():
        return socket.create_server(("::", port), family=socket.AF_INET6, backlog=LISTEN_BACKLOG, dualstack_ipv6=True)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # A scrape fleet (several Prometheus replicas, the server, ad-hoc curls) may connect at once; the kernel
    # caps the backlog at net.core.somaxconn.
    return socket.create_server((host or "0.0.0.0", port), family=family, backlog=LISTEN_BACKLOG)
