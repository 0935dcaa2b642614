"""Replay throughput: GPU-samples per second through `gpufleet-server replay`, start-up included.

    python -m bench.replay_bench [--nodes 64] [--minutes 30] [--fast-minutes 10] [--big-nodes 256]
                                 [--big-minutes 20] [--small-nodes 8] [--small-minutes 30]
                                 [--small-slow-minutes 60] [--repeat 3] [--stages] [--no-write]

Generates large traces with bench/evaluation/tracegen.py (N nodes x 8 GPUs at 5 s sampling, a 1 s variant,
a bigger cluster at 5 s, since the per-tick cost is shared by more GPUs there, and a small cluster at
1 s and at 5 s, where it is shared by fewest), each twice: as the agent records it (every field, ~1.5 KB per GPU)
and cut down to the snapshot contract's example fields (~0.7 KB per GPU). Then times (a) the CLI as a
subprocess end to end (interpreter start, imports, parsing, engine, JSON out) and (b)
server.replay.run_replay in-process, each pinned to one CPU core, and (c) what the CLI costs with no
engine at all: its start-up on an empty trace, and its start-up, imports, reading and parsing of the
trace without running the engine. (c) is the most any engine can leave of the floor. Writes the figures
under `## Server: replay` in docs/benchmarks.md (other sections are left alone).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.docgen.splice import Section
from bench.evaluation.tracegen import A100, H100, ClusterSpec, Incident, Job, NodeSpec, Trace, write_trace

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
# The figures this script writes; the notes after them in the section are kept.
SECTION = Section("replay_bench", "## Server: replay")
GOAL, FLOOR = 500_000, 200_000
# The GPU fields of the snapshot contract's example in the agent issue: what a minimal producer writes.
CONTRACT_GPU_FIELDS = frozenset(
    (
        "index",
        "uuid",
        "model",
        "hpc_job",
        "up",
        "utilization_ratio",
        "sm_active_ratio",
        "memory_used_bytes",
        "memory_total_bytes",
        "temperature_celsius",
        "memory_temperature_celsius",
        "slowdown_temperature_celsius",
        "power_watts",
        "power_limit_watts",
        "energy_joules_total",
        "sm_clock_hertz",
        "sm_clock_max_hertz",
        "throttle_reasons",
        "nvlink_tx_bytes_total",
        "nvlink_rx_bytes_total",
        "pcie_tx_bytes_total",
        "pcie_rx_bytes_total",
        "xid_errors_total",
    )
)


@dataclass(frozen=True)
class Timing:
    """One configuration's result (seconds are the median over repeats)."""

    label: str
    gpu_samples: int
    lines: int
    trace_bytes: int
    cli_wall_s: float
    cli_cpu_s: float
    inproc_wall_s: float
    alerts: int
    no_engine_s: float  # start-up, imports, read and parse as the CLI does them, no engine
    live_tick_us_per_gpu: float  # CPU per tick and GPU, fed as the live server feeds it
    stages_s: dict[str, float] = field(default_factory=dict)  # fastest of the repeats, per stage

    @property
    def cli_rate(self) -> float:
        return self.gpu_samples / self.cli_wall_s

    @property
    def cli_cpu_rate(self) -> float:
        return self.gpu_samples / self.cli_cpu_s

    @property
    def inproc_rate(self) -> float:
        return self.gpu_samples / self.inproc_wall_s


