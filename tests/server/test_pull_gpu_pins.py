"""A node's name follows its GPUs between addresses: another target takes it, while the node's own target does
not answer or has left discovery, only by reporting GPUs among those the name is pinned to."""

from __future__ import annotations

import asyncio
import logging

import httpx
import orjson
import pytest

from gpufleet.config import ConfigError
from gpufleet.server.ingest.identity import NodePin
from gpufleet.server.ingest.puller import Puller
from gpufleet.server.settings import load_settings
from tests.server.live_fakes import envelope, parse_dict, snapshot


class Fleet:
    """Agents answering as dgx-01 at their addresses; `gpus[target]` names the GPU uuids each reports (None:
    none listed yet), `down` refuse connections, `listed` is what discovery says."""

    def __init__(self, gpus: dict[str, list[str] | None]) -> None:
        self.gpus = gpus
        self.listed = list(gpus)
        self.down: set[str] = set()
        self.now = 1000.0

    def handler(self, request: httpx.Request) -> httpx.Response:
        target = f"{request.url.host}:{request.url.port}"
        if target in self.down:
            raise httpx.ConnectError("refused")
        snap = snapshot("dgx-01", self.now)
        uuids = self.gpus[target]
        snap["gpus"] = (
            [] if uuids is None else [{**snap["gpus"][0], "index": i, "uuid": u} for i, u in enumerate(uuids)]
        )
        return httpx.Response(200, content=orjson.dumps(envelope("dgx-01", [snap])))

    def targets(self) -> list[str]:
        """What discovery lists now (the puller's target source)."""
        return list(self.listed)

    def puller(self, **kwargs) -> Puller:
        return Puller(
            self,
            transport=httpx.MockTransport(self.handler),
            clock=lambda: self.now,
            parse=parse_dict,
            clock_offset_min_seconds=0.0,
            **kwargs,
        )

    def cycle(self, puller: Puller) -> dict[str, bool]:
        """One pull, 5 s on; which targets are up."""
        self.now += 5
        asyncio.run(puller.pull_once())
        return {h.target: h.up for h in puller.health()}


OLD, NEW = "10.0.0.1:9471", "10.0.0.2:9471"
GPUS = ["GPU-a0", "GPU-a1"]


def test_an_agent_at_a_new_address_with_one_gpu_swapped_takes_its_name_while_the_old_address_is_down() -> None:
    fleet = Fleet({OLD: GPUS, NEW: ["GPU-a0", "GPU-z1"]})
    fleet.listed = [OLD]
    puller = fleet.puller()
    assert fleet.cycle(puller) == {OLD: True}
    fleet.down.add(OLD)  # the pod restarted under a new IP; discovery still lists the old one for a while
    fleet.listed = [OLD, NEW]
    assert fleet.cycle(puller) == {OLD: False, NEW: True}
    fleet.down.clear()  # the old address answers again, as dgx-01: the name is with the agent answering
    assert fleet.cycle(puller) == {OLD: False, NEW: True}
    assert puller.errors == {(OLD, "connect"): 1, (OLD, "node_claimed"): 1}


def test_a_target_with_other_gpus_is_refused_while_the_node_is_down_and_after_its_address_left() -> None:
    fleet = Fleet({OLD: GPUS, NEW: ["GPU-x0", "GPU-x1"]})
    puller = fleet.puller()
    fleet.down.add(NEW)
    fleet.cycle(puller)
    fleet.down = {OLD}
    assert fleet.cycle(puller) == {OLD: False, NEW: False}
    fleet.listed = [NEW]  # the node's address left discovery: its name stays pinned to its GPUs
    assert fleet.cycle(puller) == {NEW: False}
    assert puller.errors[(NEW, "node_claimed")] == 2
    [health] = puller.health()
    assert "pinned to 2 GPUs last answered for from 10.0.0.1:9471" in (health.last_error or "")
    assert "none of them" in (health.last_error or "") and "--targets.identity-ttl" in (health.last_error or "")


