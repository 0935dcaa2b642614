"""The simulated physics: synchronous training, power, heat, throttling and counters on a 1-second grid.

Scenario time is cut into 1 s buckets. Bucket k's state is a pure function of (scenario, seed, k, the
thermal state at the start of bucket k), and the thermal state is integrated forward from bucket 0, so
every reading is a pure function of (scenario, seed, time) however and whenever it is asked for.
`Timeline` only memoizes that recurrence for the GPUs one node's readings depend on: its own GPUs plus
every GPU of every job that touches them (a straggler on another node slows this node's GPUs).
"""

from __future__ import annotations

import hashlib
import math
import operator
from dataclasses import dataclass
from typing import Iterable

from gpufleet.reasons import ThrottleReason
from gpufleet.agent.sim.hardware import GpuModel
from gpufleet.agent.sim.scenario import GpuRef, Incident, JobSpec, Scenario

# Per-phase weights: what a GPU shows while computing vs. spinning in (or running) a collective.
SM_BUSY, SM_WAIT = 0.85, 0.05
OCC_BUSY, OCC_WAIT = 0.55, 0.03
TENSOR_BUSY = 0.70
MEM_BUSY, MEM_COMM, MEM_WAIT = 0.45, 0.30, 0.02
# Dynamic power while waiting (the compute phase's is the job's compute_intensity), as a share of the
# board's range from idle to its power limit at the maximum SM clock.
POWER_WAIT = 0.25
# The power governor (SW_POWER_CAP). Dynamic power goes as f*V^2 and V rises with f over the top of the
# V/f curve where the governor works, so the exponent of f lies between 2 and 3; the simulator takes 2.
# With it a real H100's full bf16-matmul load (held at 700 W at 1.665 GHz) wants about 960 W at 1.98 GHz.
POWER_CLOCK_EXPONENT = 2.0
GOVERNOR_MIN_CLOCK = 0.4
# What a governed GPU reads: the limit less 0-4 % from sample to sample (a real H100 held at 700 W read
# 664-716 W, 686 W on average).
GOVERNED_POWER_RATIO, GOVERNED_POWER_SPREAD = 0.98, 0.04
# Thermal control: a proportional SW cut in the band below slowdown; at slowdown, HW thermal slowdown
# drops the clock to HW_THERMAL_CLOCK for the share of each second that holds the die there (the driver
# cycles it many times a second; one-second buckets see the share).
SW_THERMAL_BAND_C = 4.0
SW_THERMAL_MAX_CUT = 0.08
HW_THERMAL_CLOCK = 0.55
# Link efficiency during collectives and host->device input traffic while computing.
NVLINK_EFFICIENCY = 0.7
PCIE_EFFICIENCY = 0.6
INPUT_BYTES_PER_S = 2.0e9
CONTEXT_BYTES = 512 * 1024 * 1024
CHECKPOINT_EVERY = 600
WINDOW_BUCKETS = 1200

# Throttle (clocks-event) bits.
IDLE, SW_POWER_CAP, HW_SLOWDOWN, SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE = (
    int(r)
    for r in (
        ThrottleReason.GPU_IDLE,
        ThrottleReason.SW_POWER_CAP,
        ThrottleReason.HW_SLOWDOWN,
        ThrottleReason.SW_THERMAL_SLOWDOWN,
        ThrottleReason.HW_THERMAL_SLOWDOWN,
        ThrottleReason.HW_POWER_BRAKE_SLOWDOWN,
    )
)

# Layout of the per-second rate vector (and of its running integral).
(
    UTIL,
    MEM_UTIL,
    SM,
    OCC,
    TENSOR,
    POWER_W,
    SM_CLOCK_MHZ,
    MEM_CLOCK_MHZ,
    NVLINK_TX_KIB,
    NVLINK_RX_KIB,
    PCIE_TX_BYTES,
    PCIE_RX_BYTES,
    NS_SW_POWER_CAP,
    NS_SW_THERMAL,
    NS_HW_THERMAL,
    NS_HW_POWER_BRAKE,
    NS_SYNC_BOOST,
    MEM_TEMP_EXCESS,
) = range(18)
N_RATES = 18
_ZERO = (0.0,) * N_RATES

