"""PodResources attribution against a real gRPC server on a Unix socket answering as the kubelet does, and a
real HTTP server on loopback answering as the API server does: each GPU's pod, namespace and job; the job
from each owner's label, else the pod's name; /proc where the kubelet cannot be asked; failures bounded,
counted and survived; the kubelet asked on the sampler's schedule, cached between refreshes."""

from __future__ import annotations

import json
import re
import shutil
import ssl
import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import orjson
import pytest

from gpufleet.agent import kubelet_podresources_v1_pb2 as api
from gpufleet.agent import kubelet_podresources_v1_pb2_grpc as api_grpc
from gpufleet.agent.attribution import BackgroundAttributor, JobAttributor
from gpufleet.agent.cli import main
from gpufleet.agent.pod_jobs import JOB_LABELS, ApiServerPodLabels
from gpufleet.agent.podresources import (
    KubeletAttributor,
    PodResourcesAttribution,
    PodResourcesClient,
    kubelet_attributor,
)
from gpufleet.agent.sampler import Sampler
from gpufleet.agent.store import SnapshotStore
from tests.agent.fakes import FakeClock, StubReader
from tests.tlsfiles import make_pki, needs_openssl

UUID = [f"GPU-{i:08x}-1111-2222-3333-444455556666" for i in range(4)]
# Bounds the calls to a server that never answers; the kubelet answers in milliseconds.
TIMEOUT_S = 0.3


def container(name: str, *devices: tuple[str, list[str]]) -> api.ContainerResources:
    return api.ContainerResources(
        name=name, devices=[api.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in devices]
    )


# Four GPUs: two held by a PyTorchJob's worker, one by a JobSet's pod (as a shared GPU's replica id), one free.
PODS = [
    api.PodResources(
        name="llama-worker-1",
        namespace="research",
        containers=[
            container("pytorch", ("nvidia.com/gpu", [UUID[0], UUID[1]]), ("example.com/nic", ["mlx5_0"])),
            container("sidecar"),
        ],
    ),
    api.PodResources(
        name="sweep-trainers-0-0-bq7zz",
        namespace="tuning",
        containers=[container("trainer", ("nvidia.com/gpu.shared", [f"{UUID[2]}::3"]))],
    ),
    api.PodResources(name="coredns-5d78c9869d-x2k4q", namespace="kube-system", containers=[container("coredns")]),
]
LABELS = {
    ("research", "llama-worker-1"): {
        "training.kubeflow.org/job-name": "llama",
        "training.kubeflow.org/replica-index": "1",
    },
    ("tuning", "sweep-trainers-0-0-bq7zz"): {
        "jobset.sigs.k8s.io/jobset-name": "sweep",
        "batch.kubernetes.io/job-name": "sweep-trainers-0",
    },
}


