"""Activity ratios integrated into time counters, for scrapers that see one sample in several.

Utilization and SM activity are averages over the agent's own sampling interval (1 s). A Prometheus
scraping every 5-15 s stores one of those 1 s averages per scrape, and in synchronous training that
one second lands at a different phase of the step on every node: the stored series alias, and nodes
doing identical work read differently (a live demo run named a waiting node as a straggler that way).
Integrated as `seconds active` and `seconds sampled` counters, the exact average between any two
scrapes is the ratio of their increases, whatever the scrape interval and phase.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Mapping

from gpufleet.agent.model import NodeSnapshot

# reading label -> GpuSample field
READINGS: tuple[tuple[str, str], ...] = (("utilization", "utilization_ratio"), ("sm_active", "sm_active_ratio"))

# uuid -> reading label -> (seconds active, seconds sampled)
ActivityTotals = Mapping[str, Mapping[str, tuple[float, float]]]
NO_TOTALS: ActivityTotals = MappingProxyType({})


class ActivityIntegrator:
    """Per GPU and reading, sum(ratio x time the sample stands for) and sum(time the sample stands for).

    A sample stands for the time since the previous snapshot, capped at max_step_seconds: after a gap
    (NVML down, a hung cycle) a ratio measured over the last second says nothing about the minutes
    before it. A sample without the reading adds to neither sum, so the ratio of increases stays the
    mean of the samples that had it; a GPU that never had the reading gets no totals (unsupported is
    absent).
    """

    def __init__(self, max_step_seconds: float) -> None:
        if not max_step_seconds > 0:
            raise ValueError("max_step_seconds must be positive")
        self._max_step_seconds = max_step_seconds
        self._previous_time: float | None = None
        self._sums: dict[str, dict[str, tuple[float, float]]] = {}

    def update(self, snapshot: NodeSnapshot) -> ActivityTotals:
        """Fold one new snapshot in; the totals of the GPUs it holds, as an immutable mapping."""
        previous, self._previous_time = self._previous_time, snapshot.time
        step = 0.0 if previous is None else min(max(snapshot.time - previous, 0.0), self._max_step_seconds)
        out: dict[str, Mapping[str, tuple[float, float]]] = {}
        for gpu in snapshot.gpus:
            sums = self._sums.setdefault(gpu.uuid, {})
            for label, attr in READINGS:
                ratio = getattr(gpu, attr)
                if ratio is not None and math.isfinite(ratio):
                    active, sampled = sums.get(label, (0.0, 0.0))
                    sums[label] = (active + min(max(ratio, 0.0), 1.0) * step, sampled + step)
            if sums:
                out[gpu.uuid] = MappingProxyType(dict(sums))
        return MappingProxyType(out)
