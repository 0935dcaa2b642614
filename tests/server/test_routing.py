"""Routing labels: external labels and the subject's Kubernetes namespace/pod on every alert that leaves the
server, fixed for the alert's life; a one-line description and a runbook link; and all of it arriving in a
real Alertmanager through the live pipeline (Runtime)."""

from __future__ import annotations

import asyncio
import sqlite3
from dataclasses import replace

import httpx
import pytest

from gpufleet.server.alerts import AlertKind, AlertState, description
from gpufleet.server.contract import parse_line
from gpufleet.server.engine import Engine, EngineConfig
from gpufleet.server.ingest.base import PullResult
from gpufleet.server.notify.alertmanager import AlertmanagerNotifier, to_alertmanager
from gpufleet.server.routing import AlertRouting
from gpufleet.server.runtime import Runtime
from gpufleet.server.settings import ConfigError, load_settings
from gpufleet.server.store import AlertStore
from tests.agent.running import alertmanager_process, requires_alertmanager
from tests.server.engine_samples import MAX_HZ, T0, healthy, sample, snapshot_line
from tests.server.live_fakes import make_alert


def _pod_sample(node: str, pods: dict[int, tuple[str, str] | None], job: str = "j1"):
    gpus = [
        healthy(i, job=job, kubernetes_namespace=p[0] if p else None, kubernetes_pod=p[1] if p else None)
        for i, p in pods.items()
    ]
    return sample(node, T0, gpus)


def test_a_gpu_alert_carries_the_external_labels_and_its_gpus_pod():
    routing = AlertRouting({"cluster": "eu-1", "site": "ams"})
    routing.observe([_pod_sample("n0", {0: ("research", "llama-0"), 1: ("research", "llama-0")})])
    alert = routing.label(replace(make_alert(1), node="n0", gpu=1))
    assert alert.labels == {"cluster": "eu-1", "site": "ams", "namespace": "research", "pod": "llama-0"}
    assert alert.to_dict()["labels"] == alert.labels


def test_a_job_alert_names_the_namespace_its_pods_share_and_no_single_pod():
    routing = AlertRouting()
    routing.observe(
        [
            _pod_sample("n0", {0: ("research", "llama-0")}),
            _pod_sample("n1", {0: ("research", "llama-1")}),
            _pod_sample("n2", {0: ("other", "x-0")}, job="j2"),
        ]
    )
    job_alert = routing.label(replace(make_alert(1, kind=AlertKind.COMM_BOUND), node=None, gpu=None, hpc_job="j1"))
    assert job_alert.labels == {"namespace": "research"}
    node_alert = routing.label(replace(make_alert(2), node="n1", gpu=None, hpc_job="j1"))
    assert node_alert.labels == {"namespace": "research", "pod": "llama-1"}


def test_pods_of_two_namespaces_give_no_namespace_and_a_gpu_without_a_pod_gives_none():
    routing = AlertRouting()
    routing.observe([_pod_sample("n0", {0: ("a", "p-0"), 1: ("b", "p-1"), 2: None})])
    assert routing.label(replace(make_alert(1), node="n0", gpu=None, hpc_job="j1")).labels == {}
    assert routing.label(replace(make_alert(2), node="n0", gpu=2)).labels == {}


def test_an_alert_keeps_its_first_labels_until_it_resolves_even_when_the_pod_changes():
    routing = AlertRouting({"cluster": "eu-1"})
    routing.observe([_pod_sample("n0", {0: ("research", "llama-0")})])
    firing = routing.label(replace(make_alert(1), node="n0", gpu=0))
    routing.observe([_pod_sample("n0", {0: ("research", "llama-restarted")})])
    resolved = routing.label(replace(firing, labels={}, state=AlertState.RESOLVED, resolved=T0 + 60))
    assert resolved.labels == firing.labels == {"cluster": "eu-1", "namespace": "research", "pod": "llama-0"}
    # Resolved: forgotten; the next occurrence of the same subject takes the pod of its own time.
    again = routing.label(replace(make_alert(2), node="n0", gpu=0))
    assert again.labels["pod"] == "llama-restarted"
    routing.retain([])
    assert routing._given == {}


def test_external_labels_may_not_take_a_name_the_server_sets_or_an_invalid_one(tmp_path):
    for bad in ("severity=page", "namespace=x", "__meta=x", "9lives=x", "cluster="):
        with pytest.raises(ConfigError, match="alert.external-labels"):
            load_settings(["--alert.external-labels", bad], env={})
    config = tmp_path / "server.yaml"
    config.write_text("alert.external-labels: {cluster: eu-1, site: ams}\n")
    settings = load_settings(["--config.file", str(config)], env={})
    assert settings.alert_external_labels == {"cluster": "eu-1", "site": "ams"}


def test_the_runbook_template_is_checked_at_start_and_filled_per_alert():
    with pytest.raises(ConfigError, match="unknown placeholder {team}"):
        load_settings(["--alert.runbook-url", "https://wiki.example.com/{team}/{kind}"], env={})
    settings = load_settings(["--alert.runbook-url", "https://wiki.example.com/gpu/{alertname}?node={node}"], env={})
    routing = AlertRouting(runbook_url=settings.alert_runbook_url)
    alert = routing.label(replace(make_alert(1, kind=AlertKind.THERMAL_THROTTLE), node="n3", gpu=2))
    assert alert.runbook_url == "https://wiki.example.com/gpu/GpufleetThermalThrottle?node=n3"
    body = to_alertmanager(alert, now=T0, resend_interval_seconds=60, external_url="http://gpufleet:9472")
    assert body["annotations"]["runbook_url"] == alert.runbook_url
    assert body["annotations"]["description"] == description(alert)


