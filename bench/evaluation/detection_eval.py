"""Precision, recall and time to fire of the detection engine over the whole scenario catalog.

    python -m bench.evaluation.detection_eval [--seeds N] [--first-seed N] [--scenarios a,b] [--no-write] [--without FIELD,...]
                                   [--noise-scale X] [--mid-job SECONDS] [--unattributed] [--holdout]
                                   [--ablate] [--report] [--probes] [--uneven]

Runs every scenario of bench/evaluation/scenarios.py over N seeds through server.replay.run_replay, prints
per-kind precision/recall/time-to-fire and a per-scenario table, and writes both into docs/evaluation.md
between the `<!-- suite:begin -->` and `<!-- suite:end -->` markers (nothing else in that file changes).

Probes (each prints, none writes a document): `--noise-scale X` scales every reading noise of the
generator; `--unattributed` removes `hpc_job` from every GPU (job-level kinds are then not scored);
`--holdout` scores the frozen hold-out seeds instead of the tuning ones; `--ablate` switches each rule the
detectors declare (policy.declared_rules) off in turn and prints what precision and recall each costs. `--report` runs the defaults, noise
x4, unattributed and hold-out conditions and the ablation table and writes them into docs/evaluation.md
between `<!-- evaluation:begin -->` and `<!-- evaluation:end -->`, the defaults' per-scenario tables into the
suite section, and the probes below it. `--probes` scores
the probe scenarios of bench/evaluation/probes.py (fleets shaped unlike the catalog's: hundreds of GPUs, 1 s sampling,
PCIe-only boards, quiet or noisy jobs, no SM activity, no attribution) and writes only their section of
docs/evaluation.md, between `<!-- probes:begin -->` and `<!-- probes:end -->`. `--uneven` scores the
uneven-rank scenarios (pipeline stages, drifting experts, two jobs sharing nodes) and writes theirs,
between `<!-- uneven:begin -->` and `<!-- uneven:end -->`.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from bench.docgen.splice import Section
from bench.evaluation import probes, scenarios
from bench.evaluation.tracegen import GENERATOR_VERSION, generate, without_fields

log = logging.getLogger(__name__)

DOC = Path(__file__).resolve().parents[2] / "docs" / "evaluation.md"
SUITE = Section("suite", "## Scenario suite")
HEADLINE_KINDS = ("thermal_throttle", "straggler", "comm_bound")
EVAL_DOC = DOC
REPORT = Section("evaluation", "## Results")

# The frozen hold-out. No threshold of the engine is tuned on these seeds: tuning runs start at
# --first-seed, which refuses to reach HOLDOUT_FIRST_SEED; only --holdout (and --report) score them, and
# their figures are reported, never iterated on. They are frozen with the generator version they were drawn
# from: once bench/evaluation/tracegen.py's GENERATOR_VERSION moves on, the same seeds are new traces and the report
# says the hold-out no longer matches.
HOLDOUT_GENERATOR_VERSION = 1
HOLDOUT_FIRST_SEED = 1_000_000
HOLDOUT_SEEDS = 1_000
# The noise multiplier of the noisy condition in the report: the robustness bar.
REPORT_NOISE_SCALE = 4.0
PROBES = Section("probes", "## Probes")


@dataclass(frozen=True)
class Ablation:
    """One declared rule switched off through EngineConfig.disabled_rules (or any overrides)."""

    name: str  # the rule's name
    switches_off: str  # what the rule says (its doc line)
    overrides: Mapping[str, Any]
    detector: str = ""


def declared_ablations() -> tuple[Ablation, ...]:
    """One ablation per rule the detectors declare (policy.declared_rules), in declaration order: the
    rule alone never holds, the rest of the engine is as configured. A gate rule switched off never
    holds either: the rules it gates never fire, those it holds back are no longer held back."""
    from gpufleet.server.engine import policy

    return tuple(
        Ablation(rule.name, rule.doc, {"disabled_rules": [rule.name]}, detector)
        for detector, rules in policy.declared_rules().items()
        for rule in rules
    )


@dataclass
class ScenarioResult:
    """Totals for one scenario over all seeds."""

    name: str
    runs: int = 0
    required: int = 0
    detected: int = 0
    fp: int = 0
    neutral: int = 0
    ttf_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


@dataclass
class Evaluation:
    """Everything the report needs."""

    seeds: int
    kinds: dict[str, scenarios.KindScore]
    kinds_5s: dict[str, scenarios.KindScore]
    per_scenario: list[ScenarioResult]
    gpu_samples: int
    replay_s: float
    first_seed: int = 0
    # Kinds the run did not score (job-level kinds of an unattributed run).
    unscored: tuple[str, ...] = ()
    # seed -> kind -> score over every scenario: lets a run on fewer seeds be compared with this one.
    by_seed: dict[int, dict[str, scenarios.KindScore]] = field(default_factory=dict)


def evaluate(
    run_replay,
    names: list[str],
    seeds: int,
    first_seed: int = 0,
    noise_scale: float = 1.0,
    mid_job_s: float | None = None,
    unattributed: bool = False,
    catalog: Mapping[str, scenarios.Scenario] | None = None,
) -> Evaluation:
    """Generate, replay and score every (scenario, seed) for seeds first_seed .. first_seed + seeds - 1
    (noise_scale: the generator's reading noise, scaled; mid_job_s: see scenarios.mid_job; unattributed:
    every GPU's hpc_job removed, scored by scenarios.unattributed; catalog: where the names are looked up,
    scenarios.BY_NAME unless given, e.g. bench.evaluation.probes.BY_NAME)."""
    catalog = scenarios.BY_NAME if catalog is None else catalog
    kinds = {k: scenarios.KindScore() for k in scenarios.ALERT_KINDS}
    kinds_5s = {k: scenarios.KindScore() for k in scenarios.ALERT_KINDS}
    unscored = scenarios.JOB_LEVEL_KINDS if unattributed else ()
    for kind in unscored:
        del kinds[kind], kinds_5s[kind]
    by_seed: dict[int, dict[str, scenarios.KindScore]] = {}
    rows, samples, replay_s = [], 0, 0.0
    for name in names:
        row = ScenarioResult(name)
        for seed in range(first_seed, first_seed + seeds):
            spec = catalog[name].build(seed)
            spec = replace(spec, noise_scale=spec.noise_scale * noise_scale)
            trace = generate(spec if mid_job_s is None else scenarios.mid_job(spec, mid_job_s))
            lines = without_fields(list(trace.lines), ("hpc_job",)) if unattributed else trace.lines
            started = time.perf_counter()
            alerts = run_replay(lines)
            replay_s += time.perf_counter() - started
            samples += trace.gpu_samples
            truths = trace.truths
            if unattributed:
                alerts, truths = scenarios.unattributed(alerts, truths)
            result = scenarios.score(alerts, truths, trace_end=trace.spec.t0 + trace.spec.duration_s)
            for kind in unscored:
                result.kinds.pop(kind, None)
            _accumulate(row, result, trace, seed)
            per_seed = by_seed.setdefault(seed, {})
            for kind, ks in result.kinds.items():
                kinds.setdefault(kind, scenarios.KindScore()).add(ks)
                per_seed.setdefault(kind, scenarios.KindScore()).add(ks)
                if trace.spec.interval_s == 5.0:
                    kinds_5s.setdefault(kind, scenarios.KindScore()).add(ks)
        rows.append(row)
        log.info(
            "scenario done", extra={"scenario": name, "required": row.required, "detected": row.detected, "fp": row.fp}
        )
    return Evaluation(seeds, kinds, kinds_5s, rows, samples, replay_s, first_seed, unscored, by_seed)


def seeds_total(ev: Evaluation, seeds: range) -> dict[str, scenarios.KindScore]:
    """Per-kind totals over some of the evaluation's seeds."""
    out: dict[str, scenarios.KindScore] = {}
    for seed in seeds:
        for kind, ks in ev.by_seed.get(seed, {}).items():
            out.setdefault(kind, scenarios.KindScore()).add(ks)
    return out


