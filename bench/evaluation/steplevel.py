"""A second opinion on the data: step-level timing of one synchronous training job, written apart from
bench/evaluation/tracegen.py (it shares only the scoring vocabulary, scenarios.Truth and scenarios.score).

The model works step by step, not second by second. Each step every rank waits on its host for a short
gap (no kernel), computes for a time drawn per rank and per step (a job-wide draw for the batch, a
rank's own draw, a rank's fixed share of the work), then spins in the all-reduce's kernels until the
slowest rank arrives, then all ranks transfer for the collective's own time. The next step starts when
the collective ends, on every rank at once. Each rank's activity is a piecewise-constant signal:

- kernel running (NVML utilization): compute, spin and transfer; not the host gap;
- SM activity: high while computing, a couple of SMs while spinning, a few while transferring;
- power: high while computing, low while spinning, in between while transferring.

A sample is what NVML would report averaged over the sampling interval ending at the sample time: the
integral of each signal over the interval, divided by its length, plus the sensor's own noise. Whether
ranks move together is not drawn: it follows from every rank waiting for the same slowest rank each step.

A straggler is a rank whose compute takes longer (silently, or with its clocks cut and HW-slowdown bits
set). Its severity is given as what it costs the job: the factor on its compute time is solved, on the
same draws, so that the job's mean step time over the incident grows by exactly that share. The truth
requires a straggler alert where the job slows by STEP_REQUIRED_SLOWDOWN or more.

    python -m bench.evaluation.steplevel [--seeds N] [--quick] [--no-write]

scores the grid of STEP_GRID (job size x sampling interval x noise x job slowdown x attribution) and
writes docs/evaluation.md between `<!-- steplevel:begin -->` and `<!-- steplevel:end -->`.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import orjson

from bench.docgen.splice import Section
from bench.evaluation import scenarios
from bench.evaluation.scenarios import Truth

DOC = Path(__file__).resolve().parents[2] / "docs" / "evaluation.md"
SECTION = Section("steplevel", "## Step-level model")
LIMIT_SECTION = Section("detection-limit", "## Detection limit")

STEP_REQUIRED_SLOWDOWN = 0.03  # the job slowdown at which a straggler must be named
WITHIN_S = 300.0  # ... and the time it must be named within
GPUS_PER_NODE = 8
HW_SLOWDOWN_BIT = 0x8

# One H100 SXM board, as NVML describes it.
TDP_W, IDLE_W, CLOCK_MAX_HZ, MEMORY_TOTAL = 700.0, 72.0, 1980e6, 85520809984
MODEL = "NVIDIA H100 80GB HBM3"
# Per-phase levels: (kernel running, SM activity, share of the power range above idle).
GAP, COMPUTE, SPIN, TRANSFER = (0.0, 0.0, 0.08), (1.0, 0.82, 0.92), (1.0, 0.02, 0.22), (1.0, 0.12, 0.34)


@dataclass(frozen=True)
class Noise:
    """How noisy a job is: per-rank per-step compute spread, job-wide per-step spread, sensor noise."""

    name: str
    rank_cv: float
    batch_cv: float
    sensor: float


QUIET = Noise("quiet", 0.01, 0.02, 1.0)
NOISY = Noise("noisy", 0.03, 0.05, 3.0)


@dataclass(frozen=True)
class StepJob:
    """One synchronous job on `size` GPUs, GPUS_PER_NODE to a node."""

    size: int
    hpc_job: str | None
    step_s: float = 0.8  # compute time at full speed
    gap_s: float = 0.03  # host gap before each step's compute
    allreduce_s: float = 0.15  # transfer time of each step's collective
    rank_share: tuple[float, ...] = ()  # a rank's fixed extra work (fraction); () = none


@dataclass(frozen=True)
class StepStraggler:
    """Rank `rank` slows the job by `job_slowdown` over [start_s, end_s); clocks: its clocks are cut (and
    HW-slowdown bits set) rather than slowing silently."""

    rank: int
    start_s: float
    end_s: float
    job_slowdown: float
    clocks: bool = False


@dataclass(frozen=True)
class StepSpec:
    job: StepJob
    straggler: StepStraggler | None
    noise: Noise = QUIET
    interval_s: float = 5.0
    duration_s: float = 720.0
    seed: int = 0
    t0: float = 1_770_000_000.0


@dataclass(frozen=True)
class StepTrace:
    spec: StepSpec
    lines: tuple[bytes, ...]
    truths: tuple[Truth, ...]
    gpu_samples: int
    factor: float  # the straggler's compute-time factor (1.0 without one)
    measured_slowdown: float  # the job's slowdown over the incident, from the steps themselves


# ------------------------------------------------------------------------------------------- steps


@dataclass
class _Steps:
    start: np.ndarray  # (K,) step start times
    compute: np.ndarray  # (K, R) each rank's compute time
    wait_end: np.ndarray  # (K,) when the slowest rank arrives (relative to start)
    end: np.ndarray  # (K,) step end (start of the next)


def _draws(spec: StepSpec, rng: np.random.Generator, steps: int) -> np.ndarray:
    """(steps, R) compute times at full speed: job-wide batch draw x rank draw x rank's fixed share."""
    job, noise = spec.job, spec.noise
    batch = np.clip(1.0 + noise.batch_cv * rng.standard_normal((steps, 1)), 0.5, None)
    rank = np.clip(1.0 + noise.rank_cv * rng.standard_normal((steps, job.size)), 0.5, None)
    share = np.ones(job.size) if not job.rank_share else 1.0 + np.asarray(job.rank_share)
    return job.step_s * batch * rank * share[None, :]


