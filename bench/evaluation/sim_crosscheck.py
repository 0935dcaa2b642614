"""Detection on traces from the agent's own NVML simulator: a second physics model, written apart from
the engine's scenario generator.

    python -m bench.evaluation.sim_crosscheck [--seeds N] [--first-seed N] [--hard] [--unattributed] [--every 1,5,10]
                                   [--workers N] [--kinds a,b] [--no-write]

The scenario suite (bench/evaluation/detection_eval.py) replays bench/evaluation/tracegen.py, which was written with
the engine and may share its blind spots. This bench draws random agent/sim scenarios instead: 1-4
nodes of H100, A100 or L40S, one job on every GPU or on half of each node (then often beside a second
job), random step time and compute share, and one incident of each kind, or a decoy (a power cap on
the whole job, nothing at all, a counter reset, an application XID, the job ending, one node's agent
silent for minutes while its job runs on). Every node is recorded through
the production agent pipeline in simulated time (bench/evaluation/sim_record.py), the node files are concatenated
as `cat` would, cut to 1, 5 or 10 s sampling, and replayed. `--hard` draws marginal severities (a GPU
5-20 % slow, a communication slowdown of 1.3-2x, a host idling 8-30 % of each step, a mild cooling
failure) and puts 30 % of the incidents other than comm_slowdown in the job's first minute.
`--unattributed` removes hpc_job from every GPU before replay (an agent without a job source), so the
engine falls back to its unattributed peer groups; a communication slowdown then has no job to name,
and one rank idling on its host (`host_rank`) may be other work beside its node's others (the engine
judges that only inside a job), so neither expects an alert.

Per run: *wrong* when a detection alert (straggler, thermal_throttle, comm_bound, input_bound,
gpu_lost, node_unreachable) names anything but the incident's subject: a victim, a healthy job, or a kind the incident
does not cause (a throttled GPU that slows its job may also be named a straggler). The expected alert
is *required* by the scenario suite scorer's rules (a job slowed 10 % by a straggler or host, a step
grown 25 % by communication, a GPU at >= 83 degC, HBM at its limit or thermal bits for 30 s): a
marginal incident may go unseen, but must never name a wrong subject.
Writes the table between `<!-- crosscheck:begin -->` and `<!-- crosscheck:end -->` in
docs/crosscheck.md (`crosscheck:hard:`, `crosscheck:unattributed:` markers for those modes).
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from gpufleet.agent.sim import parse_scenario
from gpufleet.server.replay import run_replay
from bench.docgen.splice import Section
from bench.evaluation.tracegen import COMM_REQUIRED_GROWTH, STRAGGLER_REQUIRED_SLOWDOWN
from bench.evaluation.sim_record import T0, record_node

DOC = Path(__file__).resolve().parents[2] / "docs" / "crosscheck.md"


def section(mode: str = "") -> Section:
    """The block of one mode ("", "hard", "unattributed") in docs/crosscheck.md, appended where absent."""
    return Section(f"crosscheck:{mode}" if mode else "crosscheck")


KINDS = (
    "cooling",
    "slow_silent",
    "slow_brake",
    "host",
    "host_rank",
    "comm",
    "cap",
    "none",
    "lost",
    "reset",
    "xid",
    "agent_down",
    "job_end",
)
DETECTION = ("straggler", "thermal_throttle", "comm_bound", "input_bound", "gpu_lost", "node_unreachable")
JOB = "555"
HOT_CELSIUS, HOT_SECONDS = 83.0, 30  # the thermal alert's default threshold and `for`
# Power caps an operator might set, in watts, per model: from deep (clocks cut 20 %) to barely biting.
CAP_WATTS = {"h100-sxm": (350, 650), "a100-sxm4": (220, 380), "l40s": (200, 340)}


@dataclass(frozen=True)
class Case:
    """One drawn scenario and the alert it should raise (kind, node, gpu), if any."""

    kind: str
    seed: int
    scenario: dict[str, Any]
    expect: tuple[str, str | None, int | None] | None
    # How much the incident slows the job by the simulator's step model (comm: step-time growth).
    slowdown: float | None = None
    # (node, start_s, end_s): that node's lines are dropped from the recording, an agent down while
    # its node and job run on.
    silent: tuple[str, float, float] | None = None

    def required(self, lines: list[bytes]) -> bool:
        """Whether the expected alert must be raised, by the suite's scorer's rules (tracegen): a
        straggler that slows its job by 10 %, a communication slowdown growing the step by 25 %, a GPU
        that was at the thermal alert condition (>= 83 degC, HBM at its limit, or thermal bits) for 30 s
        running."""
        if self.expect is None:
            return False
        if self.kind == "cooling":
            return _longest_hot_run_s(lines, self.expect[1], self.expect[2]) >= HOT_SECONDS
        if self.kind == "comm":
            return self.slowdown >= COMM_REQUIRED_GROWTH
        if self.slowdown is not None:
            return self.slowdown >= STRAGGLER_REQUIRED_SLOWDOWN
        return True


@dataclass
class Tally:
    """Counts for one (incident kind, sampling interval) row."""

    runs: int = 0
    expected: int = 0
    hits: int = 0
    wrong: int = 0
    notes: list[str] = field(default_factory=list)


def draw(kind: str, seed: int, hard: bool) -> Case:
    """A random scenario with one incident of `kind` (seeded; independent of the other kinds)."""
    r = random.Random(f"{kind}/{seed}/{hard}")
    model = r.choice(("h100-sxm", "h100-sxm", "a100-sxm4", "a100-sxm4", "l40s"))
    nodes = [{"name": f"n{i}", "model": model, "gpus": 8} for i in range(r.choice((1, 2, 2, 3, 4)))]
    # A host-bound node needs another node to wait for it; a silent node, another to tell the time by.
    if kind in ("host", "agent_down") and len(nodes) == 1:
        nodes.append({"name": "n1", "model": model, "gpus": 8})
    layout = r.choice(("whole", "half", "two"))
    mine = list(range(8)) if layout == "whole" else [0, 1, 2, 3]

    def job(job_id: str, gpus: list[int], start: float) -> dict[str, Any]:
        place = [n["name"] if len(gpus) == 8 else {"node": n["name"], "gpus": gpus} for n in nodes]
        return {
            "id": job_id,
            "nodes": place,
            "start_s": start,
            "step_time_s": round(r.uniform(0.4, 3.0), 2),
            "compute_fraction": round(r.uniform(0.6, 0.92), 2),
        }

    jobs = [job(JOB, mine, 0)]
    if layout == "two":
        jobs.append(job("556", [4, 5, 6, 7], r.randint(0, 200)))
    # comm_bound is a drop against the job's own baseline: at the job's start there is none to drop from.
    start = r.randint(0, 60) if hard and kind != "comm" and r.random() < 0.3 else r.randint(330, 420)
    end = start + r.randint(150, 300)
    node, gpu = r.choice(nodes)["name"], r.choice(mine)

    def sev(normal: tuple[float, float], marginal: tuple[float, float]) -> float:
        return round(r.uniform(*(marginal if hard else normal)), 2)

    inc: dict[str, Any] | None
    expect: tuple[str, str | None, int | None] | None = None
    cf = jobs[0]["compute_fraction"]
    slowdown = None
    if kind == "cooling":
        inc = {"kind": "cooling_failure", "node": node, "gpu": gpu, "resistance_factor": sev((2.0, 3.0), (1.3, 2.0))}
        expect = ("thermal_throttle", node, gpu)
    elif kind in ("slow_silent", "slow_brake"):  # no throttle bits at all, or the HW power brake's
        silent = kind == "slow_silent"
        speed = sev((0.55, 0.85) if silent else (0.5, 0.85), (0.8, 0.95))
        flag = "silent" if silent else "power_brake"
        inc = {"kind": "slow_gpu", "node": node, "gpu": gpu, "speed_factor": speed, flag: True}
        expect, slowdown = ("straggler", node, gpu), cf * (1 / speed - 1)
    elif kind == "host":
        inc = {"kind": "host_starvation", "node": node, "input_wait_ratio": sev((0.3, 1.0), (0.08, 0.3))}
        expect, slowdown = ("straggler", node, None), inc["input_wait_ratio"]  # idle time added to each step
    elif kind == "host_rank":  # one rank's own input pipeline: that GPU idles, its peers wait
        inc = {"kind": "host_starvation", "node": node, "gpu": gpu, "input_wait_ratio": sev((0.3, 1.0), (0.08, 0.3))}
        expect, slowdown = ("straggler", node, gpu), inc["input_wait_ratio"]
    elif kind == "comm":
        inc = {"kind": "comm_slowdown", "job": JOB, "factor": sev((2.0, 4.0), (1.3, 2.0))}
        expect, slowdown = ("comm_bound", None, None), (1 - cf) * (inc["factor"] - 1)
    elif kind == "cap":
        inc = {"kind": "power_cap", "job": JOB, "watts": r.randint(*CAP_WATTS[model])}
    elif kind == "lost":
        inc = {"kind": "gpu_lost", "node": node, "gpu": gpu}
        expect = ("gpu_lost", node, gpu)
    elif kind == "reset":  # every cumulative counter of a node back to 0 (driver reload)
        inc = {"kind": "counter_reset", "node": node}
    elif kind == "xid":  # an XID alert only; nobody is slowed
        inc = {
            "kind": "xid",
            "node": node,
            "gpu": gpu,
            "code": r.choice((13, 31, 43, 48, 94)),
            "count": r.randint(1, 5),
        }
    elif kind == "agent_down":  # the agent stops (crash, network): its node and job run on
        inc, expect = None, ("node_unreachable", node, None)
    elif kind == "job_end":  # the job winds down and ends; its GPUs idle
        inc = None
        jobs[0]["end_s"] = start
    else:
        inc = None
    if inc is not None:
        inc["start_s"] = start
        if kind not in ("lost", "reset"):
            inc["end_s"] = end
    scenario = {
        "name": f"crosscheck-{kind}-{seed}",
        "duration_s": end + 240,
        "nodes": nodes,
        "jobs": jobs,
        "incidents": [inc] if inc else [],
    }
    return Case(kind, seed, scenario, expect, slowdown, (node, start, end) if kind == "agent_down" else None)


def unattributed(case: Case) -> Case:
    """The same scenario as seen by an agent without a job source: job-level alerts have no job, and one
    GPU idling more than its node's others may run other work there (not judged without attribution)."""
    return replace(case, expect=None, slowdown=None) if case.kind in ("comm", "host_rank") else case


