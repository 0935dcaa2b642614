"""The shards' alerts together are one unsharded server's, over the scenario suite replayed from a database.

Each scenario's trace (tracegen, seed by seed) is loaded into a real VictoriaMetrics as the series gpufleet
agents export, stamped at their sample times (bench/evaluation/victoria.py); then `replay --prometheus-url` runs over
the whole range once unsharded and once per shard of COUNT (server/replay_db.py). An alert is its kind and
subject (kind, node, GPU, job); two alerts agree when those are equal and their start times lie within one
engine cycle. The union is a set, as Alertmanager sees it (the shards' alerts carry no shard label, so two
shards' alerts of one kind and subject are one alert there): every unsharded alert must have a twin among
the shards' and every shard's alert a twin among the unsharded. An alert raised by two shards is listed
apart; it is right only about a whole node whose GPUs two shards own (each raises `node_unreachable` for
its part), never about one GPU or one job, which belong to one shard each.

Each count runs in every mode of reading GPUs of no job asked for (`--shard.jobless`, server/shard.py): `node`,
where a shard infers jobs among its own nodes' job-less GPUs only, and `fleet`, where every shard infers among
all of them and prints only its own part (server/published.py).

    python -m bench.evaluation.shard_union [--counts 2,4] [--jobless node,fleet] [--seeds 1] [--scenarios a,b]

prints one row per scenario, mode and count, and a total line per mode; exit 1 when any scenario's union differs.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

import orjson

from bench.evaluation import victoria
from bench.evaluation import scenarios
from bench.evaluation.tracegen import generate
from gpufleet.server.alerts import Alert
from gpufleet.server.engine import EngineConfig
from gpufleet.server.replay import run_samples
from gpufleet.server.replay_db import read_history
from gpufleet.server.published import published_alerts
from gpufleet.server.shard import JOBLESS_MODES, Shard

Key = tuple[str, str | None, int | None, str | None]


def key(alert: Alert) -> Key:
    return alert.kind.value, alert.node, alert.gpu, alert.hpc_job


@dataclass
class Union:
    """One scenario replayed whole and in COUNT shards from one database."""

    scenario: str
    count: int
    whole: list[Alert]
    shards: list[list[Alert]]
    tick_seconds: float
    jobless: str = "node"
    unmatched_whole: list[Key] = field(default_factory=list)  # unsharded alerts no shard raised
    unmatched_shards: list[Key] = field(default_factory=list)  # shard alerts the unsharded server did not raise
    twice: list[Key] = field(default_factory=list)  # alerts raised by more than one shard
    misowned: list[Key] = field(default_factory=list)  # of those, about one GPU or one job

    def __post_init__(self) -> None:
        union = [a for part in self.shards for a in part]
        self.unmatched_whole = [key(a) for a in self.whole if not _twin(a, union, self.tick_seconds)]
        self.unmatched_shards = [key(a) for a in union if not _twin(a, self.whole, self.tick_seconds)]
        raised = Counter(k for part in self.shards for k in {key(a) for a in part})
        self.twice = sorted((k for k, n in raised.items() if n > 1), key=str)
        self.misowned = [k for k in self.twice if k[1] is None or k[2] is not None]

    @property
    def equal(self) -> bool:
        return not self.unmatched_whole and not self.unmatched_shards and not self.misowned


def _twin(alert: Alert, others: Iterable[Alert], tick_seconds: float) -> bool:
    return any(
        key(o) == key(alert) and abs((o.started or 0.0) - (alert.started or 0.0)) <= tick_seconds for o in others
    )


def replay(url: str, start: float, end: float, shard: Shard, config: EngineConfig) -> list[Alert]:
    """replay --prometheus-url over (start, end] for one shard, in process: what the shard prints."""
    history = asyncio.run(read_history(url, start, end, shard=shard))
    alerts = run_samples(sorted(history.samples, key=lambda s: (s.time, s.node)), config, history.handovers)
    return published_alerts(alerts, shard, history.parts) if shard.reads_every_jobless else alerts


def compare(
    url: str, start: float, end: float, counts: Iterable[int], scenario: str = "", jobless: Iterable[str] = ("node",)
) -> list[Union]:
    """The unsharded replay of the database's range against its replay in each mode and count of shards."""
    config = EngineConfig()
    whole = replay(url, start, end, Shard(), config)
    return [
        Union(
            scenario,
            n,
            whole,
            [replay(url, start, end, Shard(i, n, mode), config) for i in range(n)],
            config.tick_seconds,
            mode,
        )
        for mode in jobless
        for n in counts
    ]


def load_scenario(url: str, name: str, seed: int) -> tuple[float, float]:
    """The scenario's trace into the database; the range (start, end] that holds it."""
    trace = generate(scenarios.BY_NAME[name].build(seed))
    times = [orjson.loads(line)["time"] for line in trace.lines]
    victoria.import_trace(url, trace.lines)
    return min(times) - 1.0, max(times)


def run(names: list[str], seeds: range, counts: list[int], jobless: Iterable[str] = ("node",)) -> list[Union]:
    """Every (scenario, seed) in a fresh database of its own, compared in each mode at each count."""
    out = []
    for name in names:
        for seed in seeds:
            with victoria.victoria_metrics() as url:
                start, end = load_scenario(url, name, seed)
                for result in compare(url, start, end, counts, f"{name}/{seed}", jobless):
                    out.append(result)
                    print(_row(result), flush=True)
    return out


def _row(u: Union) -> str:
    union = sum(len(p) for p in u.shards)
    verdict = (
        "equal"
        if u.equal
        else f"DIFFERS: only unsharded {u.unmatched_whole}, only shards {u.unmatched_shards}, "
        f"one GPU's or job's by 2+ shards {u.misowned}"
    )
    twice = f"; raised by 2+ shards: {u.twice}" if u.twice else ""
    return f"{u.scenario:36s} jobless={u.jobless:5s} shards={u.count} unsharded={len(u.whole):3d} union={union:3d} {verdict}{twice}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="2,4", help="shard counts, comma-separated")
    parser.add_argument(
        "--jobless", default="node,fleet", help="modes of reading GPUs of no job (--shard.jobless), comma-separated"
    )
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--scenarios", default="", help="names, comma-separated (default: the whole catalog)")
    args = parser.parse_args(argv)
    if victoria.BINARY is None:
        print(victoria.WHY_MISSING, file=sys.stderr)
        return 2
    names = [n for n in args.scenarios.split(",") if n] or [s.name for s in scenarios.CATALOG]
    modes = [m for m in args.jobless.split(",") if m]
    unknown = [m for m in modes if m not in JOBLESS_MODES]
    if unknown or not modes:
        print(
            f"--jobless takes {' and/or '.join(JOBLESS_MODES)}, comma-separated, not {args.jobless!r}", file=sys.stderr
        )
        return 2
    results = run(names, range(args.seeds), [int(c) for c in args.counts.split(",")], modes)
    for mode in modes:
        mine = [u for u in results if u.jobless == mode]
        equal = sum(u.equal for u in mine)
        alerts = sum(len(u.whole) for u in mine)
        print(
            f"total, jobless={mode}: {equal}/{len(mine)} (scenario, count) pairs equal; "
            f"{alerts} unsharded alerts compared"
        )
    return 0 if all(u.equal for u in results) else 1


if __name__ == "__main__":
    sys.exit(main())
