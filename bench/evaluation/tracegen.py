"""Physics-based synthetic cluster traces in the snapshot contract (schema 1), with ground truth.

The generator is the detection engine's independent yardstick: it simulates synchronous training from
first principles (per-step compute, waiting for the slowest rank, collectives, thermal RC model, clock
control) and derives the ground truth from the simulated physics, never from how any detector decides.

Vocabulary: a ClusterSpec (nodes, jobs, incidents, sampling) goes through `generate()` into a Trace: the
JSONL lines an agent fleet would have recorded, plus the Truth records (kind, subject, window, required
or merely allowed) that a perfect detector would report.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from gpufleet.reasons import ThrottleReason

IDLE, STARTUP, TRAIN, WINDDOWN, HANG = range(5)

_LABELLED = (
    ThrottleReason.SW_POWER_CAP,
    ThrottleReason.SW_THERMAL_SLOWDOWN,
    ThrottleReason.HW_THERMAL_SLOWDOWN,
    ThrottleReason.HW_POWER_BRAKE_SLOWDOWN,
    ThrottleReason.SYNC_BOOST,
)
THROTTLE_LABELS = tuple(reason.label for reason in _LABELLED)
BIT_IDLE, BIT_SW_POWER_CAP, BIT_HW_SLOWDOWN = (
    int(r) for r in (ThrottleReason.GPU_IDLE, ThrottleReason.SW_POWER_CAP, ThrottleReason.HW_SLOWDOWN)
)
BIT_SW_THERMAL, BIT_HW_THERMAL, BIT_POWER_BRAKE = (
    int(r)
    for r in (
        ThrottleReason.SW_THERMAL_SLOWDOWN,
        ThrottleReason.HW_THERMAL_SLOWDOWN,
        ThrottleReason.HW_POWER_BRAKE_SLOWDOWN,
    )
)
_LABEL_BITS = tuple(int(reason) for reason in _LABELLED)

THERMAL_ALERT_CELSIUS = 83.0  # the contract's default thermal threshold
THERMAL_ALERT_FOR_S = 30.0  # ... and its default `for` duration
STRAGGLER_REQUIRED_SLOWDOWN = 0.10
STRAGGLER_ALLOWED_SLOWDOWN = 0.03
COMM_REQUIRED_GROWTH = 0.25  # step-time growth at which a comm slowdown must be reported
INPUT_REQUIRED_IDLE = 0.15  # utilization drop at which input starvation must be reported
_RESET_FIELDS = (
    "energy_joules_total",
    "nvlink_tx_bytes_total",
    "nvlink_rx_bytes_total",
    "pcie_tx_bytes_total",
    "pcie_rx_bytes_total",
)

# XIDs that are usually the application's own doing: a detector may report them, need not.
APPLICATION_XIDS = frozenset({13, 31, 43, 45})


# Bumped whenever a change here alters the trace of any spec and seed: hold-out figures (bench.evaluation.detection_eval)
# are only comparable between runs of one generator version.
GENERATOR_VERSION = 1


@dataclass(frozen=True, slots=True)
class GpuModel:
    """Static properties of one GPU model, as NVML reports them, plus its thermal resistance."""

    name: str
    has_gpm: bool
    tdp_watts: float
    idle_watts: float
    sm_clock_max_hz: float
    sm_clock_idle_hz: float
    memory_clock_max_hz: float
    memory_total_bytes: int
    slowdown_celsius: float
    shutdown_celsius: float
    max_operating_celsius: float
    memory_max_operating_celsius: float
    thermal_resistance_celsius_per_watt: float
    nvlink_bytes_per_second: float
    pcie_bytes_per_second: float
    vbios_version: str


H100 = GpuModel(
    "NVIDIA H100 80GB HBM3",
    True,
    700.0,
    72.0,
    1980e6,
    345e6,
    2619e6,
    85520809984,
    87.0,
    92.0,
    85.0,
    95.0,
    0.066,
    300e9,
    24e9,
    "96.00.89.00.01",
)
A100 = GpuModel(
    "NVIDIA A100-SXM4-80GB",
    False,
    400.0,
    55.0,
    1410e6,
    210e6,
    1593e6,
    85899345920,
    88.0,
    93.0,
    85.0,
    95.0,
    0.105,
    200e9,
    20e9,
    "92.00.45.00.06",
)
# A PCIe board: no NVLink bridge, so NVML reports no NVLink counters and every collective, inside the node
# too, crosses PCIe; half the H100 SXM's power in the same silicon.
H100_PCIE = GpuModel(
    "NVIDIA H100 PCIe",
    True,
    350.0,
    48.0,
    1755e6,
    345e6,
    1593e6,
    85520809984,
    87.0,
    92.0,
    85.0,
    95.0,
    0.13,
    0.0,
    50e9,
    "96.00.5E.00.01",
)
MODELS = {"h100": H100, "a100": A100, "h100-pcie": H100_PCIE}


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One host with its GPUs; ambient is the inlet air temperature of its chassis."""

    name: str
    model: GpuModel = H100
    gpus: int = 8
    ambient_celsius: float = 27.0
    clock_skew_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Job:
    """A synchronous data-parallel training job on a set of (node, gpu) slots.

    `key` identifies the job inside the spec; `hpc_job` is what the agent attributes (None: unattributed).
    `step_s` is the compute part of one step at full speed; `comm_ratio` the collective time relative to it.
    """

    key: str
    hpc_job: str | None
    placement: tuple[tuple[str, tuple[int, ...]], ...]
    start_s: float = 0.0
    end_s: float | None = None
    step_s: float = 0.6
    comm_ratio: float = 0.2
    intensity: float = 1.0
    sm_coefficient: float = 0.85
    startup_s: float = 90.0
    winddown_s: float = 40.0
    memory_bytes: int = 70 * 2**30
    # Fixed per-rank compute differences (uneven shards, extra work on rank 0): there all along.
    structural_spread: float = 0.005
    # Uneven ranks by role: each GPU's work factor, in placement order (pipeline stages; () = even).
    rank_work: tuple[float, ...] = ()
    # Mixture-of-experts routing: each rank's work drifts by up to this share, slowly (periods of
    # DRIFT_PERIOD_S), each rank on its own phase; 0 = no drift.
    work_drift: float = 0.0
    # How strongly what one second catches of a step (more compute, or more collective) moves every rank
    # at once, relative to the model's usual; 0: ranks share no wobble (steps too regular to show one).
    shared_wobble: float = 1.0


@dataclass(frozen=True, slots=True)
class Incident:
    """Something that happens to a GPU, node or job during [start_s, end_s) of trace time.

    kinds: cooling_failure, hot_gpu, warm_gpu, temp_spike, slow_gpu, jitter, power_brake, node_brake,
    node_power_cap (power_cap with a node), slow_node,
    host_starved (a node's host, or with `gpu` one rank's), comm_slowdown, input_starved, checkpoint, power_cap, gpu_lost, xid, agent_down,
    node_crash, counter_reset. `severity` is kind-specific (a speed factor, a multiplier, a target temperature...).
    """

    kind: str
    start_s: float
    end_s: float
    node: str | None = None
    gpu: int | None = None
    job: str | None = None
    severity: float = 0.0
    code: int = 0
    count: int = 1


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """Everything the generator needs; the same spec and seed always give the same trace."""

    nodes: tuple[NodeSpec, ...]
    jobs: tuple[Job, ...] = ()
    incidents: tuple[Incident, ...] = ()
    duration_s: float = 900.0
    interval_s: float = 5.0
    t0: float = 1_763_800_000.0
    seed: int = 0
    drop_ratio: float = 0.0
    order: str = "time"  # time | node (cat of record files) | pulls (per-node batches)
    max_jitter_s: float = 0.03
    # Scales every reading noise: the per-second ones (step time, utilization, SM activity, power, the
    # job-wide phase catch) and the sensors' at each sample (die and HBM temperature, SM clock) - a
    # robustness probe for telemetry noisier than this model's.
    noise_scale: float = 1.0