@dataclass
class AblationResult:
    """What switching one rule off did, per kind, against the defaults on the same seeds."""

    ablation: Ablation
    kinds: dict[str, scenarios.KindScore]
    error: str = ""


def ablate(
    run_replay: Callable[..., Any],
    names: list[str],
    seeds: int,
    ablations: tuple[Ablation, ...] | None = None,
    jobs: int = 1,
) -> list[AblationResult]:
    """Evaluate seeds 0 .. seeds - 1 once per ablation (default: every declared rule), with its overrides
    given to run_replay(lines, config); `jobs` processes at once."""
    chosen = declared_ablations() if ablations is None else ablations
    runs = in_parallel([partial(_ablation, run_replay, ab, names, seeds) for ab in chosen], jobs)
    return list(runs)


def _ablation(run_replay: Callable[..., Any], ab: Ablation, names: list[str], seeds: int) -> AblationResult:
    try:
        ev = evaluate(partial(_replay_with, run_replay, dict(ab.overrides)), names, seeds)
    except ValueError as exc:  # the engine no longer has (or accepts) a setting the table names
        return AblationResult(ab, {}, str(exc))
    return AblationResult(ab, ev.kinds)


def _replay_with(run_replay: Callable[..., Any], overrides: dict[str, Any], lines) -> Any:
    return run_replay(lines, overrides)


