"""End to end over loopback: two real agents (demo nodes of two jobs), a real Prometheus scraping them, and
the server's pipeline reading the agents through that Prometheus (`--ingest.prometheus-url`)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from gpufleet.server.ingest.prometheus import PrometheusSource
from gpufleet.server.serve import build_runtime
from gpufleet.server.settings import load_settings
from tests.agent.running import agent_process, prometheus_process, requires_prometheus

DEADLINE_SECONDS = 60.0
POLL_SECONDS = 0.5


@requires_prometheus
def test_the_pipeline_reads_real_agents_through_a_real_prometheus(tmp_path) -> None:
    with (
        agent_process("--simulate", "demo", "--node", "dgx-01") as (_, port_a),
        agent_process("--simulate", "demo", "--node", "dgx-03") as (_, port_b),
        prometheus_process(tmp_path, [port_a, port_b]) as (prom, prom_port, log_path),
    ):
        settings = load_settings(
            [
                "--ingest.prometheus-url",
                f"http://127.0.0.1:{prom_port}",
                "--storage.path",
                str(tmp_path / "alerts.db"),
                "--pull.interval",
                "1s",
                "--pull.timeout",
                "1s",
            ],
            env={},
        )
        runtime = build_runtime(settings)
        assert isinstance(runtime.source, PrometheusSource)
        waiter = threading.Event()

        async def cycles() -> tuple[list, list]:
            delivered: list = []
            original = runtime.source.pull_once

            async def recording():
                result = await original()
                delivered.extend(result.samples)
                return result

            runtime.source.pull_once = recording  # type: ignore[method-assign]
            try:
                for _ in range(int(DEADLINE_SECONDS / POLL_SECONDS)):
                    assert prom.poll() is None, log_path.read_text(errors="replace")[-2000:]
                    await runtime.cycle()
                    nodes = {s.node for s in delivered}
                    if nodes == {"dgx-01", "dgx-03"} and len(runtime.view.jobs) == 2:  # a tick evaluated
                        break
                    await asyncio.to_thread(waiter.wait, POLL_SECONDS)
                snapshots = [httpx.get(f"http://127.0.0.1:{p}/snapshots").json()["snapshots"] for p in (port_a, port_b)]
                return delivered, snapshots
            finally:
                await runtime.stop()

        delivered, snapshots = asyncio.run(cycles())

    # Every scrape delivered once, in time order per node.
    for node in ("dgx-01", "dgx-03"):
        times = [s.time for s in delivered if s.node == node]
        assert len(times) >= 2 and times == sorted(set(times)), times
    # Identities and job attribution are the agents' own.
    by_node = {snaps[-1]["node"]: snaps for snaps in snapshots}
    for sample in delivered:
        agent_gpus = by_node[sample.node][-1]["gpus"]
        assert sample.indices == tuple(g["index"] for g in agent_gpus)
        assert sample.uuids == tuple(g["uuid"] for g in agent_gpus)
        assert sample.models == tuple(g["model"] for g in agent_gpus)
        assert sample.jobs == tuple(g["hpc_job"] for g in agent_gpus)
    assert {j for s in delivered for j in s.jobs} == {"71001", "71002"}
    # Each sample is one the agent took: its time (the scrape's, less the age the agent reported in it)
    # and every reading are that snapshot's own, but for the activity ratios: from the second scrape of a
    # GPU on, those are the mean of every agent sample since the previous scrape, weighted by the time each
    # stands for (the agent's activity counters).
    previous: dict[str, int] = {}
    for sample in delivered:
        snaps = by_node[sample.node]
        (at,) = [i for i, snap in enumerate(snaps) if abs(snap["time"] - sample.time) < 0.05]
        since, previous[sample.node] = previous.get(sample.node), at
        for g in snaps[at]["gpus"]:
            for field in (
                "temperature_celsius",
                "power_watts",
                "energy_joules_total",
                "sm_clock_hertz",
                "sm_clock_max_hertz",
                "power_limit_watts",
                "throttle_reasons",
                "xid_errors_total",
            ):
                assert sample.value(g["index"], field) == g[field], (sample.node, g["index"], field)
            for field in ("utilization_ratio", "sm_active_ratio"):
                expected = g[field]
                if since is not None and snaps[since]["gpus"][g["index"]][field] is not None:
                    steps = [
                        (min(snaps[i]["time"] - snaps[i - 1]["time"], 2.0), snaps[i]["gpus"][g["index"]][field])
                        for i in range(since + 1, at + 1)
                    ]
                    expected = sum(dt * r for dt, r in steps) / sum(dt for dt, _ in steps)
                assert sample.value(g["index"], field) == pytest.approx(expected, rel=1e-9), (
                    sample.node,
                    g["index"],
                    field,
                )
    # The engine took them: both nodes with their 8 GPUs, both jobs, and both agents up by Prometheus's `up`.
    assert {n["node"]: n["gpus"] for n in runtime.view.nodes} == {"dgx-01": 8, "dgx-03": 8}
    assert {j["hpc_job"] for j in runtime.view.jobs} == {"71001", "71002"}
    assert sorted((h.target, h.node, h.up) for h in runtime.source.health()) == sorted(
        [(f"127.0.0.1:{port_a}", "dgx-01", True), (f"127.0.0.1:{port_b}", "dgx-03", True)]
    )
