"""A shard's part of whatever a sample source reads (`--shard INDEX/COUNT`, server/shard.py).

Every source is wrapped alike: the GPUs of a node sample that the shard does not own are cut out before the
engine sees them (a node may run GPUs of two jobs that hash to different shards), and the targets' health
(/nodes, agents' node_unreachable alerts) is kept for the nodes the shard speaks for.

Where the cost goes: the agent-pull source pulls every agent and drops the rest here, so its network and
parsing cost follow the fleet, and only the engine's (the larger share) follows the shard's. The Prometheus
source asks the database for the owned series only (ingest/prometheus.py), so its read follows the share
too; this filter then only cuts the foreign GPUs off the nodes it read whole.

A GPU that is lost (the driver reports it down) stays with its job's shard, with the node's GPUs of no job,
until it is back up (Ownership), even where its job ends meanwhile: that shard holds the gpu_lost alert,
opened with the job's name, as one unsharded server does, and no other shard raises it again, job-less. Every
shard that reads the node derives the same from its samples alone: the node's shard by name reads it whole,
and the job's shard keeps reading a node with a GPU down (ingest/prometheus.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from gpufleet.server.contract import COLUMN
from gpufleet.server.ingest.base import Blindness, MissingReading, PullResult, SampleSource, TargetHealth
from gpufleet.server.ingest.identity import NodePin
from gpufleet.server.shard import Shard


_UP = COLUMN["up"]


def host_job(sample: Any) -> str | None:
    """The job a GPU of no job on this node goes with: the least of the node's jobs (every shard picks alike)."""
    return min((job for job in sample.jobs if job), default=None)


def any_down(sample: Any) -> bool:
    """Whether a GPU of the sample reports itself down (up = 0; NaN, not reported, is not down)."""
    return bool(np.any(sample.values[:, _UP] == 0.0)) if len(sample.jobs) else False


def owned_rows(sample: Any, shard: Shard, held_job: str | None = None) -> list[int]:
    """The rows of the sample's GPUs that the shard owns. held_job: the job of a GPU of the node that is
    down (Ownership), where its GPUs of no job go."""
    jobs, node = sample.jobs, sample.node
    # A GPU of no job on a node that runs one goes with the node's job: a GPU that falls off the bus, or
    # whose processes die first, loses its job label while its job still runs, and must stay with the
    # shard that holds its history (its XIDs, its peers) rather than turn up new on another.
    host_job_ = held_job or host_job(sample)
    return [row for row, job in enumerate(jobs) if shard.owns(job or host_job_, node)]


def picked(sample: Any, keep: list[int]) -> Any | None:
    """The sample with only the rows `keep` (the same object when that is all of them); None for none."""
    if len(keep) == len(sample.jobs):
        return sample
    if not keep:
        return None
    pick = keep.__getitem__
    rows = range(len(keep))
    return type(sample)(
        sample.node,
        sample.time,
        tuple(sample.indices[pick(i)] for i in rows),
        tuple(sample.uuids[pick(i)] for i in rows),
        tuple(sample.models[pick(i)] for i in rows),
        tuple(sample.jobs[pick(i)] for i in rows),
        sample.values[keep],
        None if sample.xid_by_code is None else tuple(sample.xid_by_code[pick(i)] for i in rows),
        None if sample.pods is None else tuple(sample.pods[pick(i)] for i in rows),
    )


def owned_part(sample: Any, shard: Shard, held_job: str | None = None) -> Any | None:
    """The sample with only the shard's GPUs (the same object when it owns them all); None when it owns none."""
    return picked(sample, owned_rows(sample, shard, held_job))


@dataclass(frozen=True, slots=True)
class NodePart:
    """What a shard of `--shard.jobless fleet` read of a node at one sample: the GPUs (indices) of no job it
    reads only so that it infers jobs over the whole fleet (guests: another shard's to publish), and whether
    any GPU of the node is its own."""

    time: float
    guests: frozenset[int]
    own: bool