def _simulate(spec: StepSpec, compute: np.ndarray, factor: float) -> _Steps:
    """Run the steps: the straggler's compute scaled by `factor` while its incident lasts."""
    job, s = spec.job, spec.straggler
    K = compute.shape[0]
    start, end = np.zeros(K), np.zeros(K)
    wait_end = np.zeros(K)
    comp = compute.copy()
    t = 0.0
    for k in range(K):
        if s is not None and s.start_s <= t < s.end_s:
            comp[k, s.rank] *= factor
        slowest = float(comp[k].max())
        start[k], wait_end[k] = t, job.gap_s + slowest
        t += job.gap_s + slowest + job.allreduce_s
        end[k] = t
    return _Steps(start, comp, wait_end, end)


def _job_slowdown(spec: StepSpec, compute: np.ndarray, factor: float) -> float:
    """The job's mean step time over the incident's steps, against the same steps without the straggler."""
    s, job = spec.straggler, spec.job
    assert s is not None
    base = _simulate(spec, compute, 1.0)
    inside = (base.start >= s.start_s) & (base.start < s.end_s)
    others = np.delete(compute[inside], s.rank, axis=1).max(axis=1)
    own = compute[inside, s.rank] * factor
    slowed = job.gap_s + np.maximum(others, own) + job.allreduce_s
    healthy = job.gap_s + np.maximum(others, compute[inside, s.rank]) + job.allreduce_s
    return float(slowed.mean() / healthy.mean() - 1.0)


def _solve_factor(spec: StepSpec, compute: np.ndarray) -> float:
    """The straggler's compute factor that slows the job by its job_slowdown (bisection on the draws)."""
    s = spec.straggler
    if s is None or s.job_slowdown <= 0:
        return 1.0
    lo, hi = 1.0, 4.0
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _job_slowdown(spec, compute, mid) < s.job_slowdown else (lo, mid)
    return hi


# ----------------------------------------------------------------------------------------- sampling


def _levels(level: int) -> np.ndarray:
    """(4,) per phase gap, compute, spin, transfer: one of the three signals."""
    return np.array([p[level] for p in (GAP, COMPUTE, SPIN, TRANSFER)])


def _integrals(steps: _Steps, spec: StepSpec, rank: int, at: np.ndarray, level: int, compute_scale: float) -> np.ndarray:
    """The integral of one signal of one rank from 0 to each time in `at`."""
    job = spec.job
    gap, comp, spin, xfer = _levels(level)
    comp_end = steps.start + job.gap_s + steps.compute[:, rank]
    bps = np.stack([steps.start, steps.start + job.gap_s, comp_end, steps.start + steps.wait_end], axis=1).ravel()
    durations = np.diff(np.append(bps, steps.end[-1]))
    values = np.tile(np.array([gap, comp * compute_scale, spin, xfer]), len(steps.start))
    cum = np.concatenate([[0.0], np.cumsum(values * durations)])
    return np.interp(at, np.append(bps, steps.end[-1]), cum)


@dataclass
class _Samples:
    times: np.ndarray  # (N,) sample times, seconds into the trace
    util: np.ndarray  # (N, R)
    sm: np.ndarray
    power: np.ndarray
    energy: np.ndarray
    clock: np.ndarray
    bits: np.ndarray


def _sample(spec: StepSpec, steps: _Steps, rng: np.random.Generator, factor: float) -> _Samples:
    """Every rank's readings at each sample time, averaged over the interval that ends there."""
    job, iv, noise = spec.job, spec.interval_s, spec.noise
    times = np.arange(iv, min(spec.duration_s, steps.end[-1]), iv)
    R, N = job.size, len(times)
    util, sm, power, energy = (np.zeros((N, R)) for _ in range(4))
    clock, bits = np.full((N, R), CLOCK_MAX_HZ), np.zeros((N, R), dtype=np.int64)
    s = spec.straggler
    for r in range(R):
        cut = s is not None and s.clocks and s.rank == r
        # A clock-cut rank computes as long at a lower clock: the same SM activity, less power per second.
        comp_scale = 1.0
        u = np.diff(_integrals(steps, spec, r, np.append(times[0] - iv, times), 0, 1.0)) / iv
        a = np.diff(_integrals(steps, spec, r, np.append(times[0] - iv, times), 1, 1.0)) / iv
        e_share = _integrals(steps, spec, r, np.append(times[0] - iv, times), 2, comp_scale)
        util[:, r], sm[:, r] = u, a
        power[:, r] = IDLE_W + (TDP_W - IDLE_W) * np.diff(e_share) / iv
        energy[:, r] = IDLE_W * times + (TDP_W - IDLE_W) * e_share[1:]
        if cut:
            inside = (times >= s.start_s) & (times < s.end_s + iv)
            clock[inside, r] = CLOCK_MAX_HZ / factor
            bits[inside, r] = HW_SLOWDOWN_BIT
            power[inside, r] *= 1.0 / factor**0.5
    n = noise.sensor
    util = np.clip(util + 0.004 * n * rng.standard_normal(util.shape), 0.0, 1.0)
    sm = np.clip(sm + 0.006 * n * rng.standard_normal(sm.shape), 0.0, 1.0)
    power = power * (1.0 + 0.008 * n * rng.standard_normal(power.shape))
    clock = np.round((clock - 15e6 * (rng.random(clock.shape) < 0.1)) / 15e6) * 15e6
    return _Samples(times, util, sm, power, energy, clock, bits)


