"""The real agent process under a reopening slowloris (slow heads, slow bodies): new clients are still served."""

from __future__ import annotations

import pytest

from tests.agent.running import agent_process
from tests.slowloris import ENDLESS_BODY, ENDLESS_HEAD, Slowloris, probe_during


@pytest.mark.parametrize("payload", [ENDLESS_HEAD, ENDLESS_BODY], ids=["slow-head", "slow-body"])
def test_new_clients_are_served_while_200_connections_trickle_their_requests(payload):
    # Each trickling connection sends ~20 bytes before its 2 s head deadline, as the attack sent 15
    # (one byte every 2 s against 30 s). A probe not answered within half the deadline counts as lost: a
    # server that makes new clients queue behind the attack until trickling connections time out fails.
    with agent_process("--simulate", "hgx-h100", "--web.read-header-timeout", "2s") as (_, port):
        with Slowloris(port, payload, connections=200, pace_seconds=0.1) as attack:
            statuses = probe_during(attack, port, "/metrics")
        answered = sum(status is not None for status in statuses)
        assert answered >= 0.95 * len(statuses), statuses
        assert statuses.count(200) >= 0.9 * len(statuses), statuses  # the first sample is out within a second
        assert attack.reopened >= 200  # the agent closed the trickling connections, the attacker came back
