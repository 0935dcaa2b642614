"""Every alert the engine fires over a fixed set of traces, written down so that a change to the engine can
be shown to leave them unchanged (or to say exactly which moved).

The traces: each scenario of bench/evaluation/scenarios.py on the tuning seeds (0 .. --seeds - 1), attributed and
unattributed, and the real H100 trace of tests/fixtures/h100-driver-580. `python -m bench.evaluation.alert_digest
--write FILE` records; `--compare FILE` replays the same traces and prints each alert that appeared,
vanished or changed (exit 1 when any did).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable

from bench.evaluation import scenarios
from bench.evaluation.tracegen import generate, without_fields

H100_TRACE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "h100-driver-580" / "trace.jsonl.gz"


def _alerts(lines: Iterable[Any], config: dict[str, Any] | None) -> list[dict[str, Any]]:
    from gpufleet.server.replay import run_replay

    out = []
    for a in run_replay(lines, config):
        d = a.to_dict()
        out.append(
            {
                k: d.get(k)
                for k in (
                    "fingerprint",
                    "kind",
                    "severity",
                    "state",
                    "node",
                    "gpu",
                    "hpc_job",
                    "pending_since",
                    "started",
                    "resolved",
                    "summary",
                    "evidence",
                )
            }
        )
    return out


def digest(names: list[str], seeds: int, config: dict[str, Any] | None = None, noise_scale: float = 1.0) -> dict:
    """trace name -> its alerts, as plain JSON."""
    result: dict[str, Any] = {}
    for name in names:
        for seed in range(seeds):
            spec = replace(scenarios.BY_NAME[name].build(seed), noise_scale=noise_scale)
            trace = generate(spec)
            result[f"{name}/{seed}"] = _alerts(trace.lines, config)
            result[f"{name}/{seed}/unattributed"] = _alerts(without_fields(list(trace.lines), ("hpc_job",)), config)
    with gzip.open(H100_TRACE, "rt") as f:
        result["h100-driver-580"] = _alerts(f.read().splitlines(), config)
    return json.loads(json.dumps(result))


def compare(before: dict, after: dict) -> list[str]:
    """One line per alert that differs between two digests."""
    lines = []
    for trace in sorted(set(before) | set(after)):
        old = {a["fingerprint"] + "@" + str(a["pending_since"]): a for a in before.get(trace, [])}
        new = {a["fingerprint"] + "@" + str(a["pending_since"]): a for a in after.get(trace, [])}
        for key in sorted(set(old) | set(new)):
            if key not in new:
                lines.append(
                    f"{trace}: gone   {old[key]['kind']} {old[key]['node']} gpu {old[key]['gpu']} at {old[key]['pending_since']}"
                )
            elif key not in old:
                lines.append(
                    f"{trace}: new    {new[key]['kind']} {new[key]['node']} gpu {new[key]['gpu']} at {new[key]['pending_since']}"
                )
            elif old[key] != new[key]:
                diff = sorted(k for k in old[key] if old[key][k] != new[key].get(k))
                lines.append(
                    f"{trace}: moved  {new[key]['kind']} {new[key]['node']} gpu {new[key]['gpu']}: {', '.join(diff)}"
                )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path, help="record the digest here")
    mode.add_argument("--compare", type=Path, help="compare against a recorded digest")
    ap.add_argument("--seeds", type=int, default=2, help="tuning seeds per scenario (default 2)")
    ap.add_argument("--scenarios", default="", help="comma-separated scenario names (default: all)")
    ap.add_argument("--noise-scale", type=float, default=1.0, help="generator noise multiplier (default 1)")
    args = ap.parse_args(argv)
    names = [n for n in args.scenarios.split(",") if n] or [s.name for s in scenarios.CATALOG]
    unknown = [n for n in names if n not in scenarios.BY_NAME]
    if unknown:
        ap.error(f"unknown scenarios: {', '.join(unknown)}")
    now = digest(names, args.seeds, noise_scale=args.noise_scale)
    if args.write:
        args.write.write_text(json.dumps(now, sort_keys=True))
        print(f"{sum(len(v) for v in now.values())} alerts over {len(now)} traces written to {args.write}")
        return 0
    before = json.loads(args.compare.read_text())
    before = {k: v for k, v in before.items() if k in now}
    diffs = compare(before, now)
    print(
        "\n".join(diffs) if diffs else f"unchanged: {sum(len(v) for v in now.values())} alerts over {len(now)} traces"
    )
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
