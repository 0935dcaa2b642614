"""The demo scenario read through Prometheus: agent exposition -> scrapes -> PrometheusSource -> engine.

Every node of the `demo` scenario is sampled once per simulated second by the production agent
pipeline (bench/evaluation/sim_record.py); a scrape every 5 s, at a different offset per node as Prometheus spreads
its targets, keeps that moment's exposition body. A stand-in for Prometheus's query API answers the
source's range queries from those scrapes, and the source's rebuilt snapshots are replayed.

This is the case the live demo run got wrong: the ratio gauges are 1 s means, and sampled at a
different phase of the step on each node they made a waiting node read as a straggler. Here the
source must give exact interval means (from the agent's activity counters), and the alerts must be
the demo's own.
"""

from __future__ import annotations

import asyncio
import re
from collections import defaultdict
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.agent.exposition import render_age
from gpufleet.agent.sim import Scenario, load_scenario
from gpufleet.server.alerts import Alert, AlertKind
from gpufleet.server.ingest.prometheus import SELECTOR, PrometheusSource
from gpufleet.server.replay import run_replay
from bench.evaluation.sim_record import T0, sample_node
from tests.test_end_to_end import assert_fired_during_and_resolved_after, describe, incident, only

SCRAPE_EVERY_SECONDS = 5
# Scrape phase per node, in agent samples: these put dgx-01 and dgx-02 (one job) at different phases.
OFFSETS = {"dgx-01": 0, "dgx-02": 3, "dgx-03": 1, "dgx-04": 4}
SCRAPE_DELAY_SECONDS = 0.4  # a scrape lands this long after the sample it carries
_WANTED = re.compile(re.match(r'\{__name__=~"([^"]+)"', SELECTOR).group(1))


class ScrapedPrometheus:
    """Answers /api/v1/query for `{__name__=~"..."}[Ns]` from stored scrapes, and `up` (all up)."""

    def __init__(self) -> None:
        self.scrapes: list[tuple[float, str, list[tuple[dict[str, str], float]]]] = []

    def scrape(self, at: float, instance: str, body: bytes) -> None:
        # Only the series the source asks for are parsed: prometheus_client's parser takes 30 ms for a
        # whole 8-GPU body, and this runs 577 times.
        lines = [
            line
            for line in body.decode().splitlines()
            if not line.startswith("#") and _WANTED.fullmatch(line.split("{", 1)[0].split(" ", 1)[0])
        ]
        points = [
            ({**s.labels, "__name__": s.name, "instance": instance, "job": "gpufleet-agent"}, s.value)
            for family in text_string_to_metric_families("\n".join(lines) + "\n")
            for s in family.samples
        ]
        self.scrapes.append((at, instance, points))

    def handler(self, request: httpx.Request) -> httpx.Response:
        query, at = request.url.params["query"], float(request.url.params["time"])
        if query.startswith("up{"):
            instances = sorted({instance for _, instance, _ in self.scrapes})
            result = [
                {"metric": {"__name__": "up", "instance": i, "job": "gpufleet-agent"}, "value": [at, "1"]}
                for i in instances
            ]
            return _answer("vector", result)
        match = re.fullmatch(r'\{__name__=~"([^"]+)", gpufleet_recorded_from=""\}\[(\d+)s\]', query)
        assert match, f"unexpected query {query!r}"
        wanted, seconds = re.compile(match.group(1)), float(match.group(2))
        series: dict[tuple, dict] = {}
        for scraped_at, _, points in self.scrapes:
            if not at - seconds < scraped_at <= at:
                continue
            for labels, value in points:
                if wanted.fullmatch(labels["__name__"]):
                    key = tuple(sorted(labels.items()))
                    entry = series.setdefault(key, {"metric": labels, "values": []})
                    entry["values"].append([scraped_at, repr(value)])
        return _answer("matrix", list(series.values()))


def _answer(kind: str, result: list) -> httpx.Response:
    return httpx.Response(
        200, content=orjson.dumps({"status": "success", "data": {"resultType": kind, "result": result}})
    )


@pytest.fixture(scope="module")
def demo() -> Scenario:
    return load_scenario("demo")