@dataclass(frozen=True, slots=True)
class Truth:
    """One thing a detector should (required) or may (not required) report.

    A matching alert has the same kind and subject and its `started` within
    [start - lead - CLOCK_SLACK_S, end + grace] (see scenarios.score).
    """

    kind: str
    node: str | None
    gpu: int | None
    hpc_job: str | None
    start: float
    end: float
    required: bool
    note: str = ""
    lead_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Trace:
    """Generated lines (time order per `spec.order`) and the ground truth."""

    spec: ClusterSpec
    lines: tuple[bytes, ...]
    truths: tuple[Truth, ...]
    gpu_samples: int


class SpecError(ValueError):
    """A ClusterSpec that cannot be simulated (unknown node, overlapping jobs, bad interval...)."""


# --------------------------------------------------------------------------------------------- layout


@dataclass
class _Layout:
    """Flat GPU indexing: GPU g lives on node node_of[g] at index local[g]."""

    spec: ClusterSpec
    node_index: dict[str, int]
    node_of: np.ndarray
    local: np.ndarray
    first_gpu: list[int]
    model_of: list[GpuModel]
    job_index: dict[str, int]

    @property
    def gpus(self) -> int:
        return len(self.node_of)

    def gpu(self, node: str, index: int) -> int:
        """Flat index of one GPU; SpecError when it does not exist."""
        n = self._node(node)
        if not 0 <= index < self.spec.nodes[n].gpus:
            raise SpecError(f"node {node!r} has no GPU {index}")
        return self.first_gpu[n] + index

    def node_gpus(self, node: str) -> np.ndarray:
        n = self._node(node)
        return np.arange(self.first_gpu[n], self.first_gpu[n] + self.spec.nodes[n].gpus)

    def job_gpus(self, job: Job) -> np.ndarray:
        return np.array([self.gpu(node, i) for node, idx in job.placement for i in idx], dtype=np.int64)

    def job(self, key: str | None) -> int:
        if key not in self.job_index:
            raise SpecError(f"unknown job {key!r}")
        return self.job_index[key]

    def _node(self, node: str | None) -> int:
        if node not in self.node_index:
            raise SpecError(f"unknown node {node!r}")
        return self.node_index[node]


def _layout(spec: ClusterSpec) -> _Layout:
    if not 1.0 <= spec.interval_s <= 10.0:
        raise SpecError(f"interval_s must be within 1..10 s, got {spec.interval_s}")
    if spec.order not in ("time", "node", "pulls"):
        raise SpecError(f"unknown order {spec.order!r}")
    names = [n.name for n in spec.nodes]
    if len(set(names)) != len(names):
        raise SpecError("duplicate node names")
    first, node_of, local, models = [], [], [], []
    for n, node in enumerate(spec.nodes):
        first.append(len(node_of))
        node_of.extend([n] * node.gpus)
        local.extend(range(node.gpus))
        models.extend([node.model] * node.gpus)
    keys = [j.key for j in spec.jobs]
    if len(set(keys)) != len(keys):
        raise SpecError("duplicate job keys")
    return _Layout(
        spec,
        {n: i for i, n in enumerate(names)},
        np.array(node_of),
        np.array(local),
        first,
        models,
        {k: i for i, k in enumerate(keys)},
    )


# ------------------------------------------------------------------------------------------ schedule


@dataclass
class _Schedule:
    """Per-second, per-GPU (or per-job) inputs to the physics, built from jobs and incidents."""

    job_at: np.ndarray  # (T, G) int, -1 = no job
    phase: np.ndarray  # (T, G) int8
    silent: np.ndarray  # (T, G) speed factor without any visible cause
    brake: np.ndarray  # (T, G) clock factor from the HW power brake
    cap: np.ndarray  # (T, G) clock factor from an operator power cap
    cap_watts: np.ndarray  # (T, G) enforced power limit
    host_idle: np.ndarray  # (T, G) seconds per step a GPU waits for its host before computing
    r_mult: np.ndarray  # (T, G) thermal-resistance multiplier (cooling)
    bump: np.ndarray  # (T, G) transient sensor temperature excursion
    up: np.ndarray  # (T, G) bool
    comm_mult: np.ndarray  # (T, J)
    input_idle: np.ndarray  # (T, J) seconds per step every GPU of the job waits for input
    agent_down: np.ndarray  # (T, N) bool
    resets: list[tuple[int, int]] = field(default_factory=list)  # (t, node)
    xids: list[tuple[int, int, int]] = field(default_factory=list)  # (t, gpu, code)


def _schedule(lay: _Layout, rng: np.random.Generator) -> _Schedule:
    spec = lay.spec
    T, G, J = int(math.ceil(spec.duration_s)) + 1, lay.gpus, len(spec.jobs)
    one = np.ones((T, G))
    s = _Schedule(
        np.full((T, G), -1, dtype=np.int64),
        np.zeros((T, G), dtype=np.int8),
        one.copy(),
        one.copy(),
        one.copy(),
        np.array([m.tdp_watts for m in lay.model_of])[None, :] * one,
        np.zeros((T, G)),
        one.copy(),
        np.zeros((T, G)),
        np.ones((T, G), dtype=bool),
        np.ones((T, J)),
        np.zeros((T, J)),
        np.zeros((T, len(spec.nodes)), dtype=bool),
    )
    for j, job in enumerate(spec.jobs):
        _place_job(lay, s, j, job, T)
    for inc in sorted(spec.incidents, key=lambda i: i.kind == "gpu_lost"):
        _apply_incident(lay, s, inc, T, rng)
    return s


def _span(start_s: float, end_s: float | None, T: int) -> slice:
    a = max(0, int(round(start_s)))
    b = T if end_s is None else min(T, int(round(end_s)))
    return slice(a, max(a, b))


def _place_job(lay: _Layout, s: _Schedule, j: int, job: Job, T: int) -> None:
    gpus = lay.job_gpus(job)
    span = _span(job.start_s, job.end_s, T)
    if np.any(s.job_at[span][:, gpus] >= 0):
        raise SpecError(f"job {job.key!r} overlaps another job on the same GPU")
    s.job_at[span.start : span.stop, gpus] = j
    a, b = span.start, span.stop
    s.phase[a:b, gpus] = TRAIN
    s.phase[a : min(b, a + int(job.startup_s)), gpus] = STARTUP
    if job.end_s is not None and job.end_s <= T:
        s.phase[max(a, b - int(job.winddown_s)) : b, gpus] = WINDDOWN


