"""Replay from a database: the engine over a time range of a Prometheus-compatible database's history.

`gpufleet-server replay --prometheus-url URL --start T --end T [--shard I/N]` reads the gpufleet agents'
series and dcgm-exporter's series that Prometheus, VictoriaMetrics, Mimir or Thanos kept, rebuilds them
into snapshots with the live Prometheus source (ingest/prometheus.py: the same decoding, the same dcgm
units, the same exact means from the agents' activity counters), and feeds them to the same engine as
replay of record files, printing the same JSON lines. A post-mortem of last night needs no record files:
only the data a site already keeps.

The history is read in chunks of `--chunk` seconds, each one query of a range selector at the chunk's end:
the raw samples, never resampled by a query step. Consecutive chunks overlap by a couple of seconds so that
no scrape falls between them; a scrape read twice is delivered once. With `--shard INDEX/COUNT` only the
GPUs that shard owns (server/shard.py) are judged, so the shards' outputs together are the whole fleet's.
"""

from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable

from gpufleet.server.contract import NodeSample
from gpufleet.server.engine import EngineConfig
from gpufleet.server.shard import JOBLESS_MODES, Shard

log = logging.getLogger(__name__)

DEFAULT_CHUNK_SECONDS = 600.0
# ingest/prometheus.py's SCHEMAS, spelled out: that module, ingest/owned.py (and httpx, asyncio) load only
# when a database is read, not for every replay of files.
SCHEMAS = ("auto", "gpufleet", "dcgm")
# Each chunk also asks for this much before the previous one's end: a scrape stamped just before a
# chunk's boundary but rounded out of its range selector is read by the next.
_OVERLAP_SECONDS = 1.0


class HistoryError(Exception):
    """The database could not give a chunk of the range (unreachable, refused, too slow, too big)."""


def parse_time(text: str) -> float:
    """Unix seconds (`1764284400`, `1764284400.5`) or an RFC 3339 time with its offset
    (`2026-11-27T23:00:00Z`, `2026-11-28T00:00:00+01:00`); ValueError saying which forms are accepted."""
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"a time must be unix seconds or RFC 3339, not {text!r}")
        return value
    try:
        parsed = datetime.fromisoformat(text.strip().replace("z", "Z"))
    except ValueError:
        raise ValueError(f"a time must be unix seconds or RFC 3339 (2026-11-27T23:00:00Z), not {text!r}") from None
    if parsed.tzinfo is None:
        raise ValueError(f"an RFC 3339 time needs its offset (Z or +01:00): {text!r}")
    return parsed.timestamp()


@dataclass(frozen=True)
class History:
    """What the database gave for the range."""

    samples: list[NodeSample]
    handovers: list[tuple[float, str]]  # (time, node) where the shard stopped owning any GPU of the node
    queries: int
    snapshots: int  # rebuilt snapshots before the shard took its part
    rejected: int  # rebuilt snapshots the contract refused
    # --shard.jobless fleet: each node's parts (ingest/owned.py, NodePart) in time order, where they changed
    parts: dict[str, list[Any]] = field(default_factory=dict)


async def read_history(
    url: str,
    start: float,
    end: float,
    *,
    shard: Shard | None = None,
    chunk_seconds: float = DEFAULT_CHUNK_SECONDS,
    schema: str = "auto",
    timeout_seconds: float = 60.0,
    transport: Any = None,
    progress: Callable[[float], None] | None = None,
) -> History:
    """Every snapshot stored for (start, end], in chunks, with the live source's decoding; the shard's part
    (asked for as a live shard asks: its jobs' and job-less nodes' series only, ingest/prometheus.py; the
    GPUs of other shards' jobs on the nodes read are cut off by ingest/owned.py)."""
    from gpufleet.server.ingest.owned import Ownership
    from gpufleet.server.ingest.prometheus import PrometheusSource

    shard = shard or Shard()
    chunk = max(1.0, float(chunk_seconds))
    now = [start]
    source = PrometheusSource(
        url,
        interval_seconds=_OVERLAP_SECONDS / 2,
        timeout_seconds=timeout_seconds,
        max_lookback_seconds=chunk + _OVERLAP_SECONDS,
        stale_after_seconds=math.inf,
        transport=transport,
        clock=lambda: now[0],
        schema=schema,
        shard=shard,
    )
    samples: list[NodeSample] = []
    handovers: list[tuple[float, str]] = []
    ownership = Ownership(shard)
    ours: dict[str, bool] = {}  # node -> whether its latest sample held a GPU the shard reads
    parts: dict[str, list[Any]] = {}
    queries = snapshots = rejected = 0
    try:
        # The first query asks for the source's whole lookback, chunk and overlap: (start, start + chunk].
        now[0] = min(end, start + chunk + _OVERLAP_SECONDS)
        while True:
            result = await source.pull_once()
            queries += 1
            if result.failed_targets:
                reason = source.blind.found if source.blind is not None else "no answer"
                raise HistoryError(f"reading {url} up to {now[0]:.0f}: {reason}")
            snapshots += len(result.samples)
            rejected += result.rejected_snapshots
            for sample in result.samples:
                part = ownership.part(sample)
                if not start < sample.time <= end:
                    continue
                if part is None and ours.get(sample.node):
                    handovers.append((sample.time, sample.node))
                ours[sample.node] = part is not None
                if part is not None:
                    samples.append(part)
                _note_part(parts, sample.node, ownership.parts.get(sample.node))
            if progress is not None:
                progress(now[0])
            if now[0] >= end:
                break
            now[0] = min(end, now[0] + chunk)
    finally:
        await source.aclose()
    return History(samples, handovers, queries, snapshots, rejected, parts)