class Kubelet(api_grpc.PodResourcesListerServicer):
    """Answers List as the kubelet does; can be told to fail with a status, or to hang until released."""

    def __init__(self) -> None:
        self.pods = list(PODS)
        self.calls = 0
        self.fail: grpc.StatusCode | None = None
        self.hang = threading.Event()
        self.release = threading.Event()

    def List(self, request, context):  # noqa: N802 - the service's method name
        self.calls += 1
        if self.fail is not None:
            context.abort(self.fail, "kubelet says no")
        if self.hang.is_set():
            self.release.wait()
        return api.ListPodResourcesResponse(pod_resources=self.pods)


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # Not tmp_path: a Unix socket's path must fit in 108 bytes.
    folder = Path(tempfile.mkdtemp(prefix="kubelet-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def kubelet(socket_dir: Path) -> Iterator[tuple[Kubelet, str]]:
    servicer = Kubelet()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    api_grpc.add_PodResourcesListerServicer_to_server(servicer, server)
    path = str(socket_dir / "kubelet.sock")
    server.add_insecure_port(f"unix://{path}")
    server.start()
    yield servicer, path
    servicer.release.set()
    server.stop(None)


class ApiServer(BaseHTTPRequestHandler):
    """GET /api/v1/pods as the API server answers it, metadata only; `status` other than 200 refuses."""

    labels: dict[tuple[str, str], dict[str, str]] = {}
    status = 200
    seen: list[tuple[str, str | None, str | None]] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).seen.append((self.path, self.headers.get("Authorization"), self.headers.get("Accept")))
        if self.status != 200:
            self.send_error(self.status)
            return
        items = [
            {"metadata": {"namespace": ns, "name": name, "labels": lab}} for (ns, name), lab in self.labels.items()
        ]
        body = json.dumps({"kind": "PartialObjectMetadataList", "apiVersion": "meta.k8s.io/v1", "items": items})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def api_server(tmp_path: Path) -> Iterator[tuple[type[ApiServer], ApiServerPodLabels]]:
    handler = type("Handler", (ApiServer,), {"labels": dict(LABELS), "status": 200, "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    token = tmp_path / "token"
    token.write_text("sekrit\n")
    labels = ApiServerPodLabels(f"http://127.0.0.1:{server.server_port}", "gpu-07", token, timeout_s=TIMEOUT_S)
    yield handler, labels
    server.shutdown()
    server.server_close()


def procfs(tmp_path: Path, jobs: dict[int, str]) -> Path:
    """A procfs whose processes name their job with GPUFLEET_JOB."""
    root = tmp_path / "proc"
    for pid, job in jobs.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "environ").write_bytes(f"HOME=/root\0GPUFLEET_JOB={job}\0".encode())
    return root


def attributor(socket: str, tmp_path: Path, clock: FakeClock, labels=None, proc_jobs=None, refresh_s=5.0):
    fallback = JobAttributor(procfs(tmp_path, proc_jobs or {}))
    kubelet = PodResourcesAttribution(
        PodResourcesClient(socket, timeout_s=TIMEOUT_S),
        labels,
        note=lambda what, code, message, detail: fallback.note(what, code, message, error=detail),
        refresh_s=refresh_s,
        monotonic=clock.monotonic,
    )
    return KubeletAttributor(kubelet, fallback)


def answers(attr, pids: dict[int, tuple[int, ...]] | None = None) -> list[tuple[str | None, str | None, str | None]]:
    """(job, namespace, pod) of each of the four GPUs, asked as the sampler asks."""
    out = []
    for index, uuid in enumerate(UUID):
        ids = (pids or {}).get(index, ())
        job = attr.job_for(index, uuid, ids)
        pod = attr.pod_for(ids)
        out.append((job, pod.namespace if pod else None, pod.name if pod else None))
    attr.end_cycle()
    return out


def test_each_gpu_is_named_by_the_pod_holding_it_and_its_job_by_the_pods_labels(kubelet, api_server, tmp_path):
    (_, socket), (handler, labels) = kubelet, api_server
    attr = attributor(socket, tmp_path, FakeClock(), labels=labels)
    assert answers(attr) == [
        ("research/llama", "research", "llama-worker-1"),
        ("research/llama", "research", "llama-worker-1"),
        ("tuning/sweep", "tuning", "sweep-trainers-0-0-bq7zz"),  # the JobSet, not its child Job
        (None, None, None),
    ]
    assert attr.serving and not attr.errors
    ((path, auth, accept),) = handler.seen
    assert path == "/api/v1/pods?fieldSelector=spec.nodeName%3Dgpu-07" and auth == "Bearer sekrit"
    assert accept.startswith("application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1")


def test_every_owner_label_is_read_through_the_kubelet_and_the_api_server(kubelet, api_server, tmp_path):
    (servicer, socket), (handler, labels) = kubelet, api_server
    servicer.pods = [
        api.PodResources(name=f"p{i}", namespace="ns", containers=[container("c", ("nvidia.com/gpu", [UUID[i]]))])
        for i in range(4)
    ]
    owners = [label for label, _ in JOB_LABELS if label != "leaderworkerset.sigs.k8s.io/name"][:4]
    handler.labels = {("ns", f"p{i}"): {label: f"job{i}"} for i, label in enumerate(owners)}
    attr = attributor(socket, tmp_path, FakeClock(), labels=labels)
    assert [job for job, _, _ in answers(attr)] == [f"ns/job{i}" for i in range(4)]


def test_without_a_labels_source_the_processes_job_wins_over_the_pods_name(kubelet, tmp_path):
    _, socket = kubelet
    attr = attributor(socket, tmp_path, FakeClock(), proc_jobs={4001: "research/llama-70b"})
    assert answers(attr, {0: (4001,)})[:3] == [
        ("research/llama-70b", "research", "llama-worker-1"),
        ("research/llama", "research", "llama-worker-1"),
        ("tuning/sweep-trainers", "tuning", "sweep-trainers-0-0-bq7zz"),
    ]


def test_a_pod_whose_labels_name_no_job_is_not_given_one_by_its_name(kubelet, api_server, tmp_path):
    (_, socket), (handler, labels) = kubelet, api_server
    handler.labels = {("research", "llama-worker-1"): {"app": "notebook"}}
    attr = attributor(socket, tmp_path, FakeClock(), labels=labels)
    assert answers(attr)[0] == (None, "research", "llama-worker-1")


def test_an_api_server_refusing_is_counted_and_jobs_come_from_pod_names(kubelet, api_server, tmp_path):
    (_, socket), (handler, labels) = kubelet, api_server
    handler.status = 403
    clock = FakeClock()
    attr = attributor(socket, tmp_path, clock, labels=labels)
    assert answers(attr)[0] == ("research/llama", "research", "llama-worker-1")
    assert attr.errors == {"pod_labels:http_403": 1}
    # Asked again after twice the refresh interval, then four times (at 10 s and 30 s), ...: not every refresh.
    for _ in range(6):
        clock.advance(5.0)
        answers(attr)
    assert len(handler.seen) == 3 and attr.errors == {"pod_labels:http_403": 3}
    handler.status = 200
    clock.advance(40.0)
    assert answers(attr)[0] == ("research/llama", "research", "llama-worker-1") and len(handler.seen) == 4


def test_an_api_server_that_lists_none_of_the_held_pods_is_reported_and_asked_less_often(kubelet, api_server, tmp_path):
    """As when --node is not the Kubernetes node name: the field selector matches no pod."""
    (_, socket), (handler, labels) = kubelet, api_server
    handler.labels = {}
    clock = FakeClock()
    attr = attributor(socket, tmp_path, clock, labels=labels)
    assert answers(attr)[0] == ("research/llama", "research", "llama-worker-1")
    assert attr.errors == {"pod_labels:pods_missing": 1}
    clock.advance(5.0)
    answers(attr)
    assert len(handler.seen) == 1


def test_a_missing_socket_leaves_attribution_to_proc_uncounted(socket_dir, tmp_path):
    attr = attributor(str(socket_dir / "kubelet.sock"), tmp_path, FakeClock(), proc_jobs={4001: "71003"})
    assert answers(attr, {1: (4001,)}) == [(None, None, None), ("71003", None, None), (None, None, None)] + [
        (None, None, None)
    ]
    assert not attr.serving and not attr.errors


@pytest.mark.parametrize("status", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL])
def test_a_kubelet_erroring_is_counted_and_proc_answers(kubelet, tmp_path, status):
    servicer, socket = kubelet
    servicer.fail = status
    attr = attributor(socket, tmp_path, FakeClock(), proc_jobs={4001: "71003"})
    assert answers(attr, {0: (4001,)})[0] == ("71003", None, None)
    assert attr.errors == {f"podresources:{status.name.lower()}": 1} and not attr.serving


def test_a_kubelet_that_hangs_is_given_up_on_at_the_timeout_counted_and_proc_answers(kubelet, tmp_path):
    servicer, socket = kubelet
    servicer.hang.set()
    clock = FakeClock()
    attr = attributor(socket, tmp_path, clock, proc_jobs={4001: "71003"})
    assert answers(attr, {0: (4001,)})[0] == ("71003", None, None)
    assert attr.errors == {"podresources:deadline_exceeded": 1}
    servicer.hang.clear()
    servicer.release.set()
    clock.advance(5.0)
    assert answers(attr, {0: (4001,)})[0] == ("71003", "research", "llama-worker-1")


def test_the_kubelet_is_asked_once_per_refresh_interval_and_a_new_pod_is_seen_at_the_next(kubelet, tmp_path):
    servicer, socket = kubelet
    clock = FakeClock()
    attr = attributor(socket, tmp_path, clock, refresh_s=5.0)
    for _ in range(5):
        assert answers(attr)[3] == (None, None, None)
        clock.advance(1.0)
    assert servicer.calls == 1
    servicer.pods = PODS + [
        api.PodResources(
            name="eval-0", namespace="research", containers=[container("c", ("nvidia.com/gpu", [UUID[3]]))]
        )
    ]
    assert answers(attr)[3] == ("research/eval", "research", "eval-0")
    assert servicer.calls == 2


def test_the_sampler_asks_on_its_schedule_and_scrapes_never_do(kubelet, tmp_path):
    servicer, socket = kubelet
    clock = FakeClock()
    store = SnapshotStore()
    attr = attributor(socket, tmp_path, clock, refresh_s=5.0)
    background = BackgroundAttributor(attr, start=False)
    reader = StubReader(gpus=4)
    sampler = Sampler(reader, store, node="gpu-07", clock=clock.time, monotonic=clock.monotonic, attributor=background)
    for _ in range(10):
        sampler.run_once()
        background.resolve_pending()
        for _ in range(3):
            store.latest().metrics  # noqa: B018 - a scrape
        clock.advance(1.0)
    assert servicer.calls == 2
    snap = sampler.run_once()
    # No process on the GPUs: a GPU held by a pod keeps its pod all the same.
    assert [(g.hpc_job, g.kubernetes_namespace, g.kubernetes_pod) for g in snap.gpus][:2] == [
        ("research/llama", "research", "llama-worker-1")
    ] * 2
    metrics = store.latest().metrics
    assert b'gpufleet_gpu_pod_info{gpu="0",namespace="research",node="gpu-07",pod="llama-worker-1",' in metrics
    assert b'gpufleet_gpu_job_info{gpu="0",hpc_job="research/llama",node="gpu-07",' in metrics


@pytest.mark.parametrize(
    ("resource", "device_id"),
    [
        ("nvidia.com/gpu", "0"),  # DEVICE_ID_STRATEGY=index
        ("nvidia.com/mig-1g.10gb", f"MIG-{UUID[0]}/7/0"),  # a MIG device named after its GPU
    ],
)
def test_gpus_named_by_index_or_by_their_mig_devices_are_placed(kubelet, tmp_path, resource, device_id):
    servicer, socket = kubelet
    servicer.pods = [
        api.PodResources(name="infer-0", namespace="serving", containers=[container("c", (resource, [device_id]))])
    ]
    attr = attributor(socket, tmp_path, FakeClock())
    assert answers(attr)[0] == ("serving/infer", "serving", "infer-0")


@needs_openssl
def test_in_cluster_the_labels_come_over_tls_with_the_service_accounts_token(kubelet, api_server, tmp_path):
    """As client-go's in-cluster config: KUBERNETES_SERVICE_HOST/PORT, the account's token and CA."""
    (_, socket), (handler, _) = kubelet, api_server
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    account = tmp_path / "serviceaccount"
    account.mkdir()
    environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(server.server_port)}
    try:
        assert ApiServerPodLabels.in_cluster("gpu-07", environ, account) is None  # no token, no CA: not in a pod
        (account / "token").write_text("projected")
        shutil.copy(pki.ca_cert, account / "ca.crt")
        assert ApiServerPodLabels.in_cluster("gpu-07", {}, account) is None
        attr = kubelet_attributor(
            socket,
            JobAttributor(tmp_path),
            node="gpu-07",
            pod_labels="api-server",
            refresh_s=5.0,
            environ=environ,
            account=account,
        )
        assert answers(attr)[2] == ("tuning/sweep", "tuning", "sweep-trainers-0-0-bq7zz")
        assert handler.seen[-1][1] == "Bearer projected" and not attr.errors
        attr.close()
    finally:
        server.shutdown()
        server.server_close()