class Ownership:
    """owned_part, sample after sample: a GPU that reports down keeps the job it last had (its label goes
    with its processes), and the node's GPUs of no job go with that job while it is down, so the shard that
    holds its history keeps the node's lost GPU whether its job ends or other jobs run beside it.

    Feed each node's samples in time order (an older sample again, as overlapping reads bring, is harmless:
    the newer ones that follow decide).

    With `--shard.jobless fleet` the part also holds every other GPU of no job of the node, as guests: the
    engine infers jobs among them as one server does, and what it says about them is another shard's to
    publish (server/published.py). `parts` holds each node's latest NodePart."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.parts: dict[str, NodePart] = {}
        self._jobs: dict[str, tuple[tuple[str, ...], tuple[str | None, ...]]] = {}  # node -> latest uuids, jobs
        self._held: dict[str, dict[str, str]] = {}  # node -> {uuid: job} of its GPUs down since they had one

    def part(self, sample: Any) -> Any | None:
        node = sample.node
        held = self._down_jobs(sample)
        if held:
            self._held[node] = held
        else:
            self._held.pop(node, None)
        self._jobs[node] = (sample.uuids, sample.jobs)
        rows = owned_rows(sample, self.shard, min(held.values(), default=None))
        if self.shard.reads_every_jobless:
            own = set(rows)
            guests = [row for row, job in enumerate(sample.jobs) if not job and row not in own]
            self.parts[node] = NodePart(sample.time, frozenset(sample.indices[r] for r in guests), bool(rows))
            rows = sorted(own.union(guests))
        return picked(sample, rows)

    def own(self, node: str) -> bool:
        """Whether the node's latest sample held a GPU of the shard's own (not a guest's only)."""
        part = self.parts.get(node)
        return part is None or part.own

    def _down_jobs(self, sample: Any) -> dict[str, str]:
        if not any_down(sample):
            return {}
        before = dict(zip(*self._jobs.get(sample.node, ((), ()))))
        before.update(self._held.get(sample.node, {}))
        out = {}
        for row in np.flatnonzero(sample.values[:, _UP] == 0.0).tolist():
            uuid = sample.uuids[row]
            if job := sample.jobs[row] or before.get(uuid):
                out[uuid] = job
        return out


class ShardedSource:
    """A SampleSource giving the engine only what `shard` owns; everything else it passes through."""

    def __init__(self, source: SampleSource, shard: Shard) -> None:
        self.inner = source
        self.shard = shard
        self._ownership = Ownership(shard)
        # node -> whether its latest sample held a GPU this shard owns: a node whose GPUs all belong to other
        # shards' jobs is theirs to speak for, even where its name hashes here.
        self._ours: dict[str, bool] = {}
        self._read: dict[str, bool] = {}  # node -> whether its latest sample held a GPU read here, guests too

    @property
    def parts(self) -> Mapping[str, NodePart]:
        """Each node's latest NodePart (`--shard.jobless fleet`; empty otherwise)."""
        return self._ownership.parts

    async def pull_once(self) -> PullResult:
        result = await self.inner.pull_once()
        samples = []
        handed_over = set()
        for sample in result.samples:
            part = self._ownership.part(sample)
            if part is None and self._read.get(sample.node):
                handed_over.add(sample.node)
            self._read[sample.node] = part is not None
            self._ours[sample.node] = part is not None and self._ownership.own(sample.node)
            if part is not None:
                samples.append(part)
                handed_over.discard(sample.node)  # an older sample of the range, before its GPUs went
        return PullResult(
            samples=samples,
            started=result.started,
            duration_seconds=result.duration_seconds,
            targets=result.targets,
            failed_targets=result.failed_targets,
            rejected_snapshots=result.rejected_snapshots,
            pins=result.pins,
            handed_over=tuple(sorted(n for n in handed_over if not self._read[n])),
        )

    def speaks_for(self, health: TargetHealth) -> bool:
        """A target's node is this shard's when its GPUs were last seen in an owned job, or, before any
        sample of it (an agent down since start), when its node name (its address, unnamed) hashes here."""
        node = health.node
        if node is not None and node in self._ours:
            return self._ours[node]
        return self.shard.owns_node(node or health.target)

    def health(self) -> list[TargetHealth]:
        return [h for h in self.inner.health() if self.speaks_for(h)]

    @property
    def stale_after_seconds(self) -> float:
        return self.inner.stale_after_seconds

    async def aclose(self) -> None:
        await self.inner.aclose()

    @property
    def pulls_total(self) -> int:
        return self.inner.pulls_total

    @property
    def samples_total(self) -> int:
        return self.inner.samples_total

    @property
    def last_cycle(self) -> PullResult | None:
        return self.inner.last_cycle

    @property
    def blind(self) -> Blindness | None:
        return self.inner.blind

    @property
    def blind_cycles(self) -> Mapping[str, int]:
        return self.inner.blind_cycles

    @property
    def missing(self) -> tuple[MissingReading, ...]:
        return self.inner.missing

    @property
    def errors(self) -> Mapping[tuple[str, str], int]:
        return self.inner.errors

    def errors_by_reason(self) -> Mapping[str, int]:
        return self.inner.errors_by_reason()

    def remember_identities(self, nodes: Mapping[str, str], pins: Mapping[str, NodePin] | None = None) -> None:
        self.inner.remember_identities(nodes, pins)
