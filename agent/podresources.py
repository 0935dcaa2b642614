"""Which Kubernetes pod holds each GPU, from the kubelet's PodResources API, and which job its pod is part of.

The kubelet answers List on its Unix socket with every running pod's devices by resource name; the NVIDIA
device plugin's ids are GPU UUIDs (MIG device UUIDs under a MIG strategy, indexes where told to). That
names the pod of an allocated GPU whether or not it runs a process, and needs neither hostPID nor
SYS_PTRACE. PodResources gives no labels: a pod's job comes from the labels its operator puts on every pod
of the job, listed from the API server (one LIST of the node's pods, metadata only), and failing that
from its name with the controllers' suffixes taken off.
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol

import orjson

from gpufleet.agent.attribution import JobAttributor, Pod

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEFAULT_TIMEOUT_SECONDS = 2.0
# The device plugin's resources: whole GPUs (also shared by time-slicing, .shared), MIG devices by profile.
_GPU_RESOURCE = re.compile(r"^nvidia\.com/(gpu(\.shared)?|mig-[0-9a-z.+-]+)$")
# A pod's labels that name its job, most specific first: a JobSet's child Jobs put batch.kubernetes.io/job-name
# on its pods too, and the JobSet is the job. (label, what sets it)
JOB_LABELS: tuple[tuple[str, str], ...] = (
    ("jobset.sigs.k8s.io/jobset-name", "JobSet; Kubeflow Trainer's TrainJob runs as one"),
    ("training.kubeflow.org/job-name", "Kubeflow training operator: PyTorchJob, MPIJob v2, TFJob, JAXJob"),
    ("mpi-job-name", "MPI operator v1"),
    ("leaderworkerset.sigs.k8s.io/name", "LeaderWorkerSet: one job per group, NAME-GROUP"),
    ("volcano.sh/job-name", "Volcano Job"),
    ("batch.kubernetes.io/job-name", "Kubernetes Job"),
    ("job-name", "Kubernetes Job, before 1.27"),
)
_LWS_GROUP = "leaderworkerset.sigs.k8s.io/group-index"
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
# The suffixes controllers put after a job's name: a Job's pod's five random characters (the alphabet
# Kubernetes' name generator draws from), indexes (StatefulSet, Indexed Job, operators' replicas) and the
# training operators' replica types.
_RANDOM_SUFFIX = re.compile(r"-[bcdfghjklmnpqrstvwxz2456789]{5}$")
_INDEX_SUFFIX = re.compile(r"-[0-9]+$")
_ROLE_SUFFIX = re.compile(r"-(master|worker|launcher|chief|ps|evaluator|leader|driver)$")
_SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MAX_API_RESPONSE_BYTES = 32 << 20


@dataclass(frozen=True, slots=True)
class Holder:
    """The container a device is allocated to."""

    namespace: str
    pod: str
    container: str


def gpu_holders(response: Any) -> dict[str, Holder]:
    """Device id -> holder, for the GPU devices of a ListPodResourcesResponse (a shared GPU's replica ids,
    UUID::N, under the GPU's id; the first holder listed wins)."""
    out: dict[str, Holder] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if not _GPU_RESOURCE.match(devices.resource_name):
                    continue
                for device_id in devices.device_ids:
                    out.setdefault(device_id.split("::", 1)[0], Holder(pod.namespace, pod.name, container.name))
    return out


def holder_of(holders: Mapping[str, Holder], index: int, uuid: str) -> Holder | None:
    """The holder of GPU `index` (`uuid`): by its UUID, its index (a plugin told DEVICE_ID_STRATEGY=index),
    or its MIG devices named after it (MIG-GPU-UUID/GI/CI), the holder of most of them."""
    found = holders.get(uuid) or holders.get(str(index))
    if found is not None:
        return found
    prefix = f"MIG-{uuid}/"
    mig = [h for device_id, h in holders.items() if device_id.startswith(prefix)]
    return max(mig, key=lambda h: (mig.count(h), h.namespace, h.pod)) if mig else None


def job_from_labels(namespace: str, labels: Mapping[str, str]) -> str | None:
    """NAMESPACE/NAME of the job the first of JOB_LABELS names; None when none is set to a valid name."""
    for label, _ in JOB_LABELS:
        name = labels.get(label, "")
        if not _LABEL_VALUE.match(name):
            continue
        if label == "leaderworkerset.sigs.k8s.io/name":
            group = labels.get(_LWS_GROUP, "")
            if not group.isdigit():
                continue
            name = f"{name}-{group}"
        return f"{namespace}/{name}"
    return None


def job_from_pod_name(namespace: str, pod: str) -> str:
    """NAMESPACE/NAME, the pod's name less its controllers' suffixes: llama-worker-3 and llama-master-0
    (PyTorchJob) -> llama, train-2-x7k2p (Indexed Job) -> train, ckpt-0 (StatefulSet) -> ckpt."""
    name = _RANDOM_SUFFIX.sub("", pod)
    while True:
        stripped = _ROLE_SUFFIX.sub("", _INDEX_SUFFIX.sub("", name))
        if stripped == name or not stripped:
            break
        name = stripped
    return f"{namespace}/{name}"


class PodResourcesClient:
    """The kubelet's PodResourcesLister over its Unix socket; each call bounded by `timeout_s`."""

    def __init__(self, socket_path: str, timeout_s: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        self.socket_path = socket_path
        self._timeout_s = timeout_s
        self._channel: Any = None
        self._stub: Any = None

    def available(self) -> bool:
        """True when the socket is there (the kubelet's, or the DaemonSet mounts its folder)."""
        try:
            return stat.S_ISSOCK(os.stat(self.socket_path).st_mode)
        except OSError:
            return False

    def list_holders(self) -> dict[str, Holder]:
        """One List call; raises grpc.RpcError (the channel is rebuilt on the next call after one)."""
        import grpc

        from gpufleet.agent import kubelet_podresources_v1_pb2 as api
        from gpufleet.agent import kubelet_podresources_v1_pb2_grpc as api_grpc

        if self._stub is None:
            # Rebuilt after a failure rather than left to gRPC's reconnect backoff, which grows past the
            # refresh interval while a kubelet restarts.
            self._channel = grpc.insecure_channel(f"unix://{os.path.abspath(self.socket_path)}")
            self._stub = api_grpc.PodResourcesListerStub(self._channel)
        try:
            return gpu_holders(self._stub.List(api.ListPodResourcesRequest(), timeout=self._timeout_s))
        except grpc.RpcError:
            self.close()
            raise

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = None


class PodLabels(Protocol):
    """Labels of the node's pods, (namespace, name) -> labels; raises LabelsUnavailable."""

    def list_labels(self) -> dict[tuple[str, str], Mapping[str, str]]: ...


class LabelsUnavailable(Exception):
    """The labels could not be listed; `cause` is short and stable (http_403, timeout, ...)."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause


class ApiServerPodLabels:
    """The node's pods' labels from the API server: GET /api/v1/pods?fieldSelector=spec.nodeName=NODE, as
    metadata only (PartialObjectMetadataList). Needs a ClusterRole allowing `list` on `pods`."""

    def __init__(
        self,
        base_url: str,
        node: str,
        token_file: Path,
        *,
        context: ssl.SSLContext | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_SECONDS,
    ) -> None:
        query = urllib.parse.urlencode({"fieldSelector": f"spec.nodeName={node}"})
        self.url = f"{base_url.rstrip('/')}/api/v1/pods?{query}"
        self._token_file = token_file
        self._context = context
        self._timeout_s = timeout_s

    @classmethod
    def in_cluster(
        cls, node: str, environ: Mapping[str, str], account: Path = _SERVICE_ACCOUNT
    ) -> ApiServerPodLabels | None:
        """From the pod's service account and KUBERNETES_SERVICE_HOST/PORT, as client-go's in-cluster config
        reads them; None outside a pod."""
        host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
        token, ca = account / "token", account / "ca.crt"
        if not host or not port or not token.is_file() or not ca.is_file():
            return None
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", node, token, context=ssl.create_default_context(cafile=str(ca)))

    def list_labels(self) -> dict[tuple[str, str], Mapping[str, str]]:
        try:
            # Read each time: the kubelet rotates a projected token every hour.
            token = self._token_file.read_text().strip()
        except OSError as exc:
            raise LabelsUnavailable("token", f"cannot read the service account token: {exc.strerror}") from None
        request = urllib.request.Request(
            self.url,
            headers={
                "Authorization": f"Bearer {token}",
                "Accept": "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s, context=self._context) as response:
                body = response.read(MAX_API_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as exc:
            raise LabelsUnavailable(f"http_{exc.code}", f"the API server answered {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            cause = "timeout" if isinstance(reason, TimeoutError) else type(reason).__name__
            raise LabelsUnavailable(cause, f"cannot reach the API server: {reason}") from None
        if len(body) > MAX_API_RESPONSE_BYTES:
            raise LabelsUnavailable("too_large", f"pod list over {MAX_API_RESPONSE_BYTES} bytes")
        return _pod_labels(body)


def _pod_labels(body: bytes) -> dict[tuple[str, str], Mapping[str, str]]:
    try:
        items = orjson.loads(body).get("items") or []
    except (orjson.JSONDecodeError, AttributeError):
        raise LabelsUnavailable("malformed", "the pod list is not a JSON object") from None
    out: dict[tuple[str, str], Mapping[str, str]] = {}
    for item in items if isinstance(items, list) else ():
        meta = item.get("metadata") if isinstance(item, dict) else None
        if not isinstance(meta, dict):
            continue
        labels = meta.get("labels") or {}
        if isinstance(labels, dict):
            out[(str(meta.get("namespace", "")), str(meta.get("name", "")))] = {
                str(k): str(v) for k, v in labels.items()
            }
    return out


@dataclass(frozen=True, slots=True)
class Placement:
    """The pod holding a GPU, and its job."""

    namespace: str
    pod: str
    container: str
    job: str | None
    # False when the labels source could not be asked (or has no entry for the pod yet): job is then None
    # for want of labels, not because the pod belongs to no job.
    labels_known: bool


class PodResourcesAttribution:
    """GPU -> pod and job, refreshed at most every `refresh_s` from the kubelet (and, for pods not seen
    before, the labels source) when asked; between refreshes, from the cache. Failures are counted in
    `errors` and warned about through `note`; while the kubelet cannot be asked, nothing is placed."""

    def __init__(
        self,
        client: PodResourcesClient,
        labels: PodLabels | None,
        *,
        note: Callable[[str, str, str, str], None],
        refresh_s: float = 5.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._labels = labels
        self._note = note
        self._refresh_s = refresh_s
        self._monotonic = monotonic
        self._next = float("-inf")
        self._holders: dict[str, Holder] = {}
        self._known_labels: dict[tuple[str, str], Mapping[str, str]] = {}
        self._labels_tried_at = float("-inf")
        self.serving = False
        self.refreshes = 0

    def refresh_if_due(self) -> None:
        """Ask the kubelet again when `refresh_s` has passed since the last time."""
        now = self._monotonic()
        if now < self._next:
            return
        self._next = now + self._refresh_s
        self.refreshes += 1
        was_serving, self.serving, self._holders = self.serving, False, {}
        if self._client.available():
            try:
                self._holders = self._client.list_holders()
                self.serving = True
            except Exception as exc:  # grpc.RpcError, or anything a broken answer raises
                code = getattr(exc, "code", None)
                cause = code().name.lower() if callable(code) else type(exc).__name__
                self._note("podresources", cause, "the kubelet's PodResources API failed; using /proc", repr(exc))
        if self.serving != was_serving:
            log.info(
                "GPUs attributed to pods by the kubelet" if self.serving else "GPUs attributed through /proc",
                extra={"socket": self._client.socket_path},
            )
        if self.serving:
            self._refresh_labels(now, {(h.namespace, h.pod) for h in self._holders.values()})

    def placement(self, index: int, uuid: str) -> Placement | None:
        """The pod holding GPU `index`, as of the last refresh; None when none does or the kubelet is not asked."""
        holder = holder_of(self._holders, index, uuid)
        if holder is None:
            return None
        labels = self._known_labels.get((holder.namespace, holder.pod))
        job = job_from_labels(holder.namespace, labels) if labels is not None else None
        return Placement(holder.namespace, holder.pod, holder.container, job, labels is not None)

    def close(self) -> None:
        self._client.close()

    def _refresh_labels(self, now: float, pods: Iterable[tuple[str, str]]) -> None:
        """List the node's pods' labels when a pod without them appears, at most once a refresh interval."""
        missing = [p for p in pods if p not in self._known_labels]
        if self._labels is None or not missing or now - self._labels_tried_at < self._refresh_s:
            return
        self._labels_tried_at = now
        try:
            self._known_labels = self._labels.list_labels()
        except LabelsUnavailable as exc:
            self._note("pod_labels", exc.cause, "cannot list the node's pods' labels; jobs from pod names", str(exc))


class KubeletAttributor:
    """Job attribution with the kubelet first: a GPU a pod holds is that pod's, its job named by the pod's
    labels, else by its processes as /proc tells (where the agent can see them), else by the pod's name;
    a GPU no pod holds, or every GPU while the kubelet cannot be asked, is left to `fallback` (/proc)."""

    uses_mapping_dir = False

    def __init__(self, kubelet: PodResourcesAttribution, fallback: JobAttributor, *, pod_names: bool = True) -> None:
        self._kubelet = kubelet
        self._fallback = fallback
        self._pod_names = pod_names
        self._placed: Pod | None = None
        self.by_allocation = False

    @property
    def errors(self) -> Mapping[str, int]:
        """The fallback's counts, the kubelet's and the labels source's failures among them."""
        return self._fallback.errors

    @property
    def serving(self) -> bool:
        """True while the kubelet answered at its last refresh."""
        return self._kubelet.serving

    def job_for(self, index: int, uuid: str, pids: Iterable[int]) -> str | None:
        """The job of GPU `index`; the kubelet is asked first when its refresh interval has passed."""
        self._kubelet.refresh_if_due()
        placement = self._kubelet.placement(index, uuid)
        self.by_allocation = placement is not None
        if placement is None:
            self._placed = None
            return self._fallback.job_for(index, uuid, pids)
        self._placed = Pod(placement.namespace, placement.pod)
        job = placement.job
        if job is None:
            pids = tuple(pids)
            job = self._fallback.job_for(index, uuid, pids) if pids else None
        if job is None and self._pod_names and not placement.labels_known:
            job = job_from_pod_name(placement.namespace, placement.pod)
        return job

    def pod_for(self, pids: Iterable[int]) -> Pod | None:
        """The pod of the GPU just asked about with job_for (the sampler asks both in turn)."""
        return self._placed if self.by_allocation else self._fallback.pod_for(pids)

    def end_cycle(self) -> None:
        self._fallback.end_cycle()

    def note(self, what: str, code: str, message: str, **context: object) -> None:
        self._fallback.note(what, code, message, **context)

    def close(self) -> None:
        self._kubelet.close()


def kubelet_attributor(
    socket_path: str,
    fallback: JobAttributor,
    *,
    node: str,
    pod_labels: str,
    refresh_s: float,
    environ: Mapping[str, str],
    account: Path = _SERVICE_ACCOUNT,
) -> KubeletAttributor:
    """The kubelet first, `fallback` after; labels from the API server when `pod_labels` is api-server and
    the agent runs in a pod with a service account, else from pod names."""
    labels = ApiServerPodLabels.in_cluster(node, environ, account) if pod_labels == "api-server" else None
    kubelet = PodResourcesAttribution(
        PodResourcesClient(socket_path),
        labels,
        note=lambda what, code, message, detail: fallback.note(what, code, message, error=detail),
        refresh_s=refresh_s,
    )
    return KubeletAttributor(kubelet, fallback)