def _replay_without(run_replay: Callable[..., Any], fields: tuple[str, ...], lines, config=None) -> Any:
    return run_replay(without_fields(lines, fields), config)


def in_parallel(calls: list[Callable[[], Any]], jobs: int) -> list[Any]:
    """Each call's result, in order; with jobs > 1 the calls run in that many forked processes (each call
    and its result must pickle: module-level functions and partials of them)."""
    if jobs <= 1 or len(calls) <= 1:
        return [call() for call in calls]
    with ProcessPoolExecutor(min(jobs, len(calls)), mp_context=multiprocessing.get_context("fork")) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


def _accumulate(row: ScenarioResult, result: scenarios.Score, trace, seed: int) -> None:
    t0 = trace.spec.t0
    row.runs += 1
    for ks in result.kinds.values():
        row.required += ks.required
        row.detected += ks.detected
        row.fp += ks.fp
        row.neutral += ks.neutral
        row.ttf_s += ks.ttf_s
    tag = f"seed {seed}, {trace.spec.interval_s:g} s"
    row.failures += [f"{tag}: missed {scenarios.describe_truth(t, t0)}" for t in result.missed]
    row.failures += [f"{tag}: late ({ttf:.0f} s) {scenarios.describe_truth(t, t0)}" for t, ttf in result.late]
    row.failures += [f"{tag}: false {scenarios.describe_alert(a, t0)}" for a in result.false_alerts]
    row.failures += [
        f"{tag}: stuck {scenarios.describe_alert(a, t0)} (after {scenarios.describe_truth(t, t0)})"
        for a, t in result.stuck
    ]


# ----------------------------------------------------------------------------------------- report


