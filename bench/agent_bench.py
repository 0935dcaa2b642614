"""Agent cost on one simulated 8-GPU HGX H100 node, the default agent at 1 Hz, NVML costing what it costs.

    python -m bench.agent_bench [--cycles 300] [--requests 2000] [--duration 60] [--runs 1] [--per-link]
                                [--free-nvml] [--process-only]

Every simulated NVML call burns the thread CPU the real call costs on an H100 with driver 580
(agent.sim.costs; --free-nvml turns that off), so the figures are what a real node pays.

The headline is the whole process: the real agent (`bench.sim_agent`, which is `gpufleet-agent
--simulate hgx-h100 --simulate.nvml-costs` plus a way to ask it what the simulator spent) runs for
--duration seconds while scraped every 15 s and pulled every 5 s; its utime + stime from /proc over
that window, less the simulator's own bookkeeping beyond the real calls' cost (measured inside the
process on every thread, not estimated), is `process_cpu_percent`. Each thread's share (from
/proc/PID/task/*/schedstat), RSS, and /metrics latency (600 scrapes 37 ms apart) come with it; --runs N
repeats it with a fresh agent and shows median [min - max] and every run.

Before that, in this process: CPU per sampling cycle split three ways (the agent's own code; the
simulated NVML cost burned; the simulator's own bookkeeping, timed through a wrapper around every
SimNvml call), the render a scrape pays once per snapshot, how old the readings in a snapshot are, and
/metrics and /snapshots latency over real HTTP on loopback, each gzipped scrape followed by one of the
floor, a bare one-thread Python server in a process of its own answering as many bytes, which shows what
the machine's load alone does to a Python server's latency (--process-only skips these).
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from gpufleet.agent.attribution import JobAttributor
from gpufleet.agent.exposition import render_age
from gpufleet.agent.nvml_reader import NvmlReader
from gpufleet.agent.sampler import Sampler
from gpufleet.agent.sim import SimNvml, load_scenario
from gpufleet.agent.sim.costs import CALL_COST_US, CostedNvml
from gpufleet.agent.store import SnapshotStore
from gpufleet.agent.tiers import DEFAULT_CPU_BUDGET, FAST_READINGS
from gpufleet.agent.webserver import AgentHttpServer

SCENARIO = "hgx-h100"
SCRAPE_EVERY_S = 15.0
PULL_EVERY_S = 5.0
TICKS = os.sysconf("SC_CLK_TCK")
LIVE_SCRAPES = 600
LIVE_SCRAPE_GAP_S = 0.037  # not a divisor of the 1 s interval, so scrapes walk across the cycle
GPUS = 8
# The agent on the H100 with no reads at all (nvmlprof.txt, h100-driver-580): the XID thread's event
# waits and the process's idle wakeups, which the in-process cycle timings do not see.
BACKGROUND_CPU_PERCENT = 0.100
STEADY_SCRAPES = 60
GZIP = {"Accept-Encoding": "gzip"}  # what Prometheus sends


class Clock:
    """Fake wall clock so a cycle costs only its CPU, not a real second."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


