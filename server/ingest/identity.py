"""What a node's name is pinned to: the target it answered from and the GPU uuids it reported.

The puller pins a node's name to the target that answers as it. A target is an address, and addresses
move (on Kubernetes every agent restart is a new pod IP): the GPUs are what stays. So a name is also
pinned to the GPU uuids its node last reported (NodePins), kept in the store with its target and the
time it was last answered for. While the name's target is not answering, or no longer listed, another
target may take the name only with GPUs among the pinned ones (the same agent at a new address); one
with other GPUs, or none, is refused. A pin lapses once the name has gone unanswered for its TTL: the
way back for a node whose GPUs were all replaced.

A node that has reported no GPU uuids has nothing to match: its name stays with its target, kept across
a restart by RememberedNodes (the last target -> node of every target, from the store): each entry holds
its node's name for its target while that target is listed, until it answers for itself.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Collection, Iterable, Mapping

log = logging.getLogger(__name__)

DEFAULT_IDENTITY_TTL_SECONDS = 86400.0
# A uuid longer than this is no NVML uuid (`GPU-` and 36 characters, MIG ones a little more): it is not
# pinned, so that what the store keeps per node stays small whatever an agent sends.
_MAX_UUID_CHARS = 128


class RememberedNodes:
    """target -> node from before the restart, with the reverse index a claim is checked against."""

    def __init__(self) -> None:
        self._node_of: dict[str, str] = {}
        self._targets_of: dict[str, set[str]] = {}

    def remember(self, nodes: Mapping[str, str]) -> None:
        """The node each target answered as before the restart (target -> node)."""
        for target, node in nodes.items():
            self.forget(target)
            self._node_of[target] = node
            self._targets_of.setdefault(node, set()).add(target)

    def forget(self, target: str) -> None:
        """The target answered for itself: what it was before the restart no longer speaks for it."""
        node = self._node_of.pop(target, None)
        if node is not None:
            self._targets_of[node].discard(target)
            if not self._targets_of[node]:
                del self._targets_of[node]

    def owner(self, node: str, claimant: str, listed: Collection[str]) -> str | None:
        """Another listed target that answered as `node` before the restart and has not answered since."""
        return min((t for t in self._targets_of.get(node, ()) if t != claimant and t in listed), default=None)

    def forget_node(self, node: str) -> None:
        """The node's name is free again (its pin lapsed): no target from before the restart holds it."""
        for target in list(self._targets_of.get(node, ())):
            self.forget(target)


@dataclass(frozen=True, slots=True)
class NodePin:
    """A node's name, pinned: the target it last answered from, the GPU uuids it last reported (empty while
    it has reported none) and when it was last answered for (server clock, seconds)."""

    target: str
    gpu_uuids: frozenset[str]
    served: float


class Evidence(enum.Enum):
    """What a node's pin says of a target claiming its name."""

    NONE = "none"  # no pin, or one without GPUs: the name's targets decide
    SAME = "same"  # the pinned target, or GPUs among the pinned ones: the same agent
    OTHER = "other"  # GPUs pinned, and the claimant reports none of them


def gpu_uuids(snapshots: Iterable[Any]) -> frozenset[str]:
    """Every GPU uuid the snapshots list (malformed entries and implausibly long uuids left out)."""
    return frozenset(
        u
        for s in snapshots
        if isinstance(s, dict) and isinstance(gpus := s.get("gpus"), list)
        for g in gpus
        if isinstance(g, dict) and isinstance(u := g.get("uuid"), str) and 0 < len(u) <= _MAX_UUID_CHARS
    )


class NodePins:
    """node -> NodePin, with the changes the store has not taken yet.

    A pin's served time reaches the store when it has moved by a 24th of the TTL: a write per node per pull
    would be thousands of rows every few seconds, and after a restart a pin lapses at most that early."""

    def __init__(self, *, ttl_seconds: float = DEFAULT_IDENTITY_TTL_SECONDS, max_pins: int = 20_000) -> None:
        self.ttl_seconds = ttl_seconds
        self.max_pins = max_pins
        self._pins: dict[str, NodePin] = {}  # least recently served first
        self._saved: dict[str, NodePin] = {}  # what the store holds
        self._changed: dict[str, NodePin | None] = {}  # None: delete

    def restore(self, pins: Mapping[str, NodePin]) -> None:
        """The pins kept in the store before a restart."""
        for node, pin in sorted(pins.items(), key=lambda item: item[1].served):
            self._pins.pop(node, None)
            self._pins[node] = self._saved[node] = pin

    def get(self, node: str) -> NodePin | None:
        """The node's pin, if it has one."""
        return self._pins.get(node)

    def evidence(self, node: str, claimant: str, uuids: frozenset[str]) -> Evidence:
        """Whether a target reporting these GPU uuids is the agent the node's name is pinned to."""
        pin = self._pins.get(node)
        if pin is None or (not pin.gpu_uuids and pin.target != claimant):
            return Evidence.NONE
        if pin.target == claimant or pin.gpu_uuids & uuids:
            return Evidence.SAME
        return Evidence.OTHER

    def served(self, node: str, target: str, uuids: frozenset[str], now: float) -> None:
        """A target answered for the node, listing these GPUs (none: the pinned ones stay)."""
        old = self._pins.pop(node, None)
        kept = uuids or (old.gpu_uuids if old is not None else frozenset())
        if old is not None and old.gpu_uuids and not kept & old.gpu_uuids:
            log.warning(
                "node reports none of the GPUs its name was pinned to; pinned to the new ones",
                extra={"node": node, "target": target, "gpus": len(kept)},
            )
        pin = NodePin(target, kept, now)
        self._pins[node] = pin
        saved = self._saved.get(node)
        if saved is None or (saved.target, saved.gpu_uuids) != (target, kept) or now - saved.served >= self._every:
            self._saved[node] = self._changed[node] = pin
        while len(self._pins) > self.max_pins:
            self._drop(next(iter(self._pins)))

    def expire(self, now: float) -> list[str]:
        """Drop the pins of names not answered for in ttl_seconds; returns their nodes."""
        lapsed = [(node, pin) for node, pin in self._pins.items() if now - pin.served > self.ttl_seconds]
        for node, pin in lapsed:
            log.info(
                "node name no longer pinned to its GPUs: not answered for in the identity TTL, any target may take it",
                extra={
                    "node": node,
                    "target": pin.target,
                    "last_served": pin.served,
                    "ttl_seconds": self.ttl_seconds,
                    "gpus": len(pin.gpu_uuids),
                },
            )
            self._drop(node)
        return [node for node, _ in lapsed]

    def changes(self) -> dict[str, NodePin | None]:
        """The pins set (or dropped: None) since the last call, for the store."""
        changed, self._changed = self._changed, {}
        return changed

    @property
    def _every(self) -> float:
        return self.ttl_seconds / 24

    def _drop(self, node: str) -> None:
        del self._pins[node]
        self._saved.pop(node, None)
        self._changed[node] = None
