"""Which Kubernetes pod holds each GPU, from the kubelet's PodResources API; its job from agent.pod_jobs.

The kubelet answers List on its Unix socket with every running pod's devices by resource name; the NVIDIA
device plugin's ids are GPU UUIDs (MIG device UUIDs under a MIG strategy, indexes where told to). That
names the pod of an allocated GPU whether or not it runs a process, and needs neither hostPID nor
SYS_PTRACE. PodResources gives no labels: agent.pod_jobs reads them.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from gpufleet.agent.attribution import JobAttributor, Pod
from gpufleet.agent.pod_jobs import (
    DEFAULT_TIMEOUT_SECONDS,
    SERVICE_ACCOUNT,
    ApiServerPodLabels,
    LabelsUnavailable,
    PodLabels,
    job_from_labels,
    job_from_pod_name,
)

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
LABELS_RETRY_MAX_SECONDS = 600.0
# The device plugin's resources: whole GPUs (also shared by time-slicing, .shared), MIG devices by profile.
_GPU_RESOURCE = re.compile(r"^nvidia\.com/(gpu(\.shared)?|mig-[0-9a-z.+-]+)$")


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
    before, the labels source) when asked; between refreshes, from the cache. Failures go to `note`
    (counted, warned about); while the kubelet cannot be asked, nothing is placed. The labels source is
    asked again at most every `refresh_s`, and after a failure, or a list that lacks a held pod, at twice
    the last wait, up to LABELS_RETRY_MAX_SECONDS: a fleet's agents refused by the API server must not
    hammer it."""

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
        self._labels_wait_s = refresh_s
        self.serving = False

    def refresh_if_due(self) -> None:
        """Ask the kubelet again when `refresh_s` has passed since the last time."""
        now = self._monotonic()
        if now < self._next:
            return
        self._next = now + self._refresh_s
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
        held = set(pods)
        if self._labels is None or held <= self._known_labels.keys():
            return
        if now - self._labels_tried_at < self._labels_wait_s:
            return
        self._labels_tried_at = now
        try:
            self._known_labels = self._labels.list_labels()
        except LabelsUnavailable as exc:
            self._labels_wait_s = min(LABELS_RETRY_MAX_SECONDS, 2 * self._labels_wait_s)
            self._note("pod_labels", exc.cause, "cannot list the node's pods' labels; jobs from pod names", str(exc))
            return
        listed = held & self._known_labels.keys()
        self._labels_wait_s = (
            self._refresh_s if listed == held else min(LABELS_RETRY_MAX_SECONDS, 2 * self._labels_wait_s)
        )
        if not listed:
            self._note(
                "pod_labels",
                "pods_missing",
                "the API server lists none of the pods the kubelet names; is --node the Kubernetes node name?",
                f"{len(held)} pods held, {len(self._known_labels)} listed",
            )


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
    account: Path = SERVICE_ACCOUNT,
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