class TimedNvml:
    """Forwards to SimNvml, adding the sampler thread's CPU time spent inside each call to `spent`."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.spent = 0.0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if not callable(value) or not name.startswith("nvml") or isinstance(value, type):
            setattr(self, name, value)  # later lookups skip this method: its cost is not the agent's
            return value

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return value(*args, **kwargs)
            finally:
                if threading.current_thread() is threading.main_thread():
                    self.spent += time.thread_time() - start

        setattr(self, name, timed)
        return timed


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def reading_ages(snapshots: list[Any]) -> dict[str, float]:
    """The oldest detector reading and the oldest reading of any kind in these snapshots, in seconds."""
    fast = slow = 0.0
    for snap in snapshots:
        for gpu in snap.gpus:
            for reading, age in gpu.slow_readings_age_seconds.items():
                slow = max(slow, age)
                if reading in FAST_READINGS or reading == "sm_occupancy_ratio":
                    fast = max(fast, age)
    return {"max_age_detector_readings_s": fast, "max_age_any_reading_s": slow}


def bench_cycles(
    cycles: int, procfs: Path, per_link: bool, costed: bool
) -> tuple[dict[str, float], Sampler, SnapshotStore, Clock, str]:
    clock = Clock()
    scenario = load_scenario(SCENARIO)
    node = scenario.nodes[0]
    sim = SimNvml(scenario, node=node, clock=clock, epoch=clock.now - 300, block_on_events=True)
    sim.materialize_procfs(procfs)
    costs = CostedNvml(sim) if costed else None
    nvml = TimedNvml(costs or sim)
    store = SnapshotStore(300)
    # Probes time what the real calls cost, as the agent does on the costed simulator (agent.cli).
    cpu_clock_ns = costs.thread_time_ns if costs else time.thread_time_ns
    reader = NvmlReader(nvml, per_link_nvlink=per_link, interval_s=1.0, clock=clock, cpu_clock_ns=cpu_clock_ns)
    sampler = Sampler(reader, store, node=node, attributor=JobAttributor(procfs), clock=clock, monotonic=clock)
    for _ in range(5):  # open, probe, GPM warm-up
        sampler.run_once()
        clock.now += 1.0
    nvml.spent = 0.0
    burned_before = costs.burned_by_this_thread() if costs else 0.0
    totals, snapshots = [], []
    for _ in range(cycles):
        start = time.thread_time()
        snapshots.append(sampler.run_once())
        totals.append(time.thread_time() - start)
        clock.now += 1.0
    sim_share = nvml.spent / cycles
    burned = ((costs.burned_by_this_thread() if costs else 0.0) - burned_before) / cycles
    pub = store.latest()
    encodes, reads = [], []
    for _ in range(cycles):  # the snapshot JSON, made every cycle (the Prometheus text is not: see bench_http)
        start = time.thread_time()
        orjson.dumps(pub.snapshot.to_dict())
        encodes.append(time.thread_time() - start)
    nvml.spent = 0.0
    for _ in range(cycles):
        start = time.thread_time()
        reader.read()
        reads.append(time.thread_time() - start)
        clock.now += 1.0
    read_sim = nvml.spent / cycles
    mean = statistics.fmean(totals)
    plan = reader.plan
    slow = ", ".join(f"{k} {p}" if p else f"{k} from mask" for k, p in sorted(plan.periods.items()) if p != 1)
    return (
        {
            "cycle_total_ms": mean * 1e3,
            "cycle_nvml_cost_burned_ms": burned * 1e3,
            "cycle_simulator_bookkeeping_ms": (sim_share - burned) * 1e3,
            "cycle_agent_ms": (mean - sim_share) * 1e3,
            "of_which_reader_ms": (statistics.fmean(reads) - read_sim) * 1e3,
            "of_which_snapshot_json_ms": statistics.fmean(encodes) * 1e3,
            "tiers_nvml_cpu_percent_fitted": plan.cost_per_second * 100,
            **reading_ages(snapshots),
            "exposition_bytes": len(pub.metrics + render_age(clock.now, pub.snapshot, node)),
            "exposition_samples": sum(1 for line in pub.metrics.splitlines() if not line.startswith(b"#")) + 1,
            "snapshot_json_bytes": len(pub.snapshot_json or b""),
        },
        sampler,
        store,
        clock,
        slow,
    )


def bench_http(sampler: Sampler, store: SnapshotStore, clock: Clock, requests: int) -> dict[str, float]:
    server = AgentHttpServer(store, host="127.0.0.1", port=0, clock=clock)
    sampler._rendered_ahead = server.prepare  # as agent.cli wires them: a text rendered ahead is compressed ahead
    server.start()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    since = store.latest().snapshot.time - PULL_EVERY_S
    out: dict[str, float] = {}
    try:
        for name, path, headers in (
            ("metrics", "/metrics", {}),
            ("metrics_gzip", "/metrics", GZIP),
            ("pull", f"/snapshots?since={since}", {}),
        ):
            lat, floor_lat = [], []
            for _ in range(50):  # warm-up
                conn.request("GET", path, headers=headers)
                body = conn.getresponse().read()
            # Between gzipped scrapes, one of the floor (as on the live process): the machine's own tail.
            floor = _Floor(len(body)) if name == "metrics_gzip" else None
            process_cpu, client_cpu = time.process_time(), time.thread_time()
            for _ in range(requests):
                start = time.perf_counter()
                conn.request("GET", path, headers=headers)
                body = conn.getresponse().read()
                lat.append(time.perf_counter() - start)
                if floor is not None:
                    floor_lat.append(floor.scrape())
            # CPU the server threads spent (the whole process minus this client thread): immune to how
            # long the scheduler kept the server waiting for a core on a busy machine.
            server_cpu = (time.process_time() - process_cpu) - (time.thread_time() - client_cpu)
            out[f"{name}_server_cpu_ms"] = server_cpu / requests * 1e3
            out[f"{name}_p50_ms"] = pct(lat, 0.50) * 1e3
            out[f"{name}_p99_ms"] = pct(lat, 0.99) * 1e3
            out[f"{name}_bytes"] = len(body)
            if floor is not None:
                floor.close()
                out["metrics_gzip_floor_p50_ms"] = pct(floor_lat, 0.50) * 1e3
                out["metrics_gzip_floor_p99_ms"] = pct(floor_lat, 0.99) * 1e3
        # As Prometheus scrapes: every 15 s, 0.5 s after a sample, each scrape the first reader of its
        # snapshot. The sampler renders ahead once the period is known; a scrape that finds no text renders.
        steady, rendered, render_cpu = [], 0, []
        renderer = sampler._bodies._renderer
        render = renderer.render

        def timed_render(*args: Any) -> bytes:
            start = time.thread_time()
            try:
                return render(*args)
            finally:
                render_cpu.append(time.thread_time() - start)

        renderer.render = timed_render
        for _ in range(STEADY_SCRAPES):
            for _ in range(int(SCRAPE_EVERY_S)):
                sampler.run_once()
                clock.now += 1.0
            clock.now -= 0.5
            pub = store.latest()
            rendered += pub.rendered.rendered
            start = time.perf_counter()
            conn.request("GET", "/metrics", headers=GZIP)
            conn.getresponse().read()
            steady.append(time.perf_counter() - start)
            clock.now += 0.5
        out["metrics_15s_scraper_p50_ms"] = pct(steady, 0.50) * 1e3
        out["metrics_15s_scraper_p99_ms"] = pct(steady, 0.99) * 1e3
        out["metrics_15s_scraper_found_rendered"] = f"{rendered}/{STEADY_SCRAPES}"
        # Whoever renders (the sampler ahead of a scrape, or the scrape itself), one render per scrape.
        out["render_cpu_per_scrape_ms"] = sum(render_cpu) / STEADY_SCRAPES * 1e3
        conn.request("GET", "/snapshots")
        out["snapshots_full_bytes"] = len(conn.getresponse().read())
        out["http_load_average_1m"] = os.getloadavg()[0]
    finally:
        conn.close()
        server.close()
    return out


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def _nvml_seconds(port: int) -> float:
    """The agent's gpufleet_agent_nvml_seconds_total, summed over calls, from its /metrics."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        body = conn.getresponse().read().decode()
    finally:
        conn.close()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith("gpufleet_agent_nvml_seconds_total{")
    )


