"""A firing node_unreachable's summary says how long the node has been silent as its evidence does, however
long that grows: a summary kept from when it fired would say 40 s beside evidence of 1.7e9 s."""

from __future__ import annotations

from gpufleet.server.replay import run_replay
from tests.server.engine_samples import cluster_lines
from tests.server.test_replay import _shifted


def test_a_node_far_behind_in_replay_is_summarised_with_the_silence_its_evidence_gives() -> None:
    # Two nodes: no majority to line the odd clock up with, so n1's samples stay in its own past.
    [alert] = run_replay(_shifted(cluster_lines(900, nodes=2), "n1", -1.7e9))
    assert (alert.kind.value, alert.node, alert.state.value) == ("node_unreachable", "n1", "firing")
    silent = alert.evidence["silent_seconds"]
    assert silent > 1.69e9
    assert alert.summary == f"node n1 sent no sample for {silent:.0f} s"
