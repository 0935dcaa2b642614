"""RememberedNodes: a node's target from before a restart holds its name while listed, until it answers.
NodePins: a node's name is pinned to the GPUs it reported, until it goes unanswered for the TTL."""

from __future__ import annotations

import logging

from gpufleet.server.ingest.identity import Evidence, NodePin, NodePins, RememberedNodes, gpu_uuids


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


# --- NodePins: a name pinned to the GPUs its node reported ---------------------------------------------------

A, B = frozenset({"GPU-a0", "GPU-a1"}), frozenset({"GPU-b0", "GPU-b1"})


def test_a_claim_is_judged_by_the_pinned_gpus_and_the_pinned_target() -> None:
    pins = NodePins(ttl_seconds=3600.0)
    assert pins.evidence("dgx-01", "x:1", A) is Evidence.NONE  # never pinned
    pins.served("dgx-01", "a:1", A, 1000.0)
    assert pins.evidence("dgx-01", "x:1", A) is Evidence.SAME  # its GPUs at a new address
    assert pins.evidence("dgx-01", "x:1", frozenset({"GPU-a0", "GPU-c1"})) is Evidence.SAME  # one GPU swapped
    assert pins.evidence("dgx-01", "x:1", B) is Evidence.OTHER
    assert pins.evidence("dgx-01", "x:1", frozenset()) is Evidence.OTHER  # no GPUs listed yet: nothing to match
    assert pins.evidence("dgx-01", "a:1", B) is Evidence.SAME  # its own target, GPUs replaced in place


def test_a_node_that_listed_no_gpus_leaves_its_name_to_the_targets_and_keeps_gpus_it_listed_before() -> None:
    pins = NodePins()
    pins.served("cpu-01", "a:1", frozenset(), 1000.0)
    assert pins.evidence("cpu-01", "x:1", B) is Evidence.NONE
    pins.served("dgx-01", "a:1", A, 1000.0)
    pins.served("dgx-01", "a:1", frozenset(), 1005.0)  # NVML not ready: the pinned GPUs stay
    assert pins.get("dgx-01") == NodePin("a:1", A, 1005.0)


def test_pins_lapse_after_the_ttl_unserved_and_the_store_hears_of_it(caplog) -> None:
    pins = NodePins(ttl_seconds=3600.0)
    pins.served("dgx-01", "a:1", A, 1000.0)
    pins.served("dgx-02", "b:1", B, 2000.0)
    assert pins.changes() == {"dgx-01": NodePin("a:1", A, 1000.0), "dgx-02": NodePin("b:1", B, 2000.0)}
    assert pins.expire(4600.0) == []  # exactly the TTL: not yet
    with caplog.at_level(logging.INFO, logger="gpufleet.server.ingest.identity"):
        assert pins.expire(4601.0) == ["dgx-01"]
    assert "no longer pinned" in caplog.text
    assert pins.get("dgx-01") is None and pins.evidence("dgx-01", "x:1", B) is Evidence.NONE
    assert pins.changes() == {"dgx-01": None}


def test_a_pins_served_time_reaches_the_store_only_when_it_moved_by_a_24th_of_the_ttl() -> None:
    pins = NodePins(ttl_seconds=2400.0)
    pins.restore({"dgx-01": NodePin("a:1", A, 1000.0)})
    pins.served("dgx-01", "a:1", A, 1050.0)
    assert pins.changes() == {}  # a write per node per pull would be thousands of rows every few seconds
    pins.served("dgx-01", "a:1", A, 1100.0)
    assert pins.changes() == {"dgx-01": NodePin("a:1", A, 1100.0)}
    pins.served("dgx-01", "b:1", A, 1105.0)  # a new target (or new GPUs) is written at once
    assert pins.changes() == {"dgx-01": NodePin("b:1", A, 1105.0)}


def test_pins_are_bounded_and_the_least_recently_served_goes_first() -> None:
    pins = NodePins(max_pins=2)
    pins.restore({"n1": NodePin("a:1", A, 1000.0), "n2": NodePin("b:1", B, 900.0)})
    pins.served("n3", "c:1", frozenset({"GPU-c0"}), 1010.0)
    assert pins.get("n2") is None and pins.get("n1") is not None and pins.changes()["n2"] is None


def test_gpu_uuids_skip_what_is_not_a_uuid() -> None:
    snaps = [
        {"gpus": [{"uuid": "GPU-a0"}, {"uuid": ""}, {"uuid": "x" * 129}, {"uuid": 7}, "junk"]},
        {"gpus": "junk"},
        "junk",
        {"gpus": [{"uuid": "GPU-a1"}]},
    ]
    assert gpu_uuids(snaps) == A
