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
from dataclasses import dataclass, field
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


def _integrals(
    steps: _Steps, spec: StepSpec, rank: int, at: np.ndarray, level: int, compute_scale: float
) -> np.ndarray:
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


def _gpu_heads(spec: StepSpec) -> list[str]:
    """Each rank's fields that never change, as the start of its JSON object."""
    job = "null" if spec.job.hpc_job is None else orjson.dumps(spec.job.hpc_job).decode()
    return [
        f'{{"index":{r % GPUS_PER_NODE},"uuid":"{_uuid(spec.seed, r)}","model":"{MODEL}","up":true,'
        f'"hpc_job":{job},"memory_used_bytes":{70 * 2**30},"memory_free_bytes":{MEMORY_TOTAL - 70 * 2**30},'
        f'"memory_total_bytes":{MEMORY_TOTAL},"power_limit_watts":{TDP_W},"sm_clock_max_hertz":{CLOCK_MAX_HZ},'
        f'"xid_errors_total":0,'
        for r in range(spec.job.size)
    ]


def _gpu(head: str, row: tuple[list, ...], r: int, temp: float) -> str:
    util, sm, power, energy, clock, bits = row
    return (
        f'{head}"utilization_ratio":{util[r]:.4f},"sm_active_ratio":{sm[r]:.4f},'
        f'"temperature_celsius":{round(temp)},"power_watts":{power[r]:.2f},'
        f'"energy_joules_total":{energy[r]:.1f},"sm_clock_hertz":{clock[r]:.1f},'
        f'"throttle_reasons":{bits[r]}}}'
    )


def _lines(spec: StepSpec, smp: _Samples, rng: np.random.Generator) -> list[bytes]:
    R = spec.job.size
    nodes = (R + GPUS_PER_NODE - 1) // GPUS_PER_NODE
    skew = rng.uniform(0.0, min(0.5, spec.interval_s / 4), nodes)
    heads = _gpu_heads(spec)
    # The die follows power through a first-order lag (about a minute) above a 25-30 °C inlet.
    inlet = rng.uniform(25.0, 30.0, R)
    temp = inlet + 0.055 * smp.power[0]
    alpha = min(1.0, spec.interval_s / 60.0)
    out = []
    for k, t in enumerate(smp.times):
        temp = temp + alpha * (inlet + 0.055 * smp.power[k] - temp)
        temps = temp.tolist()
        row = tuple(a[k].tolist() for a in (smp.util, smp.sm, smp.power, smp.energy, smp.clock, smp.bits))
        for n in range(nodes):
            ranks = range(n * GPUS_PER_NODE, min(R, (n + 1) * GPUS_PER_NODE))
            gpus = ",".join(_gpu(heads[r], row, r, temps[r]) for r in ranks)
            at = spec.t0 + float(t) + float(skew[n])
            out.append(
                f'{{"schema":1,"node":"{node_name(n)}","time":{at:.3f},"driver_version":"550.90.07",'
                f'"gpus":[{gpus}]}}'.encode()
            )
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


# ---------------------------------------------------------------------------------------- evaluation

SIZES = (16, 64, 384, 1024)
INTERVALS_S = (1.0, 5.0)
NOISES = (QUIET, NOISY)
SLOWDOWNS = (0.03, 0.05, 0.10, 0.25)
# The straggler starts once the job's offsets are learned and lasts past the five minutes it must be
# named within; the trace ends a minute after it, so that its alert can clear.
ONSET_S, INCIDENT_S, TAIL_S = 240.0, 330.0, 60.0


