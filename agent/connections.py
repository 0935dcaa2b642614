"""Which connections the agent holds and when a request goes to a worker thread.

One thread accepts connections and reads every request head (and its small body, if any) without blocking,
as nginx and Go's net/http do: a client that trickles its request (slowloris), or that connects and sends
nothing, costs a file descriptor and a buffer until the head deadline, never a worker thread. Only a
request that has arrived whole is handed to a worker, so the workers answer, they do not wait. A keep-alive
connection comes back here to wait for its next request. A request whose answer is ready as it is (a
Prometheus scrape of text already rendered and compressed) is answered here, in one send, without waking
a worker: on a busy node each hand-off between threads is a wait for a core. What the socket does not
take at once a worker sends.

The connections held are bounded in all and per client address; a new connection beyond either bound takes
the place of the oldest one still waiting for its request (from that address, for the per-address bound),
so a flood of slow or idle connections delays no new client; with none waiting, the new one is closed.
"""

from __future__ import annotations

import errno
import logging
import queue
import selectors
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

# A request head beyond this is handed over unfinished: the worker answers 414 or 431 and closes.
MAX_HEAD_BYTES = 65536
# Request bodies are not used; one up to this size is read before the request is answered, so that
# keep-alive stays in step. A larger one is answered at once and its connection closed.
MAX_BODY_BYTES = 65536
ACCEPT_RETRY_SECONDS = 0.1
ACCEPTS_PER_WAKEUP = 64
# How often deadlines are checked: they fire at most this late.
DEADLINE_TICK_SECONDS = 0.05
LOG_EVERY_SECONDS = 60.0
_RECV_BYTES = 65536


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The agent's HTTP bounds (docs/agent.md, "Connections and time limits")."""

    # The whole request head, TLS handshake included, must arrive within this of the connection opening
    # (or of its first byte, on a keep-alive connection).
    read_header_timeout_seconds: float = 5.0
    # A keep-alive connection with no request in flight is closed after this.
    keep_alive_timeout_seconds: float = 30.0
    # An answer must be taken by the client within this.
    write_timeout_seconds: float = 30.0
    max_connections: int = 512
    max_connections_per_address: int = 64
    # Requests answered at once, one worker thread each; complete requests beyond wait their turn.
    max_requests: int = 16
    # /metrics and /snapshots answers built and sent at once (each holds its body in memory until the
    # client has it); more are answered 503 with Retry-After.
    max_large_answers: int = 4


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


def request_end(data: bytes | bytearray) -> int | None:
    """Where the first request in `data` ends (head and the small body it declares), or None while it is
    incomplete. A head over MAX_HEAD_BYTES, or a body that is chunked, too large or ambiguously framed,
    ends the request at the head (or at the limit): the worker answers those and closes the connection."""
    crlf, lf = data.find(b"\r\n\r\n"), data.find(b"\n\n")
    ends = [i + n for i, n in ((crlf, 4), (lf, 2)) if i >= 0]
    if not ends:
        return len(data) if len(data) > MAX_HEAD_BYTES else None
    head_end = min(ends)
    length = _declared_length(bytes(data[:head_end]))
    if length > MAX_BODY_BYTES:
        return head_end
    return head_end + length if len(data) >= head_end + length else None


