"""Probe scenarios: fleets shaped unlike the catalog's, scored like it but kept out of it.

The catalog (bench/evaluation/scenarios.py) is what the suite's figures are comparable over; these probes ask how the
same engine, with the same defaults, does on traces of other shapes: a job of several hundred GPUs with
one GPU about 10 % slow (also sampled every second, noisier, unattributed), one slow node among 48, a quiet
16-GPU job, PCIe-only boards (no NVLink), GPUs without SM activity (A100-like: power and clocks only),
noisier sensors, and two jobs side by side on a fleet without job attribution, where peer groups must be
inferred. `python -m bench.evaluation.detection_eval --probes` scores them.

Sizes: a "10 % slow" GPU here is one whose silent slowdown makes the whole job about 10-15 % slower, so
the generator's truth requires an alert (STRAGGLER_REQUIRED_SLOWDOWN); the `*_gpu10` probe slows the GPU
itself by exactly 10 %, which in a job of hundreds of ranks slows the job by less (the slowest rank's noise
already sets its pace), so its truth is only allowed: it counts false alerts, and whether the engine
notices at all shows as an allowed match.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from bench.evaluation.scenarios import Scenario, _Draw, _whole
from bench.evaluation.tracegen import A100, H100, H100_PCIE, ClusterSpec, GpuModel, Incident

# The noise multiplier of the noisy probes: the robustness bar.
NOISE_SCALE = 4.0
# A quiet job's reading noise: a quarter of the generator's, where a fixed-fraction margin is far too wide
# and a margin from the job's own spread is far too narrow without its floor.
QUIET_NOISE_SCALE = 0.25
# GPU speed factors that slow a job by about 10-15 % (comm 12-30 % of compute). Each step waits for its
# slowest rank, so the pace a straggler must fall behind is the expected maximum of the ranks' per-step
# noise: higher with more ranks and with more noise (384 ranks: 2.9 sigma; 16 ranks: 1.8 sigma).
JOB_10PCT_SPEED = (0.82, 0.86)
JOB_10PCT_SPEED_NOISE4_LARGE = (0.68, 0.73)
JOB_10PCT_SPEED_NOISE4 = (0.73, 0.78)
GPU_10PCT_SPEED = 1.0 / 1.1


def _straggler_job(
    name: str,
    seed: int,
    n_nodes: int,
    model: GpuModel,
    speed: tuple[float, float] | float,
    gpus_per_node: int = 8,
    duration_s: float = 900.0,
    noise_scale: float = 1.0,
    **job_kw,
) -> ClusterSpec:
    """One job over n_nodes whole nodes of `model`; one GPU silently slow (no clock cut, no bits) from
    240-360 s to 660-780 s."""
    d = _Draw(name, seed)
    nodes = tuple(replace(n, gpus=gpus_per_node) for n in d.nodes(n_nodes, model))
    job = d.job("j1", d.hpc(), _whole(nodes), **job_kw)
    severity = speed if isinstance(speed, float) else d.u(*speed)
    inc = Incident(
        "slow_gpu", d.u(240, 360), d.u(660, 780), d.pick(nodes).name, d.i(0, gpus_per_node - 1), severity=severity
    )
    return d.spec(nodes, [job], [inc], duration_s, interval_s=5.0, noise_scale=noise_scale)


def large_job(seed: int) -> ClusterSpec:
    return _straggler_job("probe_large_job", seed, 48, H100, JOB_10PCT_SPEED)


def large_job_gpu10(seed: int) -> ClusterSpec:
    return _straggler_job("probe_large_job_gpu10", seed, 48, H100, GPU_10PCT_SPEED)


def large_job_1s(seed: int) -> ClusterSpec:
    # 1 s sampling: five times the lines; a shorter trace keeps its replay within a minute on a small machine.
    spec = _straggler_job("probe_large_job_1s", seed, 48, H100, JOB_10PCT_SPEED, duration_s=780.0)
    return replace(spec, interval_s=1.0)


def large_job_noise4(seed: int) -> ClusterSpec:
    return _straggler_job(
        "probe_large_job_noise4", seed, 48, H100, JOB_10PCT_SPEED_NOISE4_LARGE, noise_scale=NOISE_SCALE
    )


def quiet_job(seed: int) -> ClusterSpec:
    return _straggler_job(
        "probe_quiet_job", seed, 2, H100, JOB_10PCT_SPEED, noise_scale=QUIET_NOISE_SCALE, structural_spread=0.002
    )


def _pcie_job(name: str, seed: int, speed: tuple[float, float], noise_scale: float = 1.0) -> ClusterSpec:
    # Collectives over PCIe and the network take 40-80 % of the compute time (NVLink boards: 12-30 %), so
    # a straggler's share of the step, and its slowing of the job, is smaller for the same GPU speed.
    d = _Draw(name + "_comm", seed)
    return _straggler_job(
        name, seed, 4, H100_PCIE, speed, gpus_per_node=4, noise_scale=noise_scale, comm_ratio=d.u(0.4, 0.8)
    )


def pcie_job(seed: int) -> ClusterSpec:
    return _pcie_job("probe_pcie_job", seed, (0.72, 0.8))


def pcie_job_noise4(seed: int) -> ClusterSpec:
    return _pcie_job("probe_pcie_job_noise4", seed, (0.66, 0.72), NOISE_SCALE)


def a100_job(seed: int) -> ClusterSpec:
    return _straggler_job("probe_a100_job", seed, 2, A100, JOB_10PCT_SPEED)


def a100_job_noise4(seed: int) -> ClusterSpec:
    return _straggler_job("probe_a100_job_noise4", seed, 2, A100, JOB_10PCT_SPEED_NOISE4, noise_scale=NOISE_SCALE)


def _two_jobs(name: str, seed: int, kind: str, model: GpuModel = H100, noise_scale: float = 1.0) -> ClusterSpec:
    """Two jobs of different loads, each on its own two nodes, and one incident: `slow_gpu` (a straggler
    slowing its job 10-20 %), `slow_node` (one node 18-25 % slow), `host_starved` (one node's host starving
    its GPUs) or `comm_slowdown` (one job's collectives 2-4x longer). Without attribution the peer groups
    must be inferred without mixing the two jobs."""
    d = _Draw(name, seed)
    nodes = d.nodes(4, model)
    a = d.job("a", d.hpc(), _whole(nodes[:2]))
    b = d.job("b", d.hpc(), _whole(nodes[2:]), intensity=d.u(0.5, 0.7), sm_coefficient=d.u(0.45, 0.6))
    start, end, k = d.u(240, 360), d.u(660, 780), d.i(0, 3)
    node, job = nodes[k].name, "a" if k < 2 else "b"
    if kind == "slow_gpu":
        inc = Incident(kind, start, end, node, d.i(0, 7), severity=d.u(0.75, 0.82))
    elif kind == "slow_node":
        inc = Incident(kind, start, end, node, severity=d.u(0.75, 0.82))
    elif kind == "host_starved":
        inc = Incident(kind, start, end, node, job=job, severity=d.u(0.3, 0.7))
    else:
        inc = Incident(kind, start, end, job=job, severity=d.u(2.0, 4.0))
    return d.spec(nodes, [a, b], [inc], 900.0, interval_s=5.0, noise_scale=noise_scale)


def two_jobs(seed: int) -> ClusterSpec:
    return _two_jobs("probe_two_jobs", seed, "slow_gpu")


def two_jobs_noise4(seed: int) -> ClusterSpec:
    return _two_jobs("probe_two_jobs_noise4", seed, "slow_gpu", noise_scale=NOISE_SCALE)


def two_jobs_slow_node(seed: int) -> ClusterSpec:
    return _two_jobs("probe_two_jobs_slow_node", seed, "slow_node")


def two_jobs_comm(seed: int) -> ClusterSpec:
    return _two_jobs("probe_two_jobs_comm", seed, "comm_slowdown")


def a100_two_jobs_starved_noise4(seed: int) -> ClusterSpec:
    return _two_jobs("probe_a100_two_jobs_starved_noise4", seed, "host_starved", A100, NOISE_SCALE)


def a100_two_jobs_comm_noise4(seed: int) -> ClusterSpec:
    return _two_jobs("probe_a100_two_jobs_comm_noise4", seed, "comm_slowdown", A100, NOISE_SCALE)


def large_job_slow_node(seed: int) -> ClusterSpec:
    """One of the 48 nodes silently slow as a whole: one node among hundreds of GPUs."""
    d = _Draw("probe_large_job_slow_node", seed)
    nodes = d.nodes(48, H100)
    job = d.job("j1", d.hpc(), _whole(nodes))
    inc = Incident("slow_node", d.u(240, 360), d.u(660, 780), d.pick(nodes).name, severity=d.u(0.78, 0.84))
    return d.spec(nodes, [job], [inc], 900.0, interval_s=5.0)


def _comm_job(name: str, seed: int, n_nodes: int, model: GpuModel, growth: tuple[float, float], **kw) -> ClusterSpec:
    d = _Draw(name, seed)
    gpus = kw.pop("gpus_per_node", 8)
    nodes = tuple(replace(n, gpus=gpus) for n in d.nodes(n_nodes, model))
    job = d.job("j1", d.hpc(), _whole(nodes), **kw)
    inc = Incident("comm_slowdown", d.u(240, 360), d.u(660, 780), job="j1", severity=d.u(*growth))
    return d.spec(nodes, [job], [inc], 900.0, interval_s=5.0)


def large_job_comm(seed: int) -> ClusterSpec:
    return _comm_job("probe_large_job_comm", seed, 48, H100, (2.0, 4.0))


def pcie_job_comm(seed: int) -> ClusterSpec:
    # Collectives already 40-80 % of compute: 1.6-2.5x longer still slows the job by a quarter or more.
    d = _Draw("probe_pcie_job_comm_ratio", seed)
    return _comm_job("probe_pcie_job_comm", seed, 4, H100_PCIE, (1.6, 2.5), gpus_per_node=4, comm_ratio=d.u(0.4, 0.8))


def _unattributed(build: Callable[[int], ClusterSpec]) -> Callable[[int], ClusterSpec]:
    """The same cluster on a fleet whose scheduler labels no GPU: no job carries hpc_job (the generator then
    names no job in any truth, and job-level truths fall away)."""

    def unlabelled(seed: int) -> ClusterSpec:
        spec = build(seed)
        return replace(spec, jobs=tuple(replace(j, hpc_job=None) for j in spec.jobs))

    return unlabelled


_STRAGGLER = "(straggler on the slow GPU; nothing else)"
PROBES = (
    Scenario("probe_large_job", f"48 nodes x 8 H100, one GPU slowing the job 10-14 % {_STRAGGLER}", large_job),
    Scenario(
        "probe_large_job_gpu10",
        "48 nodes x 8 H100, one GPU exactly 10 % slow (the job slows less: an alert is allowed, not required)",
        large_job_gpu10,
    ),
    Scenario("probe_large_job_1s", f"the 384-GPU job sampled every second {_STRAGGLER}", large_job_1s),
    Scenario(
        "probe_large_job_noise4",
        f"the 384-GPU job, every reading noise x{NOISE_SCALE:g} {_STRAGGLER}",
        large_job_noise4,
    ),
    Scenario("probe_large_job_unattributed", f"the 384-GPU job without hpc_job {_STRAGGLER}", _unattributed(large_job)),
    Scenario(
        "probe_quiet_job",
        f"2 nodes x 8 H100 with a quarter of the usual noise, a 10-14 % straggler {_STRAGGLER}",
        quiet_job,
    ),
    Scenario(
        "probe_quiet_job_unattributed", f"the quiet 16-GPU job without hpc_job {_STRAGGLER}", _unattributed(quiet_job)
    ),
    Scenario(
        "probe_pcie_job",
        f"4 nodes x 4 H100 PCIe (no NVLink counters, collectives 40-80 % of compute) {_STRAGGLER}",
        pcie_job,
    ),
    Scenario(
        "probe_pcie_job_noise4", f"the PCIe job, every reading noise x{NOISE_SCALE:g} {_STRAGGLER}", pcie_job_noise4
    ),
    Scenario("probe_pcie_job_unattributed", f"the PCIe job without hpc_job {_STRAGGLER}", _unattributed(pcie_job)),
    Scenario("probe_a100_job", f"2 nodes x 8 A100 (no SM activity: power and clocks only) {_STRAGGLER}", a100_job),
    Scenario(
        "probe_a100_job_noise4", f"the A100 job, every reading noise x{NOISE_SCALE:g} {_STRAGGLER}", a100_job_noise4
    ),
    Scenario("probe_a100_job_unattributed", f"the A100 job without hpc_job {_STRAGGLER}", _unattributed(a100_job)),
    Scenario(
        "probe_large_job_slow_node",
        "48 nodes x 8 H100, one node 16-22 % slow (straggler on that node, gpu null)",
        large_job_slow_node,
    ),
    Scenario(
        "probe_large_job_slow_node_unattributed",
        "the 48-node job with one slow node, without hpc_job (straggler on that node, gpu null)",
        _unattributed(large_job_slow_node),
    ),
    Scenario("probe_large_job_comm", "48 nodes x 8 H100, collectives 2-4x longer (comm_bound)", large_job_comm),
    Scenario(
        "probe_pcie_job_comm",
        "4 nodes x 4 H100 PCIe, collectives (already 40-80 % of compute) 1.6-2.5x longer (comm_bound)",
        pcie_job_comm,
    ),
    Scenario(
        "probe_two_jobs_unattributed",
        f"two jobs of different loads on two nodes each, no hpc_job {_STRAGGLER}",
        _unattributed(two_jobs),
    ),
    Scenario(
        "probe_two_jobs_noise4",
        f"the two jobs, attributed, every reading noise x{NOISE_SCALE:g} {_STRAGGLER}",
        two_jobs_noise4,
    ),
    Scenario(
        "probe_two_jobs_noise4_unattributed",
        f"the two jobs, no hpc_job, every reading noise x{NOISE_SCALE:g} {_STRAGGLER}",
        _unattributed(two_jobs_noise4),
    ),
    Scenario(
        "probe_two_jobs_slow_node_unattributed",
        "two jobs on two nodes each, no hpc_job, one node 18-25 % slow (straggler on that node, gpu null)",
        _unattributed(two_jobs_slow_node),
    ),
    Scenario(
        "probe_two_jobs_comm_unattributed",
        "two jobs on two nodes each, no hpc_job, one job's collectives 2-4x longer (no straggler may fire)",
        _unattributed(two_jobs_comm),
    ),
    Scenario(
        "probe_a100_two_jobs_starved_noise4_unattributed",
        f"two A100 jobs on two nodes each, no hpc_job, noise x{NOISE_SCALE:g}, one node's host starving its GPUs "
        "(straggler on that node, gpu null; nothing else)",
        _unattributed(a100_two_jobs_starved_noise4),
    ),
    Scenario(
        "probe_a100_two_jobs_comm_noise4_unattributed",
        f"two A100 jobs on two nodes each, no hpc_job, noise x{NOISE_SCALE:g}, one job's collectives 2-4x longer "
        "(no straggler may fire)",
        _unattributed(a100_two_jobs_comm_noise4),
    ),
)
BY_NAME = {p.name: p for p in PROBES}