def _note_part(parts: dict[str, list[Any]], node: str, part: Any) -> None:
    """Append a node's part where its guests or ownership changed (samples come in time order per node)."""
    if part is None:
        return
    seen = parts.setdefault(node, [])
    if not seen or (seen[-1].guests, seen[-1].own) != (part.guests, part.own):
        seen.append(part)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """replay's flags for reading a database instead of files."""
    group = parser.add_argument_group("replay from a database (instead of TRACE files)")
    group.add_argument(
        "--prometheus-url",
        "--ingest.prometheus-url",
        dest="prometheus_url",
        metavar="URL",
        help="Prometheus-compatible query API (Prometheus, VictoriaMetrics, Mimir, Thanos) to read history from",
    )
    group.add_argument("--start", metavar="T", help="range start: RFC 3339 (2026-11-27T23:00:00Z) or unix seconds")
    group.add_argument("--end", metavar="T", help="range end: RFC 3339 or unix seconds")
    group.add_argument("--shard", metavar="INDEX/COUNT", help="judge only what shard INDEX of COUNT owns (0/1)")
    group.add_argument(
        "--shard.jobless",
        dest="shard_jobless",
        choices=JOBLESS_MODES,
        default="node",
        help="GPUs of no job: read those of the shard's nodes (node), or every one, to infer jobs as one "
        "server does, printing only the shard's own (fleet)",
    )
    group.add_argument(
        "--chunk",
        metavar="SECONDS",
        type=float,
        default=DEFAULT_CHUNK_SECONDS,
        help=f"history read per query (default {DEFAULT_CHUNK_SECONDS:.0f}); smaller if the database refuses",
    )
    group.add_argument(
        "--schema",
        "--ingest.prometheus-schema",
        dest="schema",
        choices=SCHEMAS,
        default="auto",
        help="whose series: gpufleet agents', dcgm-exporter's, or both (auto)",
    )
    group.add_argument(
        "--query.timeout", dest="query_timeout", type=float, default=60.0, metavar="SECONDS", help="per query"
    )


@dataclass(frozen=True)
class Range:
    """A checked request to replay a database's history."""

    url: str
    start: float
    end: float
    shard: Shard
    chunk_seconds: float
    schema: str
    timeout_seconds: float


def checked(args: argparse.Namespace) -> Range:
    """The database flags as a Range; ValueError with one line for the user otherwise."""
    if args.traces:
        raise ValueError("give TRACE files or --prometheus-url, not both")
    if not args.prometheus_url.startswith(("http://", "https://")):
        raise ValueError(f"--prometheus-url must be an http:// or https:// URL, not {args.prometheus_url!r}")
    if args.start is None or args.end is None:
        raise ValueError("--prometheus-url needs --start and --end")
    start, end = parse_time(args.start), parse_time(args.end)
    if end <= start:
        raise ValueError(f"--end ({args.end}) must be after --start ({args.start})")
    if not (math.isfinite(args.chunk) and args.chunk >= 1):
        raise ValueError(f"--chunk must be at least 1 second, not {args.chunk}")
    if not (math.isfinite(args.query_timeout) and args.query_timeout > 0):
        raise ValueError(f"--query.timeout must be positive, not {args.query_timeout}")
    shard = Shard.parse(args.shard) if args.shard else Shard()
    shard = Shard(shard.index, shard.count, getattr(args, "shard_jobless", "node"))
    return Range(args.prometheus_url, start, end, shard, args.chunk, args.schema, args.query_timeout)


def replay(request: Range, config: EngineConfig) -> tuple[list, History]:
    """The alerts the engine fires over the range's history, and what was read."""
    # Here, not at the top: replay of files imports this module for its flags, and asyncio, httpx and the
    # ingest sources would be a third of its start-up.
    import asyncio

    from gpufleet.server.published import published_alerts
    from gpufleet.server.replay import run_samples

    history = asyncio.run(
        read_history(
            request.url,
            request.start,
            request.end,
            shard=request.shard,
            chunk_seconds=request.chunk_seconds,
            schema=request.schema,
            timeout_seconds=request.timeout_seconds,
        )
    )
    log.info(
        "history read",
        extra={
            "url": request.url,
            "queries": history.queries,
            "snapshots": history.snapshots,
            "owned_snapshots": len(history.samples),
            "rejected": history.rejected,
            "shard": str(request.shard),
        },
    )
    history.samples.sort(key=lambda s: (s.time, s.node))
    alerts = run_samples(history.samples, config, history.handovers)
    if request.shard.reads_every_jobless:
        alerts = published_alerts(alerts, request.shard, history.parts)
    return alerts, history