def _strip_jobs(line: bytes) -> bytes:
    snapshot = orjson.loads(line)
    for gpu in snapshot["gpus"]:
        gpu.pop("hpc_job", None)
    return orjson.dumps(snapshot)


def run_case(args: tuple[Case, tuple[int, ...], bool]) -> tuple[Case, bool, dict[int, list[tuple]]]:
    """Record every node, replay at each sampling interval (without hpc_job when strip_jobs). Returns
    whether the expected alert is required, and the alerts as (kind, node, gpu, job, start, end) per
    interval."""
    case, every, strip_jobs = args
    logging.disable(logging.WARNING)  # the agent's own reports (XIDs, a lost GPU) are the scenario's
    scenario = parse_scenario(case.scenario)
    with tempfile.TemporaryDirectory() as tmp:
        lines = b"".join(
            record_node(scenario, node, Path(tmp), scenario.duration_s)[0].read_bytes() for node in scenario.nodes
        ).splitlines()
    if case.silent:
        node, start, end = case.silent
        lines = [line for line in lines if not _silenced(orjson.loads(line), node, start, end)]
    required = case.required(lines)
    if strip_jobs:
        lines = [_strip_jobs(line) for line in lines]
    out = {}
    for interval in every:
        kept = (
            lines
            if interval == 1
            else [line for line in lines if round(orjson.loads(line)["time"] - T0) % interval == 0]
        )
        out[interval] = [
            (
                a.kind.value,
                a.node,
                a.gpu,
                a.hpc_job,
                round(a.started - T0),
                None if a.resolved is None else round(a.resolved - T0),
            )
            for a in run_replay(kept)
        ]
    return case, required, out