_MASK64 = (1 << 64) - 1


def stable_key(*parts: object) -> int:
    """A 64-bit key that is the same in every process for the same parts."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mix(x: int) -> int:
    """splitmix64 finalizer: a cheap, well-spread 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise4(key: int, bucket: int) -> tuple[float, float, float, float]:
    """Four uniform values in [-0.5, 0.5) for (key, bucket), independent of any call history."""
    x = _mix(key ^ ((bucket * 0xD1B54A32D192ED03) & _MASK64))
    return (
        (x & 0xFFFF) / 65536.0 - 0.5,
        ((x >> 16) & 0xFFFF) / 65536.0 - 0.5,
        ((x >> 32) & 0xFFFF) / 65536.0 - 0.5,
        (x >> 48) / 65536.0 - 0.5,
    )


# --- static description of the GPUs a node's view depends on ------------------------------------------


@dataclass(frozen=True, slots=True)
class GpuStatic:
    """Per-GPU constants: structural offsets (there all along) and the incidents and jobs touching it."""

    ref: GpuRef
    model: GpuModel
    key: int
    slot_offset_c: float
    silicon_factor: float
    hbm_offset_c: float
    memory_factor: float
    die_decay: float
    sink_decay: float
    incidents: tuple[Incident, ...]
    jobs: tuple[JobSpec, ...]
    link_weights: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class World:
    """Everything static that the recurrence for one node needs."""

    scenario: Scenario
    gpus: tuple[GpuStatic, ...]
    position: dict[GpuRef, int]
    jobs: tuple[JobSpec, ...]
    job_keys: dict[str, int]
    comm: tuple[Incident, ...]
    own: tuple[int, ...]


def related_gpus(scenario: Scenario, node: str) -> tuple[GpuRef, ...]:
    """The node's GPUs plus, transitively, every GPU sharing a job with them."""
    spec = scenario.node(node)
    found: list[GpuRef] = [(node, i) for i in range(spec.gpu_count)]
    seen = set(found)
    changed = True
    while changed:
        changed = False
        for job in scenario.jobs:
            if seen.intersection(job.gpus) and not seen.issuperset(job.gpus):
                for ref in job.gpus:
                    if ref not in seen:
                        seen.add(ref)
                        found.append(ref)
                changed = True
    return tuple(found)


_PHYSICAL_KINDS = frozenset({"cooling_failure", "slow_gpu", "host_starvation", "power_cap", "gpu_lost"})


def build_world(scenario: Scenario, node: str, seed: int) -> World:
    """Precompute the static per-GPU description of node's view of the scenario."""
    refs = related_gpus(scenario, node)
    gpus = tuple(_gpu_static(scenario, ref, seed) for ref in refs)
    position = {g.ref: i for i, g in enumerate(gpus)}
    ref_set = set(refs)
    jobs = tuple(j for j in scenario.jobs if ref_set.intersection(j.gpus))
    job_keys = {j.id: stable_key("job", seed, j.id) for j in jobs}
    comm = tuple(i for i in scenario.incidents if i.kind == "comm_slowdown")
    own = tuple(position[(node, i)] for i in range(scenario.node(node).gpu_count))
    return World(scenario, gpus, position, jobs, job_keys, comm, own)


def _gpu_static(scenario: Scenario, ref: GpuRef, seed: int) -> GpuStatic:
    model = scenario.node(ref[0]).model
    key = stable_key("gpu", seed, ref[0], ref[1])
    a, b, c, d = noise4(key, -1)
    links = model.nvlink_links
    raw = [1.0 + 0.08 * noise4(key, -2 - i)[0] for i in range(links)]
    total = sum(raw) or 1.0
    return GpuStatic(
        ref=ref,
        model=model,
        key=key,
        slot_offset_c=6.0 * a,
        silicon_factor=1.0 + 0.06 * b,
        hbm_offset_c=2.0 * c,
        memory_factor=1.0 + 0.02 * d,
        die_decay=math.exp(-1.0 / model.die_tau_s),
        sink_decay=math.exp(-1.0 / model.sink_tau_s),
        incidents=tuple(i for i in scenario.incidents if i.kind in _PHYSICAL_KINDS and ref in i.gpus),
        jobs=tuple(j for j in scenario.jobs if ref in j.gpus),
        link_weights=tuple(w / total for w in raw),
    )