@pytest.fixture(scope="module")
def scraped(demo: Scenario, tmp_path_factory: pytest.TempPathFactory):
    """(the stand-in Prometheus with every scrape, each node's agent samples by time)."""
    assert demo.duration_s is not None
    workdir: Path = tmp_path_factory.mktemp("prom-e2e")
    prometheus = ScrapedPrometheus()
    samples: dict[str, dict[float, dict]] = defaultdict(dict)
    for port, node in enumerate(demo.nodes, start=9471):
        for now, snapshot, publication in sample_node(demo, node, workdir, demo.duration_s):
            if snapshot is not None:
                samples[node][snapshot.time] = {g.uuid: g for g in snapshot.gpus}
            if round(now - T0) % SCRAPE_EVERY_SECONDS == OFFSETS[node] and publication.snapshot is not None:
                at = now + SCRAPE_DELAY_SECONDS
                body = publication.metrics + render_age(at, publication.snapshot, node)
                prometheus.scrape(at, f"10.0.0.{port - 9470}:{port}", body)
    return prometheus, samples


@pytest.fixture(scope="module")
def rebuilt(scraped) -> list[dict]:
    """Every snapshot the source delivered, querying every 5 s from the start of the trace."""
    prometheus, _ = scraped
    now = [T0 + 2.5]
    source = PrometheusSource(
        "http://prometheus:9090",
        transport=httpx.MockTransport(prometheus.handler),
        clock=lambda: now[0],
        parse=lambda raw: raw,
    )
    end = max(at for at, _, _ in prometheus.scrapes) + SCRAPE_EVERY_SECONDS

    async def pull_all() -> list[dict]:
        out = []
        while now[0] <= end:
            result = await source.pull_once()
            assert result.failed_targets == 0 and result.rejected_snapshots == 0
            out.extend(result.samples)
            now[0] += SCRAPE_EVERY_SECONDS
        await source.aclose()
        return out

    return asyncio.run(pull_all())


def test_every_scrape_is_delivered_once_at_its_sample_time(scraped, rebuilt: list[dict]) -> None:
    prometheus, samples = scraped
    delivered = sorted((s["node"], s["time"]) for s in rebuilt)
    assert len(delivered) == len(set(delivered)) == len(prometheus.scrapes)
    for node, time in delivered:
        assert time in samples[node], f"{node}: delivered a sample time {time - T0:+.3f} no agent sample has"


def test_ratios_are_exact_means_of_every_agent_sample_since_the_previous_scrape(scraped, rebuilt) -> None:
    _, samples = scraped
    checked = 0
    previous: dict[str, float] = {}
    for snap in sorted(rebuilt, key=lambda s: s["time"]):
        node, time = snap["node"], snap["time"]
        since, previous[node] = previous.get(node), time
        if since is None:
            continue
        between = [t for t in samples[node] if since < t <= time]
        for gpu in snap["gpus"]:
            for field in ("sm_active_ratio", "utilization_ratio"):
                if getattr(samples[node][since][gpu["uuid"]], field) is None:
                    continue  # the counters start with the reading (GPM's first poll has none): the gauge
                values = [samples[node][t][gpu["uuid"]] for t in between]
                mean = sum(getattr(v, field) for v in values) / len(values)
                assert gpu[field] == pytest.approx(mean, abs=1e-9), (node, time - T0, gpu["index"], field)
                checked += 1
    assert checked > 9_000


def test_gauge_alone_would_differ_from_the_mean(scraped, rebuilt) -> None:
    """The premise of the counters: on this trace a scraped gauge is not the interval mean (else the
    test above would pass with the gauges and prove nothing): off by more than 0.02 on at least one GPU
    in every other snapshot on average."""
    _, samples = scraped
    differing = sum(
        abs(samples[s["node"]][s["time"]][g["uuid"]].sm_active_ratio - g["sm_active_ratio"]) > 0.02
        for s in rebuilt
        for g in s["gpus"]
        if g.get("sm_active_ratio") is not None
    )
    assert differing > len(rebuilt) // 2


@pytest.fixture(scope="module")
def alerts(rebuilt: list[dict]) -> list[Alert]:
    return run_replay(orjson.dumps(s) for s in rebuilt)


def test_alerts_are_the_demos_incidents_and_nothing_else(demo: Scenario, alerts: list[Alert]) -> None:
    cooling, slow, comm = (incident(demo, kind) for kind in ("cooling_failure", "slow_gpu", "comm_slowdown"))
    assert_fired_during_and_resolved_after(only(alerts, AlertKind.THERMAL_THROTTLE, node="dgx-02", gpu=5), cooling)
    assert_fired_during_and_resolved_after(only(alerts, AlertKind.STRAGGLER, node="dgx-02", gpu=5), cooling)
    assert_fired_during_and_resolved_after(only(alerts, AlertKind.STRAGGLER, node="dgx-03", gpu=2), slow)
    assert_fired_during_and_resolved_after(only(alerts, AlertKind.COMM_BOUND, hpc_job="71002"), comm)
    assert len(alerts) == 4, describe(alerts)