def _silenced(snapshot: dict[str, Any], node: str, start: float, end: float) -> bool:
    return snapshot["node"] == node and start <= snapshot["time"] - T0 < end


def _longest_hot_run_s(lines: list[bytes], node: str, gpu: int) -> int:
    """Longest run of consecutive 1 s samples of one GPU at the thermal alert condition."""
    run = best = 0
    for line in lines:
        snap = orjson.loads(line)
        if snap["node"] != node:
            continue
        for g in snap["gpus"]:
            if g["index"] == gpu:
                hbm, hbm_max = g.get("memory_temperature_celsius"), g.get("memory_max_operating_temperature_celsius")
                hot = (
                    (g.get("temperature_celsius") or 0) >= HOT_CELSIUS
                    or bool((g.get("throttle_reasons") or 0) & 0x60)
                    or (hbm is not None and hbm_max is not None and hbm >= hbm_max)
                )
                run = run + 1 if hot else 0
                best = max(best, run)
    return best


def judge(case: Case, alerts: list[tuple]) -> tuple[bool, list[tuple]]:
    """(expected alert present, wrong detection alerts)."""
    found = [a for a in alerts if a[0] in DETECTION]
    hit = case.expect is not None and any(a[:3] == case.expect for a in found)

    def allowed(a: tuple) -> bool:
        if case.expect is None:
            return False
        if a[:3] == case.expect:
            return True
        # A GPU cut by its own heat does slow its job: naming it a straggler is right.
        return case.kind == "cooling" and a[0] == "straggler" and a[1:3] == case.expect[1:]

    return hit, [a for a in found if not allowed(a)]


