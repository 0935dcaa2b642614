"""Node clocks lined up with one rule, in the live server and in replay.

Agents stamp snapshots with their own clock, and the engine bins by sample time. A node whose clock is
off by tens of seconds has its bins compared with other instants of its peers' (at every start, end and
incident of its job it stands out, early or late), and a node behind delivers its samples after their
bin was judged (live) or stops sooner in sample time than the others (replay): either way it reads as
unreachable. So each path measures every node's clock against a reference and takes the offset out of
its sample times before the engine sees them. The two paths know different things, so they measure
differently, but what they measure is one `Evidence`, and whether and how much to take out is decided
by one function, `offset_to_apply`, as is what counts as a clock step (`stepped`).

- Live (`ClockOffsets`): the reference is the server's clock. An answer's stamp (the agent's clock when
  it answered, or else its newest sample's time) minus its arrival is the offset less a small positive
  delay (the sample's age, the transfer, a busy event loop), so the largest difference over the last
  few answers is the estimate: a slow answer only makes the delay longer, never shorter. A change of
  that difference by more than a step drops the answers before it: they say nothing about the new clock.
- Replay (`trace_offsets`): there is no arrival, and no clock to trust but the nodes' own. Every agent
  of a trace records over the same stretch of real time, so where most nodes' first and last samples
  agree, the median node's ends are the reference and a node whose two ends both sit the same offset
  from them has a clock off by that much. Within a node's own lines, in the order its agent wrote them,
  its clock stepping shows as a jump (time going back, or a gap); a gap may also be an outage. The ends
  tell which: an outage leaves the node's ends agreeing with the others', a step moves its last end by
  the jump.

This module is pure (no I/O but log lines, no numpy, no wall clock): the puller imports it at start-up.
"""

from __future__ import annotations

import logging
import math
import operator
from collections import deque
from dataclasses import dataclass
from itertools import combinations
from typing import Mapping, Sequence

log = logging.getLogger(__name__)

# Less is left in: the engine's 30 s medians absorb it; a trace's ends, a job's transitions and settle do not.
MIN_OFFSET_SECONDS = 10.0
# An offset taken out stays out down to this share of the minimum, so a clock near it does not flap.
KEEP_RATIO = 0.5
# Sample timing jitter plus NTP-level drift (about a second each): offsets and moves within it are noise.
SLACK_SECONDS = 2.0
# Beyond any answer's delay (a pull timeout plus an interval, <10 s), short of the 30 s that reads unreachable.
STEP_SECONDS = 20.0
# Live answers the estimate is the best of: a minute of 5 s pulls, how soon a corrected clock is trusted.
ANSWERS = 12
# Replay weighs each gap of a node as step or outage up to this many gaps (2**8 readings); past it, outages.
MAX_WEIGHED_GAPS = 8
# A node's lines going back in time more often than clocks step were put out of order (shuffled): time-sorted.
MAX_BACK_STEPS = 3


@dataclass(frozen=True, slots=True)
class Evidence:
    """What a path measured of one node's clock against its reference, for one stretch without a step."""

    offset_seconds: float  # the node's clock minus the reference
    # How far independent measurements of the same offset disagree (replay: the trace's two ends). Live
    # answers carry none: the least delayed answer is the measurement, and steps are cut out before.
    disagreement_seconds: float = 0.0
    # How far the measurement itself may be off: a sampling interval (a node's phase moves its ends by
    # up to one). Live: the least delayed answer's own delay, under a second, taken as 0.
    slack_seconds: float = 0.0


def agrees(evidence: Evidence) -> bool:
    """Whether the measurements agree closely enough to be one clock's offset: more closely than a lost
    first or last line (which moves one end by a whole interval) would let them."""
    return evidence.disagreement_seconds <= 0.5 * evidence.slack_seconds + SLACK_SECONDS


