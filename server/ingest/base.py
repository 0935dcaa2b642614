"""What every sample source is to the rest of the server, and what they share.

The runtime reads samples, /metrics and /healthz read a source's accounting and /nodes its targets' health,
all through SampleSource and nothing else. A source is built from settings by its SourceKind; settings
lists the kinds (`sample_sources`) and the first one the settings select reads the samples.
IngestAccounting keeps what every source counts, PullError and `bounded` are how a fetch fails, and
PullResult and TargetHealth are what a cycle and a target come to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections import Counter
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Mapping, Protocol, TypedDict

import httpx

from gpufleet.server.ingest.identity import NodePin
from gpufleet.server.outbound import for_peer

if TYPE_CHECKING:
    from gpufleet.server.settings import ClientAuth, ServerSettings

log = logging.getLogger(__name__)

# (reading, detector, effect): a reading no GPU of the source has, and what a detector does without it.
MissingReading = tuple[str, str, str]


class PullError(Exception):
    """A pull that produced nothing usable; `reason` is a short label for metrics."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class TargetHealth:
    """What the server knows about one agent's reachability and freshness."""

    target: str
    node: str | None = None
    up: bool = False
    stale: bool = False
    last_attempt: float | None = None
    last_success: float | None = None
    last_new_data: float | None = None
    last_sample_time: float | None = None
    consecutive_failures: int = 0
    last_error: str | None = None
    clock_offset_seconds: float | None = None  # agent clock minus ours, as measured (None: not yet)


@dataclass(frozen=True, slots=True)
class PullResult:
    """One cycle over every target: the accepted samples, in no particular order."""

    samples: list[Any]
    started: float
    duration_seconds: float
    targets: int
    failed_targets: int
    rejected_snapshots: int
    # Node names pinned (or unpinned: None) in this cycle, for the store to keep across a restart.
    pins: Mapping[str, NodePin | None] = field(default_factory=dict)
    # Nodes whose GPUs all went to another shard's jobs in this cycle (--shard): the engine forgets them.
    handed_over: tuple[str, ...] = ()


@contextlib.asynccontextmanager
async def bounded(timeout_seconds: float | None) -> AsyncIterator[None]:
    """One fetch from an agent or Prometheus: the whole answer within timeout_seconds (None: no limit),
    and every transport failure as a PullError with its reason.

    httpx's timeout bounds each connect or read, not the whole answer: a peer trickling a byte at a time
    would hold the cycle (and every other target's samples) for minutes.
    """
    try:
        async with asyncio.timeout(timeout_seconds):
            yield
    except (httpx.TimeoutException, TimeoutError):
        raise PullError("timeout") from None
    except httpx.ConnectError as exc:
        raise PullError("connect", str(exc)) from None
    except httpx.HTTPError as exc:
        raise PullError("http_error", exc.__class__.__name__) from None
    except ssl.SSLError as exc:
        # Under TLS 1.3 a peer refusing our client certificate says so after the handshake, on the first
        # read, which httpx passes on as it is.
        raise PullError("tls", str(exc)) from None
    except OSError as exc:
        raise PullError("connect", str(exc)) from None


@dataclass(frozen=True, slots=True)
class Blindness:
    """Why the last cycle gave the engine nothing to see: a short reason for metrics and /healthz, and what
    the source looked for and found, for people."""

    reason: str
    looked_for: str
    found: str