@dataclass(frozen=True)
class Cell:
    """One condition of the grid: job size, sampling, noise, job slowdown (0: healthy), attribution."""

    size: int
    interval_s: float
    noise: Noise
    slowdown: float
    attributed: bool

    def spec(self, seed: int) -> StepSpec:
        rng = np.random.default_rng([seed, self.size, int(self.slowdown * 1000)])
        hpc = str(int(rng.integers(100000, 999999))) if self.attributed else None
        job = StepJob(self.size, hpc, step_s=float(rng.uniform(0.5, 1.2)), allreduce_s=float(rng.uniform(0.08, 0.25)))
        straggler = (
            StepStraggler(int(rng.integers(self.size)), ONSET_S, ONSET_S + INCIDENT_S, self.slowdown)
            if self.slowdown > 0
            else None
        )
        return StepSpec(job, straggler, self.noise, self.interval_s, ONSET_S + INCIDENT_S + TAIL_S, seed)


@dataclass
class CellResult:
    cell: Cell
    runs: int = 0
    required: int = 0
    found_in_time: int = 0  # required truths named within WITHIN_S
    found: int = 0
    tp: int = 0
    fp: int = 0
    ttf_s: list[float] = field(default_factory=list)
    gpu_samples: int = 0
    cpu_s: float = 0.0

    @property
    def recall_in_time(self) -> float | None:
        return self.found_in_time / self.required if self.required else None


def run_cell(run_replay: Callable[[Iterable[bytes]], list[Any]], cell: Cell, seeds: range) -> CellResult:
    """Generate, replay and score one cell over the seeds."""
    out = CellResult(cell)
    for seed in seeds:
        started = time.process_time()
        trace = generate(cell.spec(seed))
        alerts = run_replay(trace.lines)
        end = trace.spec.t0 + trace.spec.duration_s
        ks = scenarios.score(alerts, trace.truths, trace_end=end).kinds["straggler"]
        out.runs += 1
        out.required += ks.required
        out.found += ks.detected
        out.found_in_time += sum(t <= WITHIN_S for t in ks.ttf_s)
        out.tp, out.fp = out.tp + ks.tp, out.fp + ks.fp
        out.ttf_s += ks.ttf_s
        out.gpu_samples += trace.gpu_samples
        out.cpu_s += time.process_time() - started
    return out


def grid(quick: bool = False) -> list[Cell]:
    """Every cell the document reports, the cheapest first: healthy jobs (slowdown 0) for false alerts and
    each straggler slowdown, attributed at both noises, unattributed at the quiet noise. Jobs of 384 GPUs or
    more (their traces the costliest) run the noisy and unattributed conditions at 5 s sampling only, and
    at 1 s sampling no healthy run (their straggler runs count false alerts on every other GPU) and no
    25 % straggler at 1,024 GPUs. quick: the two smaller sizes only."""
    sizes = SIZES[:2] if quick else SIZES
    slows = (0.0, *SLOWDOWNS)

    def kept(n: int, iv: float, noise: Noise, slow: float, attributed: bool) -> bool:
        if n < 384:
            return True
        if iv >= 5.0:
            return True
        return attributed and noise is QUIET and slow > 0 and not (n >= 1024 and slow > 0.10)

    cells = [Cell(n, iv, noise, slow, True) for n in sizes for iv in INTERVALS_S for noise in NOISES for slow in slows]
    cells += [Cell(n, iv, QUIET, slow, False) for n in sizes for iv in INTERVALS_S for slow in slows]
    kept_cells = [c for c in cells if kept(c.size, c.interval_s, c.noise, c.slowdown, c.attributed)]
    return sorted(kept_cells, key=lambda c: c.size / c.interval_s)


def _cell_key(cell: Cell, seeds: int) -> str:
    return f"{cell.size}/{cell.interval_s:g}/{cell.noise.name}/{cell.slowdown:g}/{int(cell.attributed)}/{seeds}"


def _cached(path: Path | None) -> dict[str, dict[str, Any]]:
    """Cell results of an earlier run of the same code (--cache), by cell and seed count."""
    if path is None or not path.exists():
        return {}
    return {row["key"]: row for row in map(orjson.loads, path.read_bytes().splitlines()) if row}


def _restore(cell: Cell, row: dict[str, Any]) -> CellResult:
    fields = ("runs", "required", "found_in_time", "found", "tp", "fp", "ttf_s", "gpu_samples", "cpu_s")
    return CellResult(cell, **{f: row[f] for f in fields})


