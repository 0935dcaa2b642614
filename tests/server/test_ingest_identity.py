"""RememberedNodes: a node's target from before a restart holds its name while listed, until it answers."""

from __future__ import annotations

from gpufleet.server.ingest.identity import RememberedNodes


def test_a_remembered_target_holds_its_nodes_name_while_listed_until_it_answers_for_itself() -> None:
    memory = RememberedNodes()
    memory.remember({"a:1": "dgx-01", "b:1": "dgx-02"})
    assert memory.owner("dgx-01", "x:1", listed={"a:1", "x:1"}) == "a:1"
    assert memory.owner("dgx-01", "a:1", listed={"a:1"}) is None  # its own target
    assert memory.owner("dgx-01", "x:1", listed={"x:1"}) is None  # no longer listed
    assert memory.owner("dgx-03", "x:1", listed={"a:1", "x:1"}) is None  # never known
    memory.forget("a:1")  # a:1 answered (as anything): its old name no longer speaks for it
    assert memory.owner("dgx-01", "x:1", listed={"a:1", "x:1"}) is None
    memory.remember({"b:1": "dgx-22"})  # a newer name for b:1 replaces the older
    assert memory.owner("dgx-02", "x:1", listed={"b:1"}) is None
    assert memory.owner("dgx-22", "x:1", listed={"b:1"}) == "b:1"
