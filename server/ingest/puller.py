"""Pulls every agent's `/snapshots?since=` concurrently and turns the answers into validated samples.

Each target remembers the newest sample time it has delivered and asks only for what came after it,
so nothing is lost or duplicated between pulls however late a cycle runs. A bad answer (timeout,
HTTP error, oversized, malformed or schema-violating payload, a sample time far ahead of our clock)
is counted by target and reason and logged; it never raises out of a cycle, never reaches the
engine, and never moves a target's `since` somewhere its good samples cannot follow.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import email.utils
import logging
import ssl
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Mapping

import httpx
import orjson

from gpufleet.server.clocks import MIN_OFFSET_SECONDS, ClockOffsets
from gpufleet.server.ingest.base import (
    IngestAccounting,
    PullError,
    PullResult,
    SourceKind,
    TargetHealth,
    Wiring,
    bounded,
    default_parse,
    peer_options,
)
from gpufleet.server.ingest.identity import (
    DEFAULT_IDENTITY_TTL_SECONDS,
    Evidence,
    NodePin,
    NodePins,
    RememberedNodes,
    gpu_uuids,
)
from gpufleet.server.ingest.targets import (
    CombinedTargets,
    DnsTargets,
    FileSdTargets,
    StaticTargets,
    TargetSource,
)
from gpufleet.server.uuids import duplicate_gpu_uuid

if TYPE_CHECKING:
    from gpufleet.server.settings import ServerSettings

log = logging.getLogger(__name__)

DEFAULT_MAX_PAYLOAD_BYTES = 32 * 1024 * 1024
# What one answer may hold, checked before it is decoded (see _load): decoding builds a Python object per
# JSON value, ~100 bytes each, so the cost of an answer is its count of values, not its bytes (a 4 MB body
# of `{},` is two million objects). A gpufleet agent sends ~50 values per GPU per snapshot: a million is
# 40 minutes of an 8-GPU node sampled every second.
DEFAULT_MAX_ENTRIES = 1_000_000
DEFAULT_MAX_SNAPSHOTS = 3600
DEFAULT_MAX_GPUS = 256  # per snapshot, and distinct GPU indices per node
DEFAULT_MAX_NODES = 10_000
# A target's first pull asks for this much of the agent's ring, not all of it: what the engine needs
# to judge (its smoothing and minimum history), not the agent's whole 300 s or more.
DEFAULT_FIRST_SPAN_SECONDS = 120.0
# First pulls carry up to first_span of samples each, and after a restart every target pulls at once.
# Their answers are read and decoded this many at a time (decoding is one thread anyway) ...
DEFAULT_FIRST_CONCURRENCY = 8
# ... and in one cycle they ask for this many target-seconds in all: each asks for first_span, or an equal
# share of this when more targets pull for the first time (at least _MIN_FIRST_SPAN_SECONDS). All of a
# cycle's samples are held until the engine takes them: this keeps a restart into a large fleet inside the
# deploy files' 1 GiB (docs/server.md, Limits).
DEFAULT_FIRST_BUDGET_SECONDS = 20_000.0
_MIN_FIRST_SPAN_SECONDS = 10.0
_MIN_SPAN_SECONDS = 1.0
# Rejections that mean "the answer was too big": the next ask of that target covers half the span.
_TOO_BIG = frozenset({"oversized", "too_many_entries", "too_many_snapshots"})
# A sample stamped further ahead of the server's clock than this is a broken agent clock, not skew to absorb:
# taken, it would sit in the engine's future and drag the target's `since` past every honest sample after it.
DEFAULT_MAX_FUTURE_SECONDS = 300.0
# A sample further behind the server's clock than this (its clock offset taken out) is a buffer kept from
# before an outage or a clock that stood still: the engine, whose window is minutes, could not use it, and
# from a fresh server it would only make the first cycle start there.
DEFAULT_MAX_PAST_SECONDS = 3600.0
# Believing an answer's stamp far from our clock (_agent_clock): how far its newest sample may trail it (an
# agent's buffer, 300 s by default, and then some) or lead it (rounding), and the earliest plausible clock.
_AGENT_BUFFER_SECONDS = 3600.0
_TOLERANCE_SECONDS = 1.0
_PLAUSIBLE_CLOCK = 1e9
# The contract's bound on a sample time (the year 5138): a stamp past it is no clock, however the answer's
# samples agree with it (believed, it would carry them past the future check and the offset with them).
_MAX_CLOCK = 1e11


def _number(value: Any) -> float | None:
    """A JSON number as float; None for anything else (bool included)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
        return float(value)
    return None