def _status(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024  # kB -> MiB
    return float("nan")


def _threads(pid: int) -> dict[str, float]:
    """Thread name -> CPU seconds (scheduler nanoseconds, exact where ticks are 10 ms), threads of one name summed."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = "main" if task.name == str(pid) else (task / "comm").read_text().strip()
            name = re.sub(r"^http-\d+$", "http-workers", name)
            ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended between listing and reading
        out[name] = out.get(name, 0.0) + ns / 1e9
    return out


class _SimCosts:
    """Asks bench.sim_agent, through its stdin, what the simulator spent beyond the real calls' cost."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self._proc = proc

    def ask(self) -> dict[str, float]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(b"?\n")
        self._proc.stdin.flush()
        return orjson.loads(self._proc.stdout.readline())


def bench_process(duration: float, per_link: bool, costed: bool) -> dict[str, float]:
    """The real agent process (simulated node) scraped every 15 s and pulled every 5 s, from /proc."""
    cmd = (
        [
            sys.executable,
            "-m",
            "bench.sim_agent",
            "--simulate",
            SCENARIO,
            "--web.listen-address",
            "127.0.0.1:0",
            "--log.level",
            "info",
        ]
        + (["--nvlink.per-link"] if per_link else [])
        + (["--simulate.nvml-costs"] if costed else [])
    )
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=root)
    sim = _SimCosts(proc)
    try:
        port = None
        for line in proc.stderr:  # type: ignore[union-attr]
            record = orjson.loads(line)
            if record.get("msg") == "agent started":
                port = int(record["port"])
                break
        assert port, "agent did not start"
        threading.Thread(target=lambda: proc.stderr.read(), daemon=True).start()  # type: ignore[union-attr]
        waiter = threading.Event()
        waiter.wait(5.0)  # let startup (imports, NVML probe, tier fitting) settle before the window opens
        start_nvml = _nvml_seconds(port)
        start_sim = sim.ask()
        start_cpu, start_threads, start = _cpu_seconds(proc.pid), _threads(proc.pid), time.monotonic()
        next_scrape = next_pull = start
        last_time = time.time() - PULL_EVERY_S
        scrapes: list[float] = []
        while (now := time.monotonic()) < start + duration:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            if now >= next_scrape:
                begin = time.perf_counter()
                conn.request("GET", "/metrics")
                conn.getresponse().read()
                scrapes.append(time.perf_counter() - begin)
                next_scrape += SCRAPE_EVERY_S
            if now >= next_pull:
                conn.request("GET", f"/snapshots?since={last_time}")
                snaps = orjson.loads(conn.getresponse().read())["snapshots"]
                last_time = snaps[-1]["time"] if snaps else last_time
                next_pull += PULL_EVERY_S
            conn.close()
            waiter.wait(max(0.0, min(next_scrape, next_pull) - time.monotonic()))
        cpu = _cpu_seconds(proc.pid) - start_cpu
        elapsed = time.monotonic() - start
        end_threads = _threads(proc.pid)
        end_sim = sim.ask()
        inside_nvml = _nvml_seconds(port) - start_nvml
        excess = end_sim["excess_s"] - start_sim["excess_s"]
        out = {
            # The headline: utime + stime of the whole process over the window, less the simulator's own
            # bookkeeping beyond the real calls' cost (measured in the process, every thread).
            "process_cpu_percent": 100 * (cpu - excess) / elapsed,
            "process_cpu_percent_simulator_included": 100 * cpu / elapsed,
            "simulator_bookkeeping_cpu_percent": 100 * excess / elapsed,
            "nvml_cost_burned_cpu_percent": 100 * (end_sim["burned_s"] - start_sim["burned_s"]) / elapsed,
            # The agent's own counter of CPU inside NVML calls (the burned cost and the simulator's bookkeeping
            # together here); the rest is the agent's code, its threads' wakeups and the interpreter.
            "process_outside_nvml_cpu_percent": 100 * (cpu - inside_nvml) / elapsed,
            "window_scrape_p50_ms": pct(scrapes, 0.50) * 1e3,
            "window_scrape_max_ms": max(scrapes) * 1e3,
            "process_rss_mib": _status(proc.pid, "VmRSS"),
            "process_peak_rss_mib": _status(proc.pid, "VmHWM"),
            "process_window_s": elapsed,
        }
        for name, seconds in sorted(end_threads.items()):
            spent = seconds - start_threads.get(name, 0.0)
            if spent > 0:
                out[f"thread_{name}_cpu_percent"] = 100 * spent / elapsed
        # Scrapes of the live agent, spread over many sampling cycles: a scrape that lands mid-cycle
        # waits for the GIL, which in-process loopback numbers do not show. Plain, then gzipped as
        # Prometheus asks (each scrape of a new text compresses it, unless the sampler did so ahead).
        # Halfway between gzipped scrapes, one of the floor: a bare one-thread Python server in a process of
        # its own answering the same number of bytes, so each run shows what this machine's load alone does
        # to a Python server's latency over the same seconds.
        floor = _Floor(len(_gzip_scrape(port)))
        try:
            for name, headers in (("live_metrics", {}), ("live_metrics_gzip", GZIP)):
                lat, floor_lat = [], []
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                for _ in range(LIVE_SCRAPES):
                    begin = time.perf_counter()
                    conn.request("GET", "/metrics", headers=headers)
                    conn.getresponse().read()
                    lat.append(time.perf_counter() - begin)
                    if headers:
                        waiter.wait(LIVE_SCRAPE_GAP_S / 2)
                        floor_lat.append(floor.scrape())
                        waiter.wait(LIVE_SCRAPE_GAP_S / 2)
                    else:
                        waiter.wait(LIVE_SCRAPE_GAP_S)
                conn.close()
                out[f"{name}_p50_ms"] = pct(lat, 0.50) * 1e3
                out[f"{name}_p99_ms"] = pct(lat, 0.99) * 1e3
                if floor_lat:
                    out["live_floor_p50_ms"] = pct(floor_lat, 0.50) * 1e3
                    out["live_floor_p99_ms"] = pct(floor_lat, 0.99) * 1e3
        finally:
            floor.close()
        # Tails follow the machine's load more than the agent's work: each run says what its load was.
        out["live_load_average_1m"] = os.getloadavg()[0]
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _gzip_scrape(port: int) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics", headers=GZIP)
        return conn.getresponse().read()
    finally:
        conn.close()