def _apply_incident(lay: _Layout, s: _Schedule, inc: Incident, T: int, rng: np.random.Generator) -> None:
    span = _span(inc.start_s, inc.end_s, T)
    kind = inc.kind
    if kind in ("slow_gpu", "jitter"):
        s.silent[span, lay.gpu(inc.node, inc.gpu)] *= inc.severity
    elif kind == "slow_node":
        s.silent[span, lay.node_gpus(inc.node)] *= inc.severity
    elif kind == "power_brake":
        s.brake[span, lay.gpu(inc.node, inc.gpu)] = inc.severity
    elif kind == "node_brake":
        s.brake[span, lay.node_gpus(inc.node)] = inc.severity
    elif kind == "host_starved":
        # A whole node's host (gpu None), or one rank's own input pipeline (gpu set).
        job = lay.spec.jobs[lay.job(inc.job)]
        gpus = lay.node_gpus(inc.node) if inc.gpu is None else lay.gpu(inc.node, inc.gpu)
        s.host_idle[span, gpus] = inc.severity * job.step_s
    elif kind == "cooling_failure":
        _ramp(s.r_mult, span, lay.gpu(inc.node, inc.gpu), inc.severity, ramp_s=inc.count or 120)
    elif kind in ("hot_gpu", "warm_gpu"):
        _ramp(s.r_mult, span, lay.gpu(inc.node, inc.gpu), _hot_multiplier(lay, inc), ramp_s=60)
    elif kind == "temp_spike":
        _spike(s.bump, span, lay.gpu(inc.node, inc.gpu), inc.severity)
    elif kind == "comm_slowdown":
        s.comm_mult[span, lay.job(inc.job)] = inc.severity
    elif kind in ("input_starved", "checkpoint"):
        job = lay.spec.jobs[lay.job(inc.job)]
        s.input_idle[span, lay.job(inc.job)] = inc.severity * job.step_s
    elif kind in ("power_cap", "node_power_cap"):
        _power_cap(lay, s, inc, span)
    elif kind == "gpu_lost":
        _gpu_lost(lay, s, inc, span, T)
    elif kind == "xid":
        g = lay.gpu(inc.node, inc.gpu)
        times = np.sort(rng.uniform(span.start, max(span.start + 1, span.stop), size=max(1, inc.count)))
        s.xids.extend((int(t), g, inc.code) for t in times)
    elif kind == "agent_down":
        s.agent_down[span, lay._node(inc.node)] = True
    elif kind == "node_crash":
        _node_crash(lay, s, inc, span, T)
    elif kind == "counter_reset":
        s.resets.append((span.start, lay._node(inc.node)))
    else:
        raise SpecError(f"unknown incident kind {kind!r}")


def _ramp(arr: np.ndarray, span: slice, g: int, target: float, ramp_s: float) -> None:
    n = span.stop - span.start
    arr[span, g] = 1.0 + (target - 1.0) * np.clip(np.arange(1, n + 1) / max(ramp_s, 1.0), 0.0, 1.0)


def _spike(arr: np.ndarray, span: slice, g: int, amplitude: float) -> None:
    n = span.stop - span.start
    arr[span, g] += amplitude * (1.0 - np.abs(np.linspace(-1.0, 1.0, n)))


def _hot_multiplier(lay: _Layout, inc: Incident) -> float:
    """Thermal-resistance multiplier that puts a training GPU's temperature near `severity` °C."""
    g = lay.gpu(inc.node, inc.gpu)
    node, model = lay.spec.nodes[lay.node_of[g]], lay.model_of[g]
    job = next(j for j in lay.spec.jobs if (inc.node, inc.gpu) in {(n, i) for n, idx in j.placement for i in idx})
    cf = 0.98 / (1.0 + job.comm_ratio)  # minus the usual few % of waiting for the slowest rank
    watts = model.idle_watts + (model.tdp_watts - model.idle_watts) * job.intensity * _silicon(lay, g) * (
        0.95 * cf + 0.25 * (1 - cf)
    )
    rise = watts * model.thermal_resistance_celsius_per_watt
    return (inc.severity - node.ambient_celsius - _slot_offset(lay, g)) / rise


def _power_cap(lay: _Layout, s: _Schedule, inc: Incident, span: slice) -> None:
    job = lay.spec.jobs[lay.job(inc.job)]
    gpus = lay.job_gpus(job)
    if inc.node is not None:  # a cap on one node's GPUs only (a rack or PDU power limit)
        gpus = np.intersect1d(gpus, lay.node_gpus(inc.node))
    model = lay.model_of[gpus[0]]
    s.cap[span, gpus] = inc.severity
    # The operator's cap sits just above what the GPUs draw at the reduced clock: they hover at it.
    cf = 1.0 / (1.0 + job.comm_ratio)
    draw = model.idle_watts + (model.tdp_watts - model.idle_watts) * job.intensity * (
        0.95 * cf * inc.severity**2 + 0.25 * (1 - cf)
    )
    s.cap_watts[span, gpus] = round(draw * 1.02)


def _gpu_lost(lay: _Layout, s: _Schedule, inc: Incident, span: slice, T: int) -> None:
    g = lay.gpu(inc.node, inc.gpu)
    s.up[span.start :, g] = False
    j = s.job_at[span.start, g]
    s.job_at[span.start :, g] = -1
    s.phase[span.start :, g] = IDLE
    if j < 0:
        return
    _hang_then_die(s, j, span.start, int(inc.severity or 30), T)


def _node_crash(lay: _Layout, s: _Schedule, inc: Incident, span: slice, T: int) -> None:
    """The node goes down (no samples until end_s, when it is back without a job); the ranks of its
    jobs on other nodes hang for `severity` seconds."""
    gpus = lay.node_gpus(inc.node)
    s.agent_down[span, lay._node(inc.node)] = True
    jobs = set(s.job_at[span.start, gpus].tolist()) - {-1}
    s.job_at[span.start :, gpus] = -1
    s.phase[span.start :, gpus] = IDLE
    for j in sorted(jobs):
        _hang_then_die(s, j, span.start, int(inc.severity or 30), T)


def _hang_then_die(s: _Schedule, j: int, start: int, seconds: int, T: int) -> None:
    """Job j's remaining ranks spin in a collective a lost rank never joins (NCCL's timeout), then the
    job dies and they go idle."""
    peers = np.flatnonzero(s.job_at[start] == j)
    hang_end = min(T, start + seconds)
    s.phase[start:hang_end, peers] = HANG
    s.job_at[hang_end:, peers] = np.where(s.job_at[hang_end:, peers] == j, -1, s.job_at[hang_end:, peers])
    s.phase[hang_end:, peers] = np.where(s.job_at[hang_end:, peers] == -1, IDLE, s.phase[hang_end:, peers])


def _slot_offset(lay: _Layout, g: int) -> float:
    """Structural temperature offset of a slot (airflow position), stable per GPU."""
    h = hashlib.sha256(f"{lay.spec.seed}:slot:{g}".encode()).digest()
    return (h[0] / 255.0 - 0.5) * 6.0


def _silicon(lay: _Layout, g: int) -> float:
    """Structural power factor of a die (leakage), stable per GPU."""
    h = hashlib.sha256(f"{lay.spec.seed}:silicon:{g}".encode()).digest()
    return 1.0 + (h[0] / 255.0 - 0.5) * 0.06


DRIFT_PERIOD_S = (600.0, 1800.0)


class _Drift:
    """Each GPU's work factor over time in jobs whose routing drifts (Job.work_drift). Drawn from its own
    generator, so specs without drift keep their traces."""

    def __init__(self, lay: _Layout):
        G = lay.gpus
        rng = np.random.default_rng([lay.spec.seed, 52])
        self.amplitude = np.zeros(G)
        for job in lay.spec.jobs:
            self.amplitude[lay.job_gpus(job)] = job.work_drift * rng.uniform(0.3, 1.0, len(lay.job_gpus(job)))
        self.period = rng.uniform(*DRIFT_PERIOD_S, G)
        self.phase = rng.uniform(0.0, 2 * math.pi, G)

    def at(self, t: int) -> np.ndarray:
        return 1.0 + self.amplitude * np.sin(2 * math.pi * t / self.period + self.phase)


# ------------------------------------------------------------------------------------------- physics


