"""Reads GPU series from Prometheus instead of pulling every agent (`--ingest.prometheus-url`): the agents'
gpufleet_* series, NVIDIA dcgm-exporter's DCGM_FI_* series (ingest/dcgm.py), or both (`--ingest.prometheus-schema`).

Where Prometheus already scrapes every agent, a second puller hitting a thousand agents every few
seconds is load for nothing: this source asks Prometheus once per cycle for the raw samples it stored
since the last cycle (one instant query of a range selector, so the answer is whole scrapes only:
Prometheus never shows a query part of a scrape's appends). The series of one scrape share its
timestamp, which becomes the snapshot's sample time, so each (node, scrape) is rebuilt into one
snapshot-contract object and validated by the same parser as a pulled snapshot.

Utilization and SM activity come from the agent's `active` counters where it exports them: a ratio
gauge is the mean of one agent sampling interval, so a scrape every few seconds keeps one second in
several, at a different phase of the training step on each node, and nodes doing the same work read
differently (enough for a false node-level straggler in the demo cluster). The counters' increases
between two delivered scrapes give the exact mean over all the samples in between.

What the exposition cannot say: per-reading support. A GPU without a series for a reading gets the
reading as unsupported (absent), as in a snapshot. XID counts are the one exception: the agent only
exports codes that occurred, so a GPU with none reads 0, which is what lets the first XID count.

dcgm-exporter's series carry no sample age: a scrape's time is the sample's. Its XID metric is the last
code, not a count: each change to a new code counts one (ingest/dcgm.py). A GPU an agent reports (by UUID)
is read from the agent alone. A cycle that finds no usable GPU series, or whose every snapshot is
refused, is blind (IngestAccounting): said in the log, /healthz and /metrics, not left to look healthy.

A SampleSource (ingest/base.py) as the Puller is, so the runtime, /healthz, /nodes and /metrics read it
the same way; health() reports each agent or exporter as Prometheus's `up` sees it.
"""

from __future__ import annotations

import logging
import math
import re
import ssl
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import httpx
import msgspec
import orjson

