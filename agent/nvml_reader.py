"""The thin NVML layer: the only code that knows NVML's calls, quirks and failure modes.

open() initialises NVML and probes every GPU once (identity, static limits, which readings exist);
read() polls the cheapest current call for each supported reading and returns immutable GpuSamples.
Probing also times every read (thread CPU), and agent.tiers spreads the costly ones over several cycles
to fit a CPU budget; between its reads a slow reading keeps its last value, and the sample says how old.
A failure stays as small as it can: one reading (absent this poll and counted, or unsupported from then
on), one GPU (lost: reported down and never called again), or the library (NvmlUnavailable: the
sampler closes and re-opens with backoff). Used from one sampler thread; XID events arrive on another.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

from gpufleet.agent.gpm import GPM_APART, GPM_READINGS, GPM_SHARED, GpmSampler
from gpufleet.agent.mig import MIG_MODE, MIG_UNIT, REDISCOVER_SECONDS, MigGpu
from gpufleet.agent.model import GpuSample
from gpufleet.agent.nvml_calls import IDENTITY, POLLED, STATIC, Call, cuda_version_text, text
from gpufleet.agent.nvml_errors import (
    GPU_IS_LOST,
    INVALID_VALUE,
    NOT_SUPPORTED,
    SUCCESS,
    ErrorCounts,
    error_code,
    error_name,
    is_library_fatal,
)
from gpufleet.agent.nvml_fields import THROTTLE_READINGS, FieldBatch, FieldEntry, batch_entries, fetch, read_link_count
from gpufleet.agent.nvml_meter import MeteredNvml
from gpufleet.agent.nvml_values import INVALID, CounterTracker, base_name, convert
from gpufleet.agent.processes import ComputeProcess, from_nvml
from gpufleet.agent.readings import READINGS, PerLinkField
from gpufleet.agent.sample_build import build_sample
from gpufleet.agent.tiers import DEFAULT_CPU_BUDGET, EVERY_CYCLE, FAST_READINGS, INTEGRATED, Plan, Unit, due, fit
from gpufleet.agent.xid import XID_READING, XidStore, XidWatcher

log = logging.getLogger(__name__)

_MISSING: Any = object()  # a guarded call that failed
_NVLINK_READINGS = tuple(r.name for r in READINGS if r.nvlink)
_LINK_FIELDS = tuple(r.name for r in READINGS if isinstance(r.source, PerLinkField))
_THROTTLE_PREFIX = "throttle_seconds_total."
# A read unit (one call, one field id, or GPM) is named after the first reading it fills.
_GPM_UNIT = GPM_SHARED[0]
_GPM_APART_UNIT = GPM_APART[0][0] if GPM_APART else ""  # the metrics asked apart: one unit
_GPM_APART_READINGS = tuple(r for r, _ in GPM_APART)
_UNIT_OF = {
    **{r: call.readings[0] for call in POLLED for r in call.readings},
    **dict.fromkeys(GPM_SHARED, _GPM_UNIT),
    **dict.fromkeys(_GPM_APART_READINGS, _GPM_APART_UNIT),
}
# Each reason's bit as a plain int: an IntFlag's & runs enum code on every cycle.
_THROTTLE_BITS = {key: int(reason) for key, reason in THROTTLE_READINGS.items()}
# The XID thread's event wait. An event ends it at once whatever the timeout; each wait costs the driver
# about 0.1 ms of CPU however long it lasts (H200, driver 580: 0.021 % of a core at 0.5 s, 0.006 % at 2 s),
# and closing the reader waits out at most one (within the agent's 5 s shutdown).
XID_WAIT_MS = 2000
_FIELD_PROBES = 2  # each field id timed twice alone, the lower figure kept
# Each per-poll call timed twice too: the first call of a function pays its lookups (ctypes, wrappers).
_CALL_PROBES = 2
_FIELD_CALL = "nvmlDeviceGetFieldValues"


class NvmlUnavailable(Exception):
    """NVML as a whole is not usable (init failed, driver gone); retry open() later."""


@dataclass(eq=False)
class _Gpu:
    """What the reader knows about one GPU between open() and close()."""

    index: int
    handle: Any
    up: bool = True
    identity: dict[str, Any] = field(default_factory=dict)
    static: dict[str, Any] = field(default_factory=dict)
    supported: dict[str, bool] = field(default_factory=dict)
    fields: FieldBatch = field(default_factory=lambda: FieldBatch(()))
    gpm: GpmSampler | None = None
    mig: MigGpu | None = None
    link_count: int | None = None
    # Read unit key -> thread CPU seconds one read took while probing.
    costs: dict[str, float] = field(default_factory=dict)
    # Last value of every reading and the (clock) time it was read: what a cycle not due to read it shows.
    held: dict[str, Any] = field(default_factory=dict)
    read_at: dict[str, float] = field(default_factory=dict)
    # The per-poll calls whose readings are all supported; None: to be worked out.
    polled: tuple[Call, ...] | None = None
    # The plan's read units not due in a cycle, by cycle modulo the schedule's length (empty: none fitted).
    resting: tuple[frozenset[str], ...] = ()
    # Every static limit read or found unsupported: later polls skip looking (it stays so until re-open).
    static_done: bool = False
    # Field entries polled together -> each reading's share of the batch's CPU (costs are fixed at open).
    batch_shares: dict[tuple[str, ...], tuple[tuple[str, float], ...]] = field(default_factory=dict)

    @property
    def uuid(self) -> str:
        return self.identity.get("uuid") or ""

    @property
    def key(self) -> str:
        """Stable identity across re-opens: the UUID, or the index when the UUID is unreadable."""
        return self.uuid or f"index:{self.index}"

    def wants(self, readings: Iterable[str]) -> bool:
        return self.up and all(self.supported.get(r, True) for r in readings)


class NvmlReader:
    """Reads every GPU of this node through a pynvml-compatible object (pynvml itself, or SimNvml)."""

    def __init__(
        self,
        nvml: Any,
        *,
        per_link_nvlink: bool = False,
        xid_wait_ms: int = XID_WAIT_MS,
        cpu_budget: float = DEFAULT_CPU_BUDGET,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        cpu_clock_ns: Callable[[], int] = time.thread_time_ns,
    ) -> None:
        if isinstance(xid_wait_ms, bool) or not isinstance(xid_wait_ms, int) or xid_wait_ms <= 0:
            raise ValueError(f"xid_wait_ms must be a positive integer, got {xid_wait_ms!r}")
        if not cpu_budget > 0 or not interval_s > 0:
            raise ValueError(f"cpu_budget and interval_s must be positive, got {cpu_budget!r}, {interval_s!r}")
        self._meter = MeteredNvml(nvml)
        self._nvml = self._meter
        self._budget = cpu_budget
        self._interval = interval_s
        self._clock = clock
        # What probing times reads with: this thread's CPU clock (the simulator's leaves out its own Python).
        self._cpu_ns = cpu_clock_ns
        self._plan: Plan = EVERY_CYCLE
        self._periods: tuple[Plan, Mapping[str, float]] | None = None  # reading_periods, of this plan
        self._from_mask: tuple[str, ...] = ()  # throttle readings the plan integrates from the mask
        self._cycle = 0
        # GPU key -> reason reading -> seconds, for counters the reasons mask stands in for; kept across re-opens.
        self._integrated: dict[str, dict[str, float]] = {}
        self._mask_at: dict[str, float] = {}
        self._capabilities: Mapping[int, Mapping[str, bool]] | None = None
        self._per_link = per_link_nvlink
        self._xid_wait_ms = xid_wait_ms
        self._errors = ErrorCounts()
        self._xid_store = XidStore()
        self._counters = CounterTracker()
        self._logged: set[tuple[str, str, str]] = set()
        self._unit_names: dict[str, str] = {}  # reading -> its read unit's name, learned as readings are held
        # GPU index -> the attribution fields the sampler last gave it (see label()).
        self._labels: dict[int, dict[str, str | None]] = {}
        self._gpus: list[_Gpu] = []
        self._xid: XidWatcher | None = None
        self._versions: dict[str, str | None] = {}
        self._initialized = False
        self._is_open = False
        self._probing = False

    # -- public surface ------------------------------------------------------------------------

    @property
    def driver_version(self) -> str | None:
        return self._versions.get("driver_version")

    @property
    def nvml_version(self) -> str | None:
        return self._versions.get("nvml_version")

    @property
    def cuda_driver_version(self) -> str | None:
        return self._versions.get("cuda_driver_version")

    @property
    def capabilities(self) -> Mapping[int, Mapping[str, bool]]:
        """GPU index -> reading name -> supported, as probed at open() and learned since."""
        # Asked for on every cycle's health; rebuilt only when what is known changes.
        if self._capabilities is None:
            self._capabilities = MappingProxyType({g.index: _public_capabilities(g.supported) for g in self._gpus})
        return self._capabilities

    @property
    def nvml_seconds(self) -> Mapping[str, float]:
        """NVML function -> thread CPU seconds the agent spent in it since the reader was created."""
        return self._meter.seconds

    @property
    def plan(self) -> Plan:
        """The sampling tiers fitted at the last open()."""
        return self._plan

    @property
    def reading_periods(self) -> Mapping[str, float]:
        """Read unit -> seconds between its reads (per-link NVLink folded; mask-integrated: every cycle)."""
        # Asked for on every cycle's health; worked out once per plan.
        plan, cached = self._plan, self._periods
        if cached is not None and cached[0] is plan:
            return cached[1]
        out: dict[str, float] = {}
        for key, period in plan.periods.items():
            name = base_name(key) if base_name(key) in _LINK_FIELDS else key
            out[name] = max(out.get(name, 0.0), max(period, 1) * self._interval)
        self._periods = (plan, MappingProxyType(out))
        return self._periods[1]

    @property
    def errors(self) -> Mapping[tuple[str, str], int]:
        """(reading, error name) -> cumulative count since the reader was created."""
        return self._errors.snapshot()

    def open(self) -> None:
        """Initialise NVML, enumerate and probe every GPU once, start the XID watcher."""
        if self._is_open:
            return
        self._init_library()
        try:
            self._versions = self._read_versions()
            count = self._library_call("device_count", self._nvml.nvmlDeviceGetCount)
            self._probing = True
            self._xid = XidWatcher(self._nvml, self._xid_store, self._errors, wait_ms=self._xid_wait_ms)
            self._gpus = [self._open_gpu(i) for i in range(int(count))]
            self._plan = self._fit_tiers()
            self._from_mask = tuple(k for k, p in self._plan.periods.items() if p == INTEGRATED)
            for gpu in self._gpus:
                gpu.resting = _resting_schedule(self._plan.periods, gpu.index)
            self._capabilities = None
            self._xid.start()
        except BaseException:  # leave nothing half-open behind: no thread, no initialised library
            self._teardown()
            raise
        finally:
            self._probing = False
        self._is_open = True
        log.info("nvml opened", extra={"gpus": len(self._gpus), "driver_version": self.driver_version})

    def read(self) -> tuple[GpuSample, ...]:
        """One sample per GPU. Raises NvmlUnavailable (and closes) only when NVML as a whole is gone."""
        if not self._is_open:
            raise NvmlUnavailable("NVML reader is not open")
        self._cycle += 1
        now = self._clock()
        try:
            return tuple(self._read_gpu(gpu, now) for gpu in self._gpus)
        except NvmlUnavailable:
            self.close()
            raise

    def label(self, index: int, hpc_job: str | None, namespace: str | None, pod: str | None) -> None:
        """The job and pod the sampler attributed GPU `index` to, carried into its next samples: while they
        hold, the sampler finds them in place and builds no second sample to add them."""
        self._labels[index] = {"hpc_job": hpc_job, "kubernetes_namespace": namespace, "kubernetes_pod": pod}

    def compute_pids(self, index: int) -> tuple[int, ...]:
        """PIDs of the compute processes on GPU `index`; () on any error."""
        return tuple(p.pid for p in self.compute_processes(index))

    def compute_processes(self, index: int) -> tuple[ComputeProcess, ...]:
        """The compute processes on GPU `index` with their memory (one NVML call); () on any error."""
        gpus = self._gpus
        gpu = gpus[index] if 0 <= index < len(gpus) and gpus[index].index == index else None
        if gpu is None or not gpu.up or not self._is_open:
            return ()
        try:
            processes = self._nvml.nvmlDeviceGetComputeRunningProcesses(gpu.handle)
            return tuple(from_nvml(p) for p in processes)
        except Exception as exc:  # noqa: BLE001 - attribution is best effort
            name = error_name(error_code(exc))
            self._errors.add("compute_processes", name)
            if name == GPU_IS_LOST:
                self._mark_lost(gpu)
            return ()

    def close(self) -> None:
        """Stop the XID thread, free GPM buffers, shut NVML down. Safe to call twice."""
        self._is_open = False
        self._teardown()

    # -- open ----------------------------------------------------------------------------------

    def _init_library(self) -> None:
        try:
            self._nvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - any init failure means "not now"
            self._errors.add("nvml_init", error_name(error_code(exc)))
            raise NvmlUnavailable(f"nvmlInit failed: {exc}") from exc
        self._initialized = True

    def _library_call(self, reading: str, fn: Callable[[], Any]) -> Any:
        """A call without which the reader cannot work at all."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            self._errors.add(reading, error_name(error_code(exc)))
            raise NvmlUnavailable(f"{reading}: {exc}") from exc

    def _optional_library_call(self, reading: str, fn: Callable[[], Any]) -> Any:
        """A library-level call whose failure costs one value, unless the library itself is gone."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001
            code = error_code(exc)
            self._errors.add(reading, error_name(code))
            if is_library_fatal(code):
                raise NvmlUnavailable(f"{reading}: {exc}") from exc
            return None

    def _read_versions(self) -> dict[str, str | None]:
        nvml = self._nvml
        driver = self._optional_library_call("driver_version", nvml.nvmlSystemGetDriverVersion)
        version = self._optional_library_call("nvml_version", nvml.nvmlSystemGetNVMLVersion)
        cuda = self._optional_library_call("cuda_driver_version", nvml.nvmlSystemGetCudaDriverVersion)
        return {
            "driver_version": None if driver is None else text(driver),
            "nvml_version": None if version is None else text(version),
            "cuda_driver_version": cuda_version_text(cuda),
        }

    def _open_gpu(self, index: int) -> _Gpu:
        """Get the handle and probe everything about one GPU once."""
        gpu = _Gpu(index=index, handle=None)
        gpu.handle = self._guard(gpu, ("device",), self._nvml.nvmlDeviceGetHandleByIndex, index)
        if gpu.handle is _MISSING:
            self._mark_lost(gpu)
            return gpu
        self._probe_identity(gpu)
        self._probe_static(gpu)
        self._probe_fields(gpu)
        self._probe_gpm(gpu)
        self._probe_mig(gpu)
        for call in POLLED:
            gpu.supported.update(dict.fromkeys(call.readings, True))
        # A dry poll: learns which per-poll calls answer NotSupported, what each costs, and the values a
        # slow tier shows until its first read.
        probed: dict[str, Any] = {}
        for _ in range(_CALL_PROBES):
            self._poll_calls(gpu, probed, timed=True)
        self._hold(gpu, probed, probed, self._clock())
        self._register_xid(gpu)
        self._log_unsupported(gpu)
        return gpu

    def _probe_identity(self, gpu: _Gpu) -> None:
        for call in IDENTITY:
            gpu.supported.update(dict.fromkeys(call.readings, True))
            raw = self._guard(gpu, call.readings, call.fetch, self._nvml, gpu.handle)
            if raw is not _MISSING:
                gpu.identity.update(zip(call.readings, raw))

    def _probe_static(self, gpu: _Gpu) -> None:
        for call in STATIC:
            gpu.supported.update(dict.fromkeys(call.readings, True))
        self._read_missing_static(gpu)

    def _probe_fields(self, gpu: _Gpu) -> None:
        """Learn the link count, then ask the whole batch once and drop what is unsupported."""
        links = self._guard(gpu, ("nvlink_link_count",), read_link_count, self._nvml, gpu.handle)
        gpu.link_count = None if links is _MISSING else links
        gpu.fields = FieldBatch(batch_entries(self._nvml, link_count=gpu.link_count or 0, per_link=self._per_link))
        gpu.supported.update(dict.fromkeys((e.reading for e in gpu.fields.entries), True))
        if gpu.link_count == 0:  # a card without NVLink: absent, not a stream of zeros
            self._mark_unsupported(gpu, _NVLINK_READINGS)
        probed: dict[str, Any] = {}
        self._poll_fields(gpu, probed)
        self._hold(gpu, probed, probed, self._clock())
        self._time_fields(gpu)

    def _time_fields(self, gpu: _Gpu) -> None:
        """Each remaining field id alone in its own call: the batch's cost, split by field. The cheapest
        single call stands for what any call costs; each field is charged what it costs beyond that,
        and the first one a detector reads (kept fresh whatever the budget) carries the call itself."""
        singles = {e.reading: min(self._timed_fetch(gpu, e) for _ in range(_FIELD_PROBES)) for e in gpu.fields.entries}
        if not singles:
            return
        base = min(singles.values())
        for reading, cost in singles.items():
            gpu.costs[reading] = cost - base
        gpu.costs[next((r for r in singles if r in FAST_READINGS), next(iter(singles)))] += base

    def _timed_fetch(self, gpu: _Gpu, entry: FieldEntry) -> float:
        started = self._cpu_ns()
        try:
            fetch(self._nvml, gpu.handle, [entry])
        except Exception:  # noqa: BLE001 - only timing here; the batch poll handles every failure
            pass
        return (self._cpu_ns() - started) / 1e9

    def _probe_gpm(self, gpu: _Gpu) -> None:
        for reading in GPM_READINGS:  # an NVLink rate on a card without NVLink stays unsupported
            gpu.supported.setdefault(reading, True)
        support = self._guard(gpu, GPM_READINGS, self._nvml.nvmlGpmQueryDeviceSupport, gpu.handle)
        if support is not _MISSING and int(getattr(support, "isSupportedDevice", 0)):
            sampler = self._guard(gpu, GPM_READINGS, GpmSampler, self._nvml, gpu.handle)
            gpu.gpm = None if sampler is _MISSING else sampler
            if gpu.gpm is not None:
                gpu.gpm.drop(frozenset(r for r in GPM_READINGS if not gpu.supported[r]))
        if gpu.gpm is None and gpu.up:
            self._mark_unsupported(gpu, GPM_READINGS)
        elif gpu.gpm is not None:
            started = self._cpu_ns()
            gpu.gpm.touch()
            gpu.costs[_GPM_UNIT] = (self._cpu_ns() - started) / 1e9
            if gpu.gpm.has_apart:
                gpu.costs[_GPM_APART_UNIT] = gpu.gpm.time_apart(self._cpu_ns)

    def _probe_mig(self, gpu: _Gpu) -> None:
        """The GPU's MIG mode and instances, and what reading the instances costs (a read unit of the tiers)."""
        if not gpu.up:
            return
        gpu.supported[MIG_MODE] = True
        gpu.mig = MigGpu(self._nvml, gpu.handle, self._mig_call(gpu), gpu.supported, gpm=gpu.gpm is not None)
        gpu.mig.discover()
        if gpu.mig.instances:
            started = self._cpu_ns()
            gpu.mig.read()
            gpu.costs[MIG_UNIT] = (self._cpu_ns() - started) / 1e9

    def _mig_call(self, gpu: _Gpu) -> Callable[..., Any]:
        def call(readings: tuple[str, ...], fn: Callable[..., Any], *args: Any) -> Any:
            result = self._guard(gpu, readings, fn, *args)
            return None if result is _MISSING else result

        return call

    def _poll_mig(self, gpu: _Gpu) -> None:
        mig = gpu.mig
        if mig is None or not gpu.up:
            return
        if due(max(1, round(REDISCOVER_SECONDS / self._interval)), self._cycle, gpu.index):
            mig.discover()
        if mig.instances and self._due(gpu, MIG_UNIT):
            mig.read()

    def _fit_tiers(self) -> Plan:
        """Every read unit with its cost summed over the GPUs that answer, fitted to the budget."""
        costs: dict[str, float] = {}
        readings: dict[str, tuple[str, ...]] = {}
        for gpu in self._gpus:
            if not gpu.up:
                continue
            for key, cost in gpu.costs.items():
                if not gpu.supported.get(key, True):  # found unsupported while probing: never read
                    continue
                costs[key] = costs.get(key, 0.0) + cost
                readings[key] = GPM_SHARED if key == _GPM_UNIT else _unit_readings(key)
        masked = all(g.supported.get("throttle_reasons") for g in self._gpus if g.up)
        units = [Unit(k, readings[k], c, integrable=masked and k in THROTTLE_READINGS) for k, c in costs.items()]
        plan = fit(units, budget=self._budget, interval_s=self._interval)
        for gpu in self._gpus:
            for key, period in plan.periods.items():
                if period == INTEGRATED:
                    gpu.held.pop(key, None)
        slow = {k: p * self._interval for k, p in sorted(plan.periods.items()) if p > 1}
        integrated = sorted(k.partition(".")[2] for k, p in plan.periods.items() if p == INTEGRATED)
        log.log(
            logging.INFO if plan.fits else logging.WARNING,
            "sampling tiers" if plan.fits else "sampling tiers exceed the cpu budget at their longest periods",
            extra={
                "cpu_budget": self._budget,
                "nvml_cpu_per_second": round(plan.cost_per_second, 6),
                "slow_readings_seconds": slow,
                "throttle_from_mask": integrated,
            },
        )
        return plan

    def _register_xid(self, gpu: _Gpu) -> None:
        """Ask for this GPU's XID events; where that is unsupported the GPU has no XID reading."""
        if self._xid is not None and gpu.up:
            gpu.supported[XID_READING] = True
            self._guard(gpu, (XID_READING,), self._xid.register, gpu.handle, gpu.key)

    def _log_unsupported(self, gpu: _Gpu) -> None:
        """One info line per GPU naming readings it lacks that were not reported before."""
        lacking = _public_capabilities(gpu.supported)
        fresh = [r for r, ok in lacking.items() if not ok and self._first(gpu, r, NOT_SUPPORTED)]
        if fresh:
            log.info(
                "gpu readings unsupported",
                extra={"gpu": gpu.index, "uuid": gpu.uuid, "unsupported": sorted(fresh)},
            )

    # -- poll ----------------------------------------------------------------------------------

    def _read_gpu(self, gpu: _Gpu, now: float) -> GpuSample:
        if not gpu.up:
            return self._down_sample(gpu)
        values: dict[str, Any] = {}
        asked: list[str] = []
        self._read_missing_static(gpu)
        self._poll_calls(gpu, values, asked=asked)
        self._poll_fields(gpu, values, asked)
        self._poll_gpm(gpu, values, asked)
        self._poll_mig(gpu)
        if not gpu.up:
            return self._down_sample(gpu)
        self._hold(gpu, values, asked, now)
        ages = self._fill_held(gpu, values, now)
        self._integrate_throttle(gpu, values, now)
        return self._build(gpu, values, ages)

    def _due(self, gpu: _Gpu, key: str) -> bool:
        resting = gpu.resting
        if resting:
            return key not in resting[self._cycle % len(resting)]
        return due(self._plan.period(key), self._cycle, gpu.index)

    def _hold(self, gpu: _Gpu, values: Mapping[str, Any], asked: Iterable[str], now: float) -> None:
        """Remember what was read now; a reading asked for but not read (failed) is held no longer."""
        held, read_at = gpu.held, gpu.read_at
        for reading in asked:
            held.pop(reading, None)
        held.update(values)
        read_at.update(dict.fromkeys(values, now))

    def _fill_held(self, gpu: _Gpu, values: dict[str, Any], now: float) -> dict[str, float]:
        """Held values of the readings not due this cycle; their ages by read unit (per-link folded)."""
        ages: dict[str, float] = {}
        if len(values) == len(gpu.held):
            return ages
        read_at, units = gpu.read_at, self._unit_names
        oldest: dict[str, float] = {}  # unit -> when its least recently read reading was read
        for reading, value in gpu.held.items():
            if reading not in values:
                values[reading] = value
                name = units.get(reading) or units.setdefault(reading, _UNIT_OF.get(reading) or base_name(reading))
                at = read_at[reading]
                if at < oldest.get(name, at + 1.0):
                    oldest[name] = at
        for name, at in oldest.items():
            ages[name] = max(0.0, round(now - at, 3))
        return ages

    def _integrate_throttle(self, gpu: _Gpu, values: dict[str, Any], now: float) -> None:
        """Throttle seconds from the reasons mask (bit x time since the last mask) where the plan says so."""
        integrated = self._from_mask
        if not integrated:
            return
        totals = self._integrated.setdefault(gpu.key, {})
        mask = values.get("throttle_reasons")
        if mask is not None:
            last, self._mask_at[gpu.key] = self._mask_at.get(gpu.key), now
            # One missed cycle is normal; a longer gap is unknown time, not throttled time.
            step = 0.0 if last is None else min(max(now - last, 0.0), 2 * self._interval)
            for key in integrated:
                totals[key] = totals.get(key, 0.0) + (step if mask & _THROTTLE_BITS[key] else 0.0)
        for key in integrated:
            if gpu.supported.get(key, True) and key in totals:
                values[key] = totals[key]

    def _read_missing_static(self, gpu: _Gpu) -> None:
        """Read the static limits not known yet: at open, and on later polls after a transient failure
        (Timeout, Unknown, ...), which would otherwise leave a limit null until NVML is next re-opened."""
        if gpu.static_done:
            return
        missing = False
        for call in STATIC:
            if gpu.wants(call.readings) and not all(r in gpu.static for r in call.readings):
                raw = self._guard(gpu, call.readings, call.fetch, self._nvml, gpu.handle)
                if raw is not _MISSING:
                    self._convert_into(gpu, zip(call.readings, raw), gpu.static)
                missing = missing or not all(r in gpu.static for r in call.readings)
        gpu.static_done = not missing and gpu.up

    def _poll_calls(
        self, gpu: _Gpu, values: dict[str, Any], *, asked: list[str] | None = None, timed: bool = False
    ) -> None:
        wanted = gpu.polled
        if wanted is None:  # worked out again only after a reading is found unsupported
            wanted = gpu.polled = tuple(call for call in POLLED if gpu.wants(call.readings))
        for call in wanted:
            key = call.readings[0]
            if gpu.up and (asked is None or self._due(gpu, key)):
                if asked is not None:
                    asked.extend(call.readings)
                started = self._cpu_ns() if timed else 0
                raw = self._guard(gpu, call.readings, call.fetch, self._nvml, gpu.handle)
                if timed:
                    spent = (self._cpu_ns() - started) / 1e9
                    gpu.costs[key] = min(spent, gpu.costs.get(key, spent))
                if raw is not _MISSING:
                    self._convert_into(gpu, zip(call.readings, raw), values)

    def _poll_fields(self, gpu: _Gpu, values: dict[str, Any], asked: list[str] | None = None) -> None:
        if not gpu.up:
            return
        if asked is None:
            entries = gpu.fields.entries
            results = self._guard(gpu, tuple(e.reading for e in entries), gpu.fields.fetch, self._nvml, gpu.handle)
        else:
            entries = tuple(e for e in gpu.fields.entries if self._due(gpu, e.reading))
            readings = tuple(e.reading for e in entries)
            asked.extend(readings)
            if not entries:
                return
            if len(entries) == len(gpu.fields.entries):  # the whole batch: its request list is built once
                results = self._guard(gpu, readings, gpu.fields.fetch, self._nvml, gpu.handle)
            else:
                results = self._guard(gpu, readings, fetch, self._nvml, gpu.handle, entries)
        if results is not _MISSING:
            self._apply(gpu, ((r.entry.reading, r.code, r.raw) for r in results), values)
        if asked is not None:
            self._attribute_batch(gpu, entries)

    def _attribute_batch(self, gpu: _Gpu, entries: Iterable[FieldEntry]) -> None:
        """Split the batch call's CPU among its fields by what each cost alone while probing, so the
        cost counter names the costly field ids rather than one call."""
        spent = self._meter.last_call_ns(_FIELD_CALL)
        if not spent:
            return
        readings = tuple(e.reading for e in entries)
        fractions = gpu.batch_shares.get(readings)
        if fractions is None:
            fractions = gpu.batch_shares[readings] = _batch_fractions(gpu.costs, readings)
        shares: dict[str, int] = {}
        for name, fraction in fractions:
            shares[name] = shares.get(name, 0) + int(spent * fraction)
        self._meter.attribute(_FIELD_CALL, shares)

    def _poll_gpm(self, gpu: _Gpu, values: dict[str, Any], asked: list[str]) -> None:
        readings = tuple(r for r in GPM_SHARED if gpu.supported.get(r))
        if gpu.gpm is None or not gpu.up:
            return
        # The metrics apart ride on the shared call's two samples, in the cycles their own period is due.
        apart = gpu.gpm.has_apart and (
            self._due(gpu, _GPM_APART_UNIT) or not any(r in gpu.held for r in _GPM_APART_READINGS)
        )
        # GPM needs two samples for a value: until there is one, sample every cycle (--once has two).
        if not apart and not self._due(gpu, _GPM_UNIT) and any(r in gpu.held for r in readings):
            return
        if apart:
            readings += tuple(r for r in _GPM_APART_READINGS if gpu.supported.get(r))
        if not readings:
            return
        asked.extend(readings)
        result = self._guard(gpu, readings, gpu.gpm.sample, apart)
        if result is not _MISSING and result is not None:
            self._apply(gpu, ((r, code, raw) for r, (code, raw) in result.items()), values)

    def _apply(self, gpu: _Gpu, results: Iterable[tuple[str, int | None, Any]], values: dict[str, Any]) -> None:
        """Per-entry results: convert the successes, handle each failure code once for its readings."""
        failed: dict[int | None, list[str]] = {}
        for reading, code, raw in results:
            if code == SUCCESS:
                value = convert(reading, raw)
                if value is INVALID:
                    self._count(gpu, (reading,), INVALID_VALUE, f"value {raw!r}")
                else:
                    values[reading] = value
            else:
                failed.setdefault(code, []).append(reading)
        for code, readings in failed.items():
            self._on_failure(gpu, tuple(readings), code, f"entry return code {code}")

    def _convert_into(self, gpu: _Gpu, pairs: Iterable[tuple[str, Any]], out: dict[str, Any]) -> None:
        for reading, raw in pairs:
            value = convert(reading, raw)
            if value is INVALID:
                self._count(gpu, (reading,), INVALID_VALUE, f"value {raw!r}")
            else:
                out[reading] = value

    # -- assembling samples --------------------------------------------------------------------

    def _identity(self, gpu: _Gpu) -> dict[str, Any]:
        ident = gpu.identity
        return {
            "index": gpu.index,
            "uuid": gpu.uuid,
            "model": ident.get("model") or "",
            "pci_bus_id": ident.get("pci_bus_id"),
            "serial": ident.get("serial"),
            "vbios_version": ident.get("vbios_version"),
        }

    def _down_sample(self, gpu: _Gpu) -> GpuSample:
        return GpuSample(up=False, **self._identity(gpu))

    def _build(self, gpu: _Gpu, values: dict[str, Any], ages: dict[str, float]) -> GpuSample:
        fields: dict[str, Any] = {}
        throttle: dict[str, Any] = {}
        skip = len(_THROTTLE_PREFIX)
        for k, v in values.items():  # one pass: the model's own fields, and the throttle reasons
            if "." not in k:
                fields[k] = v
            elif k.startswith(_THROTTLE_PREFIX):
                throttle[k[skip:]] = v
        fields.update(gpu.static)
        fields["throttle_seconds_total"] = MappingProxyType(throttle)
        for name in _LINK_FIELDS:
            fields[name] = self._links(gpu, name, values)
        fields.update(self._xid_fields(gpu))
        if gpu.mig is not None:
            fields.update(mig_enabled=gpu.mig.enabled, mig_instances=gpu.mig.instances)
        resets = self._counters.check(gpu.key, fields)
        if ages:
            fields["slow_readings_age_seconds"] = MappingProxyType(ages)
        fields.update(self._identity(gpu))
        fields["counter_resets"] = resets
        fields.update(self._labels.get(gpu.index, {}))
        return build_sample(fields)

    def _links(self, gpu: _Gpu, name: str, values: Mapping[str, Any]) -> tuple[int | None, ...]:
        """Per-link counters in link order; () when disabled or no link is supported."""
        if not self._per_link:
            return ()
        readings = [f"{name}.{i}" for i in range(gpu.link_count or 0)]
        if not any(gpu.supported.get(r) for r in readings):
            return ()
        return tuple(values.get(r) for r in readings)

    def _xid_fields(self, gpu: _Gpu) -> dict[str, Any]:
        if self._xid is None or gpu.key not in self._xid.watched:
            return {}
        counts = self._xid_store.get(gpu.key)
        return {"xid_errors_total": counts.total, "xid_errors_by_code": counts.by_code, "last_xid": counts.last}

    # -- failures ------------------------------------------------------------------------------

    def _guard(self, gpu: _Gpu, readings: tuple[str, ...], fn: Callable[..., Any], *args: Any) -> Any:
        """Call fn, turning any failure into _MISSING after handling it for these readings."""
        if not gpu.up:
            return _MISSING
        try:
            return fn(*args)
        except NvmlUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - one reading must never take the agent down
            code = error_code(exc)
            self._on_failure(gpu, readings, code, str(exc) if code is not None else repr(exc))
            return _MISSING

    def _on_failure(self, gpu: _Gpu, readings: tuple[str, ...], code: int | None, detail: str) -> None:
        if is_library_fatal(code):
            raise NvmlUnavailable(f"NVML unusable ({detail}) while reading {readings[0]} on GPU {gpu.index}")
        name = error_name(code)
        if name == NOT_SUPPORTED:
            self._mark_unsupported(gpu, readings)
            if self._probing:
                return  # discovering what a GPU lacks at open is not an error
        self._count(gpu, readings, name, detail)
        if name == GPU_IS_LOST:
            self._mark_lost(gpu)

    def _count(self, gpu: _Gpu, readings: tuple[str, ...], name: str, detail: str) -> None:
        for base in dict.fromkeys(base_name(r) for r in readings):
            self._errors.add(base, name)
            if name not in (NOT_SUPPORTED, GPU_IS_LOST):
                level = logging.WARNING if self._first(gpu, base, name) else logging.DEBUG
                log.log(level, "nvml reading failed", extra=_context(gpu, base, name, detail))

    def _mark_unsupported(self, gpu: _Gpu, readings: Iterable[str]) -> None:
        readings = tuple(readings)
        newly = [r for r in readings if gpu.supported.get(r, True)]
        gpu.supported.update(dict.fromkeys(readings, False))
        gpu.polled = None
        self._capabilities = None
        for reading in readings:
            gpu.held.pop(reading, None)
        gpu.fields.drop(readings)
        if gpu.gpm is not None:
            gpu.gpm.drop(frozenset(readings))
        if newly and not self._probing:
            self._log_unsupported(gpu)

    def _mark_lost(self, gpu: _Gpu) -> None:
        gpu.up = False
        if self._first(gpu, "gpu", GPU_IS_LOST):
            log.warning("gpu lost; no further NVML calls on it", extra={"gpu": gpu.index, "uuid": gpu.uuid})

    def _first(self, gpu: _Gpu, reading: str, name: str) -> bool:
        """True the first time (GPU, reading, error) is seen since the reader was created."""
        slot = (gpu.key, reading, name)
        if slot in self._logged:
            return False
        self._logged.add(slot)
        return True

    # -- teardown ------------------------------------------------------------------------------

    def _teardown(self) -> None:
        self._capabilities = None
        if self._xid is not None:
            self._xid.stop()
            self._xid = None
        for gpu in self._gpus:
            if gpu.gpm is not None:
                gpu.gpm.free()
                gpu.gpm = None
            if gpu.mig is not None:
                gpu.mig.free()
                gpu.mig = None
        self._gpus = []
        if self._initialized:
            self._initialized = False
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - the library may already be gone
                log.debug("nvmlShutdown failed", exc_info=True)