def test_the_agents_builder_reads_labels_from_pod_names_when_told(kubelet, tmp_path):
    _, socket = kubelet
    attr = kubelet_attributor(
        socket,
        JobAttributor(tmp_path),
        node="gpu-07",
        pod_labels="pod-name",
        refresh_s=5.0,
        environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"},
        account=tmp_path,
    )
    try:
        assert answers(attr)[0] == ("research/llama", "research", "llama-worker-1")
    finally:
        attr.close()


@pytest.mark.usefixtures("restore_logging")
def test_the_agent_names_the_pod_the_kubelet_says_holds_a_simulated_gpu(kubelet, capsys):
    """gpufleet-agent --once on the simulator, told the socket: the held GPU is the pod's, the others are
    left to /proc (the simulator's Slurm job), and each GPU keeps the job its processes name."""
    servicer, socket = kubelet
    assert main(["--once", "--log.level", "error", "--simulate", "hgx-h100"]) == 0
    plain = orjson.loads(capsys.readouterr().out)
    uuid = plain["gpus"][0]["uuid"]
    servicer.pods = [
        api.PodResources(
            name="llama-worker-0", namespace="research", containers=[container("c", ("nvidia.com/gpu", [uuid]))]
        )
    ]
    args = [
        "--simulate",
        "hgx-h100",
        "--kubernetes.pod-resources-socket",
        socket,
        "--kubernetes.pod-labels",
        "pod-name",
    ]
    assert main(["--once", "--log.level", "error", *args]) == 0
    doc = orjson.loads(capsys.readouterr().out)
    placed = [(g["hpc_job"], g["kubernetes_namespace"], g["kubernetes_pod"]) for g in doc["gpus"]]
    assert placed[0] == (plain["gpus"][0]["hpc_job"], "research", "llama-worker-0")
    assert placed[1:] == [(g["hpc_job"], None, None) for g in plain["gpus"][1:]]
    assert servicer.calls == 1  # --once samples twice, within one refresh interval


def test_the_committed_modules_are_generated_from_the_committed_protocol_definition():
    """`make podresources-stubs` was run after the last change to the .proto: every message's fields and
    the service's methods, with their names and numbers, are the same in both."""
    text = (Path(api.__file__).parent / "kubelet_podresources_v1.proto").read_text()
    text = re.sub(r"//[^\n]*", "", text)
    messages = {
        name: {(field, int(number)) for field, number in re.findall(r"(\w+)\s*=\s*(\d+)\s*;", body)}
        for name, body in re.findall(r"message\s+(\w+)\s*\{([^}]*)\}", text)
    }
    generated = {
        name: {(f.name, f.number) for f in message.fields}
        for name, message in api.DESCRIPTOR.message_types_by_name.items()
    }
    assert generated == messages and api.DESCRIPTOR.package == "v1"
    (service,) = api.DESCRIPTOR.services_by_name.values()
    methods = re.findall(r"rpc\s+(\w+)\((\w+)\)\s+returns\s+\((\w+)\)", text)
    assert service.full_name == "v1.PodResourcesLister"
    assert [(m.name, m.input_type.name, m.output_type.name) for m in service.methods] == methods
