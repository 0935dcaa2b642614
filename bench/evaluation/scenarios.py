"""The scenario catalog for the detection engine, and the scoring of alerts against ground truth.

Each Scenario builds a ClusterSpec from a seed: which GPU, when, how severe, the GPU model, the sampling
interval and the line order all vary with it. `score()` matches alerts to the generator's truths:

- an alert matches a truth when kind and subject agree and `started` lies in
  [start - lead - CLOCK_SLACK_S, end + grace];
- precision per kind = alerts matching a required truth / alerts not matching only an allowed one;
- recall per kind = required truths matched / required truths; time to fire = started - (start - lead),
  i.e. from the first moment the condition could be said to have begun;
- given the trace's end, a detection alert still open (or resolved) more than RESOLVE_S after the last
  truth it matches ended is "stuck": an alert that outlives its incident misleads as much as a false one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from bench.evaluation.tracegen import A100, H100, ClusterSpec, GpuModel, Incident, Job, NodeSpec, Truth

GRACE_S = 120.0
DEADLINE_S = 150.0
RESOLVE_S = 300.0
# Truths are in true time, alerts in the sample time of the node's own clock, which the generator sets up
# to 2 s off (NTP-level drift, too small for replay to take out), plus a sample's timing jitter: a GPU
# lost on a node whose clock runs 1.9 s behind is stamped, and alerted, before the incident's true start.
CLOCK_SLACK_S = 2.5
# Alerts that describe a condition and clear when it ends (health alerts clear on their own timers).
_RESOLVING_KINDS = ("thermal_throttle", "straggler", "comm_bound", "input_bound")
ALERT_KINDS = (
    "thermal_throttle",
    "straggler",
    "comm_bound",
    "input_bound",
    "node_unreachable",
    "gpu_lost",
    "xid",
    "ecc",
)


@dataclass(frozen=True)
class Scenario:
    """A named, seed-randomised cluster situation; `small` ones run in pytest, all run in the bench."""

    name: str
    description: str
    build: Callable[[int], ClusterSpec]
    small: bool = True
    decoy: bool = False


# ------------------------------------------------------------------------------------------ helpers


class _Draw:
    """Seeded random choices used by the builders."""

    def __init__(self, name: str, seed: int):
        self.rng = np.random.default_rng([seed, sum(map(ord, name))])
        self.seed = seed
        self._hpc_ids: set[str] = set()

    def u(self, a: float, b: float) -> float:
        return float(self.rng.uniform(a, b))

    def i(self, a: int, b: int) -> int:
        return int(self.rng.integers(a, b + 1))

    def pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    def model(self) -> GpuModel:
        return self.pick((H100, H100, A100))

    def interval(self) -> float:
        return float(self.pick((5.0, 5.0, 5.0, 1.0, 2.0, 10.0)))

    def order(self) -> str:
        return self.pick(("time", "node", "pulls"))

    def nodes(self, n: int, model: GpuModel | None = None, prefix: str = "dgx") -> tuple[NodeSpec, ...]:
        return tuple(
            NodeSpec(
                f"{prefix}-{k:03d}",
                model or self.model(),
                8,
                self.u(20.0, 32.0),
                self.u(-0.5, 0.5) if self.rng.random() < 0.8 else self.u(-2.0, 2.0),
            )
            for k in range(1, n + 1)
        )

    def job(self, key: str, hpc: str | None, slots, start: float = 0.0, end: float | None = None, **kw: Any) -> Job:
        params = dict(
            step_s=self.u(0.3, 1.5),
            comm_ratio=self.u(0.12, 0.3),
            intensity=self.u(0.9, 1.1),
            sm_coefficient=self.u(0.75, 0.9),
            startup_s=self.u(60.0, 120.0),
            winddown_s=self.u(20.0, 60.0),
            memory_bytes=int(self.u(40, 78) * 2**30),
        )
        params.update(kw)
        return Job(key, hpc, tuple((n, tuple(g)) for n, g in slots), start, end, **params)

    def hpc(self) -> str:
        """A job id not drawn before in this spec: two jobs under one id are one job to any attribution
        (an id drawn twice made the engine rightly compare the two as one)."""
        while True:
            hpc = str(self.i(70000, 99999))
            if hpc not in self._hpc_ids:
                self._hpc_ids.add(hpc)
                return hpc

    def spec(self, nodes, jobs, incidents, duration: float, **kw: Any) -> ClusterSpec:
        base = dict(
            interval_s=self.interval(),
            order=self.order(),
            drop_ratio=self.u(0.0, 0.01),
            seed=self.seed,
            t0=1_763_800_000.0 + self.i(0, 10**6),
        )
        base.update(kw)
        return ClusterSpec(tuple(nodes), tuple(jobs), tuple(incidents), duration, **base)


def _whole(nodes: Iterable[NodeSpec]) -> list[tuple[str, range]]:
    return [(n.name, range(n.gpus)) for n in nodes]


def _one_job(d: _Draw, n_nodes: int, model: GpuModel | None = None, hpc: bool = True):
    nodes = d.nodes(n_nodes, model or d.model())
    return nodes, d.job("j1", d.hpc() if hpc else None, _whole(nodes))


# ------------------------------------------------------------------------------------ incident kinds


def cooling_failure(seed: int) -> ClusterSpec:
    d = _Draw("cooling_failure", seed)
    nodes, job = _one_job(d, d.i(1, 3))
    victim = d.pick(nodes).name
    start = d.u(240, 420)
    end = d.pick((None, start + d.u(360, 540)))
    inc = Incident("cooling_failure", start, end or 1e9, victim, d.i(0, 7), severity=d.u(1.7, 2.4), count=d.i(60, 240))
    return d.spec(nodes, [job], [inc], 1080.0)


def hot_gpu(seed: int) -> ClusterSpec:
    d = _Draw("hot_gpu", seed)
    nodes, job = _one_job(d, d.i(1, 2))
    model = nodes[0].model
    target = d.u(84.0, min(85.5, model.slowdown_celsius - 2.5))
    inc = Incident("hot_gpu", d.u(200, 400), d.u(720, 900), d.pick(nodes).name, d.i(0, 7), severity=target)
    return d.spec(nodes, [job], [inc], 960.0)


def silent_slow_gpu(seed: int) -> ClusterSpec:
    d = _Draw("silent_slow_gpu", seed)
    nodes, job = _one_job(d, d.i(1, 3))
    inc = Incident("slow_gpu", d.u(240, 420), d.u(700, 900), d.pick(nodes).name, d.i(0, 7), severity=d.u(0.6, 0.85))
    return d.spec(nodes, [job], [inc], 960.0)


def power_brake(seed: int) -> ClusterSpec:
    d = _Draw("power_brake", seed)
    nodes, job = _one_job(d, d.i(1, 2))
    start = d.u(240, 420)
    inc = Incident("power_brake", start, start + d.u(240, 480), d.pick(nodes).name, d.i(0, 7), severity=d.u(0.5, 0.75))
    return d.spec(nodes, [job], [inc], 960.0)


def node_power_cap(seed: int) -> ClusterSpec:
    """A power cap on one node of a multi-node job (a rack or PDU limit; 0x4 bits, clocks down): the job
    runs at that node's pace. Unlike the operator's cap on the whole job, it sets one node apart."""
    return _node_incident("node_power_cap", seed, (0.6, 0.8), job="j1")


def partial_brake(seed: int) -> ClusterSpec:
    """A power brake on 3-6 of a single-node job's 8 GPUs (one power domain): the group's median clock is
    no longer the healthy one, and the unbraked GPUs draw more power spinning at full clocks."""
    d = _Draw("partial_brake", seed)
    nodes, job = _one_job(d, 1)
    start, end = d.u(240, 420), d.u(700, 900)
    sev = d.u(0.5, 0.7)
    braked = sorted(d.rng.choice(8, size=d.i(3, 6), replace=False).tolist())
    incs = [Incident("power_brake", start, end, nodes[0].name, g, severity=sev) for g in braked]
    return d.spec(nodes, [job], incs, 960.0)


def slow_node(seed: int) -> ClusterSpec:
    return _node_incident("slow_node", seed, (0.7, 0.88))


def node_brake(seed: int) -> ClusterSpec:
    """A power brake on every GPU of one node (a PSU or PDU fault): the others spin at full clocks and,
    without SM activity, draw more power than the braked node; the braked node is the culprit."""
    return _node_incident("node_brake", seed, (0.5, 0.7))


def host_starved(seed: int) -> ClusterSpec:
    return _node_incident("host_starved", seed, (0.25, 0.8), job="j1")


def starved_rank(seed: int) -> ClusterSpec:
    """One rank waits on its own host each step (a slow input pipeline, extra host-side work on rank 0):
    that GPU idles while its peers spin in the collective at full utilization. Their SM activity drops
    together and nobody is busier than the rest: without the idle rank named this reads as comm_bound."""
    d = _Draw("starved_rank", seed)
    nodes, job = _one_job(d, d.i(1, 3))
    inc = Incident(
        "host_starved", d.u(240, 420), d.u(700, 900), d.pick(nodes).name, d.i(0, 7), job="j1", severity=d.u(0.2, 0.8)
    )
    return d.spec(nodes, [job], [inc], 960.0)


def _node_incident(kind: str, seed: int, severity: tuple[float, float], job: str | None = None) -> ClusterSpec:
    """One job on 2-4 nodes; one of them has the incident `kind` from 240-420 s to 700-900 s."""
    d = _Draw(kind, seed)
    nodes, j = _one_job(d, d.i(2, 4))
    inc = Incident(kind, d.u(240, 420), d.u(700, 900), d.pick(nodes).name, job=job, severity=d.u(*severity))
    return d.spec(nodes, [j], [inc], 960.0)


def comm_slowdown(seed: int) -> ClusterSpec:
    d = _Draw("comm_slowdown", seed)
    nodes, job = _one_job(d, d.i(2, 4))
    inc = Incident("comm_slowdown", d.u(240, 420), d.u(700, 900), job="j1", severity=d.u(2.0, 4.0))
    return d.spec(nodes, [job], [inc], 960.0)


def input_starved(seed: int) -> ClusterSpec:
    d = _Draw("input_starved", seed)
    nodes, job = _one_job(d, d.i(1, 3))
    inc = Incident("input_starved", d.u(240, 420), d.u(700, 900), job="j1", severity=d.u(0.4, 1.5))
    return d.spec(nodes, [job], [inc], 960.0)


def gpu_lost(seed: int) -> ClusterSpec:
    return _lost_gpu("gpu_lost", seed, (300, 500), (15, 45), 840.0)


def gpu_lost_hang(seed: int) -> ClusterSpec:
    """As gpu_lost, but the other ranks hang in the collective until NCCL's timeout (minutes): utilization
    stays high and SM activity is gone job-wide, which is not comm_bound (the lost GPU explains it)."""
    return _lost_gpu("gpu_lost_hang", seed, (300, 400), (180, 600), 1080.0)


def _lost_gpu(
    name: str, seed: int, at_s: tuple[float, float], hang_s: tuple[float, float], duration_s: float
) -> ClusterSpec:
    """A GPU falls off the bus (XID 79 just before) at a time in at_s; its job's other ranks hang for a
    time in hang_s, then the job dies."""
    d = _Draw(name, seed)
    nodes, job = _one_job(d, d.i(1, 2))
    victim, gpu, at = d.pick(nodes).name, d.i(0, 7), d.u(*at_s)
    incs = [
        Incident("xid", at - 2, at - 1, victim, gpu, code=79),
        Incident("gpu_lost", at, 1e9, victim, gpu, severity=d.u(*hang_s)),
    ]
    return d.spec(nodes, [job], incs, duration_s)


def node_crash(seed: int) -> ClusterSpec:
    """A node of a multi-node job goes down for good; the job's ranks on the other nodes hang in the
    collective until NCCL's timeout, which is not comm_bound (the lost node explains it)."""
    d = _Draw("node_crash", seed)
    nodes, job = _one_job(d, d.i(2, 3))
    inc = Incident("node_crash", d.u(300, 400), 1e9, d.pick(nodes).name, severity=d.u(180, 600))
    return d.spec(nodes, [job], [inc], 1080.0)