# --- one bucket ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Thermal:
    """A GPU's thermal state at the start of a bucket: die (what NVML reads) and heatsink temperature."""

    temp_c: float
    sink_c: float


@dataclass(frozen=True, slots=True)
class Local:
    """What a GPU's own condition does to it during one bucket. clock_ratio is the SM clock's mean over the
    bucket, power_ratio the mean of the factor it puts on dynamic power (clock_ratio ** POWER_CLOCK_EXPONENT
    unless HW thermal slowdown takes hw_duty of the bucket)."""

    clock_ratio: float
    power_ratio: float
    hw_duty: float
    speed: float
    reasons: int
    input_wait_ratio: float
    lost: bool
    resistance_factor: float
    inlet_rise_c: float
    power_limit_w: float


@dataclass(frozen=True, slots=True)
class Phases:
    """Share of one bucket a GPU spends in each phase of a training step."""

    input_wait: float
    compute: float
    collective_wait: float
    comm: float
    step_s: float
    job: JobSpec
    memory_ratio: float
    nvlink_ratio: float


@dataclass(frozen=True, slots=True)
class BucketState:
    """One GPU over one 1-s bucket: per-second rates, the throttle mask, and temperatures at both ends."""

    rates: tuple[float, ...]
    reasons: int
    temp_start_c: float
    temp_end_c: float
    memory_used_bytes: int
    job: str | None


def initial_thermal(world: World) -> tuple[Thermal, ...]:
    """Every GPU idle and in equilibrium at scenario time 0."""
    out = []
    for g in world.gpus:
        power = g.model.idle_watts * g.silicon_factor
        sink = world.scenario.ambient_c + g.slot_offset_c + g.model.sink_resistance_c_per_w * power
        out.append(Thermal(sink + g.model.die_resistance_c_per_w * power, sink))
    return tuple(out)


def thermal_clock(model: GpuModel, temp_c: float) -> tuple[float, int]:
    """Clock ratio and throttle bits of the SW thermal band at die temperature temp_c."""
    band_start = model.slowdown_celsius - SW_THERMAL_BAND_C
    if temp_c >= band_start:
        cut = SW_THERMAL_MAX_CUT * min(1.0, (temp_c - band_start) / SW_THERMAL_BAND_C)
        return 1.0 - cut, SW_THERMAL
    return 1.0, 0


def hw_thermal_duty(
    g: GpuStatic, thermal: Thermal, inlet_c: float, resistance_factor: float, run_watts: float, hw_watts: float
) -> float:
    """Share of the next bucket HW thermal slowdown spends at its clock (drawing hw_watts instead of
    run_watts) so that the die ends it at its slowdown threshold; 0 when it stays under it anyway. The end
    temperature is linear in the bucket's mean power, so the share follows from the two end points."""
    model = g.model
    base = (
        inlet_c * (1.0 - g.sink_decay) + thermal.sink_c * g.sink_decay + (thermal.temp_c - thermal.sink_c) * g.die_decay
    )
    per_watt = resistance_factor * (
        model.sink_resistance_c_per_w * (1.0 - g.sink_decay) + model.die_resistance_c_per_w * (1.0 - g.die_decay)
    )
    threshold = model.slowdown_celsius
    end_run, end_hw = base + per_watt * run_watts, base + per_watt * hw_watts
    if end_run <= threshold:
        return 0.0
    if end_hw >= threshold:
        return 1.0
    return (end_run - threshold) / (end_run - end_hw)


