"""Which target each node answered from before a restart, so that a name stays with its target across one.

The puller pins a node's name to the target that first answers as it, in memory. After a restart that
memory is empty: a target claiming a known node's name while the node's own target is merely down
(not yet answering) would take it, and the returning agent would be refused. The store keeps the last
target -> node of every target; handed back at start, each entry holds its node's name for its target
while that target is listed, until it answers for itself (as that node or another).
"""

from __future__ import annotations

from typing import Collection, Mapping


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