class IngestAccounting:
    """What every sample source counts for /metrics, and its error log that cannot flood."""

    def __init__(self) -> None:
        # (target, reason) -> count for current targets, and reason -> count for targets since removed: both
        # changed on the event loop only. /metrics reads them from a worker thread, so it gets the immutable
        # copies published at the end of each cycle (iterating a dict the loop changes raises).
        self._errors: Counter[tuple[str, str]] = Counter()
        self._gone_errors: Counter[str] = Counter()
        self._published: tuple[Mapping[tuple[str, str], int], Mapping[str, int]] = (
            MappingProxyType({}),
            MappingProxyType({}),
        )
        self.pulls_total = 0
        self.samples_total = 0
        self.cycles_total = 0
        self.last_cycle: PullResult | None = None
        self.blind: Blindness | None = None  # set while the last cycle was blind
        self.blind_cycles: Counter[str] = Counter()  # reason -> blind cycles
        self.missing: tuple[MissingReading, ...] = ()  # a source that knows its readings says which it lacks

    def _finish_cycle(self, result: PullResult) -> PullResult:
        """Account one whole cycle."""
        self.cycles_total += 1
        self.samples_total += len(result.samples)
        self.last_cycle = result
        self._publish_errors()
        self._note_blind(self._blindness(result))
        return result

    def _blindness(self, result: PullResult) -> Blindness | None:
        """Whether the cycle saw nothing usable, by its counts (a source that knows more overrides this)."""
        return _blind_from_counts(result)

    def _note_blind(self, blind: Blindness | None) -> None:
        """Count a blind cycle; log when blindness starts, changes reason, or ends (not every cycle)."""
        previous, self.blind = self.blind, blind
        if blind is not None:
            # Replaced whole, not changed in place: /metrics iterates it on another thread.
            self.blind_cycles = self.blind_cycles + Counter({blind.reason: 1})
            if previous is None or previous.reason != blind.reason:
                log.warning(
                    "ingest is blind: no usable GPU samples",
                    extra={"reason": blind.reason, "looked_for": blind.looked_for, "found": blind.found},
                )
        elif previous is not None:
            log.info("ingest sees GPU samples again", extra={"after": previous.reason})

    def _publish_errors(self) -> None:
        """Swap in fresh read-only copies of the error counts, as one tuple: a reader gets both or neither."""
        self._published = (MappingProxyType(dict(self._errors)), MappingProxyType(dict(self._gone_errors)))

    @property
    def errors(self) -> Mapping[tuple[str, str], int]:
        """Rejections by (target, reason) for current targets, as of the end of the last cycle (read-only)."""
        return self._published[0]

    def errors_by_reason(self) -> Counter[str]:
        """Every rejection counted up to the last cycle, by reason (never decreasing: gone targets' counts
        included); safe from any thread."""
        current, gone = self._published
        total = Counter(gone)
        for (_, reason), n in current.items():
            total[reason] += n
        return total

    def remember_identities(self, nodes: Mapping[str, str], pins: Mapping[str, NodePin] | None = None) -> None:
        """A source whose targets are not the agents themselves has no names to pin: nothing to remember."""

    def _forget_target(self, target: str) -> None:
        """A target left discovery: its per-target series go (on Kubernetes every agent restart is a new
        address, and they would pile up), its counts stay in the per-reason totals."""
        for key in [k for k in self._errors if k[0] == target]:
            self._gone_errors[key[1]] += self._errors.pop(key)

    def _count_error(self, key: tuple[str, str], detail: str, message: str, extra: Mapping[str, Any]) -> None:
        """Count one rejection under (target, reason); log the 1st, 2nd, 4th, 8th... of each to bound noise."""
        self._errors[key] += 1
        count = self._errors[key]
        if count & (count - 1):
            return
        log.warning(message, extra={**extra, "reason": key[1], "detail": detail[:300], "count": count})


def _blind_from_counts(result: PullResult) -> Blindness | None:
    """Blind by the cycle's counts alone: no target listed, every target failing, or every snapshot refused."""
    if result.samples:
        return None
    if result.targets == 0:
        return Blindness("no_targets", "agent targets from the configured discovery", "no target listed")
    if result.failed_targets >= result.targets:
        return Blindness(
            "all_targets_down",
            f"snapshots from {result.targets} target(s)",
            "every pull failed (see gpufleet_server_pull_errors_total)",
        )
    if result.rejected_snapshots:
        return Blindness(
            "all_rejected",
            f"snapshots from {result.targets} target(s)",
            f"{result.rejected_snapshots} snapshot(s), every one rejected",
        )
    return None


