"""The real server process under a reopening slowloris (slow heads, slow bodies): new clients are still served."""

from __future__ import annotations

import pytest

from tests.agent.running import server_process
from tests.slowloris import ENDLESS_BODY, ENDLESS_HEAD, Slowloris, probe_during


@pytest.mark.parametrize("payload", [ENDLESS_HEAD, ENDLESS_BODY], ids=["slow-head", "slow-body"])
def test_new_clients_are_served_while_200_connections_trickle_their_requests(tmp_path, payload):
    # As for the agent (tests/agent/test_slow_clients.py): ~20 bytes per connection before its 2 s head
    # deadline, and a probe not answered within half of it counts as lost.
    with server_process(tmp_path, "--targets", "127.0.0.1:1", "--web.read-header-timeout", "2s") as (_, port):
        with Slowloris(port, payload, connections=200, pace_seconds=0.1) as attack:
            statuses = probe_during(attack, port, "/healthz")
        assert sum(status is not None for status in statuses) >= 0.95 * len(statuses), statuses
        assert attack.reopened >= 200  # the server closed the trickling connections, the attacker came back
