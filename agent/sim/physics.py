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
POWER_BUSY, POWER_WAIT = 0.95, 0.25
# Thermal control: a proportional SW cut in the band below slowdown, a deep HW cut at/above it.
SW_THERMAL_BAND_C = 4.0
SW_THERMAL_MAX_CUT = 0.08
HW_THERMAL_CLOCK = 0.55
HW_THERMAL_RELEASE_C = 2.0
# Link efficiency during collectives and host->device input traffic while computing.
NVLINK_EFFICIENCY = 0.7
PCIE_EFFICIENCY = 0.6
INPUT_BYTES_PER_S = 2.0e9
CONTEXT_BYTES = 512 * 1024 * 1024
CHECKPOINT_EVERY = 600
WINDOW_BUCKETS = 1200

# Throttle (clocks-event) bits.
IDLE, SW_POWER_CAP, HW_SLOWDOWN, SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE = (
    int(r) for r in (ThrottleReason.GPU_IDLE, ThrottleReason.SW_POWER_CAP, ThrottleReason.HW_SLOWDOWN,
                     ThrottleReason.SW_THERMAL_SLOWDOWN, ThrottleReason.HW_THERMAL_SLOWDOWN,
                     ThrottleReason.HW_POWER_BRAKE_SLOWDOWN))

# Layout of the per-second rate vector (and of its running integral).
(UTIL, MEM_UTIL, SM, OCC, TENSOR, POWER_W, SM_CLOCK_MHZ, MEM_CLOCK_MHZ, NVLINK_TX_KIB, NVLINK_RX_KIB,
 PCIE_TX_BYTES, PCIE_RX_BYTES, NS_SW_POWER_CAP, NS_SW_THERMAL, NS_HW_THERMAL, NS_HW_POWER_BRAKE,
 NS_SYNC_BOOST, MEM_TEMP_EXCESS) = range(18)
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
    decay: float
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
        decay=math.exp(-1.0 / model.thermal_tau_s),
        incidents=tuple(i for i in scenario.incidents if i.kind in _PHYSICAL_KINDS and ref in i.gpus),
        jobs=tuple(j for j in scenario.jobs if ref in j.gpus),
        link_weights=tuple(w / total for w in raw),
    )


# --- one bucket ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Thermal:
    """A GPU's thermal state at the start of a bucket."""

    temp_c: float
    hw_latched: bool


@dataclass(frozen=True, slots=True)
class Local:
    """What a GPU's own condition does to it during one bucket."""

    clock_ratio: float
    speed: float
    reasons: int
    input_wait_ratio: float
    lost: bool
    resistance_factor: float
    inlet_rise_c: float
    cap_watts: float | None
    hw_latched: bool


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
        rise = g.model.thermal_resistance_c_per_w * power
        out.append(Thermal(world.scenario.ambient_c + g.slot_offset_c + rise, False))
    return tuple(out)


def thermal_clock(model: GpuModel, thermal: Thermal) -> tuple[float, int, bool]:
    """Clock ratio, throttle bits and the HW latch implied by a GPU's temperature."""
    slowdown = model.slowdown_celsius
    temp = thermal.temp_c
    if temp >= slowdown or (thermal.hw_latched and temp >= slowdown - HW_THERMAL_RELEASE_C):
        return HW_THERMAL_CLOCK, HW_THERMAL | SW_THERMAL | HW_SLOWDOWN, True
    band_start = slowdown - SW_THERMAL_BAND_C
    if temp >= band_start:
        return 1.0 - SW_THERMAL_MAX_CUT * (temp - band_start) / SW_THERMAL_BAND_C, SW_THERMAL, False
    return 1.0, 0, False


def local_effects(g: GpuStatic, thermal: Thermal, t: float) -> Local:
    """Combine temperature and the GPU's active incidents at scenario time t."""
    ratio, reasons, latched = thermal_clock(g.model, thermal)
    speed = 1.0
    input_wait = 0.0
    lost = False
    resistance, rise = 1.0, 0.0
    cap: float | None = None
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
            cap = inc.watts if cap is None else min(cap, inc.watts)
        elif kind == "gpu_lost":
            lost = True
    return Local(ratio, speed, reasons, input_wait, lost, resistance, rise, cap, latched)


def cap_clock_ratio(model: GpuModel, cap_watts: float, job: JobSpec) -> float:
    """Uniform clock ratio that keeps a GPU running job at nominal phases under cap_watts."""
    busy = POWER_BUSY * job.compute_fraction + POWER_WAIT * (1.0 - job.compute_fraction)
    dynamic = (model.tdp_watts - model.idle_watts) * busy
    headroom = max(cap_watts - model.idle_watts, 1.0)
    return max(0.4, min(1.0, math.sqrt(headroom / dynamic)))


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
        if loc.cap_watts is not None:
            speed *= min(1.0, cap_clock_ratio(world.gpus[p].model, loc.cap_watts, job))
        compute = compute0 / speed * (1.0 + 0.03 * noise4(world.gpus[p].key, k)[0])
        ready[p] = (loc.input_wait_ratio * job.step_time_s, compute)
    slowest = max(i + c for i, c in ready.values())
    step = slowest + comm
    nominal_step = job.step_time_s
    return {
        p: Phases(i / step, c / step, (slowest - i - c) / step, comm / step, step, job, 1.0, nominal_step / step)
        for p, (i, c) in ready.items()
    }