def local_effects(g: GpuStatic, thermal: Thermal, t: float, ambient_c: float) -> Local:
    """Combine temperature, the GPU's active incidents and its job's power demand at scenario time t into
    the clock it runs at: the lowest of the SW thermal band, a HW slowdown and the power governor, then HW
    thermal slowdown for the share of the bucket that holds the die at its threshold."""
    model = g.model
    ratio, reasons = thermal_clock(model, thermal.temp_c)
    speed = 1.0
    input_wait = 0.0
    lost = False
    resistance, rise = 1.0, 0.0
    limit = model.tdp_watts
    for inc in g.incidents:
        if not inc.active(t):
            continue
        kind = inc.kind
        if kind == "cooling_failure":
            resistance = max(resistance, inc.factor)
            rise = max(rise, inc.ambient_rise_c)
        elif kind == "slow_gpu":
            if inc.silent:
                speed = min(speed, inc.speed_factor)
            else:
                ratio = min(ratio, inc.speed_factor)
                reasons |= HW_SLOWDOWN | (HW_POWER_BRAKE if inc.power_brake else 0)
        elif kind == "host_starvation":
            input_wait = max(input_wait, inc.input_wait_ratio)
        elif kind == "power_cap":
            limit = min(limit, inc.watts)
        elif kind == "gpu_lost":
            lost = True
    job = next((j for j in g.jobs if j.active(t)), None)
    duty = 0.0
    hw_ratio = ratio
    if job is not None and not lost:
        governed = governor_clock_ratio(model, limit, job)
        if governed < ratio:
            ratio = governed
            reasons |= SW_POWER_CAP
        hw_ratio = min(ratio, HW_THERMAL_CLOCK)
        demand = demanded_dynamic_watts(model, job)
        run_w, hw_w = (
            (model.idle_watts + demand * r**POWER_CLOCK_EXPONENT) * g.silicon_factor for r in (ratio, hw_ratio)
        )
        duty = hw_thermal_duty(g, thermal, ambient_c + rise + g.slot_offset_c, resistance, run_w, hw_w)
        if duty > 0.0:
            reasons |= HW_THERMAL | SW_THERMAL | HW_SLOWDOWN
    clock = ratio + duty * (hw_ratio - ratio)
    run_factor, hw_factor = ratio**POWER_CLOCK_EXPONENT, hw_ratio**POWER_CLOCK_EXPONENT
    power_ratio = run_factor + duty * (hw_factor - run_factor)
    return Local(clock, power_ratio, duty, speed, reasons, input_wait, lost, resistance, rise, limit)


def demanded_dynamic_watts(model: GpuModel, job: JobSpec) -> float:
    """Dynamic power a GPU running job at nominal phases would draw at the maximum SM clock."""
    share = job.compute_intensity * job.compute_fraction + POWER_WAIT * (1.0 - job.compute_fraction)
    return (model.tdp_watts - model.idle_watts) * share


def governor_clock_ratio(model: GpuModel, limit_w: float, job: JobSpec) -> float:
    """The SM clock ratio the power governor holds a GPU running job at, to stay under limit_w (the board's
    limit or an operator's lower cap): 1.0 when the job wants less. From nominal phases and the model, not
    the GPU's own silicon, so a cap is uniform over a job and a job's step time does not feed back."""
    headroom = max(limit_w - model.idle_watts, 1.0)
    ratio = (headroom / demanded_dynamic_watts(model, job)) ** (1.0 / POWER_CLOCK_EXPONENT)
    return max(GOVERNOR_MIN_CLOCK, min(1.0, ratio))


def _comm_factor(world: World, job: JobSpec, t: float) -> float:
    factor = 1.0
    for inc in world.comm:
        if inc.job == job.id and inc.active(t):
            factor *= inc.factor
    return factor