from gpufleet.podnames import job_from_pod_name
from gpufleet.server.ingest import dcgm
from gpufleet.server.ingest.base import (
    Blindness,
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
from gpufleet.server.ingest.owned import any_down
from gpufleet.server.readings import READINGS, Kind, Reading
from gpufleet.server.shard import Shard

if TYPE_CHECKING:
    from gpufleet.server.settings import ServerSettings

log = logging.getLogger(__name__)

DEFAULT_MAX_LOOKBACK_SECONDS = 300.0
DEFAULT_MAX_ANSWER_BYTES = 512 * 1024 * 1024


def agent_fields(table: tuple[Reading, ...]) -> dict[str, tuple[str | None, dict[str | None, str]]]:
    """exposition metric -> (label that tells its series apart or None, {that label's value: reading}),
    from the reading table's agent series; without a label, the one reading sits under None."""
    out: dict[str, tuple[str | None, dict[str | None, str]]] = {}
    for r in table:
        if r.agent is not None:
            label, fields = out.setdefault(r.agent.metric, (r.agent.label, {}))
            if label != r.agent.label:
                raise ValueError(f"{r.agent.metric}: told apart by {label!r} and by {r.agent.label!r}")
            fields[r.agent.value] = r.name
    return out


_FIELDS = agent_fields(READINGS)
_BOOLS = frozenset(r.name for r in READINGS if r.kind is Kind.FLAG)
_JOB_INFO = "gpufleet_gpu_job_info"
_XID = "gpufleet_gpu_xid_errors_total"
_AGE = "gpufleet_agent_sample_age_seconds"
_UP_SERIES = "gpufleet_gpu_up"  # one series per GPU in every agent's answer
# A sample's time is the scrape's less the age the agent read while answering it, so it comes out early
# by however long the answer took. The same sample scraped again then reads up to that much newer (on a
# busy host, tenths of a second); a new one is a sampling period or more newer.
_SAME_SAMPLE_SECONDS = 0.5
# An instance Prometheus stopped listing (its target left discovery: on Kubernetes every agent restart is
# a new pod address) and that sends nothing is forgotten after this long, with its per-target series.
_FORGET_INSTANCE_SECONDS = 600.0
# activity counter -> which of the pair; the `reading` label -> the contract field its mean replaces
_ACTIVITY = {"gpufleet_gpu_active_seconds_total": 0, "gpufleet_gpu_active_sampled_seconds_total": 1}
_ACTIVITY_FIELDS = {r.activity: r.name for r in READINGS if r.activity is not None}
_GPUFLEET_NAMES = sorted([*_FIELDS, *_ACTIVITY, _JOB_INFO, _XID, _AGE])
# Series the dcgm recording rules (deploy/prometheus/dcgm-recording-rules.yaml) make under gpufleet's names
# carry this label: the source reads the dcgm-exporter originals instead, once.
RECORDED_LABEL = "gpufleet_recorded_from"
# dcgm-exporter (and the agent's --metrics.names dcgm) label a MIG GPU instance's series so; the GPU's have none.
_MIG_INSTANCE_LABEL = "GPU_I_ID"
SCHEMAS = ("auto", "gpufleet", "dcgm")


def selector(schema: str = "auto") -> str:
    """The series one cycle asks for: the agents' (`gpufleet`), dcgm-exporter's (`dcgm`), or both (`auto`)."""
    names = {"gpufleet": _GPUFLEET_NAMES, "dcgm": sorted(dcgm.READINGS)}.get(schema)
    names = names if names is not None else _GPUFLEET_NAMES + sorted(dcgm.READINGS)
    return '{__name__=~"' + "|".join(names) + '", ' + RECORDED_LABEL + '=""}'


SELECTOR = selector()


class _Series(msgspec.Struct, gc=False):
    """One series of a range query's answer, its points' values as floats (the API writes them as strings)."""

    metric: dict[str, str]
    values: list[tuple[float, float]]


class _Matrix(msgspec.Struct, gc=False):
    result: list[_Series]


class _MatrixAnswer(msgspec.Struct, gc=False):
    status: str
    data: _Matrix


# A well-formed answer decodes in one typed pass (lax: "0.5" -> 0.5), several times faster than JSON to
# Python objects and then per point; anything else (an error answer, a bad series or point, "+Inf")
# takes the generic path, which keeps what is good and counts the rest.
_MATRIX_DECODER = msgspec.json.Decoder(_MatrixAnswer, strict=False)


@dataclass(slots=True)
class _Gpu:
    """One GPU's readings at one scrape, as they arrive series by series."""

    uuid: str
    model: str | None = None
    job: str | None = None
    readings: dict[str, Any] | None = None
    xids: dict[str, float] | None = None  # code -> count (a non-finite one is refused by the contract)
    # reading label -> [seconds active, seconds sampled] (NaN until that series is seen)
    activity: dict[str, list[float]] | None = None
    ranks: dict[str, int] | None = None  # field -> rank of the dcgm metric that set it
    dcgm: bool = False

    def take(self, target: tuple, model: str | None, value: float) -> None:
        """One point of a reading series (target: what _target decided for the series)."""
        field, is_bool, reading, which, code, _, from_dcgm = target
        if self.readings is None:
            self.readings = {}
        if model is not None:
            self.model = model
        if field is not None:
            if from_dcgm is not None:  # a dcgm-exporter metric: the higher rank of two for one field wins
                self.dcgm = True
                converted = from_dcgm.value(value)
                if converted is None:
                    return  # DCGM's blank: unsupported, as an absent series
                if self.ranks is None:
                    self.ranks = {}
                if self.ranks.get(field, -1) > from_dcgm.rank:
                    return
                self.ranks[field] = from_dcgm.rank
                value = converted
            self.readings[field] = bool(value) if is_bool else value
        elif reading:
            if self.activity is None:
                self.activity = {}
            self.activity.setdefault(reading, [math.nan, math.nan])[which] = value
        elif code:
            if self.xids is None:
                self.xids = {}
            self.xids[code] = int(value) if math.isfinite(value) else value


class PrometheusSource(IngestAccounting):
    """Rebuilds node snapshots from Prometheus's stored scrapes of the agents, one query per cycle."""

    def __init__(
        self,
        url: str,
        *,
        interval_seconds: float = 5.0,
        timeout_seconds: float = 4.0,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
        max_lookback_seconds: float = DEFAULT_MAX_LOOKBACK_SECONDS,
        stale_after_seconds: float = 30.0,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.time,
        parse: Callable[[Mapping[str, Any]], Any] | None = None,
        verify: ssl.SSLContext | bool = True,
        auth: httpx.Auth | None = None,
        schema: str = "auto",
        shard: Shard | None = None,
    ) -> None:
        super().__init__()
        self.shard = shard or Shard()
        if schema not in SCHEMAS:
            raise ValueError(f"schema must be one of {', '.join(SCHEMAS)}, not {schema!r}")
        self.url = url.rstrip("/")
        self.schema = schema
        self._selector = selector(schema)
        self.interval_seconds = interval_seconds
        self.max_answer_bytes = max_answer_bytes
        self.max_lookback_seconds = max_lookback_seconds
        self.stale_after_seconds = stale_after_seconds
        self._clock = clock
        self._parse = parse or default_parse()
        self._timeout_seconds = timeout_seconds
        self._client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(timeout_seconds),
            follow_redirects=False,
            headers={"accept": "application/json"},
            verify=verify,
            auth=auth,
        )
        self._last_query: float | None = None
        self._range_cap = max_lookback_seconds
        self._newest: dict[str, float] = {}  # node -> newest sample time already delivered
        # (node, uuid, reading) -> (seconds active, seconds sampled, sample time) at the last delivered scrape
        self._activity: dict[tuple[str, str, str], tuple[float, float, float]] = {}
        self._instances: dict[str, str] = {}  # instance -> node it scrapes
        self._jobs: set[str] = set()  # Prometheus scrape jobs the agents are in
        self._health: dict[str, TargetHealth] = {}
        self._unlisted_since: dict[str, float] = {}  # instance -> since when `up` has not listed it
        # uuid -> newest sample time of an agent's series for the GPU: its dcgm-exporter series are left out
        self._agent_uuids: dict[str, float] = {}
        # dcgm uuid -> (last XID code seen, XIDs counted since): the gauge holds the last code, not a count
        self._dcgm_xids: dict[str, tuple[float, int]] = {}
        self._dcgm_fields: frozenset[str] | None = None  # contract fields some dcgm GPU had, once known
        self._cycle_blind: Blindness | None = None
        self._last_usable: float | None = None  # when an answer last held usable GPU series
        self._fleet_listed = False  # a shard's: whether the last listing found any job or node, owned or not
        # a shard's: nodes whose latest sample had a GPU down, read on after their job ends, since the job's
        # shard keeps such a node (ingest/owned.py, Ownership)
        self._down_nodes: set[str] = set()

    async def aclose(self) -> None:
        """Close the connection to Prometheus."""
        await self._client.aclose()

    def health(self) -> list[TargetHealth]:
        """Every agent Prometheus scrapes for us, by instance, as its `up` series and our samples say."""
        return [self._health[t] for t in sorted(self._health)]

    async def pull_once(self) -> PullResult:
        """Everything Prometheus stored since the last cycle, as validated samples."""
        started = now = self._clock()
        t0 = time.perf_counter()
        self.pulls_total += 1
        samples: list[Any] = []
        rejected = 0
        failed = 0
        lookback = self._lookback(now)
        self._cycle_blind = None
        try:
            series = await self._read(lookback, now)
        except PullError as exc:
            failed = 1
            self._record_error(exc.reason, exc.detail)
            if exc.reason in ("timeout", "oversized") and lookback > self._steady_range():
                # A range Prometheus cannot answer in time (the first cycle's history of a big fleet, the
                # backlog after an outage) would fail the same way every cycle: ask for less next time.
                self._range_cap = max(self._steady_range(), lookback / 2)
                log.warning(
                    "prometheus answer too slow or big, asking for less history",
                    extra={"url": self.url, "lookback_seconds": lookback, "next_lookback_seconds": self._range_cap},
                )
            self._health = {
                t: replace(
                    h,
                    up=False,
                    last_attempt=now,
                    last_error=f"prometheus: {exc}",
                    consecutive_failures=h.consecutive_failures + 1,
                )
                for t, h in self._health.items()
            }
            self._cycle_blind = Blindness("source_down", f"an answer from Prometheus at {self.url}", str(exc)[:200])
        else:
            skipped = 0.0 if self._last_query is None else now - lookback - self._last_query
            if skipped > 0:
                log.warning(
                    "scrapes older than the shortened lookback were skipped",
                    extra={"url": self.url, "skipped_seconds": round(skipped, 3)},
                )
            self._last_query = now
            self._range_cap = min(self.max_lookback_seconds, 2 * self._range_cap)
            snapshots, arrived, usable = self._assemble(series)
            for raw in snapshots:
                try:
                    samples.append(self._parse(raw))
                except Exception as exc:  # noqa: BLE001 - a bad rebuilt snapshot is rejected, not a crash
                    rejected += 1
                    self._record_error("schema", f"node {raw.get('node')!r}: {exc}")
            if not self.shard.whole:
                self._note_down(samples)
            self._cycle_blind = self._blind_answer(series, usable, len(snapshots), rejected, lookback, now)
            self._update_health(await self._up(now), arrived, now)
        return self._finish_cycle(
            PullResult(
                samples=samples,
                started=started,
                duration_seconds=time.perf_counter() - t0,
                targets=len(self._health),
                failed_targets=failed,
                rejected_snapshots=rejected,
            )
        )

    def _note_down(self, samples: list[Any]) -> None:
        """Which nodes read had a GPU down in their latest sample (those read again next cycle)."""
        latest: dict[str, Any] = {}
        for sample in samples:
            if sample.node not in latest or sample.time >= latest[sample.node].time:
                latest[sample.node] = sample
        for node, sample in latest.items():
            if any_down(sample):
                self._down_nodes.add(node)
            else:
                self._down_nodes.discard(node)

    async def _read(self, lookback: float, now: float) -> list[_Series]:
        """The series of the last `lookback` seconds: all of them, or a shard's own (_read_owned)."""
        if self.shard.whole:
            return self._matrix(*await self._fetch(f"{self._selector}[{lookback:.0f}s]", now))
        return await self._read_owned(lookback, now)

    async def _read_owned(self, lookback: float, now: float) -> list[_Series]:
        """Only the series of the jobs and job-less nodes this shard owns, so the database's work and the
        answer follow the shard's share, not the fleet.

        First the label values of `hpc_job` and of the node labels (an index lookup, no samples read), owned
        ones picked here by the same hash every shard uses. dcgm-exporter's series carry `hpc_job`
        themselves: they are asked for by job, and the job-less ones by `Hostname`. The agents name the job
        on one info series per GPU only (`gpufleet_gpu_job_info`, so that job churn does not multiply every
        series): the owned jobs' info series give their nodes, and those nodes' series are read, with the
        nodes whose name hashes here (for GPUs of no job). So a shard reads the nodes of its jobs plus
        1/COUNT of the nodes: about twice its share, still a share. Foreign GPUs on a node read whole are cut
        off by ingest/owned.py. Long lists are asked for in several queries."""
        window = {"start": f"{now - lookback:.3f}", "end": f"{now:.3f}"}
        range_ = f"[{lookback:.0f}s]"
        recorded = f'{RECORDED_LABEL}=""'
        out: list[_Series] = []
        owned_jobs: list[str] = []
        with_jobs = {"gpufleet": [_JOB_INFO], "dcgm": sorted(dcgm.READINGS)}.get(self.schema)
        jobs = await self._label_values(
            "hpc_job", '{__name__=~"' + "|".join(with_jobs or [_JOB_INFO, *sorted(dcgm.READINGS)]) + '"}', window
        )
        owned_jobs = [j for j in jobs if j and self.shard.owns_job(j)]
        self._fleet_listed = bool(jobs)
        if self.schema != "dcgm":
            names = '{__name__=~"' + "|".join(_GPUFLEET_NAMES) + '", ' + recorded
            every = await self._label_values("node", _AGE, window)
            self._fleet_listed |= bool(every)
            nodes = {n for n in every if self.shard.owns_node(n)} | (self._down_nodes & set(every))
            if self.shard.reads_every_jobless:
                nodes.update(await self._jobless_nodes(lookback, now))
            for jobs_ in _chunks(owned_jobs):
                info = self._matrix(*await self._fetch(f"{_JOB_INFO}{{hpc_job=~{_regex(jobs_)}}}{range_}", now))
                nodes.update(n for s in info if isinstance(n := s.metric.get("node"), str))
            for part in _chunks(sorted(nodes)):
                out += self._matrix(*await self._fetch(f"{names}, node=~{_regex(part)}}}{range_}", now))
        if self.schema != "gpufleet":
            names = '{__name__=~"' + "|".join(sorted(dcgm.READINGS)) + '", ' + recorded
            job_hosts: set[str] = set()
            for jobs_ in _chunks(owned_jobs):
                part_ = self._matrix(*await self._fetch(f"{names}, hpc_job=~{_regex(jobs_)}}}{range_}", now))
                job_hosts.update(h for s in part_ if isinstance(h := s.metric.get(dcgm.NODE_LABEL), str))
                out += part_
            pods = await self._read_owned_pods(names, window, range_, now)
            job_hosts.update(h for s in pods if isinstance(h := s.metric.get(dcgm.NODE_LABEL), str))
            out += pods
            jobless = f'{names}, {dcgm.JOB_LABEL}="", {dcgm.POD_LABEL}=""}}'
            every = await self._label_values(dcgm.NODE_LABEL, jobless, window)
            self._fleet_listed |= bool(every)
            # ingest/owned.py gives a job-less GPU on a host that runs a job to that job's shard: the job-less
            # series of the owned jobs' hosts, and of the hosts hashing here that run no job.
            busy: set[str] = set()
            if every:
                for label in (dcgm.JOB_LABEL, dcgm.POD_LABEL):
                    busy.update(await self._label_values(dcgm.NODE_LABEL, f'{names}, {label}=~".+"}}', window))
            hosts = [
                h
                for h in every
                if (self.shard.owns_node(h) and h not in busy)
                or h in job_hosts
                or h in self._down_nodes
                or self.shard.reads_every_jobless
            ]
            for part in _chunks(sorted(hosts)):
                out += self._matrix(
                    *await self._fetch(
                        f'{names}, {dcgm.JOB_LABEL}="", {dcgm.POD_LABEL}="", {dcgm.NODE_LABEL}=~{_regex(part)}}}{range_}',
                        now,
                    )
                )
        return out

    async def _jobless_nodes(self, lookback: float, now: float) -> list[str]:
        """`--shard.jobless fleet`: the nodes with a GPU of no job in the range, whatever shard their name
        hashes to. The agents name a GPU's job on its info series only, so a GPU is job-less where it was
        sampled more often than its job was named (never, for a GPU that ran none): one instant query over
        one series per GPU, whose answer is one label value per such node."""
        range_ = f"[{lookback:.0f}s]"
        recorded = f'{RECORDED_LABEL}=""'
        sampled = f"sum by (node, uuid) (count_over_time({_UP_SERIES}{{{recorded}}}{range_}))"
        named = f'sum by (node, uuid) (count_over_time({_JOB_INFO}{{{recorded}, hpc_job!=""}}{range_}))'
        query = f"group by (node) (({sampled} unless on (node, uuid) {named}) or ({sampled} > on (node, uuid) {named}))"
        buf, status = await self._fetch(query, now)
        try:
            doc = orjson.loads(buf)
        except orjson.JSONDecodeError:
            raise PullError("malformed_json", f"HTTP {status}") from None
        if not isinstance(doc, dict) or doc.get("status") != "success" or not isinstance(doc.get("data"), dict):
            raise PullError("query_failed", f"HTTP {status}: {str(doc)[:200]}")
        result = doc["data"].get("result")
        return [
            node
            for item in (result if isinstance(result, list) else [])
            if isinstance(item, dict)
            and isinstance(item.get("metric"), dict)
            and isinstance(node := item["metric"].get("node"), str)
        ]

    async def _read_owned_pods(self, names: str, window: Mapping[str, str], range_: str, now: float) -> list[_Series]:
        """dcgm-exporter series of the owned jobs that only Kubernetes pod labels name (no hpc_job): the job is
        the pod's namespace and name less its suffixes, so the pods are listed per namespace (label values
        again, no samples read) and the owned ones asked for by name."""
        out: list[_Series] = []
        podded = f'{names}, {dcgm.JOB_LABEL}=""'
        for namespace in await self._label_values(dcgm.NAMESPACE_LABEL, podded + "}", window):
            in_namespace = f"{podded}, {dcgm.NAMESPACE_LABEL}={orjson.dumps(namespace).decode()}"
            pods = await self._label_values(dcgm.POD_LABEL, in_namespace + "}", window)
            self._fleet_listed |= bool(pods)
            owned = [p for p in pods if p and self.shard.owns_job(job_from_pod_name(namespace, p))]
            for part in _chunks(owned):
                out += self._matrix(
                    *await self._fetch(f"{in_namespace}, {dcgm.POD_LABEL}=~{_regex(part)}}}{range_}", now)
                )
        return out

    async def _label_values(self, label: str, match: str, window: Mapping[str, str]) -> list[str]:
        """The values `label` takes on the series `match` selects within `window`; PullError on failure."""
        async with bounded(self._timeout_seconds):
            response = await self._client.get(
                f"{self.url}/api/v1/label/{label}/values", params={"match[]": match, **window}
            )
        if len(response.content) > self.max_answer_bytes:
            raise PullError("oversized", f"over {self.max_answer_bytes} bytes")
        try:
            doc = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            raise PullError("malformed_json", f"HTTP {response.status_code}") from None
        if not isinstance(doc, dict) or doc.get("status") != "success" or not isinstance(doc.get("data"), list):
            raise PullError("query_failed", f"HTTP {response.status_code}: {str(doc)[:200]}")
        return [v for v in doc["data"] if isinstance(v, str)]

    def _blindness(self, result: PullResult) -> Blindness | None:
        return self._cycle_blind

    def _blind_answer(
        self, series: list[_Series], usable: int, snapshots: int, rejected: int, lookback: float, now: float
    ) -> Blindness | None:
        """Blind when Prometheus held no usable GPU series on the first cycle (which asks for minutes) or for
        --pull.stale-after since (a scrape interval longer than the cycle leaves some ranges empty), or when
        every rebuilt snapshot was refused. A range with usable series but no new scrape is not blind."""
        wanted = {"gpufleet": "gpufleet agents' gpufleet_gpu_* series", "dcgm": "dcgm-exporter's DCGM_FI_* series"}.get(
            self.schema, "gpufleet_gpu_* or dcgm-exporter DCGM_FI_* series"
        )
        looked_for = f"{wanted} with node/gpu/uuid (dcgm: Hostname/gpu/UUID) labels, last {lookback:.0f}s"
        if usable or (not series and self._fleet_listed):
            # A shard may own nothing at all of a fleet the database holds (fewer jobs than shards): not blind.
            self._last_usable = now
        elif self._last_usable is None or now - self._last_usable > self.stale_after_seconds:
            found = (
                f"{len(series)} series, none with those labels"
                if series
                else "no series of those names (check --ingest.prometheus-schema and that Prometheus "
                "scrapes the exporters)"
            )
            return Blindness("no_series", looked_for, found)
        if snapshots and rejected >= snapshots:
            return Blindness(
                "all_rejected",
                looked_for,
                f"{snapshots} snapshot(s) rebuilt, every one rejected (see gpufleet_server_rejected_total)",
            )
        return None

    def _lookback(self, now: float) -> float:
        """Range to ask for: since the last good query, plus two intervals for scrapes committed after it
        under an earlier timestamp, capped; on the first cycle the cap, which warms the engine's windows.
        The cap halves after each answer that timed out or was too big (never below one cycle's range) and
        doubles back after each good one."""
        if self._last_query is None:
            return self._range_cap
        return min(self._range_cap, max(now - self._last_query + 2 * self.interval_seconds, 1.0))

    def _steady_range(self) -> float:
        """What one cycle asks for when nothing was missed."""
        return 3 * self.interval_seconds

    async def _up(self, now: float) -> list[Any]:
        """Prometheus's `up` for the scrape jobs the agents are in (learned from their series), which
        names agents that fail to be scraped; [] when unknown yet or when the query fails."""
        if not self._jobs:
            return []
        jobs = "|".join(sorted(re.escape(j) for j in self._jobs))
        try:
            return await self._query(f"up{{job=~{orjson.dumps(jobs).decode()}}}", now)
        except PullError as exc:
            self._record_error(exc.reason, f"up: {exc.detail}")
            return []

    async def _query(self, promql: str, at: float) -> list[Any]:
        """One instant query's result list, decoded generically; PullError on any failure."""
        return _result(*await self._fetch(promql, at))

    async def _fetch(self, promql: str, at: float) -> tuple[bytes | bytearray, int]:
        """One instant query's raw answer and HTTP status; PullError when it cannot be had in time."""
        async with (
            bounded(self._timeout_seconds),
            self._client.stream(
                "GET", f"{self.url}/api/v1/query", params={"query": promql, "time": f"{at:.3f}"}
            ) as response,
        ):
            buf = bytearray()
            async for chunk in response.aiter_bytes():
                buf += chunk
                if len(buf) > self.max_answer_bytes:
                    raise PullError("oversized", f"over {self.max_answer_bytes} bytes")
            return buf, response.status_code

    def _matrix(self, buf: bytes | bytearray, status: int) -> list[_Series]:
        """A range query's series, typed; malformed series and points are counted and left out."""
        if status == 200:
            try:
                answer = _MATRIX_DECODER.decode(buf)
            except (msgspec.DecodeError, UnicodeDecodeError):
                pass  # the tolerant path below says what is wrong with it
            else:
                if answer.status == "success":
                    return answer.data.result
        out = []
        for s in _result(buf, status):
            labels, values = (s.get("metric"), s.get("values")) if isinstance(s, dict) else (None, None)
            if not isinstance(labels, dict) or not isinstance(values, list):
                self._record_error("schema", "series without metric labels or values")
                continue
            points = []
            for point in values:
                try:
                    points.append((float(point[0]), float(point[1])))
                except (TypeError, ValueError, IndexError):
                    self._record_error("schema", f"bad sample {str(point)[:80]} in {labels.get('__name__')}")
            out.append(_Series({str(k): v for k, v in labels.items()}, points))
        return out

    def _assemble(self, series: list[_Series]) -> tuple[list[dict[str, Any]], dict[str, float], int]:
        """Snapshot-contract objects per (node, scrape) whose agent sample is newer than what was
        delivered, the newest delivered sample time per instance, and how many series were usable."""
        scrapes, ages, sources, usable = self._gather(series)
        out: list[dict[str, Any]] = []
        arrived: dict[str, float] = {}
        for (node, at), gpus in sorted(scrapes.items(), key=lambda kv: kv[0][1]):
            # The sample's own time: the scrape's, less the sample's age the agent reported in it. The scrape
            # time alone is off by up to a sampling period, which would skew every rate over the next one.
            taken = at - ages[(node, at)] if (node, at) in ages else at
            present = [(index, g) for index, g in sorted(gpus.items()) if g.readings is not None]
            if not present or taken <= self._newest.get(node, float("-inf")) + _SAME_SAMPLE_SECONDS:
                continue  # the same sample scraped again (an agent whose sampling is stuck): not new
            rows = [self._with_activity_means(node, taken, g, self._row(index, g)) for index, g in present]
            self._dcgm_rows(rows, [g for _, g in present])
            out.append({"schema": 1, "node": node, "time": taken, "gpus": rows})
            self._newest[node] = taken
            instance = sources.get((node, at))
            if instance is not None:
                arrived[instance] = max(arrived.get(instance, taken), taken)
        if out:
            horizon = max(s["time"] for s in out) - 2 * self.max_lookback_seconds
            self._activity = {k: v for k, v in self._activity.items() if v[2] >= horizon}
            self._agent_uuids = {k: t for k, t in self._agent_uuids.items() if t >= horizon}
        return out, arrived, usable

    def _dcgm_rows(self, rows: list[dict[str, Any]], gpus: list[_Gpu]) -> None:
        """dcgm-exporter GPUs' rows: an XID count from the last-XID gauge, and what readings the source has."""
        fields = set(self._dcgm_fields or ())
        seen = False
        for row, g in zip(rows, gpus):
            if not g.dcgm:
                continue
            seen = True
            fields.update(g.readings or ())
            code = row.pop("last_xid", None)
            row.pop("xid_errors_total", None)
            if code is None or code != code:
                continue
            row["last_xid"] = code
            # A count of the changes to a new nonzero code, from 0 at the first sight of the GPU (the code
            # then is from before we watched): the engine raises an XID alert on each increase.
            last, count = self._dcgm_xids.get(g.uuid, (code, 0))
            if code != last and code != 0:
                count += 1
            self._dcgm_xids[g.uuid] = (code, count)
            row["xid_errors_total"] = count
        if seen:
            self._note_dcgm_fields(frozenset(fields))

    def _note_dcgm_fields(self, fields: frozenset[str]) -> None:
        """Say once (and again when it changes) what each detector cannot do for the readings no GPU has."""
        if fields == self._dcgm_fields:
            return
        self._dcgm_fields = fields
        missing = dcgm.missing_effects(fields)
        if missing != self.missing:
            self.missing = missing
            for reading, detector, effect in missing:
                log.warning(
                    "dcgm-exporter source lacks a reading",
                    extra={
                        "reading": reading,
                        "detector": detector,
                        "effect": effect,
                        "export": " or ".join(dcgm.metrics_for(reading)),
                    },
                )

    def _gather(
        self, series: list[_Series]
    ) -> tuple[
        dict[tuple[str, float], dict[int, _Gpu]], dict[tuple[str, float], float], dict[tuple[str, float], str], int
    ]:
        """The points newer than what was delivered, per (node, scrape time): each GPU's readings, the
        sample's age the agent reported, the instance scraped; and how many series were usable."""
        scrapes: dict[tuple[str, float], dict[int, _Gpu]] = defaultdict(dict)
        by_gpu: dict[tuple[str, int], dict[float, _Gpu]] = {}  # the same records, by GPU then scrape
        ages: dict[tuple[str, float], float] = {}
        sources: dict[tuple[str, float], str] = {}
        agents = self._agent_uuids
        usable = 0
        for s in _agents_first(series):
            labels = s.metric
            if labels.get(_MIG_INSTANCE_LABEL):
                continue  # dcgm-exporter's series of one MIG instance, beside the GPU's own
            key = self._series_key(labels)
            if key is None:
                continue
            name, node, index, uuid = key
            if name in dcgm.READINGS:
                if uuid in agents:
                    continue  # the GPU's agent says it all, in its own units and times: counted once
            elif uuid and s.values:
                agents[uuid] = s.values[-1][0]
            usable += 1
            instance, job = labels.get("instance"), labels.get("job")
            if isinstance(instance, str):
                self._instances[instance] = node
            if isinstance(job, str):
                self._jobs.add(job)
            # A scrape carries the agent's newest sample, taken before it: a scrape no later than the
            # newest delivered sample cannot carry a newer one.
            newest = self._newest.get(node, -math.inf)
            if name == _AGE:
                for at, value in s.values:
                    if at > newest:
                        ages[(node, at)] = value
                        if isinstance(instance, str):
                            sources[(node, at)] = instance
                continue
            target = _target(name, labels, self.shard.whole)
            if target is None:
                self._record_error("schema", f"series of an unexpected metric {name[:80]}")
                continue
            model = labels.get(dcgm.MODEL_LABEL if name in dcgm.READINGS else "model")
            model = model if isinstance(model, str) else None
            records = by_gpu.get((node, index))
            if records is None:
                records = by_gpu[(node, index)] = {}
            for at, value in s.values:
                if at <= newest:
                    continue
                gpu = records.get(at)
                if gpu is None:
                    gpu = records[at] = scrapes[(node, at)][index] = _Gpu(uuid)
                    if isinstance(instance, str):
                        sources[(node, at)] = instance
                if name == _JOB_INFO:
                    if value == 1.0:
                        gpu.job = target[5]
                else:
                    if target[5] is not None:  # a dcgm-exporter series' hpc_job label
                        gpu.job = target[5]
                    gpu.take(target, model, value)
        return scrapes, ages, sources, usable

    def _with_activity_means(self, node: str, taken: float, g: _Gpu, row: dict[str, Any]) -> dict[str, Any]:
        """The row with its ratio gauges replaced by the mean since the GPU's previous delivered scrape, from
        the agent's activity counters. Without a previous scrape, or after the counters went back (the
        agent restarted), the gauge stays."""
        for reading, (active, sampled) in (g.activity or {}).items():
            field = _ACTIVITY_FIELDS.get(reading)
            if field is None or not (active == active and sampled == sampled):
                continue
            key = (node, g.uuid, reading)
            previous = self._activity.get(key)
            self._activity[key] = (active, sampled, taken)
            if previous is None:
                continue
            d_active, d_sampled = active - previous[0], sampled - previous[1]
            if d_sampled > 0 and 0 <= d_active <= d_sampled * (1 + 1e-9):
                row[field] = min(d_active / d_sampled, 1.0)
        return row

    def _series_key(self, labels: Mapping[str, Any]) -> tuple[str, str, int, str] | None:
        """(metric, node, GPU index, uuid) of one series (index -1 and no uuid for the node's sample age),
        or None (counted) when its labels are unusable."""
        name = labels.get("__name__")
        if name in dcgm.READINGS:
            node, gpu, uuid = labels.get(dcgm.NODE_LABEL), labels.get(dcgm.INDEX_LABEL), labels.get(dcgm.UUID_LABEL)
        else:
            node, gpu, uuid = labels.get("node"), labels.get("gpu"), labels.get("uuid")
        if name == _AGE and isinstance(node, str) and node:
            return name, node, -1, ""
        if not (
            isinstance(name, str)
            and isinstance(node, str)
            and isinstance(gpu, str)
            and isinstance(uuid, str)
            and name
            and node
            and uuid
            and gpu.isdigit()
        ):
            wanted = "Hostname/gpu/UUID" if name in dcgm.READINGS else "node/gpu/uuid"
            self._record_error("schema", f"series without {wanted} labels: {str(labels)[:200]}")
            return None
        return name, node, int(gpu), uuid

    @staticmethod
    def _row(index: int, g: _Gpu) -> dict[str, Any]:
        """The contract's GPU object."""
        row: dict[str, Any] = {"index": index, "uuid": g.uuid, "model": g.model or "unknown", "hpc_job": g.job}
        row.update(g.readings or {})
        xids = g.xids or {}
        row["xid_errors_total"] = sum(xids.values())
        if xids:
            row["xid_errors_by_code"] = xids
        return row

    def _update_health(self, up: list[Any], arrived: Mapping[str, float], now: float) -> None:
        """Each agent instance: up as Prometheus last scraped it, stale when no new scrape came for too long."""
        state: dict[str, bool] = {}
        for s in up:
            labels, value = (s.get("metric"), s.get("value")) if isinstance(s, dict) else (None, None)
            instance = labels.get("instance") if isinstance(labels, dict) else None
            if isinstance(instance, str) and isinstance(value, list) and len(value) == 2:
                state[instance] = value[1] == "1"
        if not self.shard.whole:
            # `up` lists the whole fleet's agents: a shard keeps the ones it reads, and the failing ones it
            # cannot name a node for (which ingest/owned.py gives a shard by their address).
            state = {i: is_up for i, is_up in state.items() if i in self._instances or not is_up}
        for instance in set(state) | set(arrived) | set(self._health):
            previous = self._health.get(instance) or TargetHealth(target=instance)
            newest = arrived.get(instance, previous.last_sample_time)
            got_new = newest is not None and (previous.last_sample_time is None or newest > previous.last_sample_time)
            last_new = now if got_new or previous.last_new_data is None else previous.last_new_data
            is_up = state.get(instance, previous.up if instance not in arrived else True)
            self._health[instance] = replace(
                previous,
                node=self._instances.get(instance, previous.node),
                up=is_up,
                stale=is_up and now - last_new > self.stale_after_seconds,
                last_attempt=now,
                last_success=now if is_up else previous.last_success,
                last_new_data=last_new,
                last_sample_time=newest,
                consecutive_failures=0 if is_up else previous.consecutive_failures + 1,
                last_error=None if is_up else "prometheus reports the scrape failing (up == 0)",
            )
        if state:  # `up` answered (an empty answer, or a failed query, says nothing about who left)
            self._forget_unlisted(state, arrived, now)

    def _forget_unlisted(self, listed: Mapping[str, bool], arrived: Mapping[str, float], now: float) -> None:
        for instance in list(self._health):
            if instance in listed or instance in arrived:
                self._unlisted_since.pop(instance, None)
            elif now - self._unlisted_since.setdefault(instance, now) >= _FORGET_INSTANCE_SECONDS:
                del self._health[instance], self._unlisted_since[instance]
                self._instances.pop(instance, None)

    def _record_error(self, reason: str, detail: str) -> None:
        """Count one failed query or rejected series, under the Prometheus URL as the target."""
        self._count_error((self.url, reason), detail, "prometheus read rejected", {"url": self.url})