class Puller(IngestAccounting):
    """Concurrent `/snapshots?since=` client over a changing set of targets, with per-target health."""

    def __init__(
        self,
        source: TargetSource,
        *,
        timeout_seconds: float = 4.0,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        concurrency: int = 256,
        stale_after_seconds: float = 30.0,
        max_future_seconds: float = DEFAULT_MAX_FUTURE_SECONDS,
        max_past_seconds: float = DEFAULT_MAX_PAST_SECONDS,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.time,
        parse: Callable[[Mapping[str, Any]], Any] | None = None,
        scheme: str = "http",
        clock_offset_min_seconds: float = MIN_OFFSET_SECONDS,
        verify: ssl.SSLContext | None = None,
        auth: httpx.Auth | None = None,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_snapshots: int = DEFAULT_MAX_SNAPSHOTS,
        max_gpus: int = DEFAULT_MAX_GPUS,
        max_nodes: int = DEFAULT_MAX_NODES,
        first_span_seconds: float = DEFAULT_FIRST_SPAN_SECONDS,
        first_concurrency: int = DEFAULT_FIRST_CONCURRENCY,
        first_budget_seconds: float = DEFAULT_FIRST_BUDGET_SECONDS,
        identity_ttl_seconds: float = DEFAULT_IDENTITY_TTL_SECONDS,
    ) -> None:
        super().__init__()
        self.source = source
        self.max_payload_bytes = max_payload_bytes
        self.max_entries = max_entries
        self.max_snapshots = max_snapshots
        self.max_gpus = max_gpus
        self.max_nodes = max_nodes
        self.first_span_seconds = first_span_seconds
        self.first_budget_seconds = first_budget_seconds
        self._cycle_first_span = first_span_seconds
        self.stale_after_seconds = stale_after_seconds
        self.max_future_seconds = max_future_seconds
        self.max_past_seconds = max_past_seconds
        self._clock = clock
        self._parse = parse or default_parse()
        self._scheme = scheme
        self._semaphore = asyncio.Semaphore(concurrency)
        self._first_semaphore = asyncio.Semaphore(min(first_concurrency, concurrency))
        # Decoding and validation run here, one answer at a time: off the event loop (which keeps serving
        # the API and pulling), and with a single decoded answer in memory at once.
        self._decoder: concurrent.futures.ThreadPoolExecutor | None = None
        # Per target, the span (seconds back from its newest sample) to ask for instead of everything
        # since its `since`: set for a first pull, halved after a too-big answer, cleared by a good one.
        self._span: dict[str, float] = {}
        # Identity: the node each target answers for, which target answers for each node, and the GPU
        # indices each node has shown (all bounded: see _claim and _gpus_fit).
        self._node_of: dict[str, str] = {}
        self._target_of: dict[str, str] = {}
        self._gpus_of: dict[str, set[int]] = {}
        # The target each node answered from before a restart, the GPUs and target each node's name is pinned
        # to (both see identity.py), the targets listed now and those that answered in this cycle.
        self._remembered = RememberedNodes()
        self._pins = NodePins(ttl_seconds=identity_ttl_seconds, max_pins=2 * max_nodes)
        self._listed: frozenset[str] = frozenset()
        self._answered: set[str] = set()
        self._dated: dict[str, float] = {}  # target -> its clock offset from its Date header, until better known
        self._transport = transport
        self._timeout_seconds = timeout_seconds
        self._timeout = httpx.Timeout(timeout_seconds)
        # One small client per target: httpcore's pool scans every connection on each request, so a
        # single pool over a thousand agents costs O(n^2) per cycle; per-target pools stay O(1).
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._ssl = verify
        self._auth = auth
        self._health: dict[str, TargetHealth] = {}
        self.clocks = ClockOffsets(clock_offset_min_seconds)

    async def aclose(self) -> None:
        """Close every target's connection."""
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.aclose() for c in clients))
        decoder, self._decoder = self._decoder, None
        if decoder is not None:
            decoder.shutdown(wait=False)

    def _client(self, target: str) -> httpx.AsyncClient:
        """The target's keep-alive client, created on first use."""
        client = self._clients.get(target)
        if client is None:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()  # building one per client would load the CA store 1000 times
            client = httpx.AsyncClient(
                transport=self._transport,
                timeout=self._timeout,
                follow_redirects=False,
                verify=self._ssl,
                auth=self._auth,
                limits=httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=300),
                headers={"accept": "application/json"},
            )
            self._clients[target] = client
        return client

    def health(self) -> list[TargetHealth]:
        """Every current target's health, sorted by target."""
        return [self._health[t] for t in sorted(self._health)]

    async def pull_once(self) -> PullResult:
        """Pull every target once, concurrently; returns the accepted samples."""
        started = self._clock()
        t0 = time.perf_counter()
        targets = await asyncio.to_thread(self._list_targets)
        self._listed = frozenset(targets)
        self._answered = set()
        for gone in set(self._health) - set(targets):
            del self._health[gone]
            self.clocks.forget(gone)
        for gone in (set(self._node_of) | set(self._span)) - set(targets):
            self._forget_identity(gone)
        for gone in {t for t, _ in self._errors} - set(targets):
            self._forget_target(gone)
        for gone in set(self._clients) - set(targets):
            await self._clients.pop(gone).aclose()
        self._expire_pins(started)
        self._cycle_first_span = self._first_span_now(targets)
        outcomes = await asyncio.gather(*(self._pull_target(t) for t in targets))
        samples = [s for ok, batch, _ in outcomes for s in batch]
        result = PullResult(
            samples=samples,
            started=started,
            duration_seconds=time.perf_counter() - t0,
            targets=len(targets),
            failed_targets=sum(1 for ok, _, _ in outcomes if not ok),
            rejected_snapshots=sum(r for _, _, r in outcomes),
            pins=self._pins.changes(),
        )
        return self._finish_cycle(result)

    def _list_targets(self) -> list[str]:
        """The sources' current targets; a failing source yields the previous set rather than none."""
        try:
            return self.source.targets()
        except Exception:  # a discovery bug must not stop ingest from the targets we already know
            log.exception("target discovery failed, keeping last targets")
            return sorted(self._health)

    async def _pull_target(self, target: str) -> tuple[bool, list[Any], int]:
        """Fetch, validate and account one target; never raises."""
        previous = self._health.get(target) or TargetHealth(target=target)
        now = self._clock()
        self.pulls_total += 1
        since = previous.last_sample_time
        span = self._span.get(target, self._cycle_first_span if since is None else None)
        try:
            async with self._semaphore, contextlib.AsyncExitStack() as held:
                # A first (or shortened) pull is the big one: fewer of those are read at once (see _get).
                gate = (held, self._first_semaphore) if span is not None else None
                body = await self._fetch(target, self._ask_since(target, since, span, now), span, gate)
                # The clock is read again on arrival: the fetch may have waited for the semaphore and the
                # agent, and that wait would read as the agent's clock running behind.
                arrived = self._clock()
                doc = await self._off_loop(self._load, body)
                del body
                node, samples, rejected, newest = await self._decode(target, doc, since, arrived)
        except PullError as exc:
            if exc.reason in _TOO_BIG:
                self._shrink(target, since, span, now)
            self._record_error(target, exc.reason, exc.detail)
            self._health[target] = replace(
                previous,
                up=False,
                last_attempt=now,
                last_error=str(exc),
                consecutive_failures=previous.consecutive_failures + 1,
            )
            return False, [], 0
        if newest is not None:
            self._span.pop(target, None)
        self._health[target] = replace(
            self._healthy(previous, node, now, newest, bool(samples)), clock_offset_seconds=self.clocks.estimate(target)
        )
        return True, samples, rejected

    def _first_span_now(self, targets: list[str]) -> float:
        """What each first pull of this cycle asks for: first_span, or its share of the cycle's budget."""
        firsts = sum(
            1
            for t in targets
            if t not in self._span and (t not in self._health or self._health[t].last_sample_time is None)
        )
        if not firsts:
            return self.first_span_seconds
        share = self.first_budget_seconds / firsts
        return min(self.first_span_seconds, max(share, _MIN_FIRST_SPAN_SECONDS))

    def _ask_since(self, target: str, since: float | None, span: float | None, now: float) -> float | None:
        """The `since` to send. With a span to keep to, and the agent's clock known, also no earlier than its
        newest sample less the span: agents that do not know the `span` parameter keep to it that way."""
        offset = self.clocks.estimate(target)
        if offset is None:
            # No answer decoded yet (every one too big): its HTTP Date header, to the second, is what we know of
            # its clock, and enough to keep an agent that ignores `span` to one.
            offset = self._dated.get(target)
        if span is None or offset is None:
            return since
        floor = now + offset - span
        return floor if since is None else max(since, floor)

    def _shrink(self, target: str, since: float | None, span: float | None, now: float) -> None:
        """After a too-big answer, ask the target for half the span next time rather than the same again
        (what lies before it is skipped: a gap, where asking again would bring nothing ever)."""
        if span is None:
            offset = self.clocks.estimate(target)
            gap = now + offset - since if since is not None and offset is not None else self.first_span_seconds
            span = max(gap, _MIN_SPAN_SECONDS)
        shorter = max(span / 2, _MIN_SPAN_SECONDS)
        if shorter < span:
            log.warning(
                "answer too big: asking the agent for a shorter span",
                extra={"target": target, "span_seconds": round(shorter, 3)},
            )
        self._span[target] = shorter

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the decoder thread."""
        if self._decoder is None:
            self._decoder = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpufleet-decode")
        return await asyncio.get_running_loop().run_in_executor(self._decoder, fn, *args)

    def _healthy(
        self, previous: TargetHealth, node: str | None, now: float, newest: float | None, got_new: bool
    ) -> TargetHealth:
        """Health after a successful answer; stale when no new sample has arrived for too long."""
        last_new = now if got_new or previous.last_new_data is None else previous.last_new_data
        stale = now - last_new > self.stale_after_seconds
        if stale and not previous.stale:
            log.warning("agent serves stale samples", extra={"target": previous.target, "node": node})
        return replace(
            previous,
            node=node or previous.node,
            up=True,
            stale=stale,
            last_attempt=now,
            last_success=now,
            last_new_data=last_new,
            last_sample_time=newest,
            consecutive_failures=0,
            last_error=None,
        )

    async def _fetch(
        self,
        target: str,
        since: float | None,
        span: float | None = None,
        gate: tuple[contextlib.AsyncExitStack, asyncio.Semaphore] | None = None,
    ) -> bytearray:
        """GET the target's snapshots newer than `since` (and within `span` seconds of its newest), the agent's
        part within the pull timeout, refusing oversized bodies; PullError on a non-200 status or a body over
        the limit.

        With a gate, its semaphore is taken once the answer's headers are in, into the caller's exit stack
        (released after decoding): agents that do not answer hold no slot, and the bodies read or waiting for
        the decoder at once are no more than the slots. The wait for a slot is ours, not the agent's: it is
        left out of the agent's timeout."""
        url = f"{self._scheme}://{target}/snapshots"
        params = {}
        if since is not None:
            params["since"] = repr(since)
        if span is not None:
            params["span"] = repr(round(span, 3))
        loop = asyncio.get_running_loop()
        async with bounded(None), contextlib.AsyncExitStack() as stream:  # closing the stream may fail too
            started = loop.time()
            async with bounded(self._timeout_seconds):
                response = await stream.enter_async_context(
                    self._client(target).stream("GET", url, params=params or None)
                )
                if response.status_code != 200:
                    raise PullError("http_status", str(response.status_code))
                self._note_date(target, response.headers.get("date"))
                declared = response.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > self.max_payload_bytes:
                    raise PullError("oversized", f"content-length {declared}")
            left = self._timeout_seconds - (loop.time() - started)
            if gate is not None:
                await gate[0].enter_async_context(gate[1])
            async with bounded(max(left, 0.0)):
                buf = bytearray()
                async for chunk in response.aiter_bytes():
                    buf += chunk
                    if len(buf) > self.max_payload_bytes:
                        raise PullError("oversized", f"over {self.max_payload_bytes} bytes")
                return buf  # orjson reads a bytearray as is: no second copy of a large body

    def _note_date(self, target: str, date: str | None) -> None:
        """Keep the agent's clock as its Date header shows it (agent minus ours, rounded down to the second, so
        a `since` set from it reaches back a little further, never less), while no answer has shown better."""
        if date is None or self.clocks.estimate(target) is not None:
            self._dated.pop(target, None)
            return
        with contextlib.suppress(TypeError, ValueError, IndexError, OverflowError):
            self._dated[target] = email.utils.parsedate_to_datetime(date).timestamp() - self._clock()

    def _load(self, body: bytes | bytearray) -> dict[str, Any]:
        """The answer's envelope, decoded and checked (on the decoder thread); its size is bounded first.

        Every JSON value but the first is preceded by a ',' or opens a '{' or '[' (its container), so their
        count bounds the number of values, and so the decoder's work and memory, before it starts; a
        ',', '{' or '[' inside a string only makes the bound more cautious."""
        entries = body.count(b",") + body.count(b"{") + body.count(b"[") + 1
        if entries > self.max_entries:
            raise PullError("too_many_entries", f"up to {entries} JSON values, over {self.max_entries}")
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise PullError("malformed_json") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("snapshots"), list):
            raise PullError("schema", "envelope without a 'snapshots' list")
        if doc.get("schema") != 1:
            raise PullError("schema", f"unsupported schema {doc.get('schema')!r}")
        if len(doc["snapshots"]) > self.max_snapshots:
            raise PullError("too_many_snapshots", f"{len(doc['snapshots'])} snapshots, over {self.max_snapshots}")
        return doc

    async def _decode(
        self, target: str, doc: dict[str, Any], since: float | None, now: float
    ) -> tuple[str | None, list[Any], int, float | None]:
        """Validate each snapshot of a loaded answer; returns (node, samples, rejected count, newest time).

        `since` and the newest time are in the agent's clock (they are what it is asked for next); the
        samples' times are in ours, less the clock offset the answer's stamp shows (ClockOffsets)."""
        node = self._claim(target, doc)
        served = self._agent_clock(_number(doc.get("time")), doc["snapshots"], now)
        # Samples are stamped in the agent's clock: one far ahead of the server's is only broken when it is
        # also ahead of the agent's own (a clock stepped forward is an offset to learn, not a fault).
        horizon = max(now, served if served is not None else now) + self.max_future_seconds
        fresh: list[tuple[Any, float | None]] = []
        rejected = 0
        newest, newest_fresh = since, None
        for raw in doc["snapshots"]:
            raw_time = _number(raw.get("time")) if isinstance(raw, dict) else None
            if raw_time is not None and since is not None and raw_time <= since:
                continue  # an agent that ignores `since` must not make us ingest twice
            if raw_time is not None and raw_time > horizon:
                rejected += 1
                self._record_error(
                    target,
                    "future_time",
                    f"sample time {raw_time!r} is {raw_time - now:.0f}s ahead of the server clock",
                )
                continue  # and `since` stays put, or the agent's honest samples after it would never be asked for
            identity_error = self._identity_error(node, raw)
            if identity_error is not None:
                rejected += 1
                self._record_error(target, *identity_error)
                continue
            fresh.append((raw, raw_time))
            if raw_time is not None:
                newest = raw_time if newest is None else max(newest, raw_time)  # past a bad one too: not re-fetched
                newest_fresh = raw_time if newest_fresh is None else max(newest_fresh, raw_time)
        if served is not None and since is not None and served < since:
            # The agent's clock went back past what it already served: every sample it takes now is stamped
            # before `since`, and asked for with it the agent would hold them back until its clock passes
            # `since` again (an hour's step: an hour dark). It starts its buffer afresh on such a step, so
            # the next pull asks for all of it.
            log.warning(
                "agent clock went back; asking for its samples afresh",
                extra={"target": target, "node": node, "behind_seconds": round(since - served, 3)},
            )
            newest = None
        offset = self._clock_offset(target, node, served, newest_fresh, now)
        oldest = now - self.max_past_seconds
        current = []
        for raw, raw_time in fresh:
            if raw_time is not None and raw_time - offset < oldest:
                rejected += 1
                self._record_error(
                    target,
                    "too_old",
                    f"sample time {raw_time - offset!r} is {now - raw_time + offset:.0f}s behind the server clock",
                )
                continue
            current.append((raw, raw_time))
        if node is not None:
            # The GPUs of its newest snapshot that lists any: the node's hardware as it is now.
            uuids = next((u for raw, _ in reversed(current) if (u := gpu_uuids((raw,)))), frozenset())
            self._pins.served(node, target, uuids, now)
        samples, problems = await self._off_loop(self._parse_all, current, offset)
        for problem in problems:
            rejected += 1
            self._record_error(target, "schema", problem)
        return node, samples, rejected, newest

    def _parse_all(self, fresh: list[tuple[Any, float | None]], offset: float) -> tuple[list[Any], list[str]]:
        """The contract's samples of accepted snapshots, and why each other one failed (on the decoder thread)."""
        samples: list[Any] = []
        problems: list[str] = []
        for raw, raw_time in fresh:
            if offset and raw_time is not None:
                raw = {**raw, "time": raw_time - offset}
            try:
                samples.append(self._parse(raw))
            except Exception as exc:  # noqa: BLE001 - any parser failure is a rejected snapshot, not a crash
                problems.append(str(exc) or exc.__class__.__name__)
        return samples, problems

    def _claim(self, target: str, doc: Mapping[str, Any]) -> str | None:
        """The node this answer speaks for, which must be the one the target first answered as: a target
        cannot take over another node's name (its samples would raise that node's alerts), nor grow the
        server's state by naming a new node each time. PullError when it tries."""
        node = doc.get("node") if isinstance(doc.get("node"), str) else None
        if node is None:
            first = next((s for s in doc["snapshots"] if isinstance(s, dict)), None)
            node = first.get("node") if first is not None and isinstance(first.get("node"), str) else None
        pinned = self._node_of.get(target)
        if node is None or node == pinned:
            if pinned is not None:
                self._answered.add(target)
            return pinned if node is None else node
        if pinned is not None:
            raise PullError("node_changed", f"answers as {node[:100]!r}, first seen as {pinned[:100]!r}")
        self._check_claim(target, node, doc["snapshots"])
        if node not in self._target_of and len(self._target_of) >= self.max_nodes:
            raise PullError("too_many_nodes", f"{len(self._target_of)} nodes already, the most accepted")
        self._take(target, node)
        return node

    def _check_claim(self, target: str, node: str, snapshots: list[Any]) -> None:
        """PullError `node_claimed` unless the target may answer for the node: never while the node's own
        target answers (or, listed, has not been asked yet); otherwise with GPUs among those its name is
        pinned to, or, where it has none pinned, while no other listed target holds the name (identity.py)."""
        owner = self._target_of.get(node)
        if owner is not None and self._answering(owner):
            raise PullError("node_claimed", f"{node[:100]!r} is pulled from {owner}")
        uuids = gpu_uuids(snapshots)
        evidence = self._pins.evidence(node, target, uuids)
        if evidence is Evidence.OTHER:
            raise PullError("node_claimed", self._other_gpus(node, uuids))
        pin = self._pins.get(node)
        if pin is not None and pin.target != target and pin.target in self._listed and pin.target not in self._health:
            # Two targets with the node's GPUs (one agent listed under two addresses): the one the name is
            # pinned to keeps it, whichever answers first after a restart.
            raise PullError("node_claimed", f"{node[:100]!r} is pinned to {pin.target}, not asked yet")
        owner = owner or self._remembered.owner(node, target, self._listed)
        if evidence is Evidence.NONE and owner is not None:
            raise PullError("node_claimed", f"{node[:100]!r} is pulled from {owner}")

    def _other_gpus(self, node: str, uuids: frozenset[str]) -> str:
        """Why a claim with other GPUs than the pinned ones is refused, for the error's detail."""
        pin = self._pins.get(node)
        pinned = f"{len(pin.gpu_uuids)} GPUs last answered for from {pin.target}" if pin is not None else "its GPUs"
        listed = f"{len(uuids)} GPU uuids, none of them" if uuids else "no GPU uuid"
        return (
            f"{node[:100]!r} is pinned to {pinned}; this answer lists {listed} "
            f"(the pin lapses after {self._pins.ttl_seconds:.0f} s unanswered, --targets.identity-ttl)"
        )

    def _answering(self, target: str) -> bool:
        """Whether a target answers: it did in this cycle, or its latest pull did not fail."""
        health = self._health.get(target)
        return target in self._answered or health is None or health.up

    def _take(self, target: str, node: str) -> None:
        """The target answers for the node from now on (taking it from a target that does not answer)."""
        previous = self._target_of.get(node)
        if previous is not None:
            del self._node_of[previous]
            if previous in self._health:
                self._health[previous] = replace(self._health[previous], node=None)
            log.warning(
                "node name taken by another target reporting its GPUs",
                extra={"node": node, "target": target, "previous_target": previous},
            )
        self._node_of[target] = node
        self._target_of[node] = target
        self._remembered.forget(target)
        self._answered.add(target)

    def _expire_pins(self, now: float) -> None:
        """Free the names whose pins lapsed: from the targets that held them, when those do not answer."""
        for node in self._pins.expire(now):
            self._remembered.forget_node(node)
            owner = self._target_of.get(node)
            if owner is not None and not self._answering(owner):
                del self._node_of[owner], self._target_of[node]

    def remember_identities(self, nodes: Mapping[str, str], pins: Mapping[str, NodePin] | None = None) -> None:
        """The node each target answered as before a restart (target -> node) and what each node's name was
        pinned to (node -> pin), from the store."""
        self._remembered.remember(nodes)
        self._pins.restore(pins or {})

    def _identity_error(self, node: str | None, raw: Any) -> tuple[str, str] | None:
        """(reason, detail) when a snapshot names another node than its target's, or brings its node's GPUs
        past max_gpus; None when it may go on to the contract's checks."""
        if not isinstance(raw, dict):
            return None
        if node is not None and isinstance(raw.get("node"), str) and raw["node"] != node:
            return "node_mismatch", f"a snapshot of {raw['node'][:100]!r} from the target of {node[:100]!r}"
        gpus = raw.get("gpus")
        if not isinstance(gpus, list):
            return None
        if len(gpus) > self.max_gpus:
            return "too_many_gpus", f"{len(gpus)} GPUs in one snapshot, over {self.max_gpus}"
        # The contract refuses it too (as `schema`): checked here first for a reason of its own.
        twice = duplicate_gpu_uuid(u for g in gpus if isinstance(g, dict) and isinstance(u := g.get("uuid"), str))
        if twice is not None:
            return "duplicate_gpu_uuid", twice
        if node is None:
            return None
        known = self._gpus_of.setdefault(node, set())
        new = {i for g in gpus if isinstance(g, dict) and type(i := g.get("index")) is int} - known
        if len(known) + len(new) > self.max_gpus:
            return "too_many_gpus", f"node would have {len(known) + len(new)} GPU indices, over {self.max_gpus}"
        known |= new
        return None

    def _forget_identity(self, target: str) -> None:
        """A target that left discovery frees its node's name (another target may now answer for it)."""
        self._span.pop(target, None)
        self._dated.pop(target, None)
        node = self._node_of.pop(target, None)
        if node is not None and self._target_of.get(node) == target:
            del self._target_of[node]
            self._gpus_of.pop(node, None)

    def _clock_offset(
        self, target: str, node: str | None, served: float | None, newest: float | None, now: float
    ) -> float:
        """The offset to take out of this answer's sample times: learned from the agent's stamp of the answer
        (as _agent_clock vetted it), or else from its newest sample, when the answer has either."""
        stamp = served if served is not None else newest
        if stamp is None:
            return self.clocks.offset(target)
        return self.clocks.observe(target, stamp, now, node)

    def _agent_clock(self, served: float | None, snapshots: list[Any], now: float) -> float | None:
        """The answer's stamp (the agent's clock when it answered) where it can be believed: near ours, or
        else agreeing with the answer's own samples (none newer, the newest within the agent's buffer of
        it): a clock stepped far away. A zero, milliseconds or a typo agree with neither."""
        if served is not None and not 0.0 <= served < _MAX_CLOCK:
            return None
        if served is None or abs(served - now) <= self.max_future_seconds:
            return served
        times = [t for t in (_number(raw.get("time")) for raw in snapshots if isinstance(raw, dict)) if t is not None]
        if not times:
            # Nothing to check it against: believed while it is a plausible clock (after 2001), which is
            # what an agent whose clock went back, asked for what came after its old time, answers with.
            return served if served > _PLAUSIBLE_CLOCK else None
        newest = max(times)
        return served if served - _AGENT_BUFFER_SECONDS <= newest <= served + _TOLERANCE_SECONDS else None

    def _record_error(self, target: str, reason: str, detail: str) -> None:
        """Count one rejected pull or snapshot."""
        self._count_error((target, reason), detail, "pull rejected", {"target": target})


