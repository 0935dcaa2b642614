"""The sampling loop: reader -> job attribution -> immutable snapshot -> store (and record); rendered when read."""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import Counter
from typing import Any, Callable, Mapping, Protocol

import orjson

from gpufleet.agent import __version__
from gpufleet.agent.activity import NO_TOTALS, ActivityIntegrator, ActivityTotals
from gpufleet.agent.attribution import Attributor
from gpufleet.agent.exposition import FamiliesFn
from gpufleet.agent.health import AgentHealth
from gpufleet.agent.model import GpuSample, NodeSnapshot
from gpufleet.agent.nvml_reader import NvmlUnavailable
from gpufleet.agent.processes import ComputeProcess, ProcessTable
from gpufleet.agent.sample_parts import GpuProcess
from gpufleet.agent.record import Recorder
from gpufleet.agent.render_on_demand import RenderOnDemand
from gpufleet.agent.sample_build import replace_sample
from gpufleet.agent.store import Publication, SnapshotStore

log = logging.getLogger(__name__)

FAILURE_LOG_EVERY_SECONDS = 60.0


class Reader(Protocol):
    """What the sampler needs from agent.nvml_reader.NvmlReader (tests pass small fakes)."""

    @property
    def capabilities(self) -> Mapping[int, Mapping[str, bool]]: ...
    @property
    def errors(self) -> Mapping[tuple[str, str], int]: ...
    @property
    def driver_version(self) -> str | None: ...
    @property
    def nvml_version(self) -> str | None: ...
    @property
    def cuda_driver_version(self) -> str | None: ...

    def open(self) -> None: ...
    def read(self) -> tuple[GpuSample, ...]: ...
    def compute_pids(self, index: int) -> tuple[int, ...]: ...
    def close(self) -> None: ...


