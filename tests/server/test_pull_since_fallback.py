"""An agent that honours `since=` but not `span=`, with a ring larger than --pull.max-bytes: the server
learns its clock and asks with `since=` for the span it wants, rather than being refused the whole ring
on every pull."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
from http.server import BaseHTTPRequestHandler
from typing import Iterator
from urllib.parse import parse_qs, urlparse

import orjson

from gpufleet.server.ingest.puller import Puller
from gpufleet.server.ingest.targets import StaticTargets
from tests.loopback import answer_json, serving
from tests.server.live_fakes import envelope, parse_dict, snapshot

NEWEST = 1_763_800_000.0  # the agent's newest snapshot, one a second before it (600 s of ring)
AGENT_CLOCK_AHEAD_SECONDS = 7200.0  # its clock runs two hours ahead of the server's


class _SinceOnlyAgent(BaseHTTPRequestHandler):
    """Answers /snapshots with every snapshot after ?since= (all of them without it); ?span= it ignores."""

    asked: list[dict[str, list[str]]] = []

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        query = parse_qs(urlparse(self.path).query)
        self.asked.append(query)
        since = float(query["since"][0]) if "since" in query else float("-inf")
        ring = [snapshot("dgx-01", NEWEST - age) for age in range(599, -1, -1)]
        body = orjson.dumps({**envelope("dgx-01", [s for s in ring if s["time"] > since]), "time": NEWEST + 0.5})
        answer_json(self, body)

    def date_time_string(self, timestamp: float | None = None) -> str:
        """Its Date header, in its own clock (as a real agent's is)."""
        return email.utils.formatdate(NEWEST + 0.5, usegmt=True)

    def log_message(self, *_: object) -> None:
        pass


@contextlib.contextmanager
def _agent() -> Iterator[int]:
    _SinceOnlyAgent.asked = []
    with serving(_SinceOnlyAgent) as port:
        yield port


def test_an_agent_ignoring_span_is_ingested_through_since_once_its_clock_is_known() -> None:
    with _agent() as port:
        puller = Puller(
            StaticTargets((f"127.0.0.1:{port}",)),
            parse=parse_dict,
            clock=lambda: NEWEST + 1.0 - AGENT_CLOCK_AHEAD_SECONDS,
            max_payload_bytes=64 * 1024,  # the whole ring is ~170 KB; 120 s of it ~34 KB
            max_past_seconds=1e12,
        )

        async def pulls():
            out = [await puller.pull_once() for _ in range(4)]
            await puller.aclose()
            return out

        results = asyncio.run(pulls())
    sizes = [len(r.samples) for r in results]
    assert puller.errors.get((f"127.0.0.1:{port}", "oversized")) == 1, (sizes, _SinceOnlyAgent.asked)
    assert sizes[0] == 0 and sum(sizes) > 0, (sizes, _SinceOnlyAgent.asked)
    # Asked for the first span (ignored: oversized), then with since= 60 s (half the first span) back from the
    # agent's clock as its Date header showed it, to the second, then for what came after.
    asked = [q.get("since", [None])[0] for q in _SinceOnlyAgent.asked]
    assert asked == [None, repr(NEWEST - 60.0), repr(NEWEST), repr(NEWEST)]
    assert sizes == [0, 60, 0, 0]
    offset = AGENT_CLOCK_AHEAD_SECONDS - 0.5  # taken out of its sample times
    got = [s["time"] for r in results for s in r.samples]
    assert got == [NEWEST - offset - age for age in range(59, -1, -1)]
    assert puller.clocks.estimate(f"127.0.0.1:{port}") == offset  # from the answer's own stamp, once one is read
    assert [h.up for h in puller.health()] == [True]
