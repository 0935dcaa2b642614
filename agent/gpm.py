"""GPM profiling metrics for one GPU (SM activity and occupancy, pipes, DRAM, PCIe and NVLink rates),
from two samples taken one poll apart.

Utilization says whether any kernel ran; GPM says how many SMs were busy, which is what exposes a GPU
waiting in a collective. nvmlGpmMetricsGet averages between two samples, so each poll takes one sample
and compares it with the previous poll's, alternating between two buffers allocated once (no per-poll
allocation, and the metric covers exactly the sampling interval).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import pynvml

from gpufleet.agent.nvml_errors import SUCCESS
from gpufleet.agent.readings import READINGS, GpmMetric

# (reading, pynvml metric id name) of the reading table's GPM rows: those of the shared call, those apart.
GPM_METRICS = tuple(
    (r.name, r.source.metric_id) for r in READINGS if isinstance(r.source, GpmMetric) and not r.source.apart
)
GPM_APART = tuple((r.name, r.source.metric_id) for r in READINGS if isinstance(r.source, GpmMetric) and r.source.apart)
GPM_SHARED = tuple(reading for reading, _ in GPM_METRICS)
GPM_READINGS = GPM_SHARED + tuple(reading for reading, _ in GPM_APART)

# Straight to the ctypes descriptors: pynvml's printable structures run Python in __setattr__ for every
# member set, more than the rest of a poll's handling of each metric.
_REQUEST = pynvml.c_nvmlGpmMetricsGet_t
_SET_SAMPLE1 = _REQUEST.sample1.__set__
_SET_SAMPLE2 = _REQUEST.sample2.__set__


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
        self._apart = [(reading, getattr(nvml, name)) for reading, name in GPM_APART]
        self._request = pynvml.c_nvmlGpmMetricsGet_t()
        self._apart_request = pynvml.c_nvmlGpmMetricsGet_t()
        self._prepare()

    def _prepare(self) -> None:
        """Fill the reused requests with the metric ids still wanted."""
        for request, wanted in ((self._request, self._wanted), (self._apart_request, self._apart)):
            request.version = self._nvml.NVML_GPM_METRICS_GET_VERSION
            request.numMetrics = len(wanted)
            for i, (_, metric_id) in enumerate(wanted):
                request.metrics[i].metricId = metric_id

    @property
    def has_apart(self) -> bool:
        """Whether any metric asked apart is still wanted."""
        return bool(self._apart)

    def drop(self, readings: set[str] | frozenset[str]) -> None:
        """Stop asking for metrics found unsupported."""
        self._wanted = [(r, m) for r, m in self._wanted if r not in readings]
        self._apart = [(r, m) for r, m in self._apart if r not in readings]
        self._prepare()

    def time_apart(self, cpu_clock_ns: Callable[[], int] = time.thread_time_ns) -> float:
        """Thread CPU seconds of one call for the metrics asked apart, on two samples taken now into both
        buffers (the first poll's sample overwrites them and has no previous one to compare with). Only
        timing: a failed call costs what it cost, and the polls handle every failure."""
        if not self._apart:
            return 0.0
        self._have_previous = False
        started = spent = 0
        try:
            for buffer in self._buffers:
                self._nvml.nvmlGpmSampleGet(self._handle, buffer)
            self._apart_request.sample1, self._apart_request.sample2 = self._buffers[0], self._buffers[1]
            started = cpu_clock_ns()
            self._nvml.nvmlGpmMetricsGet(self._apart_request)
        except Exception:  # noqa: BLE001 - timing only
            pass
        finally:
            spent = cpu_clock_ns() - started if started else 0
        return spent / 1e9

    def touch(self) -> None:
        """One sample into the buffer the next poll overwrites: costs what a poll's sample costs (the
        reader times it while probing) and changes nothing the next poll sees."""
        self._nvml.nvmlGpmSampleGet(self._handle, self._buffers[self._current])

    def sample(self, apart: bool = False) -> dict[str, tuple[int, float | None]] | None:
        """reading -> (return code, percent) between the previous poll and now; None on the first poll.
        `apart`: the metrics asked apart too, in their own call on the same two samples.

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
        if not had_previous:
            return None
        out: dict[str, tuple[int, float | None]] = {}
        if self._wanted:
            _SET_SAMPLE1(self._request, previous)
            _SET_SAMPLE2(self._request, current)
            self._nvml.nvmlGpmMetricsGet(self._request)
            _collect(self._request, self._wanted, out)
        if apart and self._apart:
            _SET_SAMPLE1(self._apart_request, previous)
            _SET_SAMPLE2(self._apart_request, current)
            self._nvml.nvmlGpmMetricsGet(self._apart_request)
            _collect(self._apart_request, self._apart, out)
        return out or None

    def free(self) -> None:
        """Release both buffers; errors are ignored since the library may already be gone."""
        buffers, self._buffers = self._buffers, []
        for buffer in buffers:
            try:
                self._nvml.nvmlGpmSampleFree(buffer)
            except Exception:  # noqa: BLE001 - best effort on teardown
                pass


# Straight to the ctypes descriptors: pynvml's printable-structure __getattribute__ on each member cost
# more than the rest of a metric's handling (3.3 us against 1.2 us a metric).
_METRIC = pynvml.c_nvmlGpmMetric_t
_GET_RETURN = _METRIC.nvmlReturn.__get__
_GET_VALUE = _METRIC.value.__get__


def _collect(request: Any, wanted: list[tuple[str, int]], out: dict[str, tuple[int, float | None]]) -> None:
    """Each wanted metric's own return code and value, into out."""
    metrics = request.metrics
    for i, (reading, _) in enumerate(wanted):
        metric = metrics[i]
        if type(metric) is _METRIC:
            code, value = _GET_RETURN(metric), _GET_VALUE(metric)
        else:
            code, value = int(metric.nvmlReturn), metric.value
        out[reading] = (code, float(value) if code == SUCCESS else None)
