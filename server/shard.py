"""Which part of the fleet one server judges, when several share it (`--shard INDEX/COUNT`).

Peers are only ever compared inside a job, so the fleet splits by job: a shard owns the jobs whose id hashes
to its index, and the GPUs that belong to no job by the hash of their node. Every shard computes the same
answer from the label alone, without talking to the others.

The hash is the first 8 bytes of SHA-256 of the UTF-8 label, big-endian, modulo COUNT: stable across
processes, Python versions and machines (Python's own `hash` of a str is salted per process). Changing COUNT
from N to M moves a job unless its hash gives the same index under both, so about 1 - 1/M of the jobs move
(modulo hashing, not a consistent-hash ring: a restart of every shard with warm-up from the database's history
costs less than a ring's bookkeeping, and COUNT changes rarely).

GPUs of no job are read in one of two ways (`--shard.jobless`). `node`: a shard reads and judges the ones of its
nodes only, so its read follows its share; jobs the engine infers among them are inferred per shard, and one
that spans nodes of several shards is judged in parts. `fleet`: every shard reads every GPU of no job and
infers jobs among all of them as one server does (ingest/owned.py marks the ones not its own as guests), then
publishes only what is about its own (server/published.py): each inferred job is judged whole, at the cost of
every shard reading the whole job-less part of the fleet.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

_SHARD = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")
# How a shard reads the GPUs of no job (--shard.jobless): those of its own nodes, or every one in the fleet.
JOBLESS_MODES = ("node", "fleet")


def shard_of(label: str, count: int) -> int:
    """The index of the shard that owns `label` (a job id, or a node name for GPUs of no job)."""
    digest = hashlib.sha256(label.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % count


@dataclass(frozen=True, slots=True)
class Shard:
    """Shard `index` of `count`, indexes from 0 (as a StatefulSet ordinal gives them)."""

    index: int = 0
    count: int = 1
    jobless: str = "node"  # JOBLESS_MODES

    def __post_init__(self) -> None:
        if self.jobless not in JOBLESS_MODES:
            raise ValueError(f"jobless GPUs are read by {' or '.join(JOBLESS_MODES)}, not {self.jobless!r}")
        if self.count < 1:
            raise ValueError(f"a shard count must be at least 1, not {self.count}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard index {self.index} is not in 0..{self.count - 1}")

    @classmethod
    def parse(cls, text: str) -> Shard:
        """`"2/16"` → Shard(2, 16); a ValueError that says what was expected otherwise."""
        match = _SHARD.match(text)
        if match is None:
            raise ValueError(f"a shard is INDEX/COUNT, such as 2/16 (index from 0), not {text!r}")
        return cls(int(match.group(1)), int(match.group(2)))

    @property
    def whole(self) -> bool:
        """True when this server owns the whole fleet (the default, unsharded)."""
        return self.count == 1

    @property
    def reads_every_jobless(self) -> bool:
        """True for a shard of `--shard.jobless fleet`: it reads and infers over every GPU of no job."""
        return self.jobless == "fleet" and self.count > 1

    def owns_job(self, job: str) -> bool:
        return self.count == 1 or shard_of(job, self.count) == self.index

    def owns_node(self, node: str) -> bool:
        """For GPUs of no job: their node decides."""
        return self.count == 1 or shard_of(node, self.count) == self.index

    def owns(self, job: str | None, node: str) -> bool:
        """The job decides where there is one, the node otherwise."""
        return self.owns_job(job) if job else self.owns_node(node)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"