# The floor: answers every request on its one connection with a fixed 200 of argv[1] bytes.
_FLOOR_SERVER = """
import socket, sys
body = b"x" * int(sys.argv[1])
answer = b"HTTP/1.1 200 OK\\r\\nContent-Type: text/plain\\r\\nContent-Length: %d\\r\\n\\r\\n" % len(body) + body
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
sock, _ = listener.accept()
sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
data = b""
while chunk := sock.recv(65536):
    data += chunk
    while b"\\r\\n\\r\\n" in data:
        data = data.split(b"\\r\\n\\r\\n", 1)[1]
        sock.sendall(answer)
"""


class _Floor:
    """A bare Python HTTP responder in its own process, scraped as the agent is."""

    def __init__(self, size: int) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _FLOOR_SERVER, str(size)], stdout=subprocess.PIPE)
        assert self._proc.stdout is not None
        self._conn = http.client.HTTPConnection("127.0.0.1", int(self._proc.stdout.readline()), timeout=10)

    def scrape(self) -> float:
        begin = time.perf_counter()
        self._conn.request("GET", "/metrics", headers=GZIP)
        self._conn.getresponse().read()
        return time.perf_counter() - begin

    def close(self) -> None:
        self._conn.close()
        self._proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.agent_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of the subprocess run (0: skip)")
    parser.add_argument("--runs", type=int, default=1, help="subprocess runs, each a fresh agent (spread shown)")
    parser.add_argument(
        "--process-only", action="store_true", help="only the subprocess runs, not the in-process timings"
    )
    parser.add_argument(
        "--per-link",
        action="store_true",
        help="also export NVLink counters for each of the 18 links per GPU (off by default)",
    )
    parser.add_argument(
        "--free-nvml",
        dest="costed",
        action="store_false",
        help="simulated NVML calls cost only the simulator's Python, not the real driver's CPU",
    )
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    slow = ""
    if not args.process_only:
        results, slow = bench_in_process(args)
    runs = [
        bench_process(args.duration, args.per_link, args.costed) for _ in range(args.runs if args.duration > 0 else 0)
    ]
    if runs:
        results.update(runs[-1] if len(runs) == 1 else _spread(runs))
    sys.stdout.write(
        f"# {SCENARIO}, 8 GPUs, 1 Hz, per-link export {'on' if args.per_link else 'off'}, "
        f"NVML costs {'H100 driver 580' if args.costed else 'off (simulator only)'}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n"
    )
    if slow:
        sys.stdout.write(f"# slower tiers (period in cycles): {slow}\n")
    width = max(map(len, results), default=0)
    for key, value in results.items():
        shown = f"{value:,.3f}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else value
        sys.stdout.write(f"{key:<{width}}  {shown}\n")
    return 0