def job_phases(world: World, job: JobSpec, k: int, t: float, local: list[Local]) -> dict[int, Phases]:
    """Phase shares for every GPU of job during bucket k (mid-time t), coupled through the collective."""
    positions = [world.position[ref] for ref in job.gpus]
    age = t - job.start_s
    memory_ratio = min(1.0, age / max(job.ramp_up_s * 0.5, 1.0))
    jk = world.job_keys[job.id]
    if age < job.ramp_up_s or (job.end_s is not None and job.end_s - t < job.wind_down_s):
        base = 0.08 if age < job.ramp_up_s else 0.15
        out = {}
        for p in positions:
            u = base + 0.35 * (noise4(world.gpus[p].key ^ jk, k)[0] + 0.5)
            out[p] = Phases(1.0 - u, 0.6 * u, 0.35 * u, 0.05 * u, job.step_time_s, job, memory_ratio, 0.05 * u)
        return out
    if any(local[p].lost for p in positions):
        # A GPU fell off the bus: its peers hang in the collective at full "utilization".
        return {p: Phases(0.0, 0.0, 1.0, 0.0, job.step_time_s, job, 1.0, 0.0) for p in positions}
    jitter = noise4(jk, k)[0]
    compute0 = job.step_time_s * job.compute_fraction * (1.0 + 0.04 * jitter)
    comm = job.step_time_s * (1.0 - job.compute_fraction) * _comm_factor(world, job, t)
    ready: dict[int, tuple[float, float]] = {}
    for p in positions:
        loc = local[p]
        speed = loc.clock_ratio * loc.speed
        compute = compute0 / speed * (1.0 + 0.03 * noise4(world.gpus[p].key, k)[0])
        ready[p] = (loc.input_wait_ratio * job.step_time_s, compute)
    slowest = max(i + c for i, c in ready.values())
    step = slowest + comm
    nominal_step = job.step_time_s
    return {
        p: Phases(i / step, c / step, (slowest - i - c) / step, comm / step, step, job, 1.0, nominal_step / step)
        for p, (i, c) in ready.items()
    }


def gpu_bucket(
    world: World, p: int, k: int, t: float, thermal: Thermal, loc: Local, phases: Phases | None
) -> tuple[BucketState, Thermal]:
    """One GPU's rates over bucket k and its thermal state at the start of bucket k+1."""
    g = world.gpus[p]
    model = g.model
    n0, n1, n2, n3 = noise4(g.key, k)
    reasons = loc.reasons
    rates = [0.0] * N_RATES
    memory_used = 0
    if phases is None or loc.lost:
        reasons |= IDLE
        power = model.idle_watts * g.silicon_factor * (1.0 + 0.02 * n2)
        rates[SM_CLOCK_MHZ] = model.sm_clock_idle_mhz
        rates[MEM_CLOCK_MHZ] = model.mem_clock_idle_mhz
        job_id = None
    else:
        power = _busy_outputs(rates, g, phases, loc, (n0, n1, n2, n3))
        if reasons & SW_POWER_CAP:
            power = min(power, loc.power_limit_w * (GOVERNED_POWER_RATIO + GOVERNED_POWER_SPREAD * n3))
        memory_used = _memory_used(g, phases)
        job_id = phases.job.id
    rates[POWER_W] = power
    for bit, index in (
        (SW_POWER_CAP, NS_SW_POWER_CAP),
        (SW_THERMAL, NS_SW_THERMAL),
        (HW_POWER_BRAKE, NS_HW_POWER_BRAKE),
    ):
        if reasons & bit:
            rates[index] = 1e9
    rates[NS_HW_THERMAL] = 1e9 * loc.hw_duty
    rates[MEM_TEMP_EXCESS] = 3.0 + g.hbm_offset_c + 12.0 * rates[MEM_UTIL]
    # Two first-order stages in series: the heatsink over the inlet (slow) and the die over the heatsink
    # (fast), each relaxing towards its steady rise at this power. They are a fit of the die's response,
    # not separate parts, so a cooling failure scales both: the steady rise per watt by its factor.
    inlet = world.scenario.ambient_c + loc.inlet_rise_c + g.slot_offset_c
    sink_target = inlet + model.sink_resistance_c_per_w * loc.resistance_factor * power
    sink_next = sink_target + (thermal.sink_c - sink_target) * g.sink_decay
    die_target = model.die_resistance_c_per_w * loc.resistance_factor * power
    die_next = die_target + (thermal.temp_c - thermal.sink_c - die_target) * g.die_decay
    temp_next = sink_next + die_next
    state = BucketState(tuple(rates), reasons, thermal.temp_c, temp_next, memory_used, job_id)
    return state, Thermal(temp_next, sink_next)