def gpu_bucket(world: World, p: int, k: int, t: float, thermal: Thermal, loc: Local,
               phases: Phases | None) -> tuple[BucketState, Thermal]:
    """One GPU's rates over bucket k and its thermal state at the start of bucket k+1."""
    g = world.gpus[p]
    model = g.model
    n0, n1, n2, n3 = noise4(g.key, k)
    ratio, reasons = loc.clock_ratio, loc.reasons
    rates = [0.0] * N_RATES
    memory_used = 0
    if phases is None or loc.lost:
        reasons |= IDLE
        power = model.idle_watts * g.silicon_factor * (1.0 + 0.02 * n2)
        rates[SM_CLOCK_MHZ] = model.sm_clock_idle_mhz
        rates[MEM_CLOCK_MHZ] = model.mem_clock_idle_mhz
        job_id = None
    else:
        if loc.cap_watts is not None:
            cap_ratio = cap_clock_ratio(model, loc.cap_watts, phases.job)
            if cap_ratio < 1.0:
                ratio = min(ratio, cap_ratio)
                reasons |= SW_POWER_CAP
        power = _busy_outputs(rates, g, phases, ratio, (n0, n1, n2, n3))
        if loc.cap_watts is not None:
            power = min(power, loc.cap_watts * (0.99 + 0.01 * n3))
        memory_used = _memory_used(g, phases)
        job_id = phases.job.id
    rates[POWER_W] = power
    for bit, index in ((SW_POWER_CAP, NS_SW_POWER_CAP), (SW_THERMAL, NS_SW_THERMAL),
                       (HW_THERMAL, NS_HW_THERMAL), (HW_POWER_BRAKE, NS_HW_POWER_BRAKE)):
        if reasons & bit:
            rates[index] = 1e9
    rates[MEM_TEMP_EXCESS] = 3.0 + g.hbm_offset_c + 12.0 * rates[MEM_UTIL]
    inlet = world.scenario.ambient_c + loc.inlet_rise_c + g.slot_offset_c
    target = inlet + model.thermal_resistance_c_per_w * loc.resistance_factor * power
    temp_next = target + (thermal.temp_c - target) * g.decay
    state = BucketState(tuple(rates), reasons, thermal.temp_c, temp_next, memory_used, job_id)
    return state, Thermal(temp_next, loc.hw_latched)


def _busy_outputs(rates: list[float], g: GpuStatic, ph: Phases, ratio: float,
                  noise: tuple[float, float, float, float]) -> float:
    """Fill utilization, activity, clocks and link rates of a GPU running a job; return its power."""
    model = g.model
    n0, n1, n2, n3 = noise
    waiting = ph.collective_wait + ph.comm
    rates[UTIL] = min(1.0, max(0.0, (1.0 - ph.input_wait) * (1.0 + 0.01 * n0)))
    rates[SM] = min(1.0, (SM_BUSY * ph.compute + SM_WAIT * waiting) * (1.0 + 0.02 * n1))
    rates[OCC] = min(1.0, (OCC_BUSY * ph.compute + OCC_WAIT * waiting) * (1.0 + 0.02 * n1))
    rates[TENSOR] = TENSOR_BUSY * ph.compute
    rates[MEM_UTIL] = MEM_BUSY * ph.compute + MEM_COMM * ph.comm + MEM_WAIT * ph.collective_wait
    rates[SM_CLOCK_MHZ] = model.sm_clock_max_mhz * ratio
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
    dynamic = (model.tdp_watts - model.idle_watts) * (POWER_BUSY * ph.compute + POWER_WAIT * waiting)
    return (model.idle_watts + dynamic * ratio * ratio) * g.silicon_factor * (1.0 + 0.015 * n0)


def _memory_used(g: GpuStatic, ph: Phases) -> int:
    model = g.model
    target = ph.job.memory_used_bytes
    if target is None:
        target = int(0.72 * (model.memory_total_bytes - model.memory_reserved_bytes))
    return CONTEXT_BYTES + int(max(0, target - CONTEXT_BYTES) * ph.memory_ratio * g.memory_factor)


def step(world: World, k: int, thermal: tuple[Thermal, ...]) -> tuple[tuple[BucketState, ...], tuple[Thermal, ...]]:
    """Advance every GPU of the world over bucket k; returns (states, thermal at the start of k+1)."""
    t = k + 0.5
    local = [local_effects(g, thermal[p], t) for p, g in enumerate(world.gpus)]
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