def xid_burst(seed: int) -> ClusterSpec:
    d = _Draw("xid_burst", seed)
    nodes, job = _one_job(d, d.i(1, 2))
    at = d.u(240, 500)
    code = d.pick((48, 63, 64, 74, 92, 94, 95, 119))
    incs = [Incident("xid", at, at + d.u(1, 30), d.pick(nodes).name, d.i(0, 7), code=code, count=d.i(1, 5))]
    if d.rng.random() < 0.5:
        at2 = d.u(240, 600)
        incs.append(
            Incident("xid", at2, at2 + 5, d.pick(nodes).name, d.i(0, 7), code=d.pick((13, 31, 43)), count=d.i(1, 3))
        )
    return d.spec(nodes, [job], incs, 840.0)


def agent_down(seed: int) -> ClusterSpec:
    d = _Draw("agent_down", seed)
    nodes, job = _one_job(d, d.i(2, 3))
    start = d.u(240, 420)
    inc = Incident("agent_down", start, start + d.u(120, 360), d.pick(nodes).name)
    return d.spec(nodes, [job], [inc], 960.0)


def straggler_unattributed(seed: int) -> ClusterSpec:
    d = _Draw("straggler_unattributed", seed)
    nodes, job = _one_job(d, d.i(1, 2), hpc=False)
    kind = d.pick(("slow_gpu", "power_brake"))
    sev = d.u(0.6, 0.8) if kind == "slow_gpu" else d.u(0.5, 0.7)
    inc = Incident(kind, d.u(240, 420), d.u(700, 900), d.pick(nodes).name, d.i(0, 7), severity=sev)
    return d.spec(nodes, [job], [inc], 960.0)