def _store(path: Path | None, key: str, r: CellResult) -> None:
    if path is None:
        return
    row = {f: getattr(r, f) for f in ("runs", "required", "found_in_time", "found", "tp", "fp", "ttf_s")}
    row.update(key=key, gpu_samples=r.gpu_samples, cpu_s=r.cpu_s)
    with open(path, "ab") as fh:
        fh.write(orjson.dumps(row) + b"\n")


def _f(x: float | None, pattern: str = "{:.2f}") -> str:
    return "–" if x is None else pattern.format(x)


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def _totals(results: list[CellResult]) -> tuple[int, int, int, int, int, list[float]]:
    req = sum(r.required for r in results)
    in_time = sum(r.found_in_time for r in results)
    tp, fp = sum(r.tp for r in results), sum(r.fp for r in results)
    runs = sum(r.runs for r in results)
    return runs, req, in_time, tp, fp, [t for r in results for t in r.ttf_s]


def render(results: list[CellResult], seeds: int) -> str:
    """The Step-level model section: per job slowdown and attribution, over every size and sampling."""
    lines = [
        f"Generated by `python -m bench.evaluation.steplevel --seeds {seeds}`. Traces come from "
        "`bench/evaluation/steplevel.py`, a model written apart from the suite's generator: one synchronous "
        "job simulated step by step (each rank's compute drawn per step, every rank spinning in the "
        "all-reduce until the slowest arrives, readings averaged over the sampling interval as NVML reports "
        "them), so ranks move together because of the steps, not because a shared wobble is drawn. A "
        "straggler's severity is what it costs its job: its compute factor is solved on the same draws so "
        f"that the job's mean step time grows by that share. It starts {ONSET_S:.0f} s in and lasts "
        f"{INCIDENT_S:.0f} s; a straggler slowing its job by {STEP_REQUIRED_SLOWDOWN:.0%} or more must be "
        f"named, and is counted found when named within {WITHIN_S:.0f} s. Jobs of {', '.join(map(str, SIZES))} "
        f"GPUs, sampled every {' and '.join(f'{iv:g}' for iv in INTERVALS_S)} s, {seeds} seeds per cell. "
        f"Noise: quiet ({QUIET.rank_cv:.0%} per-rank and {QUIET.batch_cv:.0%} job-wide compute spread per "
        f"step, sensor noise ×{QUIET.sensor:g}); noisy ({NOISY.rank_cv:.0%}, {NOISY.batch_cv:.0%}, "
        f"×{NOISY.sensor:g}). False alerts count every straggler alert on a GPU that was not slowed.",
        "",
        "| job slowdown | attribution | noise | runs | required | named within 5 min | recall within 5 min "
        "| TP | FP | precision | median time to fire (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted(
        {(r.cell.slowdown, r.cell.attributed, r.cell.noise.name) for r in results}, key=lambda k: (k[0], not k[1], k[2])
    )
    for slow, att, noise in keys:
        rows = [r for r in results if (r.cell.slowdown, r.cell.attributed, r.cell.noise.name) == (slow, att, noise)]
        runs, req, in_time, tp, fp, ttf = _totals(rows)
        prec = tp / (tp + fp) if tp + fp else None
        lines.append(
            f"| {'healthy' if slow == 0 else f'{slow:.0%}'} | {'hpc_job' if att else 'none'} | {noise} | {runs} | "
            f"{req} | {in_time} | {_f(in_time / req if req else None)} | {tp} | {fp} | {_f(prec)} | "
            f"{_f(_median(ttf), '{:.0f}')} |"
        )
    cpu = sum(r.cpu_s for r in results)
    samples = sum(r.gpu_samples for r in results)
    lines += ["", f"{len(results)} cells, {samples:,} GPU-samples, {cpu / 60:.0f} min of CPU (generation and replay)."]
    return "\n".join(lines)