_MAX_SCHEDULE_CYCLES = 3600


def _resting_schedule(periods: Mapping[str, int], offset: int) -> tuple[frozenset[str], ...]:
    """For each cycle of the plan's repeat, the units not due then (tiers.due, worked out once at open, so a
    cycle asks a set rather than the plan for each unit). Empty where the repeat is longer than an hour's
    cycles, or the plan reads everything every cycle."""
    length = math.lcm(*(p for p in periods.values() if p > 1)) if any(p > 1 for p in periods.values()) else 1
    if length > _MAX_SCHEDULE_CYCLES or all(p == 1 for p in periods.values()):
        return ()
    shared: dict[frozenset[str], frozenset[str]] = {}
    schedule = []
    for cycle in range(length):
        resting = frozenset(k for k, p in periods.items() if not due(p, cycle, offset))
        schedule.append(shared.setdefault(resting, resting))
    return tuple(schedule)


def _batch_fractions(costs: Mapping[str, float], readings: tuple[str, ...]) -> tuple[tuple[str, float], ...]:
    """Each reading's share of a batch's CPU by what it cost alone (per-link counters under their name)."""
    weights = [costs.get(r, 0.0) for r in readings]
    total = sum(weights)
    out = []
    for reading, weight in zip(readings, weights):
        name = base_name(reading) if base_name(reading) in _LINK_FIELDS else reading
        out.append((name, weight / total if total > 0 else 1 / len(readings)))
    return tuple(out)


def _unit_readings(key: str) -> tuple[str, ...]:
    """The readings one polled call or field entry (keyed by its first reading) fills."""
    for call in POLLED:
        if call.readings[0] == key:
            return call.readings
    return (key,)


def _public_capabilities(supported: Mapping[str, bool]) -> Mapping[str, bool]:
    """Capabilities as exported: per-link NVLink readings folded into one (supported if any link is)."""
    out: dict[str, bool] = {}
    for reading, ok in supported.items():
        name = base_name(reading) if base_name(reading) in _LINK_FIELDS else reading
        out[name] = out.get(name, False) or ok
    return MappingProxyType(out)


def _context(gpu: _Gpu, reading: str, error: str, detail: str) -> dict[str, Any]:
    return {"gpu": gpu.index, "uuid": gpu.uuid, "reading": reading, "error": error, "detail": detail}