def _target(
    name: str, labels: Mapping[str, Any], owners: bool = True
) -> tuple[str | None, bool, str, int, str, Any, dcgm.Reading | None] | None:
    """What every point of one GPU series sets (the same at each point, so decided once per series):
    (contract field or None, whether it is a bool, activity reading, which activity counter, XID code,
    hpc_job of a job-info or dcgm-exporter series, how to read a dcgm-exporter metric); None for a metric
    this source does not read. `owners`: see dcgm.job_of (False on a shard)."""
    if name == _JOB_INFO:
        return None, False, "", 0, "", labels.get("hpc_job") or None, None
    if name == _XID:
        return None, False, "", 0, str(labels.get("xid")), None, None
    if name in _ACTIVITY:
        return None, False, str(labels.get("reading")), _ACTIVITY[name], "", None, None
    if name in _FIELDS:
        label, fields = _FIELDS[name]
        field = fields.get(None if label is None else labels.get(label))
        if field is not None:
            return field, field in _BOOLS, "", 0, "", None, None
        return None, False, "", 0, "", None, None
    reading = dcgm.READINGS.get(name)
    if reading is not None:
        return reading.field, reading.field in dcgm.BOOLS, "", 0, "", dcgm.job_of(labels, owners), reading
    return None


# Characters of one regex matcher's alternatives: a query's URL stays far below the limits proxies put on one.
_CHUNK_CHARS = 4000