def straggler_on_shared_node(seed: int) -> ClusterSpec:
    d = _Draw("straggler_on_shared_node", seed)
    nodes = d.nodes(2, d.model())
    a = d.job("a", d.hpc(), [(nodes[0].name, range(4)), (nodes[1].name, range(4))])
    b = d.job(
        "b",
        d.hpc(),
        [(nodes[0].name, range(4, 8)), (nodes[1].name, range(4, 8))],
        intensity=d.u(0.5, 0.8),
        comm_ratio=d.u(0.05, 0.12),
        sm_coefficient=d.u(0.4, 0.6),
    )
    inc = Incident("slow_gpu", d.u(240, 420), d.u(700, 900), d.pick(nodes).name, d.i(4, 7), severity=d.u(0.6, 0.8))
    return d.spec(nodes, [a, b], [inc], 960.0)


def intermittent_straggler(seed: int) -> ClusterSpec:
    d = _Draw("intermittent_straggler", seed)
    nodes, job = _one_job(d, d.i(1, 3))
    node, gpu, sev = d.pick(nodes).name, d.i(0, 7), d.u(0.6, 0.8)
    incs, at = [], d.u(240, 330)
    while at < 800:
        on = d.u(60, 150)
        incs.append(Incident("slow_gpu", at, at + on, node, gpu, severity=sev))
        at += on + d.u(20, 60)
    return d.spec(nodes, [job], incs, 960.0)


def straggler_from_start(seed: int) -> ClusterSpec:
    d = _Draw("straggler_from_start", seed)
    nodes, job = _one_job(d, d.i(1, 3))
    inc = Incident("slow_gpu", 0.0, 1e9, d.pick(nodes).name, d.i(0, 7), severity=d.u(0.6, 0.8))
    return d.spec(nodes, [job], [inc], 900.0)


def brake_from_start(seed: int) -> ClusterSpec:
    d = _Draw("brake_from_start", seed)
    nodes, job = _one_job(d, d.i(1, 2))
    end = d.u(330, 450)
    inc = Incident(
        "power_brake", d.pick((0.0, 40.0, 80.0)), end, d.pick(nodes).name, d.i(0, 7), severity=d.u(0.5, 0.75)
    )
    return d.spec(nodes, [job], [inc], 1100.0)


def node_from_start(seed: int) -> ClusterSpec:
    d = _Draw("node_from_start", seed)
    nodes, job = _one_job(d, d.i(2, 4))
    start, end, node = d.pick((0.0, 40.0, 80.0)), d.u(330, 450), d.pick(nodes).name
    if d.rng.random() < 0.5:
        inc = Incident("host_starved", start, end, node, job="j1", severity=d.u(0.45, 0.8))
    else:
        inc = Incident("slow_node", start, end, node, severity=d.u(0.6, 0.72))
    return d.spec(nodes, [job], [inc], 1100.0)


def early_straggler_then_comm(seed: int) -> ClusterSpec:
    d = _Draw("early_straggler_then_comm", seed)
    nodes, job = _one_job(d, d.i(1, 2))
    end = d.u(360, 440)
    start = d.u(620, 680)
    incs = [
        Incident("slow_gpu", 0.0, end, d.pick(nodes).name, d.i(0, 7), severity=d.u(0.6, 0.75)),
        Incident("comm_slowdown", start, start + d.u(180, 240), job="j1", severity=d.u(2.5, 4.0)),
    ]
    return d.spec(nodes, [job], incs, 1100.0)


def marginal_straggler(seed: int) -> ClusterSpec:
    d = _Draw("marginal_straggler", seed)
    nodes, job = _one_job(d, d.i(1, 2))
    inc = Incident("slow_gpu", d.u(240, 420), d.u(700, 900), d.pick(nodes).name, d.i(0, 7), severity=d.u(0.86, 0.94))
    return d.spec(nodes, [job], [inc], 960.0)


def straggler_under_power_cap(seed: int) -> ClusterSpec:
    d = _Draw("straggler_under_power_cap", seed)
    nodes, job = _one_job(d, d.i(1, 2))
    kind = d.pick(("slow_gpu", "power_brake"))
    incs = [
        Incident("power_cap", d.u(150, 250), 1e9, job="j1", severity=d.u(0.75, 0.9)),
        Incident(kind, d.u(450, 550), d.u(800, 900), d.pick(nodes).name, d.i(0, 7), severity=d.u(0.55, 0.75)),
    ]
    return d.spec(nodes, [job], incs, 960.0)


def clock_skew(seed: int) -> ClusterSpec:
    """One node's clock runs 30-120 s off (its NTP lost), in a job whose collectives then slow down."""
    d = _Draw("clock_skew", seed)
    nodes, job = _one_job(d, d.i(3, 4))
    k = d.i(0, len(nodes) - 1)
    skew = d.pick((-1.0, 1.0)) * d.u(30.0, 120.0)
    nodes = tuple(replace(n, clock_skew_s=skew) if i == k else n for i, n in enumerate(nodes))
    inc = Incident("comm_slowdown", d.u(240, 420), d.u(700, 900), job="j1", severity=d.u(2.0, 4.0))
    return d.spec(nodes, [job], [inc], 960.0)


def comm_flapping(seed: int) -> ClusterSpec:
    d = _Draw("comm_flapping", seed)
    nodes, job = _one_job(d, d.i(2, 4))
    job = replace(job, comm_ratio=d.u(0.2, 0.3))
    sev, incs, at = d.u(2.5, 4.0), [], d.u(240, 330)
    while at < 800:
        on = d.u(90, 180)
        incs.append(Incident("comm_slowdown", at, at + on, job="j1", severity=sev))
        at += on + d.u(20, 60)
    return d.spec(nodes, [job], incs, 960.0)


