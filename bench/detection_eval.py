"""Precision, recall and time to fire of the detection engine over the whole scenario catalog.

    python -m bench.detection_eval [--seeds N] [--first-seed N] [--scenarios a,b] [--no-write] [--without FIELD,...]
                                   [--noise-scale X] [--mid-job SECONDS]

Runs every scenario of tests/server/scenarios.py over N seeds through server.replay.run_replay, prints
per-kind precision/recall/time-to-fire and a per-scenario table, and writes both into docs/detection.md
between the `<!-- suite:begin -->` and `<!-- suite:end -->` markers (nothing else in that file changes).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from bench import scenarios
from bench.tracegen import generate, without_fields

log = logging.getLogger(__name__)

DOC = Path(__file__).resolve().parent.parent / "docs" / "detection.md"
BEGIN, END = "<!-- suite:begin -->", "<!-- suite:end -->"
HEADING = "## Scenario suite results"
HEADLINE_KINDS = ("thermal_throttle", "straggler", "comm_bound")


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


def evaluate(
    run_replay,
    names: list[str],
    seeds: int,
    first_seed: int = 0,
    noise_scale: float = 1.0,
    mid_job_s: float | None = None,
) -> Evaluation:
    """Generate, replay and score every (scenario, seed) for seeds first_seed .. first_seed + seeds - 1
    (noise_scale: the generator's reading noise, scaled; mid_job_s: see scenarios.mid_job)."""
    kinds = {k: scenarios.KindScore() for k in scenarios.ALERT_KINDS}
    kinds_5s = {k: scenarios.KindScore() for k in scenarios.ALERT_KINDS}
    rows, samples, replay_s = [], 0, 0.0
    for name in names:
        row = ScenarioResult(name)
        for seed in range(first_seed, first_seed + seeds):
            spec = replace(scenarios.BY_NAME[name].build(seed), noise_scale=noise_scale)
            trace = generate(spec if mid_job_s is None else scenarios.mid_job(spec, mid_job_s))
            started = time.perf_counter()
            alerts = run_replay(trace.lines)
            replay_s += time.perf_counter() - started
            samples += trace.gpu_samples
            result = scenarios.score(alerts, trace.truths, trace_end=trace.spec.t0 + trace.spec.duration_s)
            _accumulate(row, result, trace, seed)
            for kind, ks in result.kinds.items():
                kinds.setdefault(kind, scenarios.KindScore()).add(ks)
                if trace.spec.interval_s == 5.0:
                    kinds_5s.setdefault(kind, scenarios.KindScore()).add(ks)
        rows.append(row)
        log.info(
            "scenario done", extra={"scenario": name, "required": row.required, "detected": row.detected, "fp": row.fp}
        )
    return Evaluation(seeds, kinds, kinds_5s, rows, samples, replay_s)


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


def render(ev: Evaluation, max_failures: int = 40) -> str:
    """The markdown section (without markers)."""
    rate = ev.gpu_samples / ev.replay_s if ev.replay_s else 0.0
    lines = [
        f"Generated by `python -m bench.detection_eval --seeds {ev.seeds}` "
        f"({len(ev.per_scenario)} scenarios × {ev.seeds} seeds, {ev.gpu_samples:,} GPU-samples; small traces, "
        f"so the in-process rate of {rate:,.0f} GPU-samples/s is dominated by per-run set-up — see "
        "`docs/benchmarks.md` for throughput). Traces come from `tests/server/tracegen.py` (physics-based, "
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
    for r in ev.per_scenario:
        lines.append(
            f"| {r.name} | {r.runs} | {r.required} | {r.detected} | {r.fp} | {r.neutral} | "
            f"{_fmt(_pct(r.ttf_s, 50), '{:.0f}')} |"
        )
    failures = [f"- {r.name}, {f}" for r in ev.per_scenario for f in r.failures]
    lines += ["", f"### Failures ({len(failures)})", ""]
    lines += failures[:max_failures] or ["None."]
    if len(failures) > max_failures:
        lines.append(f"- … and {len(failures) - max_failures} more (run the bench to see them all)")
    return "\n".join(lines)


def write_section(doc: Path, body: str) -> None:
    """Replace only what lies between the suite markers; add heading and markers if absent."""
    block = f"{BEGIN}\n{body}\n{END}"
    text = doc.read_text() if doc.exists() else "# Detection\n"
    if BEGIN in text and END in text and text.index(BEGIN) < text.index(END):
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1]
        text = head + block + tail
    else:
        text = text.rstrip("\n") + f"\n\n{HEADING}\n\n{block}\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def _summary(ev: Evaluation) -> str:
    out = []
    for kind in HEADLINE_KINDS:
        ks = ev.kinds[kind]
        out.append(
            f"{kind}: precision {_fmt(ks.precision)} recall {_fmt(ks.recall)} "
            f"median TTF@5s {_fmt(_pct(ev.kinds_5s[kind].ttf_s, 50), '{:.0f}')} s"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(prog="python -m bench.detection_eval", description=__doc__.splitlines()[0])
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
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    names = [n for n in args.scenarios.split(",") if n] or [s.name for s in scenarios.CATALOG]
    unknown = [n for n in names if n not in scenarios.BY_NAME]
    if unknown or args.seeds < 1 or args.first_seed < 0:
        ap.error(f"unknown scenario(s) {unknown}" if unknown else "--seeds must be at least 1, --first-seed at least 0")
    if not 0.0 <= args.noise_scale <= 10.0:
        ap.error("--noise-scale must be between 0 and 10")
    if args.mid_job is not None and args.mid_job < 0:
        ap.error("--mid-job must not be negative")
    try:
        from gpufleet.server.replay import run_replay
    except ModuleNotFoundError as exc:
        print(f"detection_eval: the engine is not available ({exc})", file=sys.stderr)
        return 1
    fields = tuple(f for f in args.without.split(",") if f)
    replay = (lambda lines: run_replay(without_fields(lines, fields))) if fields else run_replay
    ev = evaluate(replay, names, args.seeds, args.first_seed, args.noise_scale, args.mid_job)
    body = render(ev)
    print(render(ev, max_failures=10**6))
    print("\n" + _summary(ev))
    if not args.no_write and not fields and not args.first_seed and args.noise_scale == 1.0 and args.mid_job is None:
        write_section(args.doc, body)
        print(f"\nwrote {args.doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