def test_a_claimant_listing_no_gpus_yet_is_refused_until_it_lists_the_pinned_ones() -> None:
    fleet = Fleet({OLD: GPUS, NEW: None})
    fleet.listed = [OLD]
    puller = fleet.puller()
    fleet.cycle(puller)
    fleet.listed = [NEW]
    assert fleet.cycle(puller) == {NEW: False}
    assert "lists no GPU uuid" in (puller.health()[0].last_error or "")
    fleet.gpus[NEW] = GPUS  # NVML came up
    assert fleet.cycle(puller) == {NEW: True}


def test_the_nodes_own_target_with_all_its_gpus_replaced_keeps_the_name_and_pins_the_new_ones(caplog) -> None:
    fleet = Fleet({OLD: GPUS, NEW: GPUS})
    fleet.listed = [OLD]
    puller = fleet.puller()
    fleet.cycle(puller)
    fleet.gpus[OLD] = ["GPU-r0", "GPU-r1"]  # a board swapped in place, the address unchanged
    with caplog.at_level(logging.WARNING, logger="gpufleet.server.ingest.identity"):
        assert fleet.cycle(puller) == {OLD: True}
    assert "none of the GPUs its name was pinned to" in caplog.text
    fleet.listed = [NEW]  # the old GPUs elsewhere are no longer this node's
    assert fleet.cycle(puller) == {NEW: False}


def test_after_the_ttl_unanswered_any_target_may_take_the_name_even_from_a_listed_target_that_is_down() -> None:
    fleet = Fleet({OLD: GPUS, NEW: ["GPU-r0", "GPU-r1"]})
    fleet.listed = [OLD]
    puller = fleet.puller(identity_ttl_seconds=60.0)
    fleet.cycle(puller)  # served at 1005
    fleet.down.add(OLD)
    fleet.listed = [OLD, NEW]
    assert fleet.cycle(puller) == {OLD: False, NEW: False}
    fleet.now = 1005.0 + 60.0 - 5  # the next cycle is at exactly the TTL: not yet
    assert fleet.cycle(puller) == {OLD: False, NEW: False}
    assert fleet.cycle(puller) == {OLD: False, NEW: True}
    fleet.down.clear()  # the old address comes back as dgx-01: the name is the new GPUs' now
    assert fleet.cycle(puller) == {OLD: False, NEW: True}
    assert puller.errors[(OLD, "node_claimed")] == 1


def test_a_node_that_never_listed_gpus_keeps_its_name_with_its_target_while_listed() -> None:
    fleet = Fleet({OLD: None, NEW: GPUS})
    fleet.listed = [OLD]
    puller = fleet.puller()
    fleet.cycle(puller)
    fleet.down.add(OLD)
    fleet.listed = [OLD, NEW]
    assert fleet.cycle(puller) == {OLD: False, NEW: False}
    assert "is pulled from 10.0.0.1:9471" in ({h.target: h for h in puller.health()}[NEW].last_error or "")
    fleet.listed = [NEW]
    assert fleet.cycle(puller) == {NEW: True}


def test_the_identity_ttl_flag_takes_a_duration_and_defaults_to_a_day() -> None:
    assert load_settings([], env={}).targets_identity_ttl_seconds == 86400.0
    assert load_settings(["--targets.identity-ttl", "90m"], env={}).targets_identity_ttl_seconds == 5400.0
    with pytest.raises(ConfigError, match="identity-ttl"):
        load_settings(["--targets.identity-ttl", "0s"], env={})


def test_after_a_restart_the_pinned_target_keeps_the_name_from_another_reporting_the_same_gpus() -> None:
    # One agent listed under two addresses: whichever answers first, the name stays where it was pinned.
    fleet = Fleet({NEW: GPUS, OLD: GPUS})
    puller = fleet.puller()
    puller.remember_identities({OLD: "dgx-01"}, {"dgx-01": NodePin(OLD, frozenset(GPUS), 1000.0)})
    assert fleet.cycle(puller) == {OLD: True, NEW: False}
    assert "pinned to 10.0.0.1:9471" in ({h.target: h for h in puller.health()}[NEW].last_error or "")
