"""How far each agent's clock runs from the server's, learned from when its answers arrive.

Agents stamp snapshots with their own clock, and the engine bins by sample time and judges a bin once
the server's clock has passed it (by settle_seconds). A node whose clock runs a minute behind therefore
delivers every sample after its bin was judged: its GPUs drop out of their job's comparisons, and with
its newest sample always a minute old it reads as unreachable. A node ahead is compared with other
instants of its peers. Replay lines such a node up from the trace's ends (server/replay.py); the live
server can do better, because it knows when each answer arrived.

An answer's stamp is the agent's clock when it answered (the envelope's `time`, which gpufleet agents
send) or else its newest sample's time, which a sampling period at most precedes the answer. Either way,
stamp minus arrival is the clock's offset less a small positive delay (the sample's age, the transfer,
a busy event loop), so the largest difference over the last few answers is the estimate: a slow answer
only makes the delay longer, never shorter.

A clock that steps (NTP correcting a large error, an operator setting the date) moves that difference by
more than any delay can: the answers before the step then say nothing about the clock, and are dropped,
so the new offset is taken out from the first answer after it, in either direction.
"""

from __future__ import annotations

import logging
from collections import deque

log = logging.getLogger(__name__)

DEFAULT_MIN_OFFSET_SECONDS = 10.0
_ANSWERS = 12  # a minute of 5 s pulls: how soon a corrected clock is trusted again
_TOLERANCE_SECONDS = 2.0  # moving a node's bins for less than this would only track delay jitter
# A change of stamp minus arrival beyond this is the clock stepping, not delay: an answer is late by a pull
# timeout and a sampling interval at most (seconds), while a step left standing for a minute of answers
# puts the node's samples that far from its peers, past the engine's unreachable threshold (30 s).
STEP_SECONDS = 20.0


class ClockOffsets:
    """Per target: the offset taken out of its sample times (agent clock minus server clock).

    An offset is taken out once it reaches min_offset_seconds (smaller ones the engine's 30 s medians
    absorb) and kept while it stays above half that, so a clock near the threshold does not flap.
    min_offset_seconds 0 turns the correction off.
    """

    def __init__(self, min_offset_seconds: float = DEFAULT_MIN_OFFSET_SECONDS) -> None:
        if min_offset_seconds < 0:
            raise ValueError("min_offset_seconds must not be negative")
        self.min_offset_seconds = min_offset_seconds
        self._seen: dict[str, deque[float]] = {}
        self._applied: dict[str, float] = {}

    def observe(self, target: str, stamp: float, arrived: float, node: str | None = None) -> float:
        """Learn from one answer (its stamp in the agent's clock, its arrival in ours); returns the offset
        to take out of the target's sample times from now on (0.0: its clock agrees with ours)."""
        seen = self._seen.get(target)
        if seen is None:
            seen = self._seen[target] = deque(maxlen=_ANSWERS)
        difference = stamp - arrived
        if seen and abs(difference - seen[-1]) > STEP_SECONDS:
            log.warning(
                "agent clock stepped",
                extra={"target": target, "node": node, "step_seconds": round(difference - seen[-1], 3)},
            )
            seen.clear()
        seen.append(difference)
        if not self.min_offset_seconds:
            return 0.0
        estimate = max(seen)
        applied = self._applied.get(target, 0.0)
        keep = self.min_offset_seconds / 2 if applied else self.min_offset_seconds
        wanted = estimate if abs(estimate) >= keep else 0.0
        if abs(wanted - applied) <= _TOLERANCE_SECONDS and (wanted == 0.0) == (applied == 0.0):
            return applied
        self._applied[target] = wanted
        if wanted:
            log.warning(
                "agent clock offset taken out",
                extra={"target": target, "node": node, "offset_seconds": round(wanted, 3)},
            )
        else:
            log.info("agent clock agrees again", extra={"target": target, "node": node})
        return wanted

    def offset(self, target: str) -> float:
        """The offset taken out of the target's sample times now."""
        return self._applied.get(target, 0.0)

    def estimate(self, target: str) -> float | None:
        """The measured offset (None before the first answer), whether or not it is taken out."""
        seen = self._seen.get(target)
        return max(seen) if seen else None

    def forget(self, target: str) -> None:
        """A target that left: its next incarnation may run another clock."""
        self._seen.pop(target, None)
        self._applied.pop(target, None)