def bench_spec(nodes: int, minutes: float, interval_s: float, seed: int = 7) -> ClusterSpec:
    """A production-like cluster: 8-node jobs (one per half on fewer than 16 nodes), half H100 / half
    A100, a few incidents and decoys."""
    rng = np.random.default_rng(seed)
    specs = tuple(
        NodeSpec(
            f"gpu-{i:04d}",
            H100 if i < nodes // 2 else A100,
            8,
            float(rng.uniform(20, 32)),
            float(rng.uniform(-0.5, 0.5)),
        )
        for i in range(nodes)
    )
    jobs, incidents = [], []
    # 8-node jobs on 8 nodes would straddle the two models, and the cluster would idle without a job:
    # the engine's cheapest case, not a production one.
    per_job = 8 if nodes >= 16 else max(1, nodes // 2)
    for k in range(0, nodes - per_job + 1, per_job):
        group = specs[k : k + per_job]
        if group[0].model is not group[-1].model:
            continue
        jobs.append(
            Job(
                f"j{k}",
                str(80000 + k),
                tuple((n.name, tuple(range(8))) for n in group),
                step_s=float(rng.uniform(0.4, 1.2)),
                comm_ratio=float(rng.uniform(0.12, 0.3)),
            )
        )
    duration = minutes * 60.0
    for job, kind in zip(jobs, ("slow_gpu", "comm_slowdown", "cooling_failure", "input_starved", "power_brake")):
        node, _ = job.placement[1]
        start = duration * 0.3
        sev = {"slow_gpu": 0.7, "comm_slowdown": 3.0, "cooling_failure": 2.2, "input_starved": 0.8, "power_brake": 0.6}[
            kind
        ]
        incidents.append(Incident(kind, start, duration * 0.8, node, 3, job=job.key, severity=sev, count=120))
    incidents.append(Incident("agent_down", duration * 0.5, duration * 0.5 + 180, specs[-1].name))
    return ClusterSpec(
        specs, tuple(jobs), tuple(incidents), duration, interval_s, seed=seed, drop_ratio=0.005, order="time"
    )


def _cli() -> list[str]:
    exe = Path(sys.executable).with_name("gpufleet-server")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "gpufleet.server.cli"]


def _compile_bytecode() -> None:
    """Write the packages' .pyc files, as a regular install does: with PYTHONDONTWRITEBYTECODE set (or
    an editable install never compiled) every CLI run would otherwise compile them again at start-up."""
    import compileall

    root = Path(__file__).resolve().parent.parent
    for package in ("server", "agent"):
        compileall.compile_dir(str(root / package), quiet=1)


