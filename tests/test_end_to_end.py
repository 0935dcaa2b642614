"""The demo scenario end to end: simulated NVML -> agent sampler -> --record lines -> replay engine -> alerts.

Every node of the built-in `demo` scenario is sampled through the production agent pipeline (SimNvml,
NvmlReader, JobAttributor over the simulator's procfs, Sampler, Recorder) on a fake clock, once per
simulated second; the node files are concatenated as `cat` would and replayed. The alerts must be
exactly the scenario's three incidents, each fired during its incident and resolved after it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gpufleet.agent.sim import Scenario, load_scenario
from gpufleet.agent.sim.scenario import Incident
from gpufleet.server.alerts import Alert, AlertKind
from gpufleet.server.contract import parse_line
from gpufleet.server.replay import run_replay
from tests.agent.running import agent_process
from bench.evaluation.sim_record import T0, record_cluster

SAMPLE_INTERVAL_SECONDS = 1.0


@pytest.fixture(scope="module")
def demo() -> Scenario:
    return load_scenario("demo")


@pytest.fixture(scope="module")
def demo_trace(demo: Scenario, tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """`cat dgx-01.jsonl dgx-02.jsonl ...`: node after node, not sorted by time."""
    assert demo.duration_s is not None, "the demo scenario must say how long it runs"
    return record_cluster(demo, tmp_path_factory.mktemp("e2e"), demo.duration_s, SAMPLE_INTERVAL_SECONDS)


@pytest.fixture(scope="module")
def alerts(demo_trace: list[bytes]) -> list[Alert]:
    return run_replay(demo_trace)


def incident(scenario: Scenario, kind: str) -> Incident:
    (found,) = [i for i in scenario.incidents if i.kind == kind]
    assert found.end_s is not None, f"the demo's {kind} must end so its alert can resolve"
    return found


def only(alerts: list[Alert], kind: AlertKind, **subject: object) -> Alert:
    """The single alert of this kind and subject; fails listing what fired instead."""
    found = [a for a in alerts if a.kind == kind and all(getattr(a, k) == v for k, v in subject.items())]
    assert len(found) == 1, f"expected one {kind.value} {subject}, got: {describe(alerts)}"
    return found[0]


def describe(alerts: list[Alert]) -> list[str]:
    return [
        f"{a.kind.value} {a.node}/{a.gpu} job {a.hpc_job} +{(a.started or T0) - T0:.0f}s"
        f"..{'open' if a.resolved is None else f'+{a.resolved - T0:.0f}s'}"
        for a in alerts
    ]


def assert_fired_during_and_resolved_after(alert: Alert, inc: Incident) -> None:
    started, resolved = alert.started - T0, None if alert.resolved is None else alert.resolved - T0
    assert inc.start_s <= started <= inc.end_s, (
        f"{alert.kind.value} fired at +{started:.0f}s, outside its incident ({inc.start_s:.0f}-{inc.end_s:.0f}s)"
    )
    assert resolved is not None, f"{alert.kind.value} {alert.node}/{alert.gpu} never resolved"
    assert resolved > inc.end_s, f"{alert.kind.value} resolved at +{resolved:.0f}s, before its incident ended"


def test_trace_is_every_node_every_second_with_jobs_attributed(demo: Scenario, demo_trace: list[bytes]) -> None:
    samples = [parse_line(line) for line in demo_trace]
    assert [s.node for s in samples[:: len(samples) // len(demo.nodes)]] == list(demo.nodes)  # node after node
    expected_jobs = {(node, index): job.id for job in demo.jobs for node, index in job.gpus}
    for sample in samples:
        assert len(sample) == demo.node(sample.node).gpu_count
        assert {(sample.node, i): j for i, j in zip(sample.indices, sample.jobs)} == {
            (sample.node, i): expected_jobs[(sample.node, i)] for i in sample.indices
        }
    per_node = {node: sum(s.node == node for s in samples) for node in demo.nodes}
    assert set(per_node.values()) == {int(demo.duration_s / SAMPLE_INTERVAL_SECONDS) + 1}


def test_cooling_failure_throttles_and_resolves(demo: Scenario, alerts: list[Alert]) -> None:
    cooling = incident(demo, "cooling_failure")
    ((node, gpu),) = cooling.gpus
    alert = only(alerts, AlertKind.THERMAL_THROTTLE, node=node, gpu=gpu)
    assert_fired_during_and_resolved_after(alert, cooling)


def test_slow_gpu_is_named_as_the_straggler_and_resolves(demo: Scenario, alerts: list[Alert]) -> None:
    slow = incident(demo, "slow_gpu")
    ((node, gpu),) = slow.gpus
    alert = only(alerts, AlertKind.STRAGGLER, node=node, gpu=gpu)
    assert alert.hpc_job == next(j.id for j in demo.jobs if (node, gpu) in j.gpus)
    assert_fired_during_and_resolved_after(alert, slow)


def test_no_waiting_peer_is_ever_called_a_straggler(demo: Scenario, alerts: list[Alert]) -> None:
    # The throttled GPU really does hold its job back, so naming it is right; anyone else is a victim.
    culprits = {ref for kind in ("slow_gpu", "cooling_failure") for ref in incident(demo, kind).gpus}
    wrong = [a for a in alerts if a.kind == AlertKind.STRAGGLER and (a.node, a.gpu) not in culprits]
    assert not wrong, f"stragglers named outside the culprits {sorted(culprits)}: {describe(wrong)}"


def test_comm_slowdown_is_comm_bound_and_resolves(demo: Scenario, alerts: list[Alert]) -> None:
    comm = incident(demo, "comm_slowdown")
    alert = only(alerts, AlertKind.COMM_BOUND, hpc_job=comm.job)
    assert alert.node is None and alert.gpu is None
    assert_fired_during_and_resolved_after(alert, comm)


def test_nothing_else_fires(demo: Scenario, alerts: list[Alert]) -> None:
    cooling, slow, comm = (incident(demo, k) for k in ("cooling_failure", "slow_gpu", "comm_slowdown"))
    expected = {
        (AlertKind.THERMAL_THROTTLE, *cooling.gpus[0]),
        (AlertKind.STRAGGLER, *slow.gpus[0]),
        (AlertKind.STRAGGLER, *cooling.gpus[0]),
        (AlertKind.COMM_BOUND, None, None),
    }
    unexpected = [
        a
        for a in alerts
        if (a.kind, a.node, a.gpu) not in expected or (a.kind == AlertKind.COMM_BOUND and a.hpc_job != comm.job)
    ]
    assert not unexpected, f"unexpected alerts: {describe(unexpected)}"
    assert all(a.resolved is not None for a in alerts), f"still open at the end: {describe(alerts)}"


def test_agent_cli_record_output_meets_the_wire_contract(tmp_path: Path) -> None:
    """A real `gpufleet-agent --simulate demo --record FILE` process: every line it wrote parses server-side."""
    trace = tmp_path / "dgx-03.jsonl"
    with agent_process(
        "--simulate", "demo", "--node", "dgx-03", "--sample.interval", "0.2", "--record", str(trace)
    ) as (proc, _port):
        waiter = threading.Event()
        for _ in range(300):  # at most 30 s; lines land every 0.2 s
            if trace.exists() and trace.read_bytes().count(b"\n") >= 3:
                break
            waiter.wait(0.1)
        proc.terminate()
        assert proc.wait(timeout=20) == 0
    lines = trace.read_bytes().splitlines()
    assert len(lines) >= 3
    samples = [parse_line(line) for line in lines]
    assert all(s.node == "dgx-03" and s.indices == tuple(range(8)) for s in samples)
    # Attribution through the simulated procfs, on its own thread: a job shows from the cycle after its
    # processes first do (docs/agent.md), so from the second line on.
    assert all(s.jobs == ("71002",) * 8 for s in samples[1:])
    assert all(b.time > a.time for a, b in zip(samples, samples[1:]))
    assert samples[-1].value(2, "sm_active_ratio") is not None  # GPM needs two samples; it has them