@dataclass
class _Result:
    """What the physics produced: per-second truth arrays and per-sample readings."""

    temp_true: np.ndarray  # (T, G) die temperature incl. transients, before sensor noise
    bits: np.ndarray  # (T, G) throttle bits
    slowdown: np.ndarray  # (T, J) step time / step time without straggling causes - 1
    own_slowdown: np.ndarray  # (T, G) the same had only this GPU been slowed (0 outside training)
    comm_growth: np.ndarray  # (T, J) step-time growth from comm slowdown
    util_drop: np.ndarray  # (T, J) share of step all GPUs idle waiting for input
    samples: dict[str, np.ndarray]  # field -> (K, G) readings at sample instants
    sample_steps: np.ndarray  # (K,) physics second of each sample


class _Physics:
    """Steps synchronous training one second at a time, vectorised over every GPU."""

    def __init__(self, lay: _Layout, sch: _Schedule, rng: np.random.Generator):
        self.lay, self.sch, self.rng = lay, sch, rng
        spec, G = lay.spec, lay.gpus
        m = lay.model_of
        self.tdp = np.array([x.tdp_watts for x in m])
        self.idle_w = np.array([x.idle_watts for x in m])
        self.r_th = np.array([x.thermal_resistance_celsius_per_watt for x in m])
        self.slowdown_c = np.array([x.slowdown_celsius for x in m])
        self.gpm = np.array([x.has_gpm for x in m])
        self.ambient = np.array([spec.nodes[n].ambient_celsius for n in lay.node_of])
        self.slot = np.array([_slot_offset(lay, g) for g in range(G)])
        self.silicon = np.array([_silicon(lay, g) for g in range(G)])
        self.tau = rng.uniform(30.0, 60.0, G)
        self.mem_delta = rng.uniform(3.0, 8.0, G)
        jobs = spec.jobs
        self.step = np.array([j.step_s for j in jobs] + [1.0])
        self.comm = np.array([j.comm_ratio * j.step_s for j in jobs] + [0.0])
        self.intensity = np.array([j.intensity for j in jobs] + [0.0])
        self.sm_coef = np.array([j.sm_coefficient for j in jobs] + [0.0])
        self.wobble = np.array([j.shared_wobble for j in jobs] + [0.0])
        self.mem_bytes = np.array([j.memory_bytes for j in jobs] + [0], dtype=np.float64)
        self.multi_node = np.array([len(j.placement) > 1 for j in jobs] + [False])
        self.rank_factor = np.ones(G)
        for job in jobs:
            gpus = lay.job_gpus(job)
            self.rank_factor[gpus] = 1.0 + rng.uniform(-job.structural_spread, job.structural_spread, len(gpus))
        self.multi_gpu = np.array([sum(len(i) for _, i in j.placement) > 1 for j in jobs] + [False])
        self.drift = _Drift(lay) if any(j.work_drift for j in jobs) else None
        for job in jobs:
            if job.rank_work:
                self.rank_factor[lay.job_gpus(job)] *= np.asarray(job.rank_work)
        self.nvlink_bw = np.array([x.nvlink_bytes_per_second for x in m])
        self.pcie_bw = np.array([x.pcie_bytes_per_second for x in m])
        idle_temp = self.ambient + self.slot + self.r_th * self.idle_w
        self.temp = idle_temp + rng.normal(0, 0.5, G)
        self.c_th = np.ones(G)
        self.irregular = np.zeros(G)

    def run(self) -> _Result:
        """Simulate every second of the trace and read the sensors at each sample instant."""
        spec, G, J = self.lay.spec, self.lay.gpus, len(self.lay.spec.jobs)
        T = self.sch.phase.shape[0]
        steps = np.unique(
            np.minimum(np.round(np.arange(0, spec.duration_s + 1e-9, spec.interval_s)), T - 1).astype(np.int64)
        )
        K = len(steps)
        names = (
            "util",
            "sm",
            "occ",
            "power",
            "temp",
            "memtemp",
            "clock",
            "bits",
            "energy",
            "nvl",
            "pcie_tx",
            "pcie_rx",
            "mem_used",
            "mem_util",
            "cap_watts",
        )
        out = {n: np.zeros((K, G)) for n in names}
        out["throttle"] = np.zeros((K, G, len(THROTTLE_LABELS)))
        res = _Result(
            np.zeros((T, G)),
            np.zeros((T, G), dtype=np.int64),
            np.zeros((T, J)),
            np.zeros((T, G)),
            np.zeros((T, J)),
            np.zeros((T, J)),
            out,
            steps,
        )
        acc = {
            "energy": self.rng.uniform(1e8, 5e9, G),
            "nvl": self.rng.uniform(1e12, 1e14, G),
            "pcie_tx": self.rng.uniform(1e11, 1e13, G),
            "pcie_rx": self.rng.uniform(1e11, 1e13, G),
            "throttle": np.zeros((G, len(THROTTLE_LABELS))),
        }
        sm_sum, occ_sum, n_sum, k = np.zeros(G), np.zeros(G), 0, 0
        resets = {}
        for t, n in self.sch.resets:
            resets.setdefault(t, []).append(n)
        for t in range(T):
            r = self._second(t, res, acc)
            sm_sum += r["sm"]
            occ_sum += r["occ"]
            n_sum += 1
            for n in resets.get(t, ()):
                for key in ("energy", "nvl", "pcie_tx", "pcie_rx"):
                    acc[key][self.lay.node_gpus(self.lay.spec.nodes[n].name)] = 0.0
            if k < K and steps[k] == t:
                self._read(out, k, r, acc, sm_sum / n_sum, occ_sum / n_sum)
                sm_sum, occ_sum, n_sum, k = np.zeros(G), np.zeros(G), 0, k + 1
        return res

    def _second(self, t: int, res: _Result, acc: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        sch, rng, G = self.sch, self.rng, self.lay.gpus
        J = len(self.lay.spec.jobs)
        job, phase = sch.job_at[t], sch.phase[t]
        jx = np.where(job < 0, J, job)
        train = phase == TRAIN
        c = np.minimum(np.minimum(self.c_th, sch.brake[t]), sch.cap[t])
        rank = self.rank_factor if self.drift is None else self.rank_factor * self.drift.at(t)
        noise = rank * (1.0 + 0.015 * self.lay.spec.noise_scale * rng.standard_normal(G))
        comp = self.step[jx] * noise / (c * sch.silent[t])
        member = (jx[None, :] == np.arange(J)[:, None]) & train[None, :]
        # The operator's cap on a whole job is its nominal pace; a cap on some of its GPUs (one node's
        # rack limit) slows it like any straggler: nominal is the least-capped member's pace.
        cap_nom = np.where(member, sch.cap[t][None, :], 0.0).max(axis=1, initial=0.0)
        cap_nom = np.append(np.where(cap_nom > 0, cap_nom, 1.0), 1.0)[jx]
        comp_nom = self.step[jx] * noise / cap_nom
        sync = np.where(member, (sch.host_idle[t] + comp)[None, :], 0.0).max(axis=1, initial=0.0)
        sync_nom = np.where(member, comp_nom[None, :], 0.0).max(axis=1, initial=0.0)
        comm = self.comm[:J] * sch.comm_mult[t]
        inp = sch.input_idle[t]
        step_j = inp + sync + comm
        nominal = inp + sync_nom + comm
        has = member.any(axis=1)
        res.slowdown[t] = np.where(has, step_j / np.where(has, nominal, 1.0) - 1.0, 0.0)
        # Each GPU's own share: a jitter on one rank slows the job, and must not count as the doing of
        # another rank's incident that happens to be open meanwhile.
        alone = np.maximum(np.append(sync_nom, 0.0)[jx], sch.host_idle[t] + comp)
        own_step = np.append(inp, 0.0)[jx] + alone + np.append(comm, 0.0)[jx]
        in_job = train & (job >= 0)
        res.own_slowdown[t] = np.where(in_job, own_step / np.where(in_job, np.append(nominal, 1.0)[jx], 1.0) - 1.0, 0.0)
        base = sync_nom + self.comm[:J]
        res.comm_growth[t] = np.where(has, (comm - self.comm[:J]) / np.where(has, base, 1.0), 0.0)
        res.util_drop[t] = np.where(has, inp / np.where(has, step_j, 1.0), 0.0)
        step_g = np.append(step_j, 1.0)[jx]
        cf = np.clip(comp / step_g, 0.0, 1.0)
        idf = np.clip((sch.host_idle[t] + np.append(inp, 0.0)[jx]) / step_g, 0.0, 1.0)
        wf = np.clip(1.0 - cf - idf, 0.0, 1.0)
        util, sm, dyn = self._activity(t, phase, jx, cf, wf, idf, c)
        power, bits = self._power(t, dyn, phase, train, c)
        self._thermal(t, power, res)
        bits = bits | self._thermal_bits(t, res)
        res.bits[t] = bits
        comm_share = np.where(train, np.append(self.comm[:J], 0.0)[jx] / step_g, 0.0)
        nvl = np.where(self.multi_gpu[jx], self.nvlink_bw * 0.6 * comm_share, 0.0)
        inter = np.where(self.multi_node[jx], self.pcie_bw * 0.5 * comm_share, 0.0)
        # Without NVLink the collective inside the node crosses PCIe as well.
        inter += np.where(self.multi_gpu[jx] & (self.nvlink_bw == 0), self.pcie_bw * 0.5 * comm_share, 0.0)
        acc["energy"] += power
        acc["nvl"] += nvl
        acc["pcie_tx"] += inter + np.where(train, 2e7, 1e4)
        acc["pcie_rx"] += inter + np.where(train, 2e8 * cf, 1e4)
        for i, b in enumerate(_LABEL_BITS):
            acc["throttle"][:, i] += (bits & b) != 0
        occ = np.where(self.gpm, 0.45 * sm / 0.85, 0.0)
        return {
            "util": util,
            "sm": sm,
            "occ": occ,
            "power": power,
            "bits": bits,
            "c": c,
            "phase": phase,
            "jx": jx,
            "cf": cf,
            "wf": wf,
            "t": np.full(G, t),
        }

    def _activity(self, t, phase, jx, cf, wf, idf, c):
        """Utilization, SM activity and the dynamic-power share for every GPU this second."""
        rng, G = self.rng, self.lay.gpus
        if t % 4 == 0:
            self.irregular = rng.uniform(0.0, 0.7, G) * (rng.random(G) < 0.7)
        irregular = (phase == STARTUP) | (phase == WINDDOWN)
        train = phase == TRAIN
        hang = phase == HANG
        irr = self.irregular * irregular
        # Synchronous ranks are in the same phase of the step at the same instant, so what a one-second
        # window catches (more compute, or more collective) moves every GPU of a job together.
        ns = self.lay.spec.noise_scale
        together = 1.0 + 0.06 * ns * self.wobble[jx] * np.append(rng.standard_normal(len(self.lay.spec.jobs)), 0.0)[jx]
        cfw = np.clip(cf * together, 0.0, 1.0)
        util = np.where(train, 1.0 - idf, 0.0) + irr + hang
        sm = np.where(train, self.sm_coef[jx] * cfw + 0.05 * wf, 0.0) + irr * 0.35 + hang * 0.03
        dyn = np.where(train, self.intensity[jx] * (0.95 * cfw * c**2 + 0.25 * wf), 0.0) + irr * 0.35 + hang * 0.12
        util = np.clip(util + np.where(util > 0, rng.normal(0, 0.01 * ns, G), 0.0), 0.0, 1.0)
        sm = np.clip(sm * (1.0 + rng.normal(0, 0.04 * ns, G)), 0.0, 1.0)
        return util, sm, dyn

    def _power(self, t, dyn, phase, train, c):
        sch, rng = self.sch, self.rng
        mean = self.idle_w + (self.tdp - self.idle_w) * dyn * self.silicon
        power = mean + rng.normal(0.0, 0.03 * self.lay.spec.noise_scale, self.lay.gpus) * self.tdp * (dyn > 0)
        power = np.clip(power, self.idle_w * 0.9, sch.cap_watts[t])
        bits = np.where(phase == IDLE, BIT_IDLE, 0)
        bits |= np.where((sch.cap[t] < 1.0) & train, BIT_SW_POWER_CAP, 0)
        bits |= np.where(sch.brake[t] < 1.0, BIT_POWER_BRAKE | BIT_HW_SLOWDOWN, 0)
        self._mean_power = np.clip(mean, self.idle_w, sch.cap_watts[t])
        return power, bits

    def _thermal(self, t, power, res):
        """First-order RC heat model on mean power, and the driver's thermal clock control."""
        sch = self.sch
        eq = self.ambient + self.slot + self.r_th * sch.r_mult[t] * self._mean_power
        self.temp += (eq - self.temp) * (1.0 - np.exp(-1.0 / self.tau))
        die = self.temp + sch.bump[t]
        res.temp_true[t] = die
        hw = die >= self.slowdown_c
        sw = die >= self.slowdown_c - 1.5
        self.c_th = np.where(
            hw,
            np.maximum(self.c_th - 0.04, 0.45),
            np.where(sw, np.maximum(self.c_th - 0.01, 0.8), np.minimum(self.c_th + 0.01, 1.0)),
        )

    def _thermal_bits(self, t, res):
        die = res.temp_true[t]
        sw = (die >= self.slowdown_c - 1.5) | ((self.c_th < 1.0) & (die >= self.slowdown_c - 3.5))
        hw = die >= self.slowdown_c
        return np.where(sw, BIT_SW_THERMAL, 0) | np.where(hw, BIT_HW_THERMAL | BIT_HW_SLOWDOWN, 0)

    def _read(self, out, k, r, acc, sm_avg, occ_avg):
        """Sensor readings at one sample instant (NVML's integer temperatures, 15 MHz clock bins)."""
        rng, G, sch, t = self.rng, self.lay.gpus, self.sch, int(r["t"][0])
        active = r["phase"] != IDLE
        max_hz = np.array([m.sm_clock_max_hz for m in self.lay.model_of])
        idle_hz = np.array([m.sm_clock_idle_hz for m in self.lay.model_of])
        ns = self.lay.spec.noise_scale
        clock = np.where(active, max_hz * r["c"] * (1.0 + rng.normal(0, 0.003 * ns, G)), idle_hz)
        out["clock"][k] = np.minimum(np.round(clock / 15e6) * 15e6, max_hz)
        out["util"][k] = np.round(r["util"], 2)
        out["sm"][k] = np.round(sm_avg, 4)
        out["occ"][k] = np.round(occ_avg, 4)
        out["power"][k] = np.round(r["power"], 3)
        out["temp"][k] = np.round(self.temp + sch.bump[t] + rng.normal(0, 0.3 * ns, G))
        out["memtemp"][k] = np.round(self.temp + self.mem_delta + rng.normal(0, 0.3 * ns, G))
        out["bits"][k] = r["bits"]
        out["energy"][k] = np.round(acc["energy"], 3)
        out["nvl"][k] = np.floor(acc["nvl"] / 1024.0) * 1024.0
        out["pcie_tx"][k] = np.floor(acc["pcie_tx"])
        out["pcie_rx"][k] = np.floor(acc["pcie_rx"])
        out["throttle"][k] = acc["throttle"]
        used = np.where(r["phase"] != IDLE, self.mem_bytes[r["jx"]], 0.0) + 512 * 2**20
        out["mem_used"][k] = used
        out["mem_util"][k] = np.round(np.clip(0.4 * r["cf"] + 0.1 * r["wf"], 0, 1) * (r["phase"] == TRAIN), 2)
        out["cap_watts"][k] = sch.cap_watts[t]


# ---------------------------------------------------------------------------------------- emission


def _static_gpu(lay: _Layout, g: int) -> dict[str, Any]:
    m, n = lay.model_of[g], lay.spec.nodes[lay.node_of[g]]
    h = hashlib.sha256(f"{lay.spec.seed}:{n.name}:{lay.local[g]}".encode()).hexdigest()
    uuid = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
    bus = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)[lay.local[g] % 8]
    return {
        "index": int(lay.local[g]),
        "uuid": uuid,
        "model": m.name,
        "up": True,
        "hpc_job": None,
        "kubernetes_namespace": None,
        "kubernetes_pod": None,
        "pci_bus_id": f"00000000:{bus:02X}:00.0",
        "serial": str(int(h[32:44], 16))[:13],
        "vbios_version": m.vbios_version,
        "memory_total_bytes": m.memory_total_bytes,
        "slowdown_temperature_celsius": m.slowdown_celsius,
        "shutdown_temperature_celsius": m.shutdown_celsius,
        "max_operating_temperature_celsius": m.max_operating_celsius,
        "memory_max_operating_temperature_celsius": m.memory_max_operating_celsius,
        "sm_clock_max_hertz": m.sm_clock_max_hz,
        "memory_clock_max_hertz": m.memory_clock_max_hz,
        "memory_clock_hertz": m.memory_clock_max_hz,
        "nvlink_link_tx_bytes_total": [],
        "nvlink_link_rx_bytes_total": [],
        "ecc_corrected_errors_total": 0,
        "ecc_uncorrected_errors_total": 0,
        "remapped_rows_correctable": 0,
        "remapped_rows_uncorrectable": 0,
        "remapped_rows_pending": False,
        "remapped_rows_failure": False,
        # Every reading is read each cycle: none is held from a slower tier.
        "slow_readings_age_seconds": {},
    }