def _fmt(x: float | None, pattern: str = "{:.3f}") -> str:
    return "–" if x is None else pattern.format(x)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _kind_table(kinds: dict[str, scenarios.KindScore]) -> list[str]:
    out = [
        "| kind | precision | recall | TP | FP | allowed | required | detected | median TTF (s) | p90 TTF (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, ks in kinds.items():
        if not (ks.required or ks.tp or ks.fp or ks.neutral):
            continue
        out.append(
            f"| `{kind}` | {_fmt(ks.precision)} | {_fmt(ks.recall)} | {ks.tp} | {ks.fp} | {ks.neutral} | "
            f"{ks.required} | {ks.detected} | {_fmt(_pct(ks.ttf_s, 50), '{:.0f}')} | "
            f"{_fmt(_pct(ks.ttf_s, 90), '{:.0f}')} |"
        )
    return out


def _scenario_cells(r: ScenarioResult) -> str:
    """A per-scenario row's cells: runs, required, detected, false alerts, allowed, median TTF."""
    return f"{r.runs} | {r.required} | {r.detected} | {r.fp} | {r.neutral} | {_fmt(_pct(r.ttf_s, 50), '{:.0f}')}"


def _failures(ev: Evaluation) -> list[str]:
    """Each scenario's failures as list items, the scenario named first."""
    return [f"- {r.name}, {f}" for r in ev.per_scenario for f in r.failures]


def render(ev: Evaluation, max_failures: int = 40) -> str:
    """The markdown section (without markers)."""
    rate = ev.gpu_samples / ev.replay_s if ev.replay_s else 0.0
    lines = [
        f"Generated by `python -m bench.evaluation.detection_eval --seeds {ev.seeds}` "
        f"({len(ev.per_scenario)} scenarios × {ev.seeds} seeds, {ev.gpu_samples:,} GPU-samples; small traces, "
        f"so the in-process rate of {rate:,.0f} GPU-samples/s is dominated by per-run set-up — see "
        "`docs/benchmarks.md` for throughput). Traces come from `bench/evaluation/tracegen.py` (physics-based, "
        "seeded: GPU, timing, severity, GPU model, sampling interval 1–10 s and line order vary with the "
        "seed); ground truth is derived from the simulated physics. An alert matches a truth when kind and "
        f"subject agree and it starts within [start − lead − {scenarios.CLOCK_SLACK_S:g} s, end + "
        f"{scenarios.GRACE_S:.0f} s] (lead: the marginal onset before the condition is clear; "
        f"{scenarios.CLOCK_SLACK_S:g} s: truths are in true time, alerts in the node's own clock, up to 2 s "
        "off), or started "
        "earlier and still fires at the truth's start. Alerts matching only an *allowed* truth (marginal "
        "cases) count neither way. Time to fire is measured from the onset (start − lead).",
        "",
        "### Per alert kind, all sampling intervals",
        "",
        *_kind_table(ev.kinds),
        "",
        "### Per alert kind, 5 s sampling only",
        "",
        *_kind_table(ev.kinds_5s),
        "",
        "### Per scenario",
        "",
        "| scenario | runs | required | detected | false alerts | allowed | median TTF (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r.name} | {_scenario_cells(r)} |" for r in ev.per_scenario]
    failures = _failures(ev)
    lines += ["", f"### Failures ({len(failures)})", ""]
    lines += failures[:max_failures] or ["None."]
    if len(failures) > max_failures:
        lines.append(f"- … and {len(failures) - max_failures} more (run the bench to see them all)")
    return "\n".join(lines)


def _condition_table(ev: Evaluation) -> list[str]:
    out = [
        "| kind | precision | recall | TP | FP | required | detected | median TTF (s) | median TTF at 5 s (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, ks in ev.kinds.items():
        if not (ks.required or ks.tp or ks.fp or ks.neutral):
            continue
        out.append(
            f"| `{kind}` | {_fmt(ks.precision)} | {_fmt(ks.recall)} | {ks.tp} | {ks.fp} | {ks.required} | "
            f"{ks.detected} | {_fmt(_pct(ks.ttf_s, 50), '{:.0f}')} | "
            f"{_fmt(_pct(ev.kinds_5s[kind].ttf_s, 50), '{:.0f}')} |"
        )
    return out


def _delta(after: float | None, before: float | None) -> str:
    if after is None or before is None:
        return "–"
    return f"{after - before:+.3f}"


def render_ablations(results: list[AblationResult], baseline: dict[str, scenarios.KindScore]) -> list[str]:
    """One row per ablation and kind whose precision or recall moved; one row per ablation that moved none."""
    out = [
        "| detector | rule switched off | what it says | kind | precision | Δ precision | recall | Δ recall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ab = r.ablation
        head = f"| {ab.detector or '–'} | `{ab.name}` | {ab.switches_off} |"
        if r.error:
            out.append(f"{head} – | not run: {r.error} | | | |")
            continue
        moved = []
        for kind, ks in r.kinds.items():
            base = baseline.get(kind, scenarios.KindScore())
            if (ks.precision, ks.recall) != (base.precision, base.recall):
                moved.append(
                    f"{head} `{kind}` | {_fmt(ks.precision)} | {_delta(ks.precision, base.precision)} | "
                    f"{_fmt(ks.recall)} | {_delta(ks.recall, base.recall)} |"
                )
        out += moved or [f"{head} every kind | unchanged | | | |"]
    return out


@dataclass
class Report:
    """The conditions and the ablation table of docs/evaluation.md."""

    scenario_names: list[str]
    conditions: list[tuple[str, str, Evaluation]]  # (name, how it was run, evaluation)
    ablation_seeds: int
    ablations: list[AblationResult]
    ablation_baseline: dict[str, scenarios.KindScore]
    wall_s: float
    jobs: int = 1


def _seed_range(seeds: int) -> str:
    return "seed 0" if seeds == 1 else f"seeds 0 – {seeds - 1}"


def render_report(rep: Report) -> str:
    """The evaluation.md section (without markers)."""
    n_all = len(scenarios.CATALOG)
    subset = (
        f"all {n_all} scenarios of `bench/evaluation/scenarios.py`"
        if len(rep.scenario_names) == n_all
        else f"{len(rep.scenario_names)} of the {n_all} scenarios of `bench/evaluation/scenarios.py` (a subset, to finish "
        f"on a small machine: {', '.join(rep.scenario_names)})"
    )
    seeds = rep.conditions[0][2].seeds
    frozen = (
        "the frozen one"
        if GENERATOR_VERSION == HOLDOUT_GENERATOR_VERSION
        else f"**not** the hold-out's frozen version {HOLDOUT_GENERATOR_VERSION}: the hold-out figures below are "
        "of new traces"
    )
    lines = [
        f"Generated by `python -m bench.evaluation.detection_eval --report --seeds {seeds} --ablate-seeds {rep.ablation_seeds}"
        + ("" if len(rep.scenario_names) == n_all else " --scenarios …")
        + ("" if rep.jobs == 1 else f" --jobs {rep.jobs}")
        + f"` over {subset}, generator version {GENERATOR_VERSION} ({frozen}), in {rep.wall_s / 60:.0f} min"
        + ("" if rep.jobs == 1 else f" with {rep.jobs} processes")
        + ". Matching rules, truths and time to fire are those of the scenario suite (below); "
        "the target is precision and recall of at least 0.95 per kind and a median time to fire of at most 45 s at "
        "5 s sampling.",
        "",
        "| condition | how | seeds |",
        "|---|---|---|",
    ]
    for name, how, ev in rep.conditions:
        lines.append(f"| {name} | {how} | {ev.first_seed:,} – {ev.first_seed + ev.seeds - 1:,} |")
    for name, _how, ev in rep.conditions:
        lines += ["", f"### {name}", ""]
        if ev.unscored:
            lines += [
                f"Not scored: {', '.join(f'`{k}`' for k in ev.unscored)} (job-level kinds: without `hpc_job` there "
                "is no job to name; their truths and alerts are both left out). GPU- and node-level kinds are "
                "matched by their GPU or node, whatever job they ran.",
                "",
            ]
        lines += _condition_table(ev)
        short = [
            f"{r.name} ({r.required - r.detected} missed, {r.fp} false)"
            for r in ev.per_scenario
            if r.required > r.detected or r.fp
        ]
        lines += ["", f"Scenarios with a miss or a false alert: {', '.join(short) or 'none'}."]
    lines += [
        "",
        "### Ablations",
        "",
        f"Each rule the detectors declare switched off in turn (`disabled_rules`: it never holds; a gate rule "
        f"switched off never lets what it gates fire), on {_seed_range(rep.ablation_seeds)}; Δ is against the "
        "defaults on the same seeds. "
        "A rule whose switching-off costs nothing on the catalog is either covered by another rule or not "
        "exercised by any scenario. Rows list only the kinds that moved.",
        "",
        *render_ablations(rep.ablations, rep.ablation_baseline),
    ]
    return "\n".join(lines)


def evaluate_probes(
    run_replay: Callable[..., Any], names: list[str], seeds: int, first_seed: int = 0, noise_scale: float = 1.0
) -> Evaluation:
    """The probe scenarios of bench/evaluation/probes.py (each carries its own noise and attribution; noise_scale
    multiplies the noise) on the given seeds."""
    return evaluate(run_replay, names, seeds, first_seed, noise_scale, catalog=probes.BY_NAME)


def render_probes(ev: Evaluation) -> str:
    """The Probes section of docs/evaluation.md (without markers): per kind, per probe, every failure."""
    lines = [
        f"Generated by `python -m bench.evaluation.detection_eval --probes --seeds {ev.seeds}` over the "
        f"{len(ev.per_scenario)} probe scenarios of `bench/evaluation/probes.py`, seeds {ev.first_seed:,} – "
        f"{ev.first_seed + ev.seeds - 1:,}, generator version {GENERATOR_VERSION}. Probes are fleets shaped unlike "
        "the catalog's and are not part of its figures above; each carries its own noise and attribution, "
        "scored with the catalog's rules.",
        "",
        *_condition_table(ev),
        "",
        "| probe | description | runs | required | detected | false alerts | allowed | median TTF (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r.name} | {probes.BY_NAME[r.name].description} | {_scenario_cells(r)} |" for r in ev.per_scenario]
    failures = _failures(ev)
    lines += ["", f"Misses, late, false and stuck alerts ({len(failures)}):", "", *(failures or ["None."])]
    return "\n".join(lines)


UNEVEN = Section("uneven", "## Uneven ranks")


def render_uneven(ev: Evaluation) -> str:
    """The Uneven ranks section of docs/evaluation.md (without markers): per kind, per scenario, failures."""
    hour = f"{scenarios.UNEVEN_HEALTHY_S / 3600:g} h"
    lines = [
        f"Generated by `python -m bench.evaluation.detection_eval --uneven --seeds {ev.seeds}` over the "
        f"{len(ev.per_scenario)} uneven-rank scenarios of `bench/evaluation/scenarios.py` (part of the catalog), "
        f"seeds {ev.first_seed:,} – {ev.first_seed + ev.seeds - 1:,}, generator version {GENERATOR_VERSION}. "
        "Pipeline stages with a busier last stage, mixture-of-experts ranks whose load drifts, and two small "
        f"jobs sharing nodes; each healthy for {hour} (any straggler alert is false) and with one GPU 25-40 % "
        "slow, with and without `hpc_job`. Scored with the catalog's rules.",
        "",
        *_condition_table(ev),
        "",
        "| scenario | description | runs | required | detected | false alerts | allowed | median TTF (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r.name} | {scenarios.BY_NAME[r.name].description} | {_scenario_cells(r)} |" for r in ev.per_scenario]
    failures = _failures(ev)
    lines += ["", f"Misses, late, false and stuck alerts ({len(failures)}):", "", *(failures or ["None."])]
    return "\n".join(lines)


def run_report(
    run_replay: Callable[..., Any], names: list[str], seeds: int, ablation_seeds: int, jobs: int = 1
) -> tuple[Report, Evaluation]:
    """Every condition of docs/evaluation.md, the ablation table, and the probes' evaluation; `jobs`
    processes at once (each condition, ablation and the probes is one piece of work)."""
    started = time.perf_counter()
    how: list[tuple[str, str, dict[str, Any]]] = [
        ("Defaults", "the catalog as generated", {}),
        (
            f"Sensor noise ×{REPORT_NOISE_SCALE:g}",
            f"`--noise-scale {REPORT_NOISE_SCALE:g}`: every reading noise of the generator ×{REPORT_NOISE_SCALE:g}",
            {"noise_scale": REPORT_NOISE_SCALE},
        ),
        ("Unattributed", "`--unattributed`: no GPU carries `hpc_job`", {"unattributed": True}),
        ("Hold-out", "`--holdout`: seeds no threshold is tuned on", {"first_seed": HOLDOUT_FIRST_SEED}),
    ]
    ablation_seeds = min(ablation_seeds, seeds)
    calls: list[Callable[[], Any]] = [partial(evaluate, run_replay, names, seeds, **kw) for _n, _h, kw in how]
    calls += [partial(_ablation, run_replay, ab, names, ablation_seeds) for ab in declared_ablations()]
    calls.append(partial(evaluate_probes, run_replay, list(probes.BY_NAME), seeds))
    done = in_parallel(calls, jobs)
    conditions = [(name, text, ev) for (name, text, _kw), ev in zip(how, done)]
    results, probe_ev = done[len(how) : -1], done[-1]
    baseline = seeds_total(conditions[0][2], range(ablation_seeds))
    report = Report(names, conditions, ablation_seeds, results, baseline, time.perf_counter() - started, jobs)
    return report, probe_ev


def _summary(ev: Evaluation) -> str:
    out = []
    for kind in HEADLINE_KINDS:
        if kind in ev.unscored:
            out.append(f"{kind}: not scored (job-level kind, no attribution)")
            continue
        ks = ev.kinds[kind]
        out.append(
            f"{kind}: precision {_fmt(ks.precision)} recall {_fmt(ks.recall)} "
            f"median TTF@5s {_fmt(_pct(ev.kinds_5s[kind].ttf_s, 50), '{:.0f}')} s"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(prog="python -m bench.evaluation.detection_eval", description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5, help="seeds per scenario (default 5)")
    ap.add_argument(
        "--first-seed",
        type=int,
        default=0,
        metavar="N",
        help="start at seed N: N above the documented run scores seeds that no threshold was ever "
        "tuned on (implies --no-write)",
    )
    ap.add_argument("--scenarios", default="", help="comma-separated scenario names (default: all)")
    ap.add_argument("--no-write", action="store_true", help=f"do not update {DOC.name}")
    ap.add_argument("--doc", type=Path, default=DOC, help="markdown file to update")
    ap.add_argument(
        "--without",
        default="",
        metavar="FIELDS",
        help="comma-separated GPU fields to remove from every line, as a driver that does not report "
        "them would (implies --no-write: the document's table is for every reading present)",
    )
    ap.add_argument(
        "--noise-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="scale the generator's per-second reading noise by X, a probe for noisier telemetry (implies --no-write)",
    )
    ap.add_argument(
        "--mid-job",
        type=float,
        default=None,
        metavar="SECONDS",
        help="record every trace from the middle of its jobs: jobs starting with the trace are past "
        "their start-up, and the incidents move so the first begins SECONDS in (implies --no-write)",
    )
    ap.add_argument(
        "--unattributed",
        action="store_true",
        help="remove hpc_job from every GPU; job-level kinds are then not scored (implies --no-write)",
    )
    ap.add_argument(
        "--holdout",
        action="store_true",
        help=f"score the frozen hold-out, seeds {HOLDOUT_FIRST_SEED:,} on, that no threshold is tuned on "
        "(implies --no-write)",
    )
    ap.add_argument(
        "--ablate",
        action="store_true",
        help="switch each declared rule off in turn and print what it costs (implies --no-write)",
    )
    ap.add_argument(
        "--report",
        action="store_true",
        help=f"run every condition of {EVAL_DOC.name} and the ablation table, and write it (not {DOC.name})",
    )
    ap.add_argument(
        "--probes",
        action="store_true",
        help=f"score the probe scenarios of bench/evaluation/probes.py (--scenarios picks among them) and write their "
        f"section of {EVAL_DOC.name} unless --no-write",
    )
    ap.add_argument(
        "--uneven",
        action="store_true",
        help=f"score only the uneven-rank scenarios and write their section of {EVAL_DOC.name} unless --no-write",
    )
    ap.add_argument(
        "--ablate-seeds", type=int, default=2, metavar="N", help="seeds per scenario for ablations (default 2)"
    )
    ap.add_argument("--eval-doc", type=Path, default=EVAL_DOC, help="markdown file --report updates")
    ap.add_argument("--jobs", type=int, default=1, metavar="N", help="processes for --report and --ablate (default 1)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    catalog = probes.BY_NAME if args.probes else scenarios.BY_NAME
    names = [n for n in args.scenarios.split(",") if n] or list(catalog)
    unknown = [n for n in names if n not in catalog]
    if unknown or args.seeds < 1 or args.first_seed < 0:
        ap.error(f"unknown scenario(s) {unknown}" if unknown else "--seeds must be at least 1, --first-seed at least 0")
    if not 0.0 <= args.noise_scale <= 10.0:
        ap.error("--noise-scale must be between 0 and 10")
    if args.mid_job is not None and args.mid_job < 0:
        ap.error("--mid-job must not be negative")
    if args.holdout and args.first_seed:
        ap.error("--holdout and --first-seed choose the seeds both: give one")
    if not args.holdout and args.first_seed + args.seeds > HOLDOUT_FIRST_SEED:
        ap.error(f"seeds from {HOLDOUT_FIRST_SEED:,} on are the frozen hold-out: score them with --holdout")
    if args.holdout and args.seeds > HOLDOUT_SEEDS:
        ap.error(f"the hold-out has {HOLDOUT_SEEDS} seeds")
    if args.ablate_seeds < 1:
        ap.error("--ablate-seeds must be at least 1")
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    if args.probes and (args.report or args.ablate or args.holdout or args.unattributed or args.mid_job is not None):
        ap.error("--probes carry their own conditions: give it alone (--report runs the probes too)")
    try:
        from gpufleet.server.replay import run_replay
    except ModuleNotFoundError as exc:
        print(f"detection_eval: the engine is not available ({exc})", file=sys.stderr)
        return 1
    fields = tuple(f for f in args.without.split(",") if f)
    replay = partial(_replay_without, run_replay, fields) if fields else run_replay
    print(f"generator version {GENERATOR_VERSION}", file=sys.stderr)
    if args.report:
        rep, probe_ev = run_report(replay, names, args.seeds, args.ablate_seeds, args.jobs)
        body = render_report(rep)
        print(body)
        probe_body = render_probes(probe_ev)
        print(f"\n{PROBES.heading}\n\n{probe_body}")
        if not args.no_write:
            REPORT.write(args.eval_doc, body, "Evaluation")
            SUITE.write(args.eval_doc, render(rep.conditions[0][2]), "Evaluation")
            PROBES.write(args.eval_doc, probe_body, "Evaluation")
            print(f"\nwrote {args.eval_doc}", file=sys.stderr)
        return 0
    if args.uneven:
        uneven_ev = evaluate(replay, [sc.name for sc in scenarios.UNEVEN], args.seeds, args.first_seed)
        uneven_body = render_uneven(uneven_ev)
        print(uneven_body + "\n\n" + _summary(uneven_ev))
        if not args.no_write and not (fields or args.first_seed):
            UNEVEN.write(args.eval_doc, uneven_body, "Evaluation")
            print(f"\nwrote {args.eval_doc}", file=sys.stderr)
        return 0
    if args.probes:
        probe_ev = evaluate_probes(replay, names, args.seeds, args.first_seed, args.noise_scale)
        probe_body = render_probes(probe_ev)
        print(probe_body + "\n\n" + _summary(probe_ev))
        probe_run = fields or args.noise_scale != 1.0 or args.first_seed or len(names) < len(probes.BY_NAME)
        if not args.no_write and not probe_run:
            PROBES.write(args.eval_doc, probe_body, "Evaluation")
            print(f"\nwrote {args.eval_doc}", file=sys.stderr)
        return 0
    if args.ablate:
        seeds = min(args.seeds, args.ablate_seeds)
        base = evaluate(replay, names, seeds)
        print("\n".join(render_ablations(ablate(replay, names, seeds, jobs=args.jobs), base.kinds)))
        return 0
    if args.holdout and GENERATOR_VERSION != HOLDOUT_GENERATOR_VERSION:
        print(
            f"detection_eval: generator version {GENERATOR_VERSION} is not the hold-out's frozen "
            f"{HOLDOUT_GENERATOR_VERSION}: these are new traces",
            file=sys.stderr,
        )
    first = HOLDOUT_FIRST_SEED if args.holdout else args.first_seed
    ev = evaluate(replay, names, args.seeds, first, args.noise_scale, args.mid_job, args.unattributed)
    body = render(ev)
    print(render(ev, max_failures=10**6))
    if ev.unscored:
        print(f"\nnot scored without attribution: {', '.join(ev.unscored)}")
    print("\n" + _summary(ev))
    probe = fields or args.first_seed or args.noise_scale != 1.0 or args.mid_job is not None
    if not args.no_write and not probe and not args.unattributed and not args.holdout:
        SUITE.write(args.doc, body, "Evaluation")
        print(f"\nwrote {args.doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