def default_parse() -> Callable[[Mapping[str, Any]], Any]:
    """The engine's contract parser, imported late so that a source does not pull numpy in at import."""
    from gpufleet.server.contract import parse_snapshot

    return parse_snapshot


class SampleSource(Protocol):
    """Where the runtime reads samples from, and everything the server reads about it: its targets' health
    (/nodes, /healthz, agents' node_unreachable alerts) and its accounting (/metrics, /healthz).

    IngestAccounting provides the accounting; a source adds pull_once, health, aclose and stale_after_seconds.
    The accounting is read from other threads than the event loop that pulls: what a reader iterates must
    be replaced whole, not changed in place (IngestAccounting.errors)."""

    @property
    def stale_after_seconds(self) -> float:
        """A target sending no new sample for this long is stale (and its node's agent alert starts)."""
        ...

    async def pull_once(self) -> PullResult:
        """One cycle: every sample that arrived since the last, validated; never raises for a bad answer."""
        ...

    def health(self) -> list[TargetHealth]:
        """Every current target's health, sorted by target."""
        ...

    async def aclose(self) -> None:
        """Close connections; the source is not used again."""
        ...

    @property
    def pulls_total(self) -> int: ...

    @property
    def samples_total(self) -> int: ...

    @property
    def last_cycle(self) -> PullResult | None: ...

    @property
    def blind(self) -> Blindness | None:
        """Why the last cycle saw no usable GPU sample; None while it saw some."""
        ...

    @property
    def blind_cycles(self) -> Mapping[str, int]: ...

    @property
    def missing(self) -> tuple[MissingReading, ...]:
        """The readings the source cannot feed, and what each detector does without them."""
        ...

    @property
    def errors(self) -> Mapping[tuple[str, str], int]: ...

    def errors_by_reason(self) -> Mapping[str, int]: ...

    def remember_identities(self, nodes: Mapping[str, str], pins: Mapping[str, NodePin] | None = None) -> None:
        """The node each target answered as before a restart (target -> node) and what each node's name was
        pinned to (node -> pin), from the store."""
        ...


@dataclass(frozen=True, slots=True)
class Wiring:
    """What a test puts in the place of the world when it builds a source from settings."""

    clock: Callable[[], float] = time.time
    transport: httpx.AsyncBaseTransport | None = None
    parse: Callable[[Mapping[str, Any]], Any] | None = None  # None: the snapshot contract's parser


class PeerOptions(TypedDict):
    """What every source's constructor takes alike: the pull timings from the settings, the test's wiring,
    and its peer's TLS context and credentials."""

    timeout_seconds: float
    stale_after_seconds: float
    transport: httpx.AsyncBaseTransport | None
    clock: Callable[[], float]
    parse: Callable[[Mapping[str, Any]], Any] | None
    verify: ssl.SSLContext
    auth: httpx.Auth


def peer_options(
    settings: ServerSettings, wiring: Wiring, peer: ClientAuth, prefix: str, *, https: bool
) -> PeerOptions:
    """The options a source built from settings reaches its peer with (its TLS and credential settings
    `peer`, their flags' prefix `prefix`); ValueError names a file that cannot be used."""
    outbound = for_peer(peer, prefix, https=https)
    return PeerOptions(
        timeout_seconds=settings.pull_timeout_seconds,
        stale_after_seconds=settings.pull_stale_after_seconds,
        transport=wiring.transport,
        clock=wiring.clock,
        parse=wiring.parse,
        verify=outbound.ssl_context,
        auth=outbound.auth,
    )


@dataclass(frozen=True, slots=True)
class SourceKind:
    """One kind of sample source: when the settings choose it, the peer it connects to, how it is built.

    Each source module holds its own (`SOURCE`); gpufleet.server.settings.sample_sources lists them."""

    name: str  # what check-config says the server reads
    selected: Callable[[ServerSettings], bool]
    build: Callable[[ServerSettings, Wiring], SampleSource]
    # Its TLS and credential settings and their flags' prefix, checked by check-config (None: no peer).
    peer: Callable[[ServerSettings], tuple[ClientAuth, str]] | None = None