_LOST_KEEP = ("index", "uuid", "model", "pci_bus_id", "serial", "vbios_version")
_NULLABLE = (
    "utilization_ratio",
    "memory_utilization_ratio",
    "sm_active_ratio",
    "sm_occupancy_ratio",
    "memory_used_bytes",
    "memory_free_bytes",
    "memory_total_bytes",
    "temperature_celsius",
    "memory_temperature_celsius",
    "slowdown_temperature_celsius",
    "shutdown_temperature_celsius",
    "max_operating_temperature_celsius",
    "memory_max_operating_temperature_celsius",
    "power_watts",
    "power_limit_watts",
    "energy_joules_total",
    "sm_clock_hertz",
    "sm_clock_max_hertz",
    "memory_clock_hertz",
    "memory_clock_max_hertz",
    "throttle_reasons",
    "nvlink_tx_bytes_total",
    "nvlink_rx_bytes_total",
    "pcie_tx_bytes_total",
    "pcie_rx_bytes_total",
    "ecc_corrected_errors_total",
    "ecc_uncorrected_errors_total",
    "remapped_rows_correctable",
    "remapped_rows_uncorrectable",
    "remapped_rows_pending",
    "remapped_rows_failure",
    "xid_errors_total",
    "last_xid",
)


class _Emitter:
    """Turns per-sample readings into snapshot-contract lines, node by node."""

    def __init__(self, lay: _Layout, sch: _Schedule, res: _Result, rng: np.random.Generator):
        self.lay, self.sch, self.res, self.rng = lay, sch, res, rng
        self.static = [_static_gpu(lay, g) for g in range(lay.gpus)]
        spec = lay.spec
        self.phase_s = rng.uniform(0.0, spec.interval_s, len(spec.nodes))
        self.dropped = self._drops()
        self.xid_by_step: dict[int, list[tuple[int, int]]] = {}
        for t, g, code in sch.xids:
            self.xid_by_step.setdefault(t, []).append((g, code))

    def _drops(self) -> np.ndarray:
        """Lines lost in transport: independent drops, never more than two in a row."""
        K, N = len(self.res.sample_steps), len(self.lay.spec.nodes)
        drop = self.rng.random((K, N)) < self.lay.spec.drop_ratio
        for k in range(2, K):
            drop[k] &= ~(drop[k - 1] & drop[k - 2])
        return drop

    def lines(self) -> list[tuple[float, int, bytes]]:
        """(time, node, line) for every emitted snapshot, in simulation order."""
        lay, res, spec = self.lay, self.res, self.lay.spec
        out = []
        xid_state = [{"total": 0, "codes": {}, "last": None} for _ in range(lay.gpus)]
        ecc = np.zeros(lay.gpus, dtype=np.int64)
        remap = np.zeros(lay.gpus, dtype=np.int64)
        prev_step = -1
        was_down = np.zeros(len(spec.nodes), dtype=bool)
        reset_at = {(t, n) for t, n in self.sch.resets}
        pending_reset = np.zeros(len(spec.nodes), dtype=bool)
        for k, t in enumerate(res.sample_steps):
            for tt in range(prev_step + 1, t + 1):
                for g, code in self.xid_by_step.get(tt, ()):
                    st = xid_state[g]
                    st["total"] += 1
                    st["codes"][code] = st["codes"].get(code, 0) + 1
                    st["last"] = code
                    ecc[g] += code in (48, 94, 95)
                    remap[g] += code in (63, 64)
                pending_reset |= np.array([(tt, n) in reset_at for n in range(len(spec.nodes))])
            prev_step = t
            rows = {name: arr[k].tolist() for name, arr in res.samples.items() if name != "throttle"}
            throttle = res.samples["throttle"][k].tolist()
            for n, node in enumerate(spec.nodes):
                if self.sch.agent_down[t, n]:
                    was_down[n] = True
                    continue
                if was_down[n]:
                    was_down[n] = False
                    for g in lay.node_gpus(node.name):  # the agent restarted: its XID tally restarts
                        xid_state[g] = {"total": 0, "codes": {}, "last": None}
                resets = _RESET_FIELDS if pending_reset[n] else ()
                pending_reset[n] = False
                if self.dropped[k, n]:
                    continue
                time = spec.t0 + t + self.phase_s[n] + node.clock_skew_s + self.rng.normal(0, spec.max_jitter_s)
                gpus = [
                    self._gpu(g, t, rows, throttle, xid_state[g], ecc[g], remap[g], resets)
                    for g in lay.node_gpus(node.name)
                ]
                snap = {
                    "schema": 1,
                    "node": node.name,
                    "time": round(float(time), 3),
                    "driver_version": "550.90.07",
                    "nvml_version": "12.550.90.07",
                    "cuda_driver_version": "12.4",
                    "sample_duration_seconds": round(float(self.rng.uniform(0.01, 0.05)), 4),
                    "gpus": gpus,
                }
                out.append((time, n, orjson.dumps(snap)))
        return out

    def _gpu(self, g, t, rows, throttle, xid, ecc, remap, resets) -> dict[str, Any]:
        lay, sch = self.lay, self.sch
        d = dict(self.static[g])
        job = sch.job_at[t, g]
        d["hpc_job"] = lay.spec.jobs[job].hpc_job if job >= 0 else None
        d["xid_errors_total"] = xid["total"]
        d["xid_errors_by_code"] = {str(c): v for c, v in xid["codes"].items()}
        d["last_xid"] = xid["last"]
        d["counter_resets"] = list(resets)
        if not sch.up[t, g]:
            for name in _NULLABLE:
                if name not in _LOST_KEEP:
                    d[name] = None
            d.update(
                up=False,
                throttle_seconds_total={},
                xid_errors_by_code={str(c): v for c, v in xid["codes"].items()},
                xid_errors_total=xid["total"],
                last_xid=xid["last"],
            )
            return d
        gpm = lay.model_of[g].has_gpm
        d["utilization_ratio"] = rows["util"][g]
        d["memory_utilization_ratio"] = rows["mem_util"][g]
        d["sm_active_ratio"] = rows["sm"][g] if gpm else None
        d["sm_occupancy_ratio"] = rows["occ"][g] if gpm else None
        d["memory_used_bytes"] = int(rows["mem_used"][g])
        # The generator reserves no memory for the driver: what is not used is free.
        d["memory_free_bytes"] = lay.model_of[g].memory_total_bytes - d["memory_used_bytes"]
        d["temperature_celsius"] = rows["temp"][g]
        d["memory_temperature_celsius"] = rows["memtemp"][g]
        d["power_watts"] = rows["power"][g]
        d["power_limit_watts"] = rows["cap_watts"][g]
        d["energy_joules_total"] = rows["energy"][g]
        d["sm_clock_hertz"] = rows["clock"][g]
        d["throttle_reasons"] = int(rows["bits"][g])
        d["throttle_seconds_total"] = dict(zip(THROTTLE_LABELS, throttle[g]))
        # A board without NVLink has no NVLink counters: NVML answers NOT_SUPPORTED, the reading is absent.
        nvl = int(rows["nvl"][g]) if lay.model_of[g].nvlink_bytes_per_second else None
        d["nvlink_tx_bytes_total"] = nvl
        d["nvlink_rx_bytes_total"] = nvl
        d["pcie_tx_bytes_total"] = int(rows["pcie_tx"][g])
        d["pcie_rx_bytes_total"] = int(rows["pcie_rx"][g])
        d["ecc_uncorrected_errors_total"] = int(ecc)
        d["remapped_rows_uncorrectable"] = int(remap)
        d["remapped_rows_pending"] = bool(remap > 0)
        return d