class Waiter(Protocol):
    """threading.Event's waiting half; tests pass one that advances a fake clock instead of blocking."""

    def is_set(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...


class StopSignal:
    """A one-way stop flag to wait on: a threading.Event's set/is_set/wait, any number of waiters, on one
    lock held until set. Event.wait makes a lock and a condition round per call, and the sampler waits
    once a cycle: on a small VM that wakeup costs it twice what a lock's does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        self._set = True
        _release(self._lock)

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            _release(self._lock)  # the next waiter passes too
        return self._set


def _release(lock: threading.Lock) -> None:
    """Release, where a second set() or a waiter passing through may have released it already."""
    try:
        lock.release()
    except RuntimeError:
        pass


class Sampler:
    """Samples on its own drift-free timer; NVML trouble shows as nvml_up 0 or a growing age, never a crash."""

    def __init__(
        self,
        reader: Reader,
        store: SnapshotStore,
        *,
        node: str,
        interval: float = 1.0,
        attributor: Attributor | None = None,
        recorder: Recorder | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        stop: Waiter | None = None,
        jitter: Callable[[], float] = random.random,
        backoff_initial: float = 1.0,
        backoff_max: float = 60.0,
        version: str = __version__,
        families: FamiliesFn | None = None,
        processes: ProcessTable | None = None,
        rendered_ahead: Callable[[bytes], None] | None = None,
    ) -> None:
        self._reader = reader
        # Told each text rendered ahead of its scrape (the web server compresses it, agent.webserver).
        self._rendered_ahead = rendered_ahead
        self._processes = processes  # per-process memory in the samples; None: off
        self._store = store
        self._node = node
        self._interval = interval
        self._attributor = attributor
        self._recorder = recorder
        self._clock = clock
        self._monotonic = monotonic
        self._stop: Waiter = stop if stop is not None else StopSignal()
        self._jitter = jitter
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._version = version
        self._open = False
        self._nvml_error: str | None = None
        self._nvml_error_detail: str | None = None
        self._open_failures = 0
        self._next_open = float("-inf")
        self._errors: Counter[tuple[str, str]] = Counter()
        # Render failures are counted on the scrape thread that asked for a body; health() copies under it.
        self._errors_lock = threading.Lock()
        self._cycles = 0
        self._last: NodeSnapshot | None = None
        self._last_json: bytes | None = None
        self._thread: threading.Thread | None = None
        # families: what /metrics names the readings (gpufleet's by default; agent.dcgm_names for --metrics.names).
        self._bodies = RenderOnDemand(
            on_error=self._render_failed, process_metrics=True, monotonic=monotonic, families=families
        )
        # A sample stands for at most two intervals: one skipped tick is normal, a longer gap is unknown.
        self._activity = ActivityIntegrator(max_step_seconds=2 * interval)
        self._activity_totals: ActivityTotals = NO_TOTALS
        self._logged_at: dict[tuple[str, str], float] = {}

    @property
    def nvml_up(self) -> bool:
        """True while the reader is open and its last read did not find NVML gone."""
        return self._open

    @property
    def next_open_delay(self) -> float:
        """Seconds until the next NVML open attempt (0 when due or open); for logs and tests."""
        return 0.0 if self._open else max(0.0, self._next_open - self._monotonic())

    def run_once(self) -> NodeSnapshot | None:
        """One cycle: (re)open NVML when due, read, attribute, publish; returns the new snapshot or None."""
        self._cycles += 1
        snapshot = None
        if self._open or self._try_open():
            snapshot = self._sample()
        self._publish(snapshot)
        return snapshot

    def _sample(self) -> NodeSnapshot | None:
        taken_at = self._clock()
        started = self._monotonic()
        try:
            gpus = self._reader.read()
            gpus = self._attribute(gpus)
        except NvmlUnavailable as exc:
            self._mark_down(exc, "nvml_read")
            return None
        except Exception as exc:  # one bad cycle must not end sampling
            self._errors[("cycle", type(exc).__name__)] += 1
            self._log_failure("sampling cycle failed", exc)
            return None
        return NodeSnapshot(
            node=self._node,
            time=taken_at,
            gpus=gpus,
            driver_version=self._reader.driver_version,
            nvml_version=self._reader.nvml_version,
            cuda_driver_version=self._reader.cuda_driver_version,
            sample_duration_seconds=max(0.0, self._monotonic() - started),
        )

    def _attribute(self, gpus: tuple[GpuSample, ...]) -> tuple[GpuSample, ...]:
        attributor, table = self._attributor, self._processes
        if attributor is None and table is None:
            return tuple(gpus)
        # One process list per GPU, shared by attribution and the per-process memory.
        by_pids = attributor is not None and not attributor.uses_mapping_dir
        listed = self._list_processes(gpus) if table is not None or by_pids else {}
        owners: dict[int, tuple[str | None, str | None, str | None]] = {}
        if attributor is not None:
            for gpu in gpus:
                pids = tuple(p.pid for p in listed.get(gpu.index, ())) if by_pids else ()
                job = attributor.job_for(gpu.index, gpu.uuid, pids)
                pod = attributor.pod_for(pids)
                owners[gpu.index] = (job, pod.namespace, pod.name) if pod is not None else (job, None, None)
            attributor.end_cycle()
        chosen = table.choose(listed, {i: owner[0] for i, owner in owners.items()}) if table is not None else {}
        # Optional on a reader (tests' stand-ins lack it): where the reader carries each GPU's last
        # attribution into its samples, a steady one needs no second sample per GPU.
        label = getattr(self._reader, "label", None)
        out = []
        for gpu in gpus:
            owner = owners.get(gpu.index)
            updated = _with_owner(gpu, owner, chosen.get(gpu.index, ()))
            if label is not None and owner is not None and updated is not gpu:
                label(gpu.index, *owner)
            out.append(updated)
        return tuple(out)

    def _list_processes(self, gpus: tuple[GpuSample, ...]) -> dict[int, tuple[ComputeProcess, ...]]:
        """Each GPU's compute processes; a reader without their memory (tests' stand-ins) gives pids alone."""
        listed: dict[int, tuple[ComputeProcess, ...]] = {}
        with_memory = getattr(self._reader, "compute_processes", None)
        for gpu in gpus:
            if not gpu.up:
                continue
            try:
                if with_memory is not None:
                    listed[gpu.index] = with_memory(gpu.index)
                else:
                    listed[gpu.index] = tuple(ComputeProcess(pid) for pid in self._reader.compute_pids(gpu.index))
            except NvmlUnavailable:
                raise
            except Exception as exc:
                self._errors[("compute_processes", type(exc).__name__)] += 1
        return listed

    def _log_failure(self, message: str, exc: Exception) -> None:
        """With traceback, but once a minute per kind: a bug that repeats every cycle must not flood."""
        key = (message, type(exc).__name__)
        now = self._monotonic()
        if now - self._logged_at.get(key, float("-inf")) >= FAILURE_LOG_EVERY_SECONDS:
            self._logged_at[key] = now
            log.error(message, exc_info=exc, extra={"node": self._node, "count": self._errors.total()})

    def _try_open(self) -> bool:
        if self._monotonic() < self._next_open:
            return False
        try:
            self._reader.open()
        except Exception as exc:  # NvmlUnavailable, or anything a broken driver throws at init
            self._open_failures += 1
            self._mark_down(exc, "nvml_open")
            return False
        self._open, self._nvml_error, self._nvml_error_detail, self._open_failures = True, None, None, 0
        log.debug(
            "NVML opened",
            extra={
                "node": self._node,
                "driver_version": self._reader.driver_version,
                "gpus": len(self._reader.capabilities),
            },
        )
        return True

    def _mark_down(self, exc: BaseException, reading: str) -> None:
        was_open = self._open
        self._open, self._nvml_error, self._nvml_error_detail = False, type(exc).__name__, str(exc)[:200]
        self._errors[(reading, self._nvml_error)] += 1
        self._close_reader()
        delay = 0.0 if was_open else self._backoff_delay()
        self._next_open = self._monotonic() + delay
        log.warning(
            "NVML unavailable; serving health metrics only",
            extra={"node": self._node, "error": repr(exc), "retry_in_seconds": round(delay, 2)},
        )

    def _backoff_delay(self) -> float:
        """1 s doubling to the cap, +-25 % jitter so a rack of agents does not retry in lockstep."""
        base = min(self._backoff_max, self._backoff_initial * 2 ** max(0, self._open_failures - 1))
        return min(self._backoff_max, base * (0.75 + 0.5 * self._jitter()))

    def _publish(self, snapshot: NodeSnapshot | None) -> None:
        if snapshot is not None:
            self._last, self._last_json = snapshot, orjson.dumps(snapshot.to_dict())
            self._activity_totals = self._activity.update(snapshot)
            if self._recorder is not None and not self._recorder.write(self._last_json):
                self._errors[("record", "write_failed")] += 1
        health = self.health()
        body = self._bodies.body(self._last, health, self._activity_totals)
        # Rendered (and compressed) ahead before it is published: a scrape meanwhile is answered at once from
        # the publication before, instead of finding this one half ready and waiting on a worker for it.
        if self._bodies.render_ahead(body, self._interval) and self._rendered_ahead is not None and body.text:
            self._rendered_ahead(body.text)
        self._store.publish(Publication(self._last, health, body, self._last_json, self._activity_totals))

    def _render_failed(self, exc: Exception) -> None:
        """Called on the scrape thread that asked for the body; counted for the next publication."""
        with self._errors_lock:
            self._errors[("render", type(exc).__name__)] += 1
        self._log_failure("exposition render failed", exc)

    def health(self) -> AgentHealth:
        """The agent's current view of itself."""
        with self._errors_lock:
            errors: Counter[tuple[str, str]] = Counter(self._errors)
        # Always merged, open or not: the reader's counts are cumulative and a counter must not shrink.
        errors.update(_copy(self._reader.errors))
        if self._attributor is not None:
            errors.update({("attribution", cause): n for cause, n in self._attributor.errors.items()})
        capabilities = _copy(self._reader.capabilities) if self._open else {}
        # Optional on a reader (tests' stand-ins lack them): the NVML cost counter and the tiers.
        nvml_seconds = getattr(self._reader, "nvml_seconds", {})
        periods = getattr(self._reader, "reading_periods", {}) if self._open else {}
        return AgentHealth(
            node=self._node,
            version=self._version,
            nvml_up=self._open,
            nvml_error=self._nvml_error,
            nvml_error_detail=self._nvml_error_detail,
            errors=dict(errors),
            capabilities=capabilities,
            cycles_total=self._cycles,
            nvml_seconds=nvml_seconds,
            reading_periods=periods,
        )

    def run(self) -> None:
        """Sample every interval on a drift-free schedule until stop is set; a slow cycle skips ticks."""
        # Health first: should the first nvmlInit never return, /metrics still answers (nvml_up 0).
        self._publish(None)
        due = self._monotonic()
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception:  # belt and braces: run_once already contains its own failures
                log.exception("sampler cycle escaped", extra={"node": self._node})
            due += self._interval
            now = self._monotonic()
            if due <= now:
                skipped = math.floor((now - due) / self._interval) + 1
                self._errors[("cycle", "overrun")] += skipped
                due += skipped * self._interval
            self._stop.wait(due - now)

    def start(self) -> None:
        """Run in a daemon thread, so a call hung inside the driver cannot keep the process alive."""
        self._thread = threading.Thread(target=self.run, name="gpufleet-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop sampling and close NVML; a cycle stuck in the driver is abandoned after `timeout`."""
        set_stop = getattr(self._stop, "set", None)
        if set_stop is not None:
            set_stop()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("sampler did not stop in time; NVML call hung", extra={"timeout_seconds": timeout})
                return
        self._close_reader()
        self._open = False

    def _close_reader(self) -> None:
        try:
            self._reader.close()
        except Exception as exc:  # closing a broken library may fail too; nothing more to do about it
            log.debug("reader close failed", extra={"error": repr(exc)})


def _with_owner(
    gpu: GpuSample, owner: tuple[str | None, str | None, str | None] | None, processes: tuple[GpuProcess, ...]
) -> GpuSample:
    """The sample with its job, pod and processes; one copy of it at most, none where nothing changes."""
    changes: dict[str, Any] = {}
    if owner is not None and owner != (gpu.hpc_job, gpu.kubernetes_namespace, gpu.kubernetes_pod):
        changes.update(hpc_job=owner[0], kubernetes_namespace=owner[1], kubernetes_pod=owner[2])
    if processes != gpu.processes:
        changes["processes"] = processes
    return replace_sample(gpu, changes) if changes else gpu


def _copy(mapping: Mapping[Any, Any]) -> dict[Any, Any]:
    """A shallow copy of a mapping another thread (the XID watcher) may be updating."""
    for _ in range(3):
        try:
            return dict(mapping)
        except RuntimeError:  # changed size during iteration; try again
            continue
    return {}
