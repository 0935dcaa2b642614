"""Run another program on simulated GPUs: python -m gpufleet.agent.sim.run SCENARIO -- CMD [ARG...]

CMD starts with a generated `pynvml` module first on PYTHONPATH that loads nvidia-ml-py and installs
the simulator into it (gpufleet.agent.sim.dropin), so any Python tool built on nvidia-ml-py (nvitop,
gpustat, nvitop-exporter, a training script's own NVML calls) sees the scenario's node, unmodified.
CMD must run on a Python where gpufleet[agent] is installed; its exit code is this command's.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from gpufleet.agent.sim.dropin import ENV_EPOCH, ENV_NODE, ENV_SCENARIO, ENV_SEED, SHIM_SOURCE

PROG = "gpufleet-sim-run"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [--node NODE] [--seed N] [--epoch UNIX_SECONDS] SCENARIO -- CMD [ARG...]",
        description="Run a program with the NVML simulator installed as pynvml.",
        epilog="example: gpufleet-sim-run hgx-h100 -- nvitop --once",
    )
    parser.add_argument("scenario", help="built-in scenario name or a YAML/JSON scenario file")
    parser.add_argument("--node", help="node of the scenario to simulate (default: its first)")
    parser.add_argument("--seed", type=int, default=0, help="simulator seed (default 0)")
    parser.add_argument(
        "--epoch",
        type=float,
        help="scenario time zero, unix seconds (default: now; every process CMD starts shares it)",
    )
    return parser


def prepare(
    scenario: str, node: str | None, seed: int, epoch: float, shim_dir: Path, environ: dict[str, str]
) -> dict[str, str]:
    """Write the shim into shim_dir and return the environment CMD runs with."""
    (shim_dir / "pynvml.py").write_text(SHIM_SOURCE)
    env = dict(environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim_dir), environ.get("PYTHONPATH", "")) if p)
    env[ENV_SCENARIO] = scenario
    env[ENV_SEED] = str(seed)
    env[ENV_EPOCH] = repr(epoch)
    if node:
        env[ENV_NODE] = node
    else:
        env.pop(ENV_NODE, None)
    return env


def main(argv: Sequence[str] | None = None) -> int:
    from gpufleet.agent.sim import ScenarioError, load_scenario

    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = _parser().parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command:
        sys.stderr.write(f"{PROG}: error: no command to run (SCENARIO -- CMD [ARG...])\n")
        return 2
    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as exc:
        sys.stderr.write(f"{PROG}: error: scenario: {exc}\n")
        return 2
    if args.node and args.node not in scenario.nodes:
        sys.stderr.write(
            f"{PROG}: error: --node: {args.node!r} is not a node of scenario {args.scenario!r} "
            f"(nodes: {', '.join(scenario.nodes)})\n"
        )
        return 2
    # A scenario file is read again by each process CMD starts, from any working directory.
    source = str(Path(args.scenario).resolve()) if Path(args.scenario).is_file() else args.scenario
    epoch = time.time() if args.epoch is None else args.epoch
    with tempfile.TemporaryDirectory(prefix="gpufleet-sim-pynvml-") as shim_dir:
        env = prepare(source, args.node, args.seed, epoch, Path(shim_dir), dict(os.environ))
        try:
            child = subprocess.Popen(command, env=env)
        except OSError as exc:
            sys.stderr.write(f"{PROG}: error: cannot run {command[0]!r}: {exc.strerror or exc}\n")
            return 127
        previous = signal.signal(signal.SIGTERM, lambda *_: child.terminate())
        try:
            while True:
                try:
                    return child.wait()
                except KeyboardInterrupt:  # the child got the same SIGINT from the terminal
                    continue
        finally:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