def offset_to_apply(
    evidence: Evidence, applied_seconds: float = 0.0, min_offset_seconds: float = MIN_OFFSET_SECONDS
) -> float:
    """The offset to take out of the node's sample times from now on (0.0: its clock is left as it is).

    Taken out when it reaches min_offset_seconds (KEEP_RATIO of it while one is already taken out) and is
    beyond the measurement's own slack, and its measurements agree; moved only by more than SLACK_SECONDS.
    min_offset_seconds 0 turns the correction off. Evidence that is not a finite number changes nothing."""
    if min_offset_seconds <= 0:
        return 0.0
    fields = (evidence.offset_seconds, evidence.disagreement_seconds, evidence.slack_seconds)
    if not all(math.isfinite(x) for x in fields):
        return applied_seconds
    estimate = evidence.offset_seconds
    least = min_offset_seconds * KEEP_RATIO if applied_seconds else min_offset_seconds
    big = abs(estimate) >= max(least, evidence.slack_seconds + SLACK_SECONDS)
    wanted = estimate if big and agrees(evidence) else 0.0
    if abs(wanted - applied_seconds) <= SLACK_SECONDS and (wanted == 0.0) == (applied_seconds == 0.0):
        return applied_seconds
    return wanted


def stepped(before_seconds: float, after_seconds: float) -> bool:
    """Whether a node's clock stepped between two readings of it against the reference (NaN: no)."""
    return abs(after_seconds - before_seconds) > STEP_SECONDS


# -- live: against the server's clock, from when answers arrive ------------------------------------------


class ClockOffsets:
    """Per target: the offset taken out of its sample times (agent clock minus server clock).

    min_offset_seconds is `--pull.clock-offset-min`; 0 turns the correction off (offsets are still
    measured, for the metric).
    """

    def __init__(self, min_offset_seconds: float = MIN_OFFSET_SECONDS) -> None:
        if not min_offset_seconds >= 0:
            raise ValueError("min_offset_seconds must not be negative")
        self.min_offset_seconds = min_offset_seconds
        self._seen: dict[str, deque[float]] = {}
        self._applied: dict[str, float] = {}

    def observe(self, target: str, stamp: float, arrived: float, node: str | None = None) -> float:
        """Learn from one answer (its stamp in the agent's clock, its arrival in ours); returns the offset
        to take out of the target's sample times from now on (0.0: its clock agrees with ours)."""
        difference = stamp - arrived
        if not math.isfinite(difference):
            return self.offset(target)
        seen = self._seen.get(target)
        if seen is None:
            seen = self._seen[target] = deque(maxlen=ANSWERS)
        if seen and stepped(seen[-1], difference):
            log.warning(
                "agent clock stepped",
                extra={"target": target, "node": node, "step_seconds": round(difference - seen[-1], 3)},
            )
            seen.clear()
        seen.append(difference)
        applied = self._applied.get(target, 0.0)
        wanted = offset_to_apply(Evidence(max(seen)), applied, self.min_offset_seconds)
        if wanted == applied:
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


# -- replay: against the other nodes of the trace, from its ends ---------------------------------------


@dataclass(frozen=True, slots=True)
class NodeTrace:
    """One node's samples in a trace, in the order its agent took them, cut where they jump.

    first/last: the earliest time of its first stretch and the latest of its last (its own clock);
    samples: how many; jumps_seconds: at each cut, how far the time moved beyond a sampling interval
    (negative: it went back, a clock step; positive: a clock step or an outage)."""

    first_seconds: float
    last_seconds: float
    samples: int
    jumps_seconds: tuple[float, ...] = ()


