"""One uuid per GPU: a snapshot listing one twice describes no real node (two GPUs cannot share one), and
its readings would be charged to one GPU twice. Every way a snapshot comes in is checked alike: pulled from
an agent, replayed from a record, rebuilt from Prometheus series (the contract calls this)."""

from __future__ import annotations

from typing import Iterable


def duplicate_gpu_uuid(uuids: Iterable[object]) -> str | None:
    """Why a snapshot's GPU uuids are not one per GPU (naming the first listed twice); None when they are."""
    seen: set[object] = set()
    for uuid in uuids:
        if uuid in seen:
            return f"GPU {str(uuid)[:100]!r} twice in one snapshot"
        seen.add(uuid)
    return None
