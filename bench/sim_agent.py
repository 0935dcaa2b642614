"""gpufleet-agent as its console script runs it, telling a benchmark how much CPU the simulator spent beyond
the real calls' cost.

    python -m bench.sim_agent --simulate hgx-h100 --simulate.nvml-costs [agent flags...]

With --simulate.nvml-costs every simulated NVML call costs at least what the real driver's call costs
(agent.sim.costs); where the simulator's own Python runs longer than that, the difference is the
simulator's bookkeeping, which no real node pays. Each line written to this process's stdin is answered
on stdout with one JSON object: `excess_s`, those seconds so far (every thread), and `burned_s`, the
real calls' cost burned so far. A benchmark reads the process's CPU from /proc and asks at both ends of
its window. The asking thread waits in a blocking read, so it costs nothing between questions.
"""

from __future__ import annotations

import ctypes
import re
import sys
import threading
from typing import Any

import orjson

from gpufleet.agent import cli
from gpufleet.agent.sim import costs


class _Kept(costs.CostedNvml):
    """CostedNvml, each instance kept so its counters can be read."""

    made: list[costs.CostedNvml] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _Kept.made.append(self)


def _answer() -> None:
    for _ in sys.stdin:
        made = list(_Kept.made)
        answer = {
            "excess_s": sum(c.excess for c in made),
            "burned_s": sum(sum(dict(c.burned).values()) for c in made),
            "costed": bool(made),
        }
        sys.stdout.buffer.write(orjson.dumps(answer) + b"\n")
        sys.stdout.flush()


def _named_threads() -> None:
    """Each thread's name (less the gpufleet- prefix) as its Linux name too, so /proc tells them apart."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    run = threading.Thread.run

    def named_run(self: threading.Thread) -> None:
        name = re.sub(r"^gpufleet-", "", self.name)
        prctl(15, name[:15].encode(), 0, 0, 0)  # PR_SET_NAME
        run(self)

    threading.Thread.run = named_run  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    _named_threads()
    # The agent imports CostedNvml from its module when it builds the simulator, so it builds this one.
    costs.CostedNvml = _Kept  # type: ignore[misc]
    threading.Thread(target=_answer, name="bench-sim-costs", daemon=True).start()
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
