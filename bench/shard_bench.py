"""Shards reading VictoriaMetrics: the CPU of one shard's cycle, and how shards' costs add up.

    python -m bench.shard_bench [--gpus 12500] [--counts 1,2,4] [--cycles 24]

A real VictoriaMetrics (bench/evaluation/victoria.py) is loaded with the history of a fleet of --gpus GPUs (8 a node,
128 a job, one node in 20 running no job) as the series gpufleet agents export, one scrape every 5 s:
60 s of history before the first cycle, and --cycles cycles after it. Then, for each COUNT and each shard of it, one
child process builds the server's own pipeline (serve.build_runtime: the Prometheus source asking only for
the shard's series, the shard filter, the engine, the alert store) and runs its cycles on a clock that
steps 5 s through that history: the first cycle reads the 60 s before it (the warm-up), the others what a live cycle
reads (15 s of range). Each cycle's CPU is the process's user+system time from /proc, split into the read
(query, decode, rebuild) and the rest (engine, view, store); VictoriaMetrics's own CPU over each child's
run comes from its /proc too. Everything is CPU time, not wall time: the machine is shared.

Prints one row per shard and a sum per COUNT, as Markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import orjson

from bench.evaluation import victoria

GPUS_PER_NODE = 8
NODES_PER_JOB = 16
JOBLESS_EVERY = 20  # one node in this many runs no job
INTERVAL_SECONDS = 5.0
# History before the first cycle: its read is the warm-up (the source asks for up to 300 s; a database
# holding less answers with what it has, and the warm-up's cost follows the history read).
WARMUP_SECONDS = 60.0
T0 = 1_764_000_000.0


def proc_cpu_seconds(pid: int | str = "self") -> float:
    """User+system CPU seconds of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fleet(gpus: int) -> list[tuple[str, str | None]]:
    """(node, its job or None) for a fleet of about `gpus` GPUs."""
    nodes = max(1, gpus // GPUS_PER_NODE)
    out = []
    for n in range(nodes):
        job = None if n % JOBLESS_EVERY == JOBLESS_EVERY - 1 else f"train-{n // NODES_PER_JOB:05d}"
        out.append((f"gpu-node-{n:06d}", job))
    return out


def snapshot(node: str, job: str | None, t: float) -> dict[str, Any]:
    """A healthy, busy 8-GPU node at sample time t."""
    k = int(t - T0)
    gpus = []
    for i in range(GPUS_PER_NODE):
        wobble = ((k // 5 + i * 7 + len(node)) % 11) / 1000.0
        gpus.append(
            {
                "index": i,
                "uuid": f"GPU-{node}-{i}",
                "model": "NVIDIA H100 80GB HBM3",
                "hpc_job": job,
                "up": True,
                "utilization_ratio": 0.97 - wobble,
                "sm_active_ratio": 0.78 - wobble,
                "temperature_celsius": 62.0 + wobble * 100,
                "memory_temperature_celsius": 70.0,
                "slowdown_temperature_celsius": 87.0,
                "memory_max_operating_temperature_celsius": 95.0,
                "power_watts": 610.0 - wobble * 1000,
                "power_limit_watts": 700.0,
                "energy_joules_total": 1e9 + 610.0 * k,
                "sm_clock_hertz": 1.98e9,
                "sm_clock_max_hertz": 1.98e9,
                "throttle_reasons": 0,
                "ecc_uncorrected_errors_total": 0,
                "remapped_rows_pending": False,
                "remapped_rows_failure": False,
            }
        )
    return {"schema": 1, "node": node, "time": t, "gpus": gpus}


def history_lines(nodes: list[tuple[str, str | None]], scrapes: int) -> Iterator[str]:
    """Every scrape of every node, as timestamped exposition lines (a node's scrapes spread over the interval)."""
    for s in range(scrapes):
        for n, (node, job) in enumerate(nodes):
            at = T0 + s * INTERVAL_SECONDS + (n % 50) * INTERVAL_SECONDS / 50
            yield from victoria.exposition_lines(snapshot(node, job, at))


class _Timed:
    """A sample source that keeps the CPU its pulls took and the GPUs they read."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.cpu_seconds = 0.0
        self.gpus_read = 0
        self.failed = 0

    async def pull_once(self) -> Any:
        before = proc_cpu_seconds()
        result = await self.inner.pull_once()
        self.cpu_seconds += proc_cpu_seconds() - before
        self.gpus_read += sum(len(s) for s in result.samples)
        self.failed += result.failed_targets
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def run_shard(url: str, shard: str, cycles: int) -> dict[str, Any]:
    """The server's pipeline for one shard over the loaded history (in this process); its CPU per cycle."""
    from gpufleet.server.serve import build_runtime
    from gpufleet.server.settings import load_settings

    now = [T0 + WARMUP_SECONDS]
    with tempfile.TemporaryDirectory() as folder:
        settings = load_settings(
            [
                "--ingest.prometheus-url",
                url,
                "--shard",
                shard,
                "--pull.interval",
                "5s",
                "--storage.path",
                f"{folder}/s.db",
            ],
            env={},
        )
        # A query's wall time on this shared machine says more about its load than about the database's
        # (a 12,500-GPU answer took 15 s at load 15): with the live 4 s timeout a slow answer is a lost
        # cycle, and the CPU measured that of a cycle that read nothing. The cycle's CPU is what is measured.
        settings = dataclasses.replace(settings, pull_timeout_seconds=600.0)
        runtime = build_runtime(settings, clock=lambda: now[0])
        source = runtime.source
        read = _Timed(getattr(source, "inner", source))
        if hasattr(source, "inner"):
            source.inner = read
        else:
            runtime.source = read  # type: ignore[assignment]

        async def run() -> list[dict[str, float]]:
            out = []
            for _ in range(cycles + 1):
                read.cpu_seconds, read.gpus_read = 0.0, 0
                before = proc_cpu_seconds()
                await runtime.cycle()
                total = proc_cpu_seconds() - before
                out.append({"cpu": total, "read": read.cpu_seconds, "gpus_read": read.gpus_read})
                now[0] += INTERVAL_SECONDS
            return out

        per_cycle = asyncio.run(run())
        stats = runtime.engine.stats().to_dict()
        runtime.store.close()
    steady = per_cycle[1:]
    return {
        "shard": shard,
        "gpus_owned": stats["gpus"],
        "jobs_owned": stats["jobs"],
        "firing_alerts": stats["firing_alerts"],
        "warmup_cpu_s": per_cycle[0]["cpu"],
        "cycle_cpu_s": statistics.median(c["cpu"] for c in steady),
        "cycle_cpu_max_s": max(c["cpu"] for c in steady),
        "read_cpu_s": statistics.median(c["read"] for c in steady),
        "gpu_samples_read_per_cycle": statistics.median(c["gpus_read"] for c in steady),
        "failed_reads": read.failed,
        "engine": stats,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=12_500)
    parser.add_argument("--counts", default="1,2,4")
    parser.add_argument("--cycles", type=int, default=24)
    parser.add_argument("--run-shard", nargs=3, metavar=("URL", "SHARD", "CYCLES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_shard:
        url, shard, cycles = args.run_shard
        print(orjson.dumps(run_shard(url, shard, int(cycles)), default=str).decode())
        return 0
    if victoria.BINARY is None:
        print(victoria.WHY_MISSING, file=sys.stderr)
        return 2
    nodes = fleet(args.gpus)
    scrapes = int(WARMUP_SECONDS / INTERVAL_SECONDS) + args.cycles + 2
    with victoria.victoria_process() as (vm, url):
        vm_pid = vm.pid
        before = proc_cpu_seconds()
        sent = victoria.import_lines(url, history_lines(nodes, scrapes))
        print(
            f"loaded {len(nodes) * GPUS_PER_NODE} GPUs x {scrapes} scrapes: {sent:,} samples "
            f"({proc_cpu_seconds() - before:.0f} s CPU to generate); load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        print(
            "| shards | shard | GPUs owned | GPU samples read / cycle | warm-up cycle CPU s | cycle CPU s (median / max) | of which read | VictoriaMetrics CPU s / cycle | failed reads |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for count in (int(c) for c in args.counts.split(",")):
            rows = []
            for index in range(count):
                vm_before = proc_cpu_seconds(vm_pid)
                done = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "bench.shard_bench",
                        "--run-shard",
                        url,
                        f"{index}/{count}",
                        str(args.cycles),
                    ],
                    capture_output=True,
                    check=True,
                )
                row = orjson.loads(done.stdout.splitlines()[-1])
                row["vm_cpu_per_cycle_s"] = (proc_cpu_seconds(vm_pid) - vm_before) / (args.cycles + 1)
                rows.append(row)
                print(_row(count, row), flush=True)
            total = {
                "gpus_owned": sum(r["gpus_owned"] or 0 for r in rows),
                "gpu_samples_read_per_cycle": sum(r["gpu_samples_read_per_cycle"] for r in rows),
                "warmup_cpu_s": sum(r["warmup_cpu_s"] for r in rows),
                "cycle_cpu_s": sum(r["cycle_cpu_s"] for r in rows),
                "cycle_cpu_max_s": sum(r["cycle_cpu_max_s"] for r in rows),
                "read_cpu_s": sum(r["read_cpu_s"] for r in rows),
                "vm_cpu_per_cycle_s": sum(r["vm_cpu_per_cycle_s"] for r in rows),
                "failed_reads": sum(r["failed_reads"] for r in rows),
                "shard": "sum",
            }
            print(_row(count, total), flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


def _row(count: int, r: dict[str, Any]) -> str:
    return (
        f"| {count} | {r['shard']} | {r['gpus_owned']:,} | {r['gpu_samples_read_per_cycle']:,.0f} | {r['warmup_cpu_s']:.2f} "
        f"| {r['cycle_cpu_s']:.3f} / {r['cycle_cpu_max_s']:.3f} | {r['read_cpu_s']:.3f} | {r['vm_cpu_per_cycle_s']:.3f} | {r['failed_reads']} |"
    )


if __name__ == "__main__":
    sys.exit(main())