def _spread(runs: list[dict[str, float]]) -> dict[str, str]:
    """Each figure over several runs: median [min - max], and every run's value."""
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs if key in r]
        each = " ".join(f"{v:.3f}" for v in values)
        out[key] = f"{statistics.median(values):.3f} [{min(values):.3f} - {max(values):.3f}]  ({each})"
    return out


def bench_in_process(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The sampling cycle, render and HTTP timings in this process, and what they add up to."""
    procfs = Path(tempfile.mkdtemp(prefix="gpufleet-bench-proc-"))
    try:
        results, sampler, store, clock, slow = bench_cycles(args.cycles, procfs, args.per_link, args.costed)
        try:
            results.update(bench_http(sampler, store, clock, args.requests))
        finally:
            sampler.stop()
    finally:
        shutil.rmtree(procfs, ignore_errors=True)
    # What a real node pays per second, the simulator's bookkeeping taken out: a cycle (the agent's code
    # and the NVML cost), one render and one scrape every 15 s, one pull every 5 s (server-side CPU per
    # request), and the background measured on the H100.
    agent_ms = (
        results["cycle_agent_ms"]
        + (results["render_cpu_per_scrape_ms"] + results["metrics_server_cpu_ms"]) / SCRAPE_EVERY_S
        + results["pull_server_cpu_ms"] / PULL_EVERY_S
    )
    nvml_ms = results["cycle_nvml_cost_burned_ms"]
    background = BACKGROUND_CPU_PERCENT if args.costed else 0.0
    results["projected_agent_code_cpu_percent"] = agent_ms / 10
    results["projected_nvml_cpu_percent"] = nvml_ms / 10
    results["projected_background_cpu_percent"] = background
    results["projected_cpu_percent"] = (agent_ms + nvml_ms) / 10 + background
    # The same with the sampling budget spent to the full (where real costs differ from the simulated
    # ones, the tiers fit them to the budget): the agent's code, the budget, the attribution's process
    # query per GPU and the background.
    pids_ms = CALL_COST_US["nvmlDeviceGetComputeRunningProcesses"] / 1e3 * GPUS if args.costed else 0.0
    results["bound_with_budget_spent_cpu_percent"] = (agent_ms + pids_ms) / 10 + background + DEFAULT_CPU_BUDGET * 100
    results["simulator_bookkeeping_cpu_percent_apart"] = results["cycle_simulator_bookkeeping_ms"] / 10
    return results, slow or "none"


if __name__ == "__main__":
    sys.exit(main())