def _busy_outputs(
    rates: list[float], g: GpuStatic, ph: Phases, loc: Local, noise: tuple[float, float, float, float]
) -> float:
    """Fill utilization, activity, clocks and link rates of a GPU running a job; return its power."""
    model = g.model
    n0, n1, n2, n3 = noise
    waiting = ph.collective_wait + ph.comm
    rates[UTIL] = min(1.0, max(0.0, (1.0 - ph.input_wait) * (1.0 + 0.01 * n0)))
    rates[SM] = min(1.0, (SM_BUSY * ph.compute + SM_WAIT * waiting) * (1.0 + 0.02 * n1))
    rates[OCC] = min(1.0, (OCC_BUSY * ph.compute + OCC_WAIT * waiting) * (1.0 + 0.02 * n1))
    rates[TENSOR] = TENSOR_BUSY * ph.compute
    rates[MEM_UTIL] = MEM_BUSY * ph.compute + MEM_COMM * ph.comm + MEM_WAIT * ph.collective_wait
    rates[SM_CLOCK_MHZ] = model.sm_clock_max_mhz * loc.clock_ratio
    rates[MEM_CLOCK_MHZ] = model.mem_clock_max_mhz
    job = ph.job
    comm_time = job.step_time_s * (1.0 - job.compute_fraction)
    multi_gpu = len(job.gpus) > 1
    if model.has_nvlink and multi_gpu:
        link = comm_time * model.nvlink_kib_per_s * NVLINK_EFFICIENCY * ph.nvlink_ratio / job.step_time_s
        rates[NVLINK_TX_KIB] = link * (1.0 + 0.03 * n2)
        rates[NVLINK_RX_KIB] = link * (1.0 + 0.03 * n3)
    pcie = 0.0
    if multi_gpu and (len(job.nodes) > 1 or not model.has_nvlink):
        pcie = comm_time * model.pcie_bytes_per_s * PCIE_EFFICIENCY * ph.nvlink_ratio / job.step_time_s
    rates[PCIE_TX_BYTES] = pcie * (1.0 + 0.03 * n3) + 0.02 * INPUT_BYTES_PER_S * ph.compute
    rates[PCIE_RX_BYTES] = pcie * (1.0 + 0.03 * n2) + INPUT_BYTES_PER_S * ph.compute
    share = job.compute_intensity * ph.compute + POWER_WAIT * waiting
    dynamic = (model.tdp_watts - model.idle_watts) * share * loc.power_ratio
    return (model.idle_watts + dynamic) * g.silicon_factor * (1.0 + 0.015 * n0)


def _memory_used(g: GpuStatic, ph: Phases) -> int:
    model = g.model
    target = ph.job.memory_used_bytes
    if target is None:
        target = int(0.72 * (model.memory_total_bytes - model.memory_reserved_bytes))
    return CONTEXT_BYTES + int(max(0, target - CONTEXT_BYTES) * ph.memory_ratio * g.memory_factor)


def step(world: World, k: int, thermal: tuple[Thermal, ...]) -> tuple[tuple[BucketState, ...], tuple[Thermal, ...]]:
    """Advance every GPU of the world over bucket k; returns (states, thermal at the start of k+1)."""
    t = k + 0.5
    ambient = world.scenario.ambient_c
    local = [local_effects(g, thermal[p], t, ambient) for p, g in enumerate(world.gpus)]
    phases: dict[int, Phases] = {}
    for job in world.jobs:
        if job.active(t):
            phases.update(job_phases(world, job, k, t, local))
    states = []
    nxt = []
    for p in range(len(world.gpus)):
        state, th = gpu_bucket(world, p, k, t, thermal[p], local[p], phases.get(p))
        states.append(state)
        nxt.append(th)
    return tuple(states), tuple(nxt)


# --- memo of the recurrence ----------------------------------------------------------------------------


def _add(a: Iterable[float], b: Iterable[float]) -> tuple[float, ...]:
    return tuple(map(operator.add, a, b))


