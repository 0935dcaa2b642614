"""The Prometheus text of a publication, rendered only when a scrape is going to read it.

At 1 Hz sampling a 15 s scrape reads one publication in fifteen: rendering after every sample spent most
of the agent's publishing CPU on text nobody fetched. So each publication carries a LazyBody that renders
on its first read, once. That alone would put the render (most of a millisecond on 8 GPUs) inside the
scrape that reads it, so the sampler also renders ahead: scrapers come at a steady period, and when the
last two first reads say a scrape is due before the next publication, the sampler renders this one on
its own thread. A guess that misses costs one render and the scrape renders as before; at most one
render ahead waits for a reader at a time, so the CPU spent stays within one render per scrape.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from gpufleet.agent.activity import NO_TOTALS, ActivityTotals
from gpufleet.agent.exposition import FamiliesFn, Renderer
from gpufleet.agent.health import AgentHealth
from gpufleet.agent.model import NodeSnapshot


class RenderOnDemand:
    """One Renderer shared by the publications of one sampler, and when their scrapes come.

    Scrape threads may ask at once, so renders are serialised (the Renderer's cache is not thread-safe).
    Should a render fail, the last good text is served and `on_error` hears of it. The record of first
    reads has a lock of its own, held for microseconds: a scrape of a rendered text never waits for the
    render of the next one.
    """

    def __init__(
        self,
        on_error: Callable[[Exception], None] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        process_metrics: bool = False,
        families: FamiliesFn | None = None,
    ) -> None:
        self._renderer = Renderer(process_metrics=process_metrics, families=families)
        self._lock = threading.Lock()  # renders
        self._reads_lock = threading.Lock()  # _first_reads and _ahead
        self._last_good = b""
        self._on_error = on_error
        self._monotonic = monotonic
        self._first_reads: list[float] = []  # the last two times a publication was first read
        self._ahead: LazyBody | None = None  # rendered ahead, not read yet

    def body(
        self, snapshot: NodeSnapshot | None, health: AgentHealth, activity: ActivityTotals = NO_TOTALS
    ) -> LazyBody:
        """A body rendered from these on first read."""
        return LazyBody(self, snapshot, health, activity)

    def render_ahead(self, body: LazyBody, interval_s: float) -> bool:
        """Render `body` now when a scrape is due before the next publication; True when it did."""
        with self._reads_lock:
            reads = self._first_reads
            if len(reads) < 2 or self._ahead is not None or body._bytes is not None:
                return False
            period = reads[-1] - reads[-2]
            if period <= 0 or self._monotonic() + interval_s < reads[-1] + period:
                return False
            self._ahead = body
        with self._lock:
            body._render_locked()
        return True

    def _first_read(self, body: LazyBody) -> None:
        """Called under the reads lock the first time a scrape reads `body`."""
        self._first_reads = [*self._first_reads[-1:], self._monotonic()]
        if self._ahead is not None:
            self._ahead = None  # the scrape came: whether it found this body or a newer one, guess again

    def _render(self, snapshot: NodeSnapshot | None, health: AgentHealth, activity: ActivityTotals) -> bytes:
        try:
            self._last_good = self._renderer.render(snapshot, health, activity)
        except Exception as exc:  # a render bug must not break /metrics: the previous body stays served
            if self._on_error is not None:
                self._on_error(exc)
        return self._last_good


class LazyBody:
    """The exposition of one publication, rendered by its first reader (or ahead of it) and kept."""

    __slots__ = ("_owner", "_args", "_bytes", "_read")

    def __init__(
        self, owner: RenderOnDemand, snapshot: NodeSnapshot | None, health: AgentHealth, activity: ActivityTotals
    ) -> None:
        self._owner = owner
        self._args: tuple | None = (snapshot, health, activity)
        self._bytes: bytes | None = None
        self._read = False

    @property
    def rendered(self) -> bool:
        """True once the text exists."""
        return self._bytes is not None

    @property
    def text(self) -> bytes | None:
        """The text if it exists, without counting as a read (for whoever prepares its answer ahead)."""
        return self._bytes

    def ready(self) -> bytes | None:
        """get(), where that needs no render (nor a wait for one); None otherwise."""
        if self._read or self._bytes is None:
            return self._bytes
        self._mark_read()
        return self._bytes

    def get(self) -> bytes:
        """The text, rendering it now if it was neither read nor rendered ahead before."""
        if self._read:
            return self._bytes  # type: ignore[return-value]
        with self._owner._lock:
            self._render_locked()
        self._mark_read()
        return self._bytes  # type: ignore[return-value]

    def _mark_read(self) -> None:
        with self._owner._reads_lock:
            if not self._read:
                self._owner._first_read(self)
                self._read = True

    def _render_locked(self) -> None:
        if self._bytes is None:
            self._bytes = self._owner._render(*self._args)  # type: ignore[misc]
            self._args = None