def _pin() -> None:
    """Run on a single core so that 'per core' means what it says."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def time_cli(path: Path, expect_code: int = 0) -> tuple[float, float, int]:
    """(wall s, child CPU s, alerts printed) for one end-to-end CLI replay that exits with expect_code."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(
        [*_cli(), "replay", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_pin, check=False
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != expect_code:
        raise RuntimeError(f"replay exited {proc.returncode}: {proc.stderr.decode()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, len([line for line in proc.stdout.splitlines() if line.strip()])


# The CLI's imports and its loading of the trace (read, decode, validate, sort), stopping before the
# engine: the part of a replay that a faster engine cannot make faster.
_NO_ENGINE = """
import sys
import gpufleet.server.cli
from gpufleet.server.replay import load_samples, open_trace
handles = []
load_samples([(sys.argv[1], open_trace(sys.argv[1], handles))])
"""


def time_no_engine(path: Path) -> float:
    """Wall seconds of a subprocess that starts, imports and loads the trace as the CLI does, on one core,
    and runs no engine."""
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _NO_ENGINE, str(path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=_pin,
        check=False,
    )
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"loading without the engine exited {proc.returncode}: {proc.stderr.decode()[-2000:]}")
    return wall


def time_startup(tmp: Path, repeat: int) -> float:
    """Median wall seconds of the CLI replaying an empty trace: interpreter, imports, nothing to do."""
    empty = tmp / "empty.jsonl"
    empty.write_bytes(b"")
    # An empty trace exits 1 (no valid snapshot read) once everything is imported and read.
    return statistics.median(time_cli(empty, expect_code=1)[0] for _ in range(repeat))


def time_inproc(path: Path) -> float:
    """Wall seconds for reading the file and run_replay over its lines, on one core."""
    from gpufleet.server.replay import run_replay

    saved = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    _pin()
    try:
        started = time.perf_counter()
        with open(path, "rb", buffering=1 << 20) as fh:  # as the CLI opens it
            run_replay(fh)
        return time.perf_counter() - started
    finally:
        if saved is not None:
            os.sched_setaffinity(0, saved)


def time_live_tick(path: Path) -> float:
    """CPU microseconds per tick and GPU of the engine fed as the live server feeds it: each tick's
    snapshots ingested, then advance(), with no prepared flushes (so the flush is included). Thread CPU
    time, so that other work on the machine does not count."""
    from gpufleet.server.engine import Engine, EngineConfig
    from gpufleet.server.replay import aligned_samples, open_trace

    handles: list = []
    try:
        samples = aligned_samples([(str(path), open_trace(str(path), handles))])
    finally:
        for fh in handles:
            fh.close()
    cfg = EngineConfig()
    engine = Engine(cfg)
    step = cfg.tick_seconds
    boundary = (math.floor(samples[0].time / step) + 1) * step
    cpu_s = 0.0
    for sample in samples:
        if sample.time >= boundary:
            started = time.thread_time()
            engine.advance(boundary)
            cpu_s += time.thread_time() - started
            boundary = (math.floor(sample.time / step) + 1) * step
        engine.ingest(sample)
    started = time.thread_time()
    engine.advance(boundary)
    cpu_s += time.thread_time() - started
    stats = engine.stats()
    return cpu_s / max(stats.ticks, 1) / max(stats.gpus, 1) * 1e6


def time_stages(path: Path) -> dict[str, float]:
    """Seconds per stage of an in-process replay on one core: where the time goes.

    read = iterating the file's lines; decode = the contract decoder (JSON, types, ranges) of every line
    alone; parse = the whole contract parser (decode included) into NodeSamples; engine = feeding them
    through the Engine.
    """
    import gc

    from gpufleet.server.contract import decode_line, parse_lines
    from gpufleet.server.engine import EngineConfig
    from gpufleet.server.replay import load_samples, run_samples

    saved = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    _pin()
    gc.disable()
    try:
        out = {}
        started = time.perf_counter()
        with open(path, "rb", buffering=1 << 20) as fh:
            lines = list(fh)
        out["read"] = time.perf_counter() - started
        started = time.perf_counter()
        for line in lines:
            decode_line(line)
        out["decode"] = time.perf_counter() - started
        started = time.perf_counter()
        for _ in parse_lines(lines):
            pass
        out["parse"] = time.perf_counter() - started
        samples = load_samples([(str(path), lines)])
        del lines
        started = time.perf_counter()
        run_samples(samples, EngineConfig())
        out["engine"] = time.perf_counter() - started
        return out
    finally:
        gc.enable()
        if saved is not None:
            os.sched_setaffinity(0, saved)


def contract_only(src: Path, dst: Path) -> None:
    """Rewrite an agent trace keeping only the header and the contract example's GPU fields."""
    import orjson

    with open(src, "rb") as fin, open(dst, "wb") as fout:
        for line in fin:
            snap = orjson.loads(line)
            gpus = [{k: v for k, v in g.items() if k in CONTRACT_GPU_FIELDS} for g in snap["gpus"]]
            fout.write(
                orjson.dumps({"schema": snap["schema"], "node": snap["node"], "time": snap["time"], "gpus": gpus})
                + b"\n"
            )


def run_one(
    label: str, spec: ClusterSpec, repeat: int, path: Path, with_stages: bool = False, contract: bool = False
) -> Timing:
    """Write the trace to `path`, then time both ways (and optionally per stage) `repeat` times."""
    trace: Trace = write_trace(spec, path)
    lines, samples = len(trace.lines), trace.gpu_samples
    del trace
    if contract:
        slim = path.with_suffix(".contract.jsonl")
        contract_only(path, slim)
        path.unlink()
        path, label = slim, label + ", contract fields"
    cli = [time_cli(path) for _ in range(repeat)]
    inproc = [time_inproc(path) for _ in range(repeat)]
    no_engine = [time_no_engine(path) for _ in range(repeat)]
    stages = [time_stages(path) for _ in range(repeat)] if with_stages else []
    live = [time_live_tick(path) for _ in range(repeat)]
    return Timing(
        label,
        samples,
        lines,
        path.stat().st_size,
        statistics.median(c[0] for c in cli),
        statistics.median(c[1] for c in cli),
        statistics.median(inproc),
        cli[0][2],
        statistics.median(no_engine),
        statistics.median(live),
        {k: min(st[k] for st in stages) for k in stages[0]} if stages else {},
    )


def render(results: list[Timing], repeat: int, startup_s: float) -> str:
    cpu = _cpu_model()
    out = [
        f"`python -m bench.replay_bench` on {cpu} ({os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} when it finished: with other work running, wall time exceeds CPU time), "
        f"Python {platform.python_version()}, each run pinned to one core; median of {repeat} runs. Traces from `bench/evaluation/tracegen.py` (a time-sorted cat of "
        "every node's snapshot lines, a few incidents, 0.5 % dropped lines). *CLI* is "
        "`gpufleet-server replay TRACE` as a subprocess, end to end: interpreter start-up, imports, "
        "parsing, engine, alert JSON on stdout. *In-process* is `run_replay(open(TRACE, 'rb', buffering=1 << 20))`.",
        f"Goal ≥ {GOAL:,} GPU-samples/s, floor {FLOOR:,}.",
        "",
        "*CLI GPU-samples/s (CPU)* divides by the CLI's CPU time (user + system), which other work on the "
        "machine does not inflate. *Live tick per GPU* is the engine's CPU time per tick and GPU when fed as "
        "the live server feeds it (each tick's snapshots ingested, then `advance()`; flush included).",
        "",
        "| trace | lines | GPU-samples | size | CLI wall (s) | CLI CPU (s) | CLI GPU-samples/s | "
        "CLI GPU-samples/s (CPU) | in-process (s) | in-process GPU-samples/s | live tick per GPU (µs) | alerts |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        out.append(
            f"| {r.label} | {r.lines:,} | {r.gpu_samples:,} | {r.trace_bytes / 2**20:.0f} MiB | "
            f"{r.cli_wall_s:.2f} | {r.cli_cpu_s:.2f} | **{r.cli_rate:,.0f}** | {r.cli_cpu_rate:,.0f} | "
            f"{r.inproc_wall_s:.2f} | {r.inproc_rate:,.0f} | {r.live_tick_us_per_gpu:.2f} | {r.alerts} |"
        )
    staged = [r for r in results if r.stages_s]
    if staged:
        out += [
            "",
            "Where the time goes, in-process on one core (fastest of the repeats; µs per GPU-sample). "
            "*decode* is the msgspec decoder alone (JSON, types and ranges checked, unread fields skipped); "
            "*matrices* is the rest of `parse_lines` (batched float matrices, per-line checks, NodeSamples); "
            "*engine* is everything after parsing.",
            "",
            "| trace | read lines | decode | matrices | engine | sum |",
            "|---|---|---|---|---|---|",
        ]
        for r in staged:
            us = {k: v / r.gpu_samples * 1e6 for k, v in r.stages_s.items()}
            parser = us["parse"] - us["decode"]
            out.append(
                f"| {r.label} | {us['read']:.2f} | {us['decode']:.2f} | {parser:.2f} | {us['engine']:.2f} | "
                f"{us['read'] + us['parse'] + us['engine']:.2f} |"
            )
    out += [
        "",
        f"What the floor leaves an engine (median of {repeat} runs, one core). *start-up + load* is the CLI's "
        "interpreter start-up, imports, reading, decoding, validating and sorting of the trace, with no engine "
        f"run (the CLI on an empty trace takes {startup_s:.2f} s). *left for the engine* is what the floor "
        "allows the whole replay less that: negative means no engine, however fast, meets the floor behind "
        "this start-up and parser.",
        "",
        "| trace | GPU-samples | the floor allows (s) | start-up + load (s) | left for the engine (s) | "
        "whole replay (s) | GPU-samples/s with no engine |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        allowed = r.gpu_samples / FLOOR
        out.append(
            f"| {r.label} | {r.gpu_samples:,} | {allowed:.2f} | {r.no_engine_s:.2f} | "
            f"{allowed - r.no_engine_s:+.2f} | {r.cli_wall_s:.2f} | {r.gpu_samples / r.no_engine_s:,.0f} |"
        )
    worst = min(r.cli_rate for r in results)
    verdict = (
        "meets the goal"
        if worst >= GOAL
        else "meets the floor, not the goal"
        if worst >= FLOOR
        else "is BELOW the floor"
    )
    out += ["", f"Slowest CLI configuration: {worst:,.0f} GPU-samples/s — {verdict}.", ""]
    return "\n".join(out)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.replay_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=30.0, help="length of the 5 s trace")
    ap.add_argument("--fast-minutes", type=float, default=10.0, help="length of the 1 s trace (0: skip)")
    ap.add_argument("--big-nodes", type=int, default=256, help="nodes of the big 5 s trace (0: skip)")
    ap.add_argument("--big-minutes", type=float, default=20.0, help="length of the big 5 s trace")
    ap.add_argument("--small-nodes", type=int, default=8, help="nodes of the small 1 s trace (0: skip)")
    ap.add_argument("--small-minutes", type=float, default=30.0, help="length of the small 1 s trace")
    ap.add_argument(
        "--small-slow-minutes", type=float, default=60.0, help="length of the small cluster's 5 s trace (0: skip)"
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stages", action="store_true", help="also time read / decode / parse / engine in-process")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--doc", type=Path, default=DOC)
    args = ap.parse_args(argv)
    if args.nodes < 8 or args.minutes <= 0 or args.repeat < 1:
        ap.error("need --nodes >= 8, --minutes > 0, --repeat >= 1")
    try:
        importlib.import_module("gpufleet.server.replay")
    except ModuleNotFoundError as exc:
        print(f"replay_bench: the engine is not available ({exc})", file=sys.stderr)
        return 1
    configs = [(f"{args.nodes} nodes × 8 GPUs, {args.minutes:g} min @ 5 s", bench_spec(args.nodes, args.minutes, 5.0))]
    if args.fast_minutes > 0:
        configs.append(
            (
                f"{args.nodes} nodes × 8 GPUs, {args.fast_minutes:g} min @ 1 s",
                bench_spec(args.nodes, args.fast_minutes, 1.0),
            )
        )
    if args.big_nodes > 0:
        configs.append(
            (
                f"{args.big_nodes} nodes × 8 GPUs, {args.big_minutes:g} min @ 5 s",
                bench_spec(args.big_nodes, args.big_minutes, 5.0),
            )
        )
    if args.small_nodes >= 8:
        configs.append(
            (
                f"{args.small_nodes} nodes × 8 GPUs, {args.small_minutes:g} min @ 1 s",
                bench_spec(args.small_nodes, args.small_minutes, 1.0),
            )
        )
    if args.small_nodes >= 8 and args.small_slow_minutes > 0:
        configs.append(
            (
                f"{args.small_nodes} nodes × 8 GPUs, {args.small_slow_minutes:g} min @ 5 s",
                bench_spec(args.small_nodes, args.small_slow_minutes, 5.0),
            )
        )
    _compile_bytecode()
    from gpufleet.server.allocator import tune_malloc

    tune_malloc()  # as the CLI does, so that in-process figures compare with it
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        startup_s = time_startup(Path(tmp), args.repeat)
        results = []
        for k, (label, spec, contract) in enumerate((lb, sp, c) for lb, sp in configs for c in (False, True)):
            try:
                results.append(run_one(label, spec, args.repeat, Path(tmp) / f"trace{k}.jsonl", args.stages, contract))
            except RuntimeError as exc:  # a crashing replay is a finding, not a figure
                print(f"{label}: {exc}", file=sys.stderr)
                return 1
            print(
                f"{label}: CLI {results[-1].cli_rate:,.0f} GPU-samples/s, in-process {results[-1].inproc_rate:,.0f}",
                file=sys.stderr,
            )
    section = render(results, args.repeat, startup_s)
    print(section)
    if not args.no_write:
        SECTION.write(args.doc, section, "Benchmarks")
        print(f"wrote {args.doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
