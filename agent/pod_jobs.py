"""Which job a Kubernetes pod is part of: the label its operator puts on every pod of the job, listed from
the API server, else the pod's name less its controllers' suffixes."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Mapping, Protocol

import orjson

from gpufleet.pod_jobs import JOB_LABELS, job_from_labels, job_from_pod_name

__all__ = ["JOB_LABELS", "ApiServerPodLabels", "LabelsUnavailable", "PodLabels", "job_from_labels", "job_from_pod_name"]

DEFAULT_TIMEOUT_SECONDS = 2.0
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MAX_API_RESPONSE_BYTES = 32 << 20


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
        cls, node: str, environ: Mapping[str, str], account: Path = SERVICE_ACCOUNT
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