def build_targets(settings: ServerSettings) -> CombinedTargets:
    """Every target source the settings name."""
    sources: list[TargetSource] = []
    if settings.targets:
        sources.append(StaticTargets(settings.targets))
    if settings.targets_file_sd:
        sources.append(FileSdTargets(settings.targets_file_sd))
    if settings.targets_dns:
        sources.append(DnsTargets(settings.targets_dns))
    return CombinedTargets(sources)


def first_span(settings: ServerSettings) -> float:
    """How far back a target's first pull reaches: the history the engine needs before it judges a job
    (its minimum history, or its smoothing window if longer), not the agent's whole ring."""
    from gpufleet.server.engine.config import EngineConfig

    config = EngineConfig.from_mapping(dict(settings.engine))
    return max(config.min_history_seconds, config.smooth_seconds)


def from_settings(settings: ServerSettings, wiring: Wiring) -> Puller:
    """The agents named by --targets, --targets.file-sd and --targets.dns, pulled with the pull.* settings."""
    agents = peer_options(settings, wiring, settings.pull_client, "pull", https=settings.pull_scheme == "https")
    targets = build_targets(settings)
    if not targets.sources:
        log.warning("no targets configured: use --targets, --targets.file-sd, --targets.dns or --ingest.prometheus-url")
    return Puller(
        targets,
        **agents,
        max_payload_bytes=settings.pull_max_bytes,
        concurrency=settings.pull_concurrency,
        clock_offset_min_seconds=settings.pull_clock_offset_min_seconds,
        scheme=settings.pull_scheme,
        max_entries=settings.pull_max_entries,
        max_snapshots=settings.pull_max_snapshots,
        max_gpus=settings.pull_max_gpus,
        max_nodes=settings.pull_max_nodes,
        first_span_seconds=first_span(settings),
        first_concurrency=settings.pull_first_concurrency,
        identity_ttl_seconds=settings.targets_identity_ttl_seconds,
    )


# Chosen when no other source is: the server's own way of reading the agents.
SOURCE = SourceKind(
    name="agents",
    selected=lambda settings: True,
    build=from_settings,
    peer=lambda settings: (settings.pull_client, "pull"),
)