# ------------------------------------------------------------------------------------------ emitting


def node_name(n: int) -> str:
    return f"steplevel-{n:04d}"


def _uuid(seed: int, rank: int) -> str:
    h = hashlib.sha256(f"steplevel:{seed}:{rank}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _gpu(spec: StepSpec, smp: _Samples, k: int, r: int, temp: float) -> dict[str, Any]:
    power = float(smp.power[k, r])
    return {
        "index": r % GPUS_PER_NODE,
        "uuid": _uuid(spec.seed, r),
        "model": MODEL,
        "up": True,
        "hpc_job": spec.job.hpc_job,
        "utilization_ratio": round(float(smp.util[k, r]), 4),
        "sm_active_ratio": round(float(smp.sm[k, r]), 4),
        "memory_used_bytes": 70 * 2**30,
        "memory_free_bytes": MEMORY_TOTAL - 70 * 2**30,
        "memory_total_bytes": MEMORY_TOTAL,
        "temperature_celsius": round(temp),
        "power_watts": round(power, 2),
        "power_limit_watts": TDP_W,
        "energy_joules_total": round(float(smp.energy[k, r]), 1),
        "sm_clock_hertz": float(smp.clock[k, r]),
        "sm_clock_max_hertz": CLOCK_MAX_HZ,
        "throttle_reasons": int(smp.bits[k, r]),
        "xid_errors_total": 0,
    }


def _lines(spec: StepSpec, smp: _Samples, rng: np.random.Generator) -> list[bytes]:
    R = spec.job.size
    nodes = (R + GPUS_PER_NODE - 1) // GPUS_PER_NODE
    skew = rng.uniform(0.0, min(0.5, spec.interval_s / 4), nodes)
    # The die follows power through a first-order lag (about a minute) above a 25-30 °C inlet.
    inlet = rng.uniform(25.0, 30.0, R)
    temp = inlet + 0.055 * smp.power[0]
    alpha = min(1.0, spec.interval_s / 60.0)
    out = []
    for k, t in enumerate(smp.times):
        temp = temp + alpha * (inlet + 0.055 * smp.power[k] - temp)
        for n in range(nodes):
            ranks = range(n * GPUS_PER_NODE, min(R, (n + 1) * GPUS_PER_NODE))
            snap = {
                "schema": 1,
                "node": node_name(n),
                "time": round(spec.t0 + float(t) + float(skew[n]), 3),
                "driver_version": "550.90.07",
                "gpus": [_gpu(spec, smp, k, r, float(temp[r])) for r in ranks],
            }
            out.append(orjson.dumps(snap))
    return out


def _truths(spec: StepSpec, measured: float) -> list[Truth]:
    s = spec.straggler
    if s is None:
        return []
    node, gpu = node_name(s.rank // GPUS_PER_NODE), s.rank % GPUS_PER_NODE
    start, end = spec.t0 + s.start_s, spec.t0 + min(s.end_s, spec.duration_s)
    note = f"step-level straggler: job slowed {measured:.1%}"
    out = [Truth("straggler", node, gpu, spec.job.hpc_job, start, end + 60.0, False, note + " (allowed)")]
    if measured >= STEP_REQUIRED_SLOWDOWN - 1e-3:
        out.append(Truth("straggler", node, gpu, spec.job.hpc_job, start, end, True, note))
    return out


def generate(spec: StepSpec) -> StepTrace:
    """Simulate the job step by step and return its lines (time order) and its truths."""
    rng = np.random.default_rng([spec.seed, spec.job.size, int(spec.interval_s * 10)])
    steps_needed = int(spec.duration_s / (spec.job.gap_s + spec.job.allreduce_s + 0.5 * spec.job.step_s)) + 10
    compute = _draws(spec, rng, steps_needed)
    factor = _solve_factor(spec, compute)
    steps = _simulate(spec, compute, factor)
    measured = _job_slowdown(spec, compute, factor) if spec.straggler else 0.0
    smp = _sample(spec, steps, rng, factor)
    lines = _lines(spec, smp, rng)
    return StepTrace(spec, tuple(lines), tuple(_truths(spec, measured)), smp.util.size, factor, measured)