def _order(spec: ClusterSpec, items: list[tuple[float, int, bytes]], rng: np.random.Generator) -> list[bytes]:
    if spec.order == "time":
        return [line for _, _, line in sorted(items, key=lambda x: x[0])]
    if spec.order == "node":
        return [line for _, _, line in sorted(items, key=lambda x: (x[1], x[0]))]
    # pulls: the server fetches each node's new samples every 10-30 s, nodes in random order.
    period = float(rng.uniform(10.0, 30.0))
    salt = rng.random(len(spec.nodes))
    return [line for _, _, line in sorted(items, key=lambda x: (int(x[0] // period), salt[x[1]], x[0]))]


# ------------------------------------------------------------------------------------------- truth


def _runs(mask: np.ndarray, min_len: int, max_gap: int) -> list[tuple[int, int]]:
    """[start, end] second ranges where mask holds, merging gaps shorter than max_gap."""
    idx = np.flatnonzero(mask)
    if idx.size == 0:
        return []
    runs, a, b = [], idx[0], idx[0]
    for i in idx[1:]:
        if i - b <= max_gap + 1:
            b = i
        else:
            runs.append((a, b))
            a = b = i
    runs.append((a, b))
    return [(int(a), int(b)) for a, b in runs if b - a + 1 >= min_len]


def _truths(lay: _Layout, sch: _Schedule, res: _Result) -> list[Truth]:
    spec, t0, out = lay.spec, lay.spec.t0, []
    name = lambda g: spec.nodes[lay.node_of[g]].name  # noqa: E731

    def thermal_truth(g: int, a: int, end: float, required: bool, note: str, lead: float = 0) -> Truth:
        return Truth("thermal_throttle", name(g), int(lay.local[g]), None, t0 + a, end, required, note, lead)

    # Integer sensor plus noise (0.3 °C): near the threshold the reading flickers across it. A die clearly
    # above it (or thermally throttled) must be reported, timed from its run within half a degree. Within a
    # degree an alert is allowed: a die at 82.2 °C reads 83 one time in five, and at 10 s sampling four such
    # readings in a row are 30 s "at 83 °C"; with a noisier sensor (noise_scale above 1) that band widens in
    # proportion. While a node's agent is down its GPUs' heat is never read: a required truth, and its 30 s,
    # count only what the agent saw.
    reported = sch.up & ~sch.agent_down[:, lay.node_of]
    band = max(1.0, spec.noise_scale)
    near = (res.temp_true >= THERMAL_ALERT_CELSIUS - 0.5) & reported
    clear = (res.temp_true >= THERMAL_ALERT_CELSIUS + 0.5) & reported
    plausible = (res.temp_true >= THERMAL_ALERT_CELSIUS - band) & sch.up
    throttled = ((res.bits & (BIT_SW_THERMAL | BIT_HW_THERMAL)) != 0) & reported
    for g in np.flatnonzero((plausible | throttled).any(axis=0)):
        hot = clear[:, g] | throttled[:, g]
        sustained = _runs(clear[:, g], int(THERMAL_ALERT_FOR_S), 0) + _runs(throttled[:, g], 10, 0)
        envelopes = _runs(near[:, g] | throttled[:, g], 1, 60)
        for a, b in _runs(hot, 1, 60):
            if not any(a <= s <= b for s, _ in sustained):
                continue
            lead = next((a - x for x, y in envelopes if x <= a <= y), 0)
            out.append(
                thermal_truth(g, a, t0 + b, True, "temperature clearly above threshold or thermal throttle bits", lead)
            )
        for a, b in _runs(plausible[:, g] | throttled[:, g], 1, 60):
            if _runs(plausible[a : b + 1, g], int(THERMAL_ALERT_FOR_S), 0) or throttled[a : b + 1, g].any():
                out.append(thermal_truth(g, a, t0 + b + 60, False, "temperature within a degree of the threshold"))
    for inc in spec.incidents:
        out.extend(_incident_truths(lay, sch, res, inc))
    return [replace(t, start=float(t.start), end=float(t.end), lead_s=float(t.lead_s)) for t in out]


_SLOWING = {
    "cooling_failure": "cooling failure (clock cut)",
    "slow_gpu": "silently slow GPU",
    "power_brake": "HW power brake",
    "node_brake": "HW power brake on the whole node",
    "node_power_cap": "power cap on one node",
    "slow_node": "slow node",
    "host_starved": "host starving GPUs",
    "hot_gpu": "hot GPU",
    "jitter": "jitter",
}


def _incident_truths(lay: _Layout, sch: _Schedule, res: _Result, inc: Incident) -> list[Truth]:
    spec, t0 = lay.spec, lay.spec.t0
    T = sch.phase.shape[0]
    span = _span(inc.start_s, inc.end_s, T)
    if inc.kind in _SLOWING:
        return _straggler_truths(lay, sch, res, inc, span)
    if inc.kind in ("comm_slowdown", "input_starved"):
        job = spec.jobs[lay.job(inc.job)]
        if job.hpc_job is None:
            return []
        j = lay.job(inc.job)
        if inc.kind == "comm_slowdown":
            level = float(np.median(res.comm_growth[span, j]))
            required, kind = level >= COMM_REQUIRED_GROWTH, "comm_bound"
        else:
            level = float(np.median(res.util_drop[span, j]))
            required, kind = level >= INPUT_REQUIRED_IDLE, "input_bound"
        # While the agents of all the job's nodes are down nothing shows it: the truth starts when one is back.
        seen = ~sch.agent_down[span][:, sorted({lay._node(n) for n, _ in job.placement})].all(axis=1)
        if not seen.any():
            return []
        return [
            Truth(
                kind,
                None,
                None,
                job.hpc_job,
                t0 + span.start + int(np.argmax(seen)),
                t0 + span.stop - 1,
                required,
                f"{inc.kind} level {level:.2f}",
            )
        ]
    if inc.kind == "gpu_lost":
        end = t0 + T - 1
        return [Truth("gpu_lost", inc.node, inc.gpu, None, t0 + span.start, end, True, "GPU fell off the bus")]
    if inc.kind == "xid":
        down = sch.agent_down[:, lay._node(inc.node)]
        raised = [t for t, g, c in sch.xids if g == lay.gpu(inc.node, inc.gpu) and c == inc.code]
        # An XID while the node's agent is down is never seen: the restarted agent's tally starts at 0.
        ts = [t for t in raised if not down[t]]
        out = []
        if ts:
            # XID 79 comes with the GPU falling off the bus: gpu_lost is the alert that must say so.
            req = inc.code not in APPLICATION_XIDS and inc.code != 79
            out.append(Truth("xid", inc.node, inc.gpu, None, t0 + min(ts), t0 + max(ts) + 60, req, f"XID {inc.code}"))
        # The GPU's own ECC and remap counters survive an agent restart: an error raised while the agent was
        # down shows on the first line after it is back.
        back = [t if not down[t] else t + int(np.argmin(down[t:])) for t in raised]
        if back and inc.code in (48, 94, 95):
            out.append(
                Truth("ecc", inc.node, inc.gpu, None, t0 + min(raised), t0 + max(back) + 60, False, "uncorrectable ECC")
            )
        elif back and inc.code in (63, 64):
            # The generator leaves the row remap pending (see _gpu): an ecc alert saying so is right too.
            out.append(
                Truth(
                    "ecc",
                    inc.node,
                    inc.gpu,
                    None,
                    t0 + min(raised),
                    t0 + max(back) + 60,
                    False,
                    "row remapping pending",
                )
            )
        return out
    if inc.kind in ("agent_down", "node_crash") and span.stop - span.start >= 90:
        return [
            Truth(
                "node_unreachable",
                inc.node,
                None,
                None,
                t0 + span.start,
                t0 + span.stop,
                True,
                "agent not answering" if inc.kind == "agent_down" else "node down",
            )
        ]
    return []


def _straggler_truths(lay: _Layout, sch: _Schedule, res: _Result, inc: Incident, span: slice) -> list[Truth]:
    spec, t0 = lay.spec, lay.spec.t0
    gpu_subject = inc.kind not in ("slow_node", "node_brake", "node_power_cap", "host_starved") or (
        inc.kind == "host_starved" and inc.gpu is not None
    )
    g = lay.gpu(inc.node, inc.gpu) if gpu_subject else lay.node_gpus(inc.node)[0]
    js = set(sch.job_at[span, g].tolist()) - {-1}
    if inc.kind == "jitter" or not js:
        return []
    j = max(js, key=lambda x: int((sch.job_at[span, g] == x).sum()))
    trained = (sch.phase[:, g] == TRAIN) & (sch.job_at[:, g] == j)
    window = np.zeros(len(trained), dtype=bool)
    window[span.start : min(len(trained), span.stop + 30)] = True
    if gpu_subject:
        own = res.own_slowdown[:, g]
    else:
        gs = lay.node_gpus(inc.node)
        own = np.where(sch.job_at[:, gs] == j, res.own_slowdown[:, gs], 0.0).max(axis=1)
    slow = own * trained * window
    gpu = int(lay.local[g]) if gpu_subject else None
    hpc = spec.jobs[j].hpc_job
    out = []
    allowed = _runs(slow >= STRAGGLER_ALLOWED_SLOWDOWN, 1, 60)
    # Per-step noise makes single steps cross 10 %; what matters is the slowdown over half a minute.
    smooth = np.convolve(slow, np.ones(30) / 30.0)[: len(slow)]
    down = sch.agent_down[:, lay._node(inc.node)]
    for a, b in _runs(smooth >= STRAGGLER_REQUIRED_SLOWDOWN, 45, 30):
        # While the culprit's own agent is down nothing says who it is: the truth starts when it is back.
        seen = ~down[a : b + 1]
        if not seen.any():
            continue
        back = int(np.argmax(seen))
        lead = 0 if back else next((a - x for x, y in allowed if x <= a <= y), 0)
        out.append(
            Truth(
                "straggler",
                inc.node,
                gpu,
                hpc,
                t0 + a + back,
                t0 + b,
                True,
                f"{_SLOWING[inc.kind]}: job slowed {float(np.median(slow[a : b + 1])):.0%}",
                lead,
            )
        )
    for a, b in allowed:
        out.append(
            Truth(
                "straggler", inc.node, gpu, hpc, t0 + a, t0 + b + 60, False, f"{_SLOWING[inc.kind]}: marginal slowdown"
            )
        )
    return out


# --------------------------------------------------------------------------------------- public API


def generate(spec: ClusterSpec) -> Trace:
    """Simulate the spec and return its lines and ground truth (deterministic for a given seed)."""
    lay = _layout(spec)
    rng = np.random.default_rng(spec.seed)
    sch = _schedule(lay, rng)
    res = _Physics(lay, sch, rng).run()
    emitted = _Emitter(lay, sch, res, rng).lines()
    lines = tuple(_order(spec, emitted, rng))
    gpus_per_node = [n.gpus for n in spec.nodes]
    samples = sum(gpus_per_node[n] for _, n, _ in emitted)
    return Trace(spec, lines, tuple(_truths(lay, sch, res)), samples)


def write_trace(spec: ClusterSpec, path: Path) -> Trace:
    """Generate and write the JSONL file; returns the trace (its lines are also kept in memory)."""
    trace = generate(spec)
    with open(path, "wb") as fh:
        for line in trace.lines:
            fh.write(line)
            fh.write(b"\n")
    return trace


def with_seed(spec: ClusterSpec, seed: int) -> ClusterSpec:
    """The same cluster with another noise seed."""
    return replace(spec, seed=seed)


def truths_to_json(trace: Trace) -> bytes:
    """The ground truth as a JSON array (for inspecting a trace next to its replay output)."""
    return orjson.dumps([{f: getattr(t, f) for f in Truth.__slots__} for t in trace.truths], option=orjson.OPT_INDENT_2)


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.evaluation.tracegen SCENARIO [--seed N] --out FILE`: write a catalog trace + truth."""
    import argparse

    from bench.evaluation.scenarios import BY_NAME

    ap = argparse.ArgumentParser(prog="python -m bench.evaluation.tracegen", description=main.__doc__)
    ap.add_argument("scenario", choices=sorted(BY_NAME))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="JSONL trace; truth goes to OUT.truth.json")
    args = ap.parse_args(argv)
    trace = write_trace(BY_NAME[args.scenario].build(args.seed), args.out)
    args.out.with_suffix(args.out.suffix + ".truth.json").write_bytes(truths_to_json(trace))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def without_fields(lines: list[bytes], fields: tuple[str, ...]) -> list[bytes]:
    """The trace as a driver that does not report `fields` would write it (absent, not 0)."""
    out = []
    for line in lines:
        snap = orjson.loads(line)
        for gpu in snap["gpus"]:
            for f in fields:
                gpu.pop(f, None)
        out.append(orjson.dumps(snap))
    return out