def evaluate(
    seeds: range, hard: bool, every: tuple[int, ...], kinds: tuple[str, ...], workers: int, strip_jobs: bool = False
) -> dict[tuple[str, int], Tally]:
    drawn = (draw(kind, seed, hard) for seed in seeds for kind in kinds)
    cases = [(unattributed(c) if strip_jobs else c, every, strip_jobs) for c in drawn]
    table = {(k, i): Tally() for k in kinds for i in every}
    with ProcessPoolExecutor(workers) as pool:
        for case, required, by_interval in pool.map(run_case, cases):
            for interval, alerts in by_interval.items():
                t = table[(case.kind, interval)]
                hit, wrong = judge(case, alerts)
                t.runs += 1
                t.expected += required
                t.hits += hit and required
                t.wrong += bool(wrong)
                if wrong or (required and not hit):
                    what = f"wrong {wrong}" if wrong else "missed"
                    slowed = "" if case.slowdown is None else f" (job slowed {case.slowdown:.0%})"
                    t.notes.append(
                        f"{case.kind} seed {case.seed} at {interval} s: {what}{slowed}; incident "
                        f"{case.scenario['incidents'][0] if case.scenario['incidents'] else None}, "
                        f"{len(case.scenario['nodes'])}× {case.scenario['nodes'][0]['model']}"
                    )
                print(
                    f"{'ok   ' if hit or not required else 'miss '}{'WRONG ' if wrong else ''}"
                    f"{case.kind} seed {case.seed} {interval}s: {alerts}",
                    file=sys.stderr,
                    flush=True,
                )
    return table


def render(table: dict[tuple[str, int], Tally], args: argparse.Namespace, max_misses: int = 12) -> str:
    cmd = (
        f"python -m bench.evaluation.sim_crosscheck --seeds {args.seeds} --first-seed {args.first_seed}"
        + (" --hard" if args.hard else "")
        + (" --unattributed" if args.unattributed else "")
        + f" --every {args.every}"
    )
    lines = [
        f"Generated by `{cmd}`.",
        "",
        "| incident | sampling | runs | required alert raised | runs with a wrong alert |",
        "|---|---|---|---|---|",
    ]
    for (kind, interval), t in table.items():
        raised = f"{t.hits}/{t.expected}" if t.expected else "–"
        lines.append(f"| {kind} | {interval} s | {t.runs} | {raised} | {t.wrong} |")
    notes = [n for t in table.values() for n in t.notes]
    wrong = [n for n in notes if " wrong " in n]
    missed = [n for n in notes if " wrong " not in n]
    lines += ["", f"Wrong alerts ({len(wrong)}):", ""] + ([f"- {n}" for n in wrong] or ["None."])
    lines += ["", f"Misses ({len(missed)}):", ""] + ([f"- {n}" for n in missed[:max_misses]] or ["None."])
    if len(missed) > max_misses:
        lines.append(f"- … and {len(missed) - max_misses} more (run the bench to see them all)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.evaluation.sim_crosscheck", description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--hard", action="store_true", help="marginal severities, 30 %% of incidents at job start")
    ap.add_argument("--unattributed", action="store_true", help="replay without hpc_job (no job source)")
    ap.add_argument("--every", default="1,5,10", help="sampling intervals to cut the 1 s recordings to")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--doc", type=Path, default=DOC)
    args = ap.parse_args(argv)
    kinds = tuple(args.kinds.split(","))
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"unknown kinds {sorted(unknown)} (known: {', '.join(KINDS)})")
    every = tuple(int(x) for x in args.every.split(","))
    table = evaluate(
        range(args.first_seed, args.first_seed + args.seeds), args.hard, every, kinds, args.workers, args.unattributed
    )
    body = render(table, args)
    print(body)
    if not args.no_write:
        mode = "-".join(m for m, on in (("hard", args.hard), ("unattributed", args.unattributed)) if on)
        section(mode).write(args.doc, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