def test_the_description_is_one_line_with_the_summary_the_subject_and_what_to_look_at():
    alert = replace(
        make_alert(1, kind=AlertKind.THERMAL_THROTTLE),
        node="dgx-02",
        gpu=5,
        uuid="GPU-abc",
        hpc_job="71001",
        summary="GPU 5 on dgx-02 at 89 °C",
        labels={"namespace": "ml", "pod": "w-3"},
        advice="Check the node's cooling.",
    )
    text = description(alert)
    assert "\n" not in text and text.startswith("GPU 5 on dgx-02 at 89 °C.")
    assert text.endswith("On node dgx-02, GPU 5 (GPU-abc), job 71001, pod ml/w-3. Check the node's cooling.")


def test_the_store_keeps_an_alerts_labels_and_opens_a_store_written_before_they_existed(tmp_path):
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript("""CREATE TABLE alerts (id TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, kind TEXT NOT NULL,
        severity TEXT NOT NULL, state TEXT NOT NULL, node TEXT, gpu INTEGER, uuid TEXT, hpc_job TEXT,
        pending_since REAL NOT NULL, started REAL, resolved REAL, updated REAL NOT NULL, summary TEXT NOT NULL,
        evidence BLOB NOT NULL);
        INSERT INTO alerts VALUES ('old', 'f', 'straggler', 'warning', 'firing', 'n0', 1, NULL, 'j1', 1.0, 2.0,
                                   NULL, 3.0, 's', '{}');""")
    db.commit()
    db.close()
    store = AlertStore(path)
    assert store.get("old").labels == {}
    labelled = replace(make_alert(7), labels={"cluster": "eu-1", "pod": "p"})
    store.upsert([labelled])
    assert store.get(labelled.id).labels == {"cluster": "eu-1", "pod": "p"}
    store.close()


class _Feed:
    """A puller that hands the runtime one time step of samples per cycle."""

    stale_after_seconds = 30.0

    def __init__(self, batches):
        self.batches = list(batches)

    async def pull_once(self) -> PullResult:
        batch = self.batches.pop(0) if self.batches else []
        return PullResult(
            samples=batch, started=0.0, duration_seconds=0.0, targets=2, failed_targets=0, rejected_snapshots=0
        )

    def health(self):
        return []

    async def aclose(self) -> None:
        pass


def _training_lines(seconds: float) -> list[list]:
    """Two nodes of job j1 in pods of namespace research; from 300 s GPU n1/3's power brake cuts its clocks
    while its peers wait. One batch of parsed samples per 5 s step."""
    batches = []
    for k in range(int(seconds / 5)):
        t = T0 + 5 * k
        batch = []
        for n in range(2):
            gpus = []
            for g in range(8):
                kw = {"kubernetes_namespace": "research", "kubernetes_pod": f"llama-worker-{n}"}
                if k * 5 >= 300:
                    kw.update(
                        {"sm_clock_hertz": 0.7 * MAX_HZ, "throttle_reasons": 0x88, "power_watts": 330.0}
                        if (n, g) == (1, 3)
                        else {"sm_active_ratio": 0.6, "power_watts": 410.0}
                    )
                gpus.append(healthy(g, **kw))
            batch.append(parse_line(snapshot_line(f"n{n}", t + 0.1 * n, gpus)))
        batches.append(batch)
    return batches


@requires_alertmanager
def test_external_labels_namespace_and_pod_reach_a_real_alertmanager(tmp_path):
    batches = _training_lines(600)
    with alertmanager_process(tmp_path) as (_, port, log_path):
        url = f"http://127.0.0.1:{port}"
        clock = iter(T0 + 5 * k + 5 for k in range(10_000))

        async def run() -> None:
            notifier = AlertmanagerNotifier(url, external_url="http://gpufleet.example:9472")
            runtime = Runtime(
                engine=Engine(EngineConfig(settle_seconds=4.0)),
                source=_Feed(batches),
                store=AlertStore(tmp_path / "a.db"),
                notifiers=[notifier],
                clock=lambda: next(clock),
                routing=AlertRouting({"cluster": "eu-1"}, "https://wiki.example.com/{kind}"),
            )
            try:
                for _ in batches:
                    await runtime.cycle()
                assert await notifier.step(), log_path.read_text(errors="replace")[-2000:]
            finally:
                await notifier.aclose()
                runtime.store.close()

        asyncio.run(run())
        held = httpx.get(f"{url}/api/v2/alerts", params={"active": "true"}, timeout=10).json()

    stragglers = [a for a in held if a["labels"]["alertname"] == "GpufleetStraggler"]
    assert stragglers, [a["labels"] for a in held]
    (culprit,) = stragglers
    assert culprit["labels"]["node"] == "n1" and culprit["labels"]["gpu"] == "3"
    assert culprit["labels"]["cluster"] == "eu-1"
    assert culprit["labels"]["namespace"] == "research" and culprit["labels"]["pod"] == "llama-worker-1"
    assert culprit["annotations"]["runbook_url"] == "https://wiki.example.com/straggler"
    assert "pod research/llama-worker-1" in culprit["annotations"]["description"]
    assert all(a["labels"]["cluster"] == "eu-1" for a in held)