def jumps(times: Sequence[float]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Where a node's sample times, in the order taken, jump (the index of the first sample after each
    jump) and by how much beyond its usual interval (the median step between its samples)."""
    if len(times) < 3:
        return (), ()
    moves = list(map(operator.sub, times[1:], times))
    usual = _median(sorted(moves))
    low, high = usual - STEP_SECONDS, usual + STEP_SECONDS
    # The bounds pick the candidates at C speed (replay has a million of these); stepped() decides.
    at = tuple(i for i, moved in enumerate(moves, 1) if not low <= moved <= high and stepped(usual, moved))
    return at, tuple(moves[i - 1] - usual for i in at)


def trace_offsets(nodes: Mapping[str, NodeTrace]) -> dict[str, tuple[float, ...]]:
    """Per node whose clock is off the others': the offset to take out of each stretch of its samples
    (one more than its jumps); nodes left as they are do not appear.

    A node that starts late or stops early (down, crashed, added) moves one end only and is left alone; so
    is every node where the others do not agree among themselves (agents started and stopped one after
    another, or two nodes: nothing says which clock is right)."""
    if len(nodes) < 3:
        return {}
    # The reference ends are one node's own (the lower middle one), not the mean of the two middle ones,
    # which can sit far from every node: among four, with one node 60 s ahead and one whose first line
    # was lost 19 s in, that mean put the offset taken out at 53 s.
    ref_first = _lower_median([t.first_seconds for t in nodes.values()])
    ref_last = _lower_median([t.last_seconds for t in nodes.values()])
    ends = {
        node: (t.first_seconds - ref_first, t.last_seconds - ref_last, _interval(t, 0.0)) for node, t in nodes.items()
    }
    # A node's sampling phase moves both of its ends alike, by less than an interval; a clock offset moves
    # both by the offset. One end agreeing is enough to count a node in step: a lost first line moves its
    # first end by another interval (at 10 s sampling, 13.6 s: counted out, only two of four nodes agreed
    # and a node 62 s ahead was left as it was).
    in_step = sum(min(abs(early), abs(late)) <= interval + SLACK_SECONDS for early, late, interval in ends.values())
    if 2 * in_step <= len(ends):
        return {}
    # The median node's ends are known to within its own interval: agents sampling every 5 s beside one
    # sampling every second put that one's two ends up to 5 s apart against theirs.
    ref_interval = _median(sorted(interval for _, _, interval in ends.values()))
    out = {}
    for node, t in nodes.items():
        early, late, _ = ends[node]
        offsets = tuple(offset_to_apply(e) for e in _stretches(t, early, late, ref_interval))
        if any(offsets):
            out[node] = offsets
    return out


def _stretches(t: NodeTrace, early: float, late: float, ref_interval: float) -> list[Evidence]:
    """The evidence for each stretch of a node's samples, under the reading of its jumps that its ends
    bear out with the fewest clock steps (a jump back is always one; a gap may be one or an outage)."""
    gaps = [i for i, jump in enumerate(t.jumps_seconds) if jump > 0]
    weighed = gaps if len(gaps) <= MAX_WEIGHED_GAPS else []
    forced = frozenset(i for i, jump in enumerate(t.jumps_seconds) if jump <= 0)
    fallback = None
    for count in range(len(weighed) + 1):
        found = []
        for chosen in combinations(weighed, count):
            evidence = _reading(t, forced.union(chosen), early, late, ref_interval)
            if fallback is None:
                fallback = evidence
            if agrees(evidence[0]):
                found.append(evidence)
        if len(found) == 1:
            return found[0]
        if found:
            break  # as many steps one way as another: nothing says which gap was the step
    assert fallback is not None
    return fallback


def _reading(t: NodeTrace, steps: frozenset[int], early: float, late: float, ref_interval: float) -> list[Evidence]:
    """Each stretch's evidence with the given jumps taken as clock steps and the others as outages: its
    offset from the first end and the steps before it, less half of what the last end then disagrees."""
    moved = [0.0]
    for i, jump in enumerate(t.jumps_seconds):
        moved.append(moved[-1] + (jump if i in steps else 0.0))
    mismatch = late - (early + moved[-1])
    slack = max(_interval(t, moved[-1]), ref_interval)
    return [Evidence(early + m + mismatch / 2.0, abs(mismatch), slack) for m in moved]


def _interval(t: NodeTrace, stepped_seconds: float) -> float:
    """The node's mean sampling interval over the real time its samples span."""
    return (t.last_seconds - t.first_seconds - stepped_seconds) / max(t.samples - 1, 1)


def _lower_median(values: list[float]) -> float:
    """The lower of the middle values (the middle one where there is one)."""
    return sorted(values)[(len(values) - 1) // 2]


def _median(ordered: Sequence[float]) -> float:
    """The median of sorted values (the mean of the two middle ones for an even count)."""
    n = len(ordered)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2.0
