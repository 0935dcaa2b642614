"""Where the agent's CPU goes on real NVML: every NVML call timed (wall and CPU of the calling thread),
the reader's read() per cycle, the XID thread's share, attribution's compute-process listing
(bench/hardware_check.sh). SIM=hgx-h100 uses the simulator instead (to check this script); CYCLES sets
the number of 1 s cycles (default 40)."""

from __future__ import annotations

import collections
import os
import sys
import time

from gpufleet.agent.nvml_reader import NvmlReader

CYCLES = int(os.environ.get("CYCLES", "40"))


class Timed:
    def __init__(self, module):
        self._m = module
        self.t = collections.defaultdict(lambda: [0, 0.0, 0.0])

    def __getattr__(self, name):
        v = getattr(self._m, name)
        if callable(v) and name.startswith("nvml"):

            def w(*a, **k):
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return v(*a, **k)
                finally:
                    e = self.t[name]
                    e[0] += 1
                    e[1] += time.perf_counter() - t0
                    e[2] += time.thread_time() - c0

            return w
        return v


def proc_cpu() -> float:
    t = os.times()
    return t.user + t.system


def main() -> None:
    if os.environ.get("SIM"):
        from gpufleet.agent.sim import SimNvml, load_scenario

        sc = load_scenario(os.environ["SIM"])
        base = SimNvml(sc, node=sc.nodes[0], clock=time.time, block_on_events=True)
    else:
        import pynvml as base
    nv = Timed(base)
    reader = NvmlReader(nv)
    t0, c0 = time.perf_counter(), proc_cpu()
    reader.open()
    print(f"open: {1e3 * (time.perf_counter() - t0):.1f} ms wall, {1e3 * (proc_cpu() - c0):.1f} ms CPU")
    nv.t.clear()
    # background only (XID watcher): 10 s with no reads
    c0, t0 = proc_cpu(), time.perf_counter()
    time.sleep(10)
    bg = (proc_cpu() - c0) / (time.perf_counter() - t0)
    print(f"background (XID watcher etc.) with no reads: {100 * bg:.3f} % of a core")
    bg_calls = {k: v[0] for k, v in nv.t.items()}
    nv.t.clear()
    walls, cpus = [], []
    pc0, pt0 = proc_cpu(), time.perf_counter()
    for _ in range(CYCLES):
        s, c = time.perf_counter(), time.thread_time()
        samples = reader.read()
        for g in samples:
            reader.compute_pids(g.index)
        walls.append(time.perf_counter() - s)
        cpus.append(time.thread_time() - c)
        time.sleep(max(0.0, 1.0 - (time.perf_counter() - s)))
    proc_pct = 100 * (proc_cpu() - pc0) / (time.perf_counter() - pt0)
    n = len(samples)
    walls.sort()
    cpus.sort()
    print(
        f"{n} GPU(s); per cycle (read + compute_pids per GPU): wall median {1e3 * walls[len(walls) // 2]:.2f} ms, "
        f"thread CPU median {1e3 * cpus[len(cpus) // 2]:.2f} ms; whole process {proc_pct:.3f} % of a core at 1 Hz "
        f"(background alone {100 * bg:.3f} %)"
    )
    print("NVML calls during the cycles (calls per cycle, wall us/call, thread-CPU us/call, CPU ms per cycle), by CPU:")
    rows = sorted(nv.t.items(), key=lambda kv: -kv[1][2])
    tot = 0.0
    for name, (calls, wall, cpu) in rows:
        tot += cpu
        print(
            f"  {name:48s} {calls / CYCLES:6.1f} {1e6 * wall / calls:9.1f} {1e6 * cpu / calls:9.1f} {1e3 * cpu / CYCLES:8.3f}"
            + ("  (XID thread too)" if name in bg_calls else "")
        )
    print(f"  NVML thread-CPU total per cycle: {1e3 * tot / CYCLES:.3f} ms")
    reader.close()


if __name__ == "__main__":
    sys.exit(main())