def _chunks(values: list[str]) -> Iterator[list[str]]:
    """`values` in runs whose escaped alternatives fit one matcher."""
    run: list[str] = []
    size = 0
    for v in values:
        n = len(_RE2_SPECIAL.sub(r"\\\1", v)) + 1
        if run and size + n > _CHUNK_CHARS:
            yield run
            run, size = [], 0
        run.append(v)
        size += n
    if run:
        yield run


# RE2's metacharacters: the rest of a label value stands for itself.
_RE2_SPECIAL = re.compile(r"([\\.+*?()|\[\]{}^$])")


def _regex(values: list[str]) -> str:
    """A PromQL string literal of a regex matching exactly `values` (RE2, anchored by PromQL)."""
    return orjson.dumps("|".join(_RE2_SPECIAL.sub(r"\\\1", v) for v in values)).decode()


def _agents_first(series: list[_Series]) -> Iterator[_Series]:
    """The agents' series, then dcgm-exporter's: a GPU's agent series are known before its dcgm twins."""
    deferred = []
    for s in series:
        if s.metric.get("__name__") in dcgm.READINGS:
            deferred.append(s)
        else:
            yield s
    yield from deferred


def _result(buf: bytes | bytearray, status: int) -> list[Any]:
    """The `result` list of a query's answer, decoded generically; PullError when the answer is no success."""
    try:
        doc = orjson.loads(buf)
    except orjson.JSONDecodeError:
        if status != 200:
            # Not Prometheus's API answering: a proxy, or its web config refusing our credentials (401, 403).
            raise PullError(
                "http_status", f"HTTP {status}: {bytes(buf[:200]).decode(errors='replace').strip()}"
            ) from None
        raise PullError("malformed_json", f"HTTP {status}") from None
    if not isinstance(doc, dict) or doc.get("status") != "success":
        error = doc.get("error") if isinstance(doc, dict) else None
        raise PullError("query_failed", f"HTTP {status}: {str(error)[:200]}")
    data = doc.get("data")
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, list):
        raise PullError("schema", "answer without a result list")
    return result


def from_settings(settings: ServerSettings, wiring: Wiring) -> PrometheusSource:
    """The source --ingest.prometheus-url and the ingest.prometheus.* settings describe."""
    url = settings.prometheus_url or ""
    prom = peer_options(
        settings, wiring, settings.prometheus_client, "ingest.prometheus", https=url.startswith("https://")
    )
    log.info("reading GPU series through Prometheus", extra={"url": url, "schema": settings.prometheus_schema})
    return PrometheusSource(
        url,
        **prom,
        interval_seconds=settings.pull_interval_seconds,
        schema=settings.prometheus_schema,
        shard=settings.shard,
    )


SOURCE = SourceKind(
    name="prometheus",
    selected=lambda settings: bool(settings.prometheus_url),
    build=from_settings,
    peer=lambda settings: (settings.prometheus_client, "ingest.prometheus"),
)
