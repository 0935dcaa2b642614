"""Busy GPUs that no peer group can judge are counted, per node and in all, and said: `/nodes`, the status
page, `/metrics` and a log warning when the count grows."""

from __future__ import annotations

import logging

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.server.contract import parse_line
from gpufleet.server.engine import Engine
from gpufleet.server.metrics import build_registry
from gpufleet.server.runtime import FleetView, warn_unjudged
from tests.server.engine_samples import T0, cluster_lines
from tests.server.test_page import build


def _fleet(t: float, node: str, gpu: int) -> dict:
    """n0: an 8-GPU job. n1: a one-GPU job on GPU 0, an unattributed GPU 1 busy alone, the rest idle."""
    if node == "n0":
        return {}
    if gpu == 0:
        return {"hpc_job": "solo"}
    if gpu == 1:
        return {"hpc_job": None}
    return {"hpc_job": None, "utilization_ratio": 0.0, "sm_active_ratio": 0.0, "power_watts": 70.0}


def _engine(override) -> Engine:
    eng = Engine()
    samples = sorted((parse_line(line) for line in cluster_lines(300, override=override)), key=lambda s: s.time)
    for s in samples:
        eng.ingest(s)
    eng.advance(samples[-1].time + 10.0)
    return eng


def test_a_gpu_alone_in_its_job_or_on_its_node_is_unjudged_and_idle_ones_are_not():
    eng = _engine(_fleet)
    nodes = {n.node: n for n in eng.nodes()}
    assert nodes["n0"].unjudged_gpus == 0
    assert nodes["n1"].unjudged_gpus == 2  # the one-GPU job and the lone unattributed GPU; not the 6 idle
    assert eng.stats().gpus_unjudged == 2 and eng.stats().to_dict()["gpus_unjudged"] == 2
    assert nodes["n1"].to_dict()["unjudged_gpus"] == 2


def test_gpus_of_a_job_or_of_a_node_with_enough_busy_peers_are_judged():
    # Unattributed throughout: eight busy GPUs of a model on a node are peers of each other.
    eng = _engine(lambda t, node, gpu: {"hpc_job": None})
    assert eng.stats().gpus_unjudged == 0
    assert all(n.unjudged_gpus == 0 for n in eng.nodes())


def test_a_forgotten_node_takes_its_unjudged_gpus_along():
    eng = _engine(_fleet)
    eng.forget_node("n1", T0 + 400.0, "left discovery")
    assert eng.stats().gpus_unjudged == 0


def _view(count: int, per_node: dict[str, int]) -> FleetView:
    nodes = tuple(
        {"node": n, "gpus": 8, "reachable": True, "open_alerts": 0, "unjudged_gpus": c} for n, c in per_node.items()
    )
    return FleetView(nodes=nodes, stats={"gpus_unjudged": count}, evaluated_at=1100.0)


def test_a_warning_is_logged_when_the_count_grows_and_only_then(caplog):
    caplog.set_level(logging.WARNING, logger="gpufleet.server.runtime")
    warned = warn_unjudged(_view(2, {"n1": 2, "n0": 0}), 0)
    (record,) = caplog.records
    assert warned == 2 and record.gpus_unjudged == 2 and record.nodes == {"n1": 2} and record.was == 0
    caplog.clear()
    assert warn_unjudged(_view(2, {"n1": 2}), warned) == 2 and not caplog.records  # the same: no repeat
    assert warn_unjudged(_view(1, {"n1": 1}), 2) == 1 and not caplog.records  # fewer: no warning, re-armed
    assert warn_unjudged(_view(2, {"n1": 2}), 1) == 2 and len(caplog.records) == 1


def test_nodes_page_and_metrics_carry_the_count(tmp_path):
    runtime, client = build(tmp_path)
    runtime.view = _view(3, {"dgx-07": 3, "dgx-01": 0})
    body = client.get("/nodes").json()
    assert body["unjudged_gpus"] == 3
    assert {n["node"]: n["unjudged_gpus"] for n in body["nodes"]} == {"dgx-07": 3, "dgx-01": 0}
    page = client.get("/").text
    assert "busy GPUs unjudged" in page and "Busy GPUs without peers" in page
    assert "<td>dgx-07</td><td class=n>3</td>" in page and "<td>dgx-01</td>" not in page
    exposition = generate_latest(build_registry(runtime)).decode()
    got = {
        (s.name, tuple(s.labels.items())): s.value
        for f in text_string_to_metric_families(exposition)
        for s in f.samples
    }
    assert got[("gpufleet_server_gpus_unjudged", ())] == 3
    assert got[("gpufleet_node_gpus_unjudged", (("node", "dgx-07"),))] == 3
    runtime.store.close()


def test_a_fleet_with_every_gpu_judged_shows_no_table(tmp_path):
    runtime, client = build(tmp_path)
    runtime.view = _view(0, {"dgx-01": 0})
    page = client.get("/").text
    assert "Busy GPUs without peers" not in page
    runtime.store.close()