class Timeline:
    """Memoized bucket states and running integrals for one node's own GPUs."""

    def __init__(self, world: World):
        self.world = world
        self._own = world.own
        self._resets = self._reset_times(world)
        self._reset_base: dict[tuple[int, float], tuple[float, ...]] = {}
        self._checkpoints: dict[int, tuple[tuple[Thermal, ...], tuple[tuple[float, ...], ...]]] = {}
        self._states: dict[int, tuple[BucketState, ...]] = {}
        self._cums: dict[int, tuple[tuple[float, ...], ...]] = {}
        self._restart(0, initial_thermal(world), tuple(_ZERO for _ in self._own))

    @staticmethod
    def _reset_times(world: World) -> dict[int, tuple[float, ...]]:
        node = world.gpus[world.own[0]].ref[0]
        out: dict[int, list[float]] = {}
        for inc in world.scenario.incidents:
            if inc.kind != "counter_reset":
                continue
            for ref_node, index in inc.gpus:
                if ref_node == node:
                    out.setdefault(index, []).append(inc.start_s)
        return {i: tuple(sorted(v)) for i, v in out.items()}

    def _restart(self, k: int, thermal: tuple[Thermal, ...], cum: tuple[tuple[float, ...], ...]) -> None:
        self._next = k
        self._thermal = thermal
        self._cum_next = cum
        self._states.clear()
        self._cums.clear()

    def _ensure(self, k: int) -> None:
        if k in self._states:
            return
        if k < self._next:
            base = max(c for c in self._checkpoints if c <= k)
            thermal, cum = self._checkpoints[base]
            self._restart(base, thermal, cum)
        while self._next <= k:
            self._advance()

    def _advance(self) -> None:
        k = self._next
        if k % CHECKPOINT_EVERY == 0 and k not in self._checkpoints:
            self._checkpoints[k] = (self._thermal, self._cum_next)
        states, self._thermal = step(self.world, k, self._thermal)
        own_states = tuple(states[p] for p in self._own)
        self._states[k] = own_states
        self._cums[k] = self._cum_next
        self._cum_next = tuple(_add(c, s.rates) for c, s in zip(self._cum_next, own_states))
        self._record_resets(k)
        self._next = k + 1
        old = k - WINDOW_BUCKETS
        self._states.pop(old, None)
        self._cums.pop(old, None)

    def _record_resets(self, k: int) -> None:
        for index, times in self._resets.items():
            for r in times:
                if k <= r < k + 1 and (index, r) not in self._reset_base:
                    self._reset_base[(index, r)] = self._integral_at(index, k, r - k)

    def _integral_at(self, index: int, k: int, frac: float) -> tuple[float, ...]:
        cum = self._cums[k][index]
        rates = self._states[k][index].rates
        return tuple(c + frac * r for c, r in zip(cum, rates))

    def state(self, index: int, t: float) -> BucketState:
        """The bucket state of own GPU `index` at scenario time t."""
        k = int(math.floor(max(t, 0.0)))
        self._ensure(k)
        return self._states[k][index]

    def integral(self, index: int, t: float) -> tuple[float, ...]:
        """Running integral of every rate of own GPU `index` from time 0 to t."""
        t = max(t, 0.0)
        k = int(math.floor(t))
        self._ensure(k)
        return self._integral_at(index, k, t - k)

    def mean(self, index: int, t0: float, t1: float) -> tuple[float, ...]:
        """Average rates of own GPU `index` over [t0, t1] (the last second before t1 when empty)."""
        t1 = max(t1, 0.0)
        t0 = max(min(t0, t1), 0.0)
        if t1 - t0 < 1e-6:
            t0 = t1 - 1.0
            if t0 < 0.0:
                return self.state(index, t1).rates
        end = self.integral(index, t1)
        start = self.integral(index, t0)
        span = t1 - t0
        return tuple((b - a) / span for a, b in zip(start, end))

    def temperature(self, index: int, t: float) -> float:
        """GPU temperature of own GPU `index` at scenario time t."""
        t = max(t, 0.0)
        state = self.state(index, t)
        frac = t - math.floor(t)
        return state.temp_start_c + frac * (state.temp_end_c - state.temp_start_c)

    def counter_base(self, index: int, t: float) -> tuple[float, ...]:
        """Integral at the latest counter reset of own GPU `index` at or before t (zeros when none)."""
        t = max(t, 0.0)
        base = _ZERO
        for r in self._resets.get(index, ()):
            if r > t:
                break
            if (index, r) not in self._reset_base:
                self._ensure(int(math.floor(r)))
            base = self._reset_base[(index, r)]
        return base