def _declared_length(head: bytes) -> int:
    """The Content-Length a well-framed head declares; 0 for none, chunked or conflicting (the worker judges
    those from the head alone), MAX_BODY_BYTES + 1 for one too large to wait for."""
    values = set()
    for line in head.split(b"\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"transfer-encoding":
            return 0
        if name == b"content-length":
            values.add(value.strip())
    if len(values) != 1:
        return 0
    value = values.pop()
    if not value.isdigit():
        return 0
    return min(int(value), MAX_BODY_BYTES + 1)


class _Waiting:
    """A connection waiting for its next request (or, with `unsent`, for a worker to finish an answer)."""

    __slots__ = ("sock", "address", "data", "deadline", "first_byte_by", "handshaking", "unsent", "sent")

    def __init__(self, sock: socket.socket, address: tuple, data: bytes, deadline: float, handshaking: bool) -> None:
        self.sock = sock
        self.address = address
        self.data = bytearray(data)
        self.deadline = deadline
        self.first_byte_by = deadline
        self.handshaking = handshaking
        self.unsent: memoryview | None = None
        self.sent: Callable[[], None] | None = None


# serve(sock, address, request_bytes, deadline) answers one request on a blocking socket; it returns the
# bytes read beyond that request when the connection is to be kept, None when it is to be closed.
Serve = Callable[[socket.socket, tuple, bytes, float], "bytes | None"]
# answer_now(request_bytes) -> the whole answer (head and body parts) to a request that needs no work, and
# what to call once it is sent, the connection kept; None for any other request, which a worker serves.
AnswerNow = Callable[[bytes], "tuple[tuple[bytes, ...], Callable[[], None]] | None"]


class ConnectionGate:
    """Accepts, reads request heads on one thread, and answers complete requests on `limits.max_requests`
    worker threads."""

    def __init__(
        self,
        listener: socket.socket,
        serve: Serve,
        limits: ConnectionLimits,
        *,
        tls: ssl.SSLContext | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        pause: Callable[[float], None] = time.sleep,
        answer_now: AnswerNow | None = None,
    ) -> None:
        self.listener = listener
        self.limits = limits
        self._serve = serve
        self._answer_now = answer_now if tls is None else None  # no sendmsg over TLS
        self._tls = tls
        self.monotonic = monotonic
        self._pause = pause
        self.warn = RateLimitedLog(log, LOG_EVERY_SECONDS, monotonic)
        self._selector = selectors.DefaultSelector()
        self._waiting: dict[socket.socket, _Waiting] = {}  # oldest first
        self._open: dict[str, int] = {}  # open connections per client address, the gate's own count
        self._ready: queue.SimpleQueue = queue.SimpleQueue()  # complete requests, for the workers
        self._back: queue.SimpleQueue = queue.SimpleQueue()  # connections the workers are done with
        self._wake_r, self._wake_w = socket.socketpair()
        self._busy: set[socket.socket] = set()  # connections a worker holds, shut down at close
        self._busy_lock = threading.Lock()
        self._changed = threading.Condition()
        self._closing = False
        self._threads: list[threading.Thread] = []
        self.evicted = 0  # connections closed to make room for a newer one
        self.refused = 0  # new connections closed for want of room
        self.expired = 0  # connections closed at their deadline
        self.answered_here = 0  # requests answered by this thread, no worker woken

    # --- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> None:
        """The gate thread and the workers, all daemons: a stuck client never holds the process up."""
        self.listener.setblocking(False)
        self._selector.register(self.listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._threads = [threading.Thread(target=self._run, name="gpufleet-http", daemon=True)]
        self._threads += [
            threading.Thread(target=self._work, name=f"gpufleet-http-{n}", daemon=True)
            for n in range(self.limits.max_requests)
        ]
        for thread in self._threads:
            thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop accepting, close every connection (unblocking workers mid-answer) and wait at most `timeout`."""
        self._closing = True
        self._wake()
        for _ in range(self.limits.max_requests):
            self._ready.put(None)
        with self._busy_lock:
            for sock in self._busy:
                _shutdown(sock)
        end = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        self._threads = []
        self._wake_r.close()
        self._wake_w.close()

    def open_connections(self) -> int:
        """Connections held now (waiting, queued or being answered)."""
        with self._changed:
            return sum(self._open.values())

    def wait_for(self, at_most: int, timeout: float) -> bool:
        """Wait until at most `at_most` connections are held (tests)."""
        with self._changed:
            return self._changed.wait_for(lambda: sum(self._open.values()) <= at_most, timeout)

    def wait_for_held(self, at_least: int, timeout: float) -> bool:
        """Wait until at least `at_least` connections are held (tests)."""
        with self._changed:
            return self._changed.wait_for(lambda: sum(self._open.values()) >= at_least, timeout)

    # --- the gate thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        next_tick = self.monotonic()
        try:
            while not self._closing:
                for key, _ in self._selector.select(self._select_timeout(next_tick)):
                    if key.fileobj is self.listener:
                        self.accept()
                    elif key.fileobj is self._wake_r:
                        self._take_back()
                    else:
                        self._read(key.data)
                now = self.monotonic()
                if now >= next_tick:
                    self._expire(now)
                    next_tick = now + DEADLINE_TICK_SECONDS
        finally:
            for waiting in list(self._waiting.values()):
                self._drop(waiting.sock, waiting.address)
            self._selector.close()
            self.listener.close()

    def _select_timeout(self, next_tick: float) -> float | None:
        """Until the earliest deadline (checked no oftener than the tick), or for ever when no connection
        waits. A wakeup costs a thread 0.1-0.2 ms of CPU on a small VM: ticking 20 times a second would
        cost more than all the scrapes an idle agent answers."""
        if not self._waiting:
            return None
        earliest = min(w.deadline for w in self._waiting.values())
        return max(0.0, max(earliest, next_tick) - self.monotonic())

    def accept(self) -> None:
        """Take what waits in the backlog (a bounded batch, so reading heads is not starved)."""
        for _ in range(ACCEPTS_PER_WAKEUP):
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._accept_failed(exc)
                return
            self._admit(sock, address)

    def _accept_failed(self, exc: OSError) -> None:
        if exc.errno in _CLIENT_GONE:
            log.debug("http client left before accept", extra={"error": str(exc)})
            return
        code = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
        self.warn(f"accept:{code}", "cannot accept connections", error=str(exc))
        if exc.errno in _OUT_OF_RESOURCES:
            # The listening socket stays readable while the process is out of descriptors or memory;
            # without a pause this loop would spin a core. A waiting connection gives its descriptor up.
            if self._waiting:
                self._evict(next(iter(self._waiting.values())))
            self._pause(ACCEPT_RETRY_SECONDS)

    def _admit(self, sock: socket.socket, address: tuple) -> None:
        host = address[0]
        limits = self.limits
        victim: _Waiting | None = None
        if self._open.get(host, 0) >= limits.max_connections_per_address:
            victim = next((w for w in self._waiting.values() if w.address[0] == host), None)
            full = True
        else:
            full = sum(self._open.values()) >= limits.max_connections
            victim = next(iter(self._waiting.values()), None) if full else None
        if full and victim is None:
            self.refused += 1
            self.warn("connections:full", "connection limit reached; new connections are closed", client=host)
            _close(sock)
            return
        if victim is not None:
            self._evict(victim)
        with self._changed:
            self._open[host] = self._open.get(host, 0) + 1
            self._changed.notify_all()
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is not None:
            try:
                sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            except (ssl.SSLError, OSError) as exc:
                log.debug("tls setup failed", extra={"client": host, "reason": str(exc)})
                self._drop(sock, address)
                return
        deadline = self.monotonic() + limits.read_header_timeout_seconds
        self._wait(_Waiting(sock, address, b"", deadline, handshaking=self._tls is not None))

    def _wait(self, waiting: _Waiting) -> None:
        self._waiting[waiting.sock] = waiting
        self._selector.register(waiting.sock, selectors.EVENT_READ, waiting)
        if waiting.handshaking:
            self._read(waiting)

    def _read(self, waiting: _Waiting) -> None:
        sock = waiting.sock
        try:
            if waiting.handshaking:
                if not self._handshake(waiting):
                    return
            while True:
                chunk = sock.recv(_RECV_BYTES)
                if not chunk:
                    self._drop(sock, waiting.address)  # the client closed
                    return
                if not waiting.data:
                    waiting.deadline = min(waiting.deadline, self.monotonic() + self.limits.read_header_timeout_seconds)
                waiting.data += chunk
                if not (isinstance(sock, ssl.SSLSocket) and sock.pending()):
                    break
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            pass
        except (ssl.SSLError, OSError) as exc:
            log.debug("http client connection lost", extra={"client": waiting.address[0], "error": type(exc).__name__})
            self._drop(sock, waiting.address)
            return
        if request_end(waiting.data) is not None:
            self._dispatch(waiting)

    def _handshake(self, waiting: _Waiting) -> bool:
        """Advance a TLS handshake; True once it is done."""
        sock = waiting.sock
        assert isinstance(sock, ssl.SSLSocket)
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            self._selector.modify(sock, selectors.EVENT_READ, waiting)
            return False
        except ssl.SSLWantWriteError:
            self._selector.modify(sock, selectors.EVENT_WRITE, waiting)
            return False
        except (ssl.SSLError, OSError) as exc:
            # A plain-HTTP client, a bad or missing client certificate, a port scanner.
            log.debug("tls handshake failed", extra={"client": waiting.address[0], "reason": str(exc)})
            self._drop(sock, waiting.address)
            return False
        waiting.handshaking = False
        self._selector.modify(sock, selectors.EVENT_READ, waiting)
        return True

    def _dispatch(self, waiting: _Waiting) -> None:
        while self._answer_now is not None:
            end = request_end(waiting.data)
            answer = None if end is None else self._answer_now(bytes(waiting.data[:end]))
            if answer is None:
                break
            del waiting.data[:end]
            if not self._send_now(waiting, *answer):
                return
            if request_end(waiting.data) is None:  # the usual case: wait for the next request
                return
        self._unwait(waiting.sock)
        self._ready.put(waiting)

    def _send_now(self, waiting: _Waiting, parts: tuple[bytes, ...], sent: Callable[[], None]) -> bool:
        """Send a ready answer without blocking; True when it all went and the connection waits for its next
        request here. What the socket did not take goes to a worker to send under the write timeout."""
        sock, total = waiting.sock, sum(map(len, parts))
        self.answered_here += 1
        try:
            done = sock.sendmsg(parts)
        except (BlockingIOError, InterruptedError):
            done = 0
        except OSError as exc:
            sent()
            log.debug("http client connection lost", extra={"client": waiting.address[0], "error": type(exc).__name__})
            self._drop(sock, waiting.address)
            return False
        if done == total:
            sent()
            now = self.monotonic()
            limits = self.limits
            waiting.deadline = now + (
                limits.read_header_timeout_seconds if waiting.data else limits.keep_alive_timeout_seconds
            )
            return True
        waiting.unsent, waiting.sent = memoryview(b"".join(parts))[done:], sent
        self._unwait(sock)
        self._ready.put(waiting)
        return False

    def _expire(self, now: float) -> None:
        for waiting in [w for w in self._waiting.values() if w.deadline <= now]:
            self.expired += 1
            log.debug("http connection timed out", extra={"client": waiting.address[0]})
            self._drop(waiting.sock, waiting.address)

    def _evict(self, waiting: _Waiting) -> None:
        self.evicted += 1
        log.debug("http connection closed to make room", extra={"client": waiting.address[0]})
        self._drop(waiting.sock, waiting.address)

    def _unwait(self, sock: socket.socket) -> None:
        if self._waiting.pop(sock, None) is not None:
            self._selector.unregister(sock)

    def _drop(self, sock: socket.socket, address: tuple) -> None:
        """Close a connection this gate counted."""
        self._unwait(sock)
        _close(sock)
        host = address[0]
        with self._changed:
            left = self._open.get(host, 0) - 1
            if left > 0:
                self._open[host] = left
            else:
                self._open.pop(host, None)
            self._changed.notify_all()

    def _take_back(self) -> None:
        try:
            self._wake_r.recv(4096)
        except OSError:
            pass
        while True:
            try:
                sock, address, rest = self._back.get_nowait()
            except queue.Empty:
                return
            if rest is None or self._closing:
                self._drop(sock, address)
                continue
            try:
                sock.setblocking(False)
            except OSError:
                self._drop(sock, address)
                continue
            now = self.monotonic()
            deadline = now + (
                self.limits.read_header_timeout_seconds if rest else self.limits.keep_alive_timeout_seconds
            )
            waiting = _Waiting(sock, address, rest, deadline, handshaking=False)
            if request_end(waiting.data) is not None:
                self._ready.put(waiting)  # the client sent its next request along (pipelining)
            else:
                self._wait(waiting)
                self._read(waiting)  # TLS may hold decrypted bytes the selector cannot see

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    # --- workers ----------------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            waiting = self._ready.get()
            if waiting is None or self._closing:
                if waiting is not None:
                    self._back.put((waiting.sock, waiting.address, None))
                    self._wake()
                return
            sock = waiting.sock
            with self._busy_lock:
                self._busy.add(sock)
            rest: bytes | None = None
            try:
                # Blocking, but never for longer than an answer may take: an error answered before the request's
                # own timeouts are set goes out under this one too.
                sock.settimeout(self.limits.write_timeout_seconds)
                if waiting.unsent is not None:
                    rest = self._finish(waiting)
                else:
                    rest = self._serve(sock, waiting.address, bytes(waiting.data), waiting.deadline)
            except Exception:  # a bug must cost one connection, not a worker
                log.exception("http connection failed", extra={"client": waiting.address[0]})
            finally:
                with self._busy_lock:
                    self._busy.discard(sock)
                self._back.put((sock, waiting.address, rest))
                self._wake()

    @staticmethod
    def _finish(waiting: _Waiting) -> bytes | None:
        """The rest of an answer the gate thread began; the bytes read beyond its request, None to close."""
        try:
            waiting.sock.sendall(waiting.unsent)  # type: ignore[arg-type]
        except OSError as exc:  # a timeout included: the client did not take its answer in time
            log.debug("http client connection lost", extra={"client": waiting.address[0], "error": type(exc).__name__})
            return None
        finally:
            if waiting.sent is not None:
                waiting.sent()
        return bytes(waiting.data)


_OUT_OF_RESOURCES = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
# A client that reset its connection while it waited in the backlog: its business, not the agent's.
_CLIENT_GONE = frozenset((errno.ECONNABORTED, errno.EPROTO))


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
