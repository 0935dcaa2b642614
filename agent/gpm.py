"""GPM SM activity and occupancy for one GPU, from two samples taken one poll apart.

Utilization says whether any kernel ran; GPM says how many SMs were busy, which is what exposes a GPU
waiting in a collective. nvmlGpmMetricsGet averages between two samples, so each poll takes one sample
and compares it with the previous poll's, alternating between two buffers allocated once (no per-poll
allocation, and the metric covers exactly the sampling interval).
"""

from __future__ import annotations

from typing import Any

import pynvml

from gpufleet.agent.nvml_errors import SUCCESS
from gpufleet.agent.readings import READINGS, GpmMetric

# (reading, pynvml metric id name) of the reading table's GPM rows.
GPM_METRICS = tuple((r.name, r.source.metric_id) for r in READINGS if isinstance(r.source, GpmMetric))
GPM_READINGS = tuple(reading for reading, _ in GPM_METRICS)

# Straight to the ctypes descriptors: pynvml's printable structures run Python in __getattribute__ and
# __setattr__ for every member, more than the rest of a poll's handling of each metric.
_REQUEST = pynvml.c_nvmlGpmMetricsGet_t
_SET_SAMPLE1 = _REQUEST.sample1.__set__
_SET_SAMPLE2 = _REQUEST.sample2.__set__
_GET_METRICS = _REQUEST.metrics.__get__
_GET_RETURN = pynvml.c_nvmlGpmMetric_t.nvmlReturn.__get__
_GET_VALUE = pynvml.c_nvmlGpmMetric_t.value.__get__


class GpmSampler:
    """Two reused GPM sample buffers and one reused metrics request for one GPU."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml = nvml
        self._handle = handle
        self._buffers: list[Any] = []
        try:
            for _ in range(2):
                self._buffers.append(nvml.nvmlGpmSampleAlloc())
        except Exception:
            self.free()
            raise
        self._current = 0
        self._have_previous = False
        self._wanted = [(reading, getattr(nvml, name)) for reading, name in GPM_METRICS]
        self._request = pynvml.c_nvmlGpmMetricsGet_t()
        self._prepare()

    def _prepare(self) -> None:
        """Fill the reused request with the metric ids still wanted."""
        self._request.version = self._nvml.NVML_GPM_METRICS_GET_VERSION
        self._request.numMetrics = len(self._wanted)
        for i, (_, metric_id) in enumerate(self._wanted):
            self._request.metrics[i].metricId = metric_id

    def drop(self, readings: set[str] | frozenset[str]) -> None:
        """Stop asking for metrics found unsupported."""
        self._wanted = [(r, m) for r, m in self._wanted if r not in readings]
        self._prepare()

    def touch(self) -> None:
        """One sample into the buffer the next poll overwrites: costs what a poll's sample costs (the
        reader times it while probing) and changes nothing the next poll sees."""
        self._nvml.nvmlGpmSampleGet(self._handle, self._buffers[self._current])

    def sample(self) -> dict[str, tuple[int, float | None]] | None:
        """reading -> (return code, percent) between the previous poll and now; None on the first poll.

        Raises pynvml's NVMLError when the sample or the metrics call as a whole fails.
        """
        previous, current = self._buffers[1 - self._current], self._buffers[self._current]
        try:
            self._nvml.nvmlGpmSampleGet(self._handle, current)
        except Exception:
            self._have_previous = False  # the next poll has nothing valid to compare with
            raise
        had_previous, self._have_previous = self._have_previous, True
        self._current = 1 - self._current
        if not had_previous or not self._wanted:
            return None
        _SET_SAMPLE1(self._request, previous)
        _SET_SAMPLE2(self._request, current)
        self._nvml.nvmlGpmMetricsGet(self._request)
        return self._collect()

    def _collect(self) -> dict[str, tuple[int, float | None]]:
        """Each wanted metric's own return code and value."""
        out: dict[str, tuple[int, float | None]] = {}
        metrics = _GET_METRICS(self._request)
        for i, (reading, _) in enumerate(self._wanted):
            metric = metrics[i]
            code = int(_GET_RETURN(metric))
            out[reading] = (code, float(_GET_VALUE(metric)) if code == SUCCESS else None)
        return out

    def free(self) -> None:
        """Release both buffers; errors are ignored since the library may already be gone."""
        buffers, self._buffers = self._buffers, []
        for buffer in buffers:
            try:
                self._nvml.nvmlGpmSampleFree(buffer)
            except Exception:  # noqa: BLE001 - best effort on teardown
                pass