def comm_then_straggler(seed: int) -> ClusterSpec:
    d = _Draw("comm_then_straggler", seed)
    nodes, job = _one_job(d, d.i(2, 3))
    job = replace(job, comm_ratio=d.u(0.2, 0.3))
    first = d.u(240, 300)
    incs = [
        Incident("comm_slowdown", first, first + d.u(200, 260), job="j1", severity=d.u(2.5, 4.0)),
        Incident("slow_gpu", first + 330, first + 600, d.pick(nodes).name, d.i(0, 7), severity=d.u(0.6, 0.8)),
    ]
    return d.spec(nodes, [job], incs, 960.0)


# ------------------------------------------------------------------------------------------- decoys


def decoy_jitter(seed: int) -> ClusterSpec:
    d = _Draw("decoy_jitter", seed)
    nodes, job = _one_job(d, d.i(1, 3))
    incs = []
    for _ in range(d.i(4, 8)):
        at = d.u(180, 840)
        incs.append(Incident("jitter", at, at + d.u(5, 15), d.pick(nodes).name, d.i(0, 7), severity=d.u(0.4, 0.7)))
    at = d.u(300, 700)
    incs.append(Incident("checkpoint", at, at + d.u(10, 20), job="j1", severity=d.u(3.0, 8.0)))
    return d.spec(nodes, [job], incs, 900.0)


def decoy_startup_winddown(seed: int) -> ClusterSpec:
    d = _Draw("decoy_startup_winddown", seed)
    nodes = d.nodes(3, d.model())
    first_end = d.u(400, 560)
    jobs = [
        d.job("a", d.hpc(), _whole(nodes[:2]), 0.0, first_end),
        d.job("b", d.hpc(), _whole(nodes[:2]), first_end + d.u(20, 90), None),
        d.job("c", d.hpc(), _whole(nodes[2:]), d.u(120, 300), d.u(700, 840)),
    ]
    return d.spec(nodes, jobs, [], 900.0)


def decoy_power_cap(seed: int) -> ClusterSpec:
    d = _Draw("decoy_power_cap", seed)
    nodes, job = _one_job(d, d.i(1, 3))
    inc = Incident("power_cap", d.u(240, 420), d.pick((1e9, d.u(700, 850))), job="j1", severity=d.u(0.72, 0.9))
    return d.spec(nodes, [job], [inc], 960.0)


def decoy_hot_not_throttling(seed: int) -> ClusterSpec:
    d = _Draw("decoy_hot_not_throttling", seed)
    nodes, job = _one_job(d, d.i(1, 2))
    warm_node, warm_gpu = d.pick(nodes).name, d.i(0, 7)
    target = d.u(78.0, 80.5)
    incs = [Incident("warm_gpu", d.u(100, 200), 1e9, warm_node, warm_gpu, severity=target)]
    at = d.u(430, 520)
    for _ in range(d.i(1, 3)):
        # A short excursion peaking near 84.2 °C: the integer sensor reads >= 83 for about 15 s.
        amplitude = 84.2 - target
        width = 15.0 * amplitude / 1.7
        incs.append(Incident("temp_spike", at, at + width, warm_node, warm_gpu, severity=amplitude))
        at += width + d.u(60, 180)
    return d.spec(nodes, [job], incs, 960.0)


def decoy_structural(seed: int) -> ClusterSpec:
    d = _Draw("decoy_structural", seed)
    nodes = tuple(
        NodeSpec(f"rack{k // 4}-n{k % 4}", d.model(), 8, 18.0 + 4.0 * k + d.u(-1, 1), d.u(-1.5, 1.5)) for k in range(4)
    )
    by_model: dict[str, list[NodeSpec]] = {}
    for n in nodes:
        by_model.setdefault(n.model.name, []).append(n)
    jobs = [d.job(f"j{i}", d.hpc(), _whole(group), structural_spread=0.02) for i, group in enumerate(by_model.values())]
    return d.spec(nodes, jobs, [], 900.0)


def decoy_mixed_node(seed: int) -> ClusterSpec:
    d = _Draw("decoy_mixed_node", seed)
    nodes = d.nodes(2, d.model())
    a = d.job("a", d.hpc(), [(nodes[0].name, range(4)), (nodes[1].name, range(8))])
    b = d.job(
        "b",
        d.hpc(),
        [(nodes[0].name, range(4, 8))],
        intensity=d.u(0.4, 0.7),
        comm_ratio=d.u(0.03, 0.1),
        sm_coefficient=d.u(0.35, 0.6),
        step_s=d.u(1.5, 3.0),
    )
    return d.spec(nodes, [a, b], [], 900.0)


def decoy_missing_samples(seed: int) -> ClusterSpec:
    d = _Draw("decoy_missing_samples", seed)
    nodes, job = _one_job(d, d.i(2, 3))
    return d.spec(nodes, [job], [], 900.0, drop_ratio=d.u(0.02, 0.06), interval_s=d.pick((1.0, 2.0, 5.0)))


def decoy_counter_reset(seed: int) -> ClusterSpec:
    d = _Draw("decoy_counter_reset", seed)
    nodes, job = _one_job(d, d.i(1, 3))
    incs = [Incident("counter_reset", d.u(200, 800), 0, d.pick(nodes).name) for _ in range(d.i(1, 3))]
    return d.spec(nodes, [job], incs, 900.0)


def decoy_idle_and_ending(seed: int) -> ClusterSpec:
    d = _Draw("decoy_idle_and_ending", seed)
    nodes = d.nodes(3, d.model())
    jobs = [
        d.job("a", d.hpc(), _whole(nodes[:1]), 0.0, d.u(400, 700)),
        d.job("u", None, [(nodes[1].name, range(4))], 0.0, None),
    ]
    return d.spec(nodes, jobs, [], 900.0)


def decoy_brief_agent_gap(seed: int) -> ClusterSpec:
    d = _Draw("decoy_brief_agent_gap", seed)
    nodes, job = _one_job(d, 2)
    start = d.u(300, 600)
    inc = Incident("agent_down", start, start + d.u(6, 15), d.pick(nodes).name)
    return d.spec(nodes, [job], [inc], 900.0)


# ------------------------------------------------------------------------------------- busy clusters

_BUSY_KINDS = (
    "cooling_failure",
    "hot_gpu",
    "slow_gpu",
    "power_brake",
    "slow_node",
    "host_starved",
    "comm_slowdown",
    "input_starved",
    "xid",
    "agent_down",
    "gpu_lost",
)