def render_limit(results: list[CellResult], seeds: int) -> str:
    """The detection-limit table: per job size, sampling and noise (attributed), the smallest job
    slowdown named within five minutes in every seed, and its median time to fire."""
    lines = [
        f"Generated by `python -m bench.evaluation.steplevel --seeds {seeds}` (the step-level model above, "
        "jobs with `hpc_job`). Per job size, sampling interval and noise: the smallest job slowdown of "
        f"{', '.join(f'{s:.0%}' for s in SLOWDOWNS)} whose straggler was named within {WITHIN_S:.0f} s in "
        f"every one of the {seeds} seeds (and every larger one too), its median time to fire, and the false "
        "straggler alerts over all of that cell's runs, healthy ones included. Conditions the grid does not "
        "run (steplevel.grid: the costliest traces) have no row or no figure.",
        "",
        "| job GPUs | sampling (s) | noise | smallest slowdown named every time | median time to fire (s) | "
        "named within 5 min, per slowdown | false alerts |",
        "|---|---|---|---|---|---|---|",
    ]
    attributed = [r for r in results if r.cell.attributed]
    for size in sorted({r.cell.size for r in attributed}):
        for iv in sorted({r.cell.interval_s for r in attributed}):
            for noise in [n for n in NOISES if any(r.cell.noise == n for r in attributed)]:
                row = sorted(
                    (r for r in attributed if (r.cell.size, r.cell.interval_s, r.cell.noise) == (size, iv, noise)),
                    key=lambda r: r.cell.slowdown,
                )
                stragglers = [r for r in row if r.cell.slowdown > 0]
                if not stragglers:
                    continue
                limit = None
                for i, r in enumerate(stragglers):
                    if all(x.required and x.found_in_time == x.required for x in stragglers[i:]):
                        limit = r
                        break
                per = ", ".join(f"{r.cell.slowdown:.0%}: {r.found_in_time}/{r.required}" for r in stragglers)
                fp = sum(r.fp for r in row)
                lines.append(
                    f"| {size} | {iv:g} | {noise.name} | {'not reached' if limit is None else f'{limit.cell.slowdown:.0%}'} | "
                    f"{'–' if limit is None else _f(_median(limit.ttf_s), '{:.0f}')} | {per} | {fp} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(prog="python -m bench.evaluation.steplevel", description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5, help="seeds per cell (default 5)")
    ap.add_argument("--quick", action="store_true", help="the two smaller job sizes only (implies --no-write)")
    ap.add_argument("--no-write", action="store_true", help=f"do not update {DOC.name}")
    ap.add_argument("--doc", type=Path, default=DOC, help="markdown file to update")
    ap.add_argument(
        "--cache",
        type=Path,
        default=None,
        metavar="FILE",
        help="keep each cell's result in FILE and reuse those found there (a run resumed with the same code)",
    )
    ap.add_argument("--from-cache", action="store_true", help="report only the cells found in --cache, running none")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error("--seeds must be at least 1")
    from gpufleet.server.replay import run_replay

    results, cache = [], _cached(args.cache)
    for cell in grid(args.quick):
        key = _cell_key(cell, args.seeds)
        if key in cache:
            results.append(_restore(cell, cache[key]))
            continue
        if args.from_cache:
            continue
        r = run_cell(run_replay, cell, range(args.seeds))
        _store(args.cache, key, r)
        results.append(r)
        print(
            f"{cell.size:5d} GPUs {cell.interval_s:g} s {cell.noise.name:5s} {cell.slowdown:4.0%} "
            f"{'attributed' if cell.attributed else 'unattributed'}: {r.found_in_time}/{r.required} in time, "
            f"{r.fp} false, {r.cpu_s:.1f} s CPU",
            file=sys.stderr,
            flush=True,
        )
    body, limit = render(results, args.seeds), render_limit(results, args.seeds)
    print(body + "\n\n" + limit)
    if not args.no_write and not args.quick:
        SECTION.write(args.doc, body, "Evaluation")
        LIMIT_SECTION.write(args.doc, limit, "Evaluation")
        print(f"\nwrote {args.doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