def _busy(name: str, n_nodes: int, n_jobs: tuple[int, int], n_incidents: tuple[int, int]):
    def build(seed: int) -> ClusterSpec:
        d = _Draw(name, seed)
        duration = 1500.0
        nodes = list(d.nodes(n_nodes // 2, H100, "hgx")) + list(d.nodes(n_nodes - n_nodes // 2, A100, "dgxa"))
        jobs = _busy_jobs(d, nodes, d.i(*n_jobs))
        incidents = _busy_incidents(d, nodes, jobs, d.i(*n_incidents), duration)
        incidents += _busy_decoys(d, nodes, jobs, duration)
        return d.spec(nodes, jobs, incidents, duration, drop_ratio=d.u(0.0, 0.02))

    return build


def _busy_jobs(d: _Draw, nodes: list[NodeSpec], count: int) -> list[Job]:
    """Jobs packed onto same-model nodes; one node shared by two jobs, one job unattributed, spare nodes idle."""
    jobs: list[Job] = []
    pools = [[n for n in nodes if n.model is H100], [n for n in nodes if n.model is A100]]
    for k in range(count):
        pool = pools[k % 2]
        if len(pool) < 2:
            continue
        size = min(len(pool) - 1, d.i(1, 8))
        taken, pools[k % 2] = pool[:size], pool[size:]
        hpc = None if k == count - 1 and count >= 3 else d.hpc()
        jobs.append(d.job(f"j{k}", hpc, _whole(taken), start=d.u(0, 120)))
    shared = pools[0][0] if pools[0] else None
    if shared is not None:
        jobs.append(d.job("sa", d.hpc(), [(shared.name, range(4))]))
        jobs.append(d.job("sb", d.hpc(), [(shared.name, range(4, 8))], intensity=d.u(0.5, 0.8)))
    return jobs


def _busy_incidents(d: _Draw, nodes, jobs: list[Job], count: int, duration: float) -> list[Incident]:
    out: list[Incident] = []
    free_jobs = [j for j in jobs if sum(len(g) for _, g in j.placement) > 1]
    for _ in range(count):
        if not free_jobs:
            break
        job = free_jobs.pop(int(d.rng.integers(len(free_jobs))))
        kinds = [k for k in _BUSY_KINDS if k not in ("slow_node", "host_starved") or len(job.placement) > 1]
        if job.hpc_job is None:
            kinds = [k for k in kinds if k not in ("comm_slowdown", "input_starved")]
        kind = d.pick(kinds)
        node, gpus = d.pick(job.placement)
        gpu = d.pick(gpus)
        start = d.u(300, 800)
        end = start + d.u(300, 600)
        out += _busy_incident(d, kind, job, node, gpu, start, end)
    return out


def _busy_incident(d: _Draw, kind: str, job: Job, node: str, gpu: int, start: float, end: float):
    if kind == "cooling_failure":
        return [Incident(kind, start, end, node, gpu, severity=d.u(1.7, 2.4), count=d.i(60, 240))]
    if kind == "hot_gpu":
        model = H100 if node.startswith("hgx") else A100
        return [Incident(kind, start, end, node, gpu, severity=d.u(84.0, min(85.5, model.slowdown_celsius - 2.5)))]
    if kind == "slow_gpu":
        return [Incident(kind, start, end, node, gpu, severity=d.u(0.6, 0.85))]
    if kind == "power_brake":
        return [Incident(kind, start, end, node, gpu, severity=d.u(0.5, 0.75))]
    if kind == "slow_node":
        return [Incident(kind, start, end, node, severity=d.u(0.7, 0.88))]
    if kind == "host_starved":
        return [Incident(kind, start, end, node, job=job.key, severity=d.u(0.25, 0.8))]
    if kind == "comm_slowdown":
        return [Incident(kind, start, end, job=job.key, severity=d.u(2.0, 4.0))]
    if kind == "input_starved":
        return [Incident(kind, start, end, job=job.key, severity=d.u(0.4, 1.5))]
    if kind == "xid":
        return [Incident(kind, start, start + 20, node, gpu, code=d.pick((48, 74, 94, 119)), count=d.i(1, 4))]
    if kind == "agent_down":
        return [Incident(kind, start, start + d.u(120, 300), node)]
    return [
        Incident("xid", start - 2, start - 1, node, gpu, code=79),
        Incident("gpu_lost", start, 1e9, node, gpu, severity=d.u(15, 45)),
    ]


def _busy_decoys(d: _Draw, nodes, jobs: list[Job], duration: float) -> list[Incident]:
    out: list[Incident] = []
    for job in jobs:
        node, gpus = d.pick(job.placement)
        for _ in range(d.i(0, 3)):
            at = d.u(200, duration - 60)
            out.append(Incident("jitter", at, at + d.u(5, 15), node, d.pick(gpus), severity=d.u(0.4, 0.7)))
        if d.rng.random() < 0.3:
            at = d.u(200, duration - 60)
            out.append(Incident("checkpoint", at, at + d.u(10, 20), job=job.key, severity=d.u(3.0, 8.0)))
    for _ in range(d.i(0, 2)):
        out.append(Incident("counter_reset", d.u(200, duration - 60), 0, d.pick(nodes).name))
    return out


def _unattributed_fleet(name: str, seed: int, wobble: float) -> ClusterSpec:
    """96 GPUs, two jobs and no job attribution: a 64-GPU job with one GPU 20-25 % slow for ten minutes,
    a 32-GPU job one of whose nodes its host starves. `wobble` scales how much the ranks of one job move
    together within a sample (0: steps too regular for any shared wobble, so co-movement names no job)."""
    d = _Draw(name, seed)
    nodes = d.nodes(12, d.model())
    big = d.job("big", None, _whole(nodes[:8]), shared_wobble=wobble)
    small = d.job("small", None, _whole(nodes[8:]), shared_wobble=wobble)
    slow_at, starve_at = d.u(240, 300), d.u(240, 360)
    incidents = [
        Incident("slow_gpu", slow_at, slow_at + 600, d.pick(nodes[:8]).name, d.i(0, 7), severity=d.u(0.75, 0.8)),
        Incident(
            "host_starved",
            starve_at,
            starve_at + d.u(400, 540),
            d.pick(nodes[8:]).name,
            job="small",
            severity=d.u(0.25, 0.6),
        ),
    ]
    return d.spec(nodes, [big, small], incidents, 960.0)


def unattributed_fleet(seed: int) -> ClusterSpec:
    return _unattributed_fleet("unattributed_fleet", seed, 1.0)


def unattributed_fleet_steady(seed: int) -> ClusterSpec:
    return _unattributed_fleet("unattributed_fleet_steady", seed, 0.0)


# ------------------------------------------------------------------------------------------ catalog

CATALOG: tuple[Scenario, ...] = (
    Scenario(
        "cooling_failure",
        "one GPU's cooling fails: it heats past 83 °C, the driver cuts its clocks, "
        "the job waits for it (thermal_throttle + straggler when the slowdown reaches 10 %)",
        cooling_failure,
    ),
    Scenario("hot_gpu", "one GPU runs at 84-86 °C without clock cuts (thermal_throttle only)", hot_gpu),
    Scenario("silent_slow_gpu", "one GPU computes at 60-85 % speed with no throttle bits (straggler)", silent_slow_gpu),
    Scenario("power_brake", "HW power brake (0x80) halves one GPU's clocks (straggler)", power_brake),
    Scenario(
        "node_power_cap",
        "a power cap on one node of a multi-node job (straggler, gpu null: the capped "
        "node, not the nodes drawing more power while they wait)",
        node_power_cap,
    ),
    Scenario(
        "partial_brake",
        "HW power brake on 3-6 of the 8 GPUs of a single-node job (straggler on "
        "each braked GPU, none on the GPUs spinning at full clocks)",
        partial_brake,
    ),
    Scenario("slow_node", "all 8 GPUs of one node of a multi-node job run slower (straggler, gpu null)", slow_node),
    Scenario(
        "node_brake",
        "HW power brake on all 8 GPUs of one node of a multi-node job (straggler, gpu "
        "null: the braked node, not the nodes spinning at full clocks)",
        node_brake,
    ),
    Scenario(
        "host_starved",
        "one host starves its GPUs: they idle while the rest of the job waits (straggler, gpu null)",
        host_starved,
    ),
    Scenario(
        "starved_rank",
        "one rank waits on its own host each step: its GPU idles while its peers spin "
        "in the collective (straggler on that GPU, and no comm_bound)",
        starved_rank,
    ),
    Scenario("comm_slowdown", "collectives take 2-4x longer job-wide (comm_bound)", comm_slowdown),
    Scenario("input_starved", "the input pipeline starves every GPU of the job (input_bound)", input_starved),
    Scenario("gpu_lost", "a GPU falls off the bus (XID 79); the job hangs, then dies (gpu_lost)", gpu_lost),
    Scenario(
        "gpu_lost_hang",
        "a GPU falls off the bus and the job's other ranks hang in the collective "
        "for 3-10 min, NCCL's timeout (gpu_lost, and no comm_bound)",
        gpu_lost_hang,
    ),
    Scenario(
        "node_crash",
        "a node of a multi-node job goes down; the other nodes' ranks hang in the "
        "collective for 3-10 min (node_unreachable, and no comm_bound)",
        node_crash,
    ),
    Scenario("xid_burst", "a burst of hardware XIDs on one GPU, maybe an application XID elsewhere (xid)", xid_burst),
    Scenario("agent_down", "a node's agent stops answering for minutes (node_unreachable)", agent_down),
    Scenario("straggler_unattributed", "a straggler in a job without hpc_job attribution", straggler_unattributed),
    Scenario(
        "straggler_on_shared_node", "a straggler in the lighter of two jobs sharing nodes", straggler_on_shared_node
    ),
    Scenario(
        "intermittent_straggler",
        "one GPU slow for 1-2.5 min at a time, normal for 20-60 s in between",
        intermittent_straggler,
        small=False,
    ),
    Scenario(
        "straggler_from_start",
        "a GPU 20-40 % slow from the job's first step (no healthy baseline)",
        straggler_from_start,
        small=False,
    ),
    Scenario(
        "brake_from_start",
        "a GPU power-braked (clocks cut, brake bits) from the job's first minute "
        "recovers; no baseline, and where SM activity is unsupported its power reads like a victim's",
        brake_from_start,
    ),
    Scenario(
        "node_from_start",
        "a node host-starved or slow from the job's first minute recovers (no "
        "baseline: the other nodes spinning while it idles, or far less active than it, name it)",
        node_from_start,
    ),
    Scenario(
        "early_straggler_then_comm",
        "a GPU slow from the job's start recovers; later collectives "
        "slow down job-wide (the straggler must resolve without a baseline, then comm_bound fire)",
        early_straggler_then_comm,
    ),
    Scenario(
        "marginal_straggler",
        "a GPU 6-14 % slow: required only where the job slows by 10 % or more",
        marginal_straggler,
        small=False,
    ),
    Scenario(
        "straggler_under_power_cap",
        "a straggler appears in a job already under an operator power cap",
        straggler_under_power_cap,
        small=False,
    ),
    Scenario(
        "comm_flapping", "collectives slow down in 1.5-3 min bursts (a flapping link)", comm_flapping, small=False
    ),
    Scenario(
        "comm_then_straggler",
        "a comm slowdown, then later a straggler, in the same job",
        comm_then_straggler,
        small=False,
    ),
    Scenario("clock_skew", "one node's clock 30-120 s off in a job whose collectives slow down", clock_skew),
    Scenario("decoy_jitter", "GPUs slow for 5-15 s and a 10-20 s checkpoint pause", decoy_jitter, decoy=True),
    Scenario("decoy_startup_winddown", "jobs starting, ending and being replaced", decoy_startup_winddown, decoy=True),
    Scenario(
        "decoy_power_cap",
        "an operator caps a whole job's power: 0x4 bits, clocks uniformly lower",
        decoy_power_cap,
        decoy=True,
    ),
    Scenario(
        "decoy_hot_not_throttling",
        "a GPU at 78-81 °C with excursions above 83 °C for under 20 s",
        decoy_hot_not_throttling,
        decoy=True,
    ),
    Scenario(
        "decoy_structural",
        "nodes at 18-32 °C inlet, mixed GPU models, ranks with ±2 % fixed extra work",
        decoy_structural,
        decoy=True,
    ),
    Scenario("decoy_mixed_node", "two jobs with different loads share a node", decoy_mixed_node, decoy=True),
    Scenario("decoy_missing_samples", "2-6 % of lines lost, fast sampling", decoy_missing_samples, decoy=True),
    Scenario("decoy_counter_reset", "energy/NVLink/PCIe counters reset mid-run", decoy_counter_reset, decoy=True),
    Scenario(
        "decoy_idle_and_ending",
        "idle GPUs, a job ending, an unattributed half-node job",
        decoy_idle_and_ending,
        decoy=True,
    ),
    Scenario("decoy_brief_agent_gap", "an agent misses 6-15 s of samples", decoy_brief_agent_gap, decoy=True),
    Scenario(
        "busy_8", "8 nodes, 2-3 jobs, 2-3 incidents and decoys at once", _busy("busy_8", 8, (2, 3), (2, 3)), small=False
    ),
    Scenario(
        "busy_16", "16 nodes, 3-4 jobs, 3-4 incidents and decoys", _busy("busy_16", 16, (3, 4), (3, 4)), small=False
    ),
    Scenario(
        "busy_32", "32 nodes, 4-6 jobs, 4-6 incidents and decoys", _busy("busy_32", 32, (4, 6), (4, 6)), small=False
    ),
    Scenario(
        "unattributed_fleet",
        "96 GPUs, two jobs, no attribution: a GPU 20-25 % slow in the 64-GPU job, a host-starved node of the other",
        unattributed_fleet,
        small=False,
    ),
    Scenario(
        "unattributed_fleet_steady",
        "as unattributed_fleet, with steps too regular for the ranks to share any wobble",
        unattributed_fleet_steady,
        small=False,
    ),
)
BY_NAME = {s.name: s for s in CATALOG}


def mid_job(spec: ClusterSpec, onset_s: float) -> ClusterSpec:
    """The same cluster recorded from the middle of its jobs: a job that starts with the trace is past its
    start-up at the first sample, and the incidents move earlier together (kept apart as they were) so
    that the first begins onset_s into the trace. A probe for traces cut from longer recordings and for a
    server restarted mid-job; an incident already earlier than onset_s stays where it is.

    An incident of a job that starts later in the trace stays where it is too: where the recording began
    says nothing about when that job starts. Moved with the others, a communication slowdown or an input
    starvation landed before its job's first step, so the job never ran healthy and there was no drop
    to see."""
    jobs = tuple(replace(j, startup_s=0.0) if j.start_s <= 0 else j for j in spec.jobs)
    later_keys = {j.key for j in spec.jobs if j.start_s > 0}
    slots = {(node, gpu): j.key in later_keys for j in spec.jobs for node, gpus in j.placement for gpu in gpus}

    def of_later_job(inc: Incident) -> bool:
        if inc.job is not None:
            return inc.job in later_keys
        if inc.gpu is not None:
            return slots.get((inc.node, inc.gpu), False)
        # A whole node: only where every job on it starts later.
        on_node = [later for (node, _), later in slots.items() if node == inc.node]
        return bool(on_node) and all(on_node)

    moving = [i for i in spec.incidents if not of_later_job(i)]
    if not moving:
        return replace(spec, jobs=jobs)
    shift = min(0.0, onset_s - min(i.start_s for i in moving))

    def moved(inc: Incident) -> Incident:
        if of_later_job(inc):
            return inc
        # An open-ended incident (end 1e9) stays open; an instant one (a counter reset: end before start)
        # keeps its end unused.
        end = inc.end_s + shift if inc.start_s <= inc.end_s < 1e8 else inc.end_s
        return replace(inc, start_s=inc.start_s + shift, end_s=end)

    return replace(spec, jobs=jobs, incidents=tuple(moved(i) for i in spec.incidents))


# ------------------------------------------------------------------------------------------ scoring


@dataclass
class KindScore:
    """Counts for one alert kind."""

    tp: int = 0
    fp: int = 0
    neutral: int = 0
    required: int = 0
    detected: int = 0
    ttf_s: list[float] = field(default_factory=list)

    @property
    def precision(self) -> float | None:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else None

    @property
    def recall(self) -> float | None:
        return self.detected / self.required if self.required else None

    def add(self, other: "KindScore") -> None:
        self.tp += other.tp
        self.fp += other.fp
        self.neutral += other.neutral
        self.required += other.required
        self.detected += other.detected
        self.ttf_s += other.ttf_s


@dataclass
class Score:
    """The result of matching one run's alerts against its truths."""

    kinds: dict[str, KindScore]
    missed: list[Truth]
    late: list[tuple[Truth, float]]
    false_alerts: list[dict[str, Any]]
    stuck: list[tuple[dict[str, Any], Truth]] = field(default_factory=list)


def normalize(alert: Any) -> dict[str, Any]:
    """An Alert object or a replay JSON dict, as a plain dict with string kind."""
    d = alert.to_dict() if hasattr(alert, "to_dict") else dict(alert)
    kind = d["kind"]
    d["kind"] = getattr(kind, "value", kind)
    return d


def _subject_matches(alert: Mapping[str, Any], truth: Truth) -> bool:
    if truth.node is None and truth.gpu is None:
        return alert.get("node") is None and alert.get("gpu") is None and alert.get("hpc_job") == truth.hpc_job
    return alert.get("node") == truth.node and alert.get("gpu") == truth.gpu


def _matches(alert: Mapping[str, Any], truth: Truth, grace_s: float) -> bool:
    started = alert.get("started")
    return (
        alert["kind"] == truth.kind
        and started is not None
        and _subject_matches(alert, truth)
        and truth.start - truth.lead_s - CLOCK_SLACK_S <= started <= truth.end + grace_s
    )


def _covers(alert: Mapping[str, Any], truth: Truth) -> bool:
    """An alert that began earlier and is still firing when the truth starts (hysteresis) detects it."""
    started, resolved = alert.get("started"), alert.get("resolved")
    return (
        alert["kind"] == truth.kind
        and started is not None
        and _subject_matches(alert, truth)
        and started < truth.start - truth.lead_s - CLOCK_SLACK_S
        and (resolved is None or resolved >= truth.start)
    )


def score(
    alerts: Iterable[Any],
    truths: Iterable[Truth],
    grace_s: float = GRACE_S,
    deadline_s: float = DEADLINE_S,
    trace_end: float | None = None,
) -> Score:
    """Match alerts to truths (see the module docstring for the rules; stuck alerts need trace_end)."""
    alerts = [normalize(a) for a in alerts]
    truths = list(truths)
    kinds = {k: KindScore() for k in ALERT_KINDS}
    missed, late, false_alerts = [], [], []
    for t in truths:
        if t.required:
            kinds.setdefault(t.kind, KindScore()).required += 1
            hits = sorted(a["started"] for a in alerts if _matches(a, t, grace_s) or _covers(a, t))
            if hits:
                kinds[t.kind].detected += 1
                # From the earliest moment the condition could be said to begin (the lead's start).
                ttf = max(0.0, hits[0] - (t.start - t.lead_s))
                kinds[t.kind].ttf_s.append(ttf)
                if ttf > deadline_s:
                    late.append((t, ttf))
            else:
                missed.append(t)
    for a in alerts:
        ks = kinds.setdefault(a["kind"], KindScore())
        if any(t.required and _matches(a, t, grace_s) for t in truths):
            ks.tp += 1
        elif any(_matches(a, t, grace_s) for t in truths):
            ks.neutral += 1
        else:
            ks.fp += 1
            false_alerts.append(a)
    stuck = [] if trace_end is None else _stuck(alerts, truths, grace_s, trace_end)
    return Score(kinds, missed, late, false_alerts, stuck)


def _stuck(
    alerts: list[dict[str, Any]], truths: list[Truth], grace_s: float, trace_end: float
) -> list[tuple[dict[str, Any], Truth]]:
    """Alerts that stay open (or resolve) more than RESOLVE_S after the last truth they match ended."""
    out = []
    for a in alerts:
        if a["kind"] not in _RESOLVING_KINDS:
            continue
        mine = [t for t in truths if _matches(a, t, grace_s) or _covers(a, t)]
        if not mine:
            continue
        # Later truths on the same subject that the open alert runs into keep it legitimately open.
        resolved = a.get("resolved")
        last = max(mine, key=lambda t: t.end)
        follow = [
            t
            for t in truths
            if t.kind == a["kind"]
            and _subject_matches(a, t)
            and t.start <= (trace_end if resolved is None else resolved)
        ]
        last = max([last] + follow, key=lambda t: t.end)
        due = last.end + RESOLVE_S
        if (resolved is None and due < trace_end) or (resolved is not None and resolved > due):
            out.append((a, last))
    return out


# Kinds whose subject is a job. Without `hpc_job` on any GPU the fleet names no job, so there is nothing to
# score them by: an unattributed evaluation leaves them out on both sides (truths and alerts).
JOB_LEVEL_KINDS = ("comm_bound", "input_bound")


def unattributed(alerts: Iterable[Any], truths: Iterable[Truth]) -> tuple[list[dict[str, Any]], list[Truth]]:
    """The alerts and truths a fleet without job attribution is scored on.

    Job-level kinds, and any truth whose subject is a job, are dropped; every other truth keeps its GPU or
    node subject with the job removed (matching never looked at the job for those). Alerts of other kinds
    stay, so a node- or GPU-level alert nothing explains still counts as false.
    """
    kept_alerts = [a for a in map(normalize, alerts) if a["kind"] not in JOB_LEVEL_KINDS]
    kept_truths = [
        replace(t, hpc_job=None)
        for t in truths
        if t.kind not in JOB_LEVEL_KINDS and not (t.node is None and t.gpu is None)
    ]
    return kept_alerts, kept_truths


def describe_truth(t: Truth, t0: float) -> str:
    """One line for a failure message."""
    subject = t.hpc_job if t.node is None else f"{t.node}/gpu{t.gpu}" if t.gpu is not None else f"{t.node}/node"
    return f"{t.kind} on {subject} at +{t.start - t0:.0f}s..+{t.end - t0:.0f}s ({t.note})"


def describe_alert(a: Mapping[str, Any], t0: float) -> str:
    subject = a.get("hpc_job") if a.get("node") is None else f"{a['node']}/gpu{a.get('gpu')}"
    started = a.get("started")
    at = f"+{started - t0:.0f}s" if started is not None else "?"
    return f"{a['kind']} on {subject} at {at}: {a.get('summary', '')}"


# ------------------------------------------------------------------------------------------ uneven ranks
# Real large jobs are not uniform: pipeline stages differ (the last carries the loss), mixture-of-experts
# ranks differ with routing, and two small jobs can share nodes. A steadily different rank is not a
# straggler; a real straggler among uneven ranks still is. Healthy variants run an hour.

UNEVEN_HEALTHY_S = 3600.0


def _uneven_straggler(d: _Draw, jobs: list[Job], straggler: bool) -> list[Incident]:
    """One GPU of the first job silently 25-40 % slow for 5-8 minutes, or none."""
    if not straggler:
        return []
    node, gpus = d.pick(jobs[0].placement)
    start = d.u(240, 420)
    return [Incident("slow_gpu", start, start + d.u(300, 480), node, d.pick(gpus), severity=d.u(0.6, 0.75))]


def _pipeline(name: str, straggler: bool, attributed: bool):
    def build(seed: int) -> ClusterSpec:
        d = _Draw(name, seed)
        nodes = d.nodes(d.i(2, 4), d.model())
        slots = _whole(nodes)
        size = sum(len(g) for _, g in slots)
        stages = d.i(4, 8)
        last, first = d.u(1.10, 1.20), d.u(1.0, 1.05)
        work = tuple(
            last if r * stages // size == stages - 1 else first if r * stages // size == 0 else 1.0 for r in range(size)
        )
        job = d.job("pp", d.hpc() if attributed else None, slots, rank_work=work)
        return d.spec(nodes, [job], _uneven_straggler(d, [job], straggler), 960.0 if straggler else UNEVEN_HEALTHY_S)

    return build


def _moe(name: str, straggler: bool, attributed: bool):
    def build(seed: int) -> ClusterSpec:
        d = _Draw(name, seed)
        nodes = d.nodes(d.i(2, 4), d.model())
        job = d.job("moe", d.hpc() if attributed else None, _whole(nodes), work_drift=d.u(0.05, 0.12))
        return d.spec(nodes, [job], _uneven_straggler(d, [job], straggler), 960.0 if straggler else UNEVEN_HEALTHY_S)

    return build


def _shared_nodes(name: str, straggler: bool, attributed: bool):
    def build(seed: int) -> ClusterSpec:
        d = _Draw(name, seed)
        nodes = d.nodes(2, d.model())
        a = d.job("a", d.hpc() if attributed else None, [(n.name, range(4)) for n in nodes])
        b = d.job(
            "b",
            d.hpc() if attributed else None,
            [(n.name, range(4, 8)) for n in nodes],
            intensity=d.u(0.5, 0.8),
            sm_coefficient=d.u(0.45, 0.65),
            step_s=d.u(1.2, 2.5),
        )
        jobs = [a, b] if d.rng.random() < 0.5 else [b, a]
        return d.spec(nodes, [a, b], _uneven_straggler(d, jobs, straggler), 960.0 if straggler else UNEVEN_HEALTHY_S)

    return build


def _uneven_variants(key: str, what: str, factory) -> tuple[Scenario, ...]:
    out = []
    for straggler in (False, True):
        for attributed in (True, False):
            name = f"uneven_{key}{'_straggler' if straggler else ''}{'' if attributed else '_unattributed'}"
            label = f"{what}{', one GPU 25-40 % slow for 5-8 min' if straggler else ', an hour healthy'}"
            label += "" if attributed else ", no hpc_job"
            out.append(Scenario(name, label, factory(name, straggler, attributed), small=False, decoy=not straggler))
    return tuple(out)


UNEVEN: tuple[Scenario, ...] = (
    *_uneven_variants("pipeline", "a pipeline-parallel job of 4-8 stages, the last 10-20 % busier", _pipeline),
    *_uneven_variants("moe", "a mixture-of-experts job whose ranks' load drifts 5-12 % over 10-30 min", _moe),
    *_uneven_variants("shared_nodes", "two small jobs of different loads sharing two nodes", _shared_nodes),
)
CATALOG = CATALOG + UNEVEN
BY_NAME = {s.name: s for s in CATALOG}
