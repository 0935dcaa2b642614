"""gpufleet-agent: wires config, NVML (real or simulated), sampler, store, recorder and HTTP together."""

from __future__ import annotations

import gc
import logging
import os
import shutil
import select
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import orjson

from gpufleet.agent import __version__
from gpufleet.agent.attribution import BackgroundAttributor, InnerAttributor, JobAttributor
from gpufleet.agent.tiers import DEFAULT_CPU_BUDGET
from gpufleet.agent.config import PROG, AgentConfig, ConfigError, default_node, load_config
from gpufleet.agent.dcgm_names import CountersError, DcgmFamilies, load_counters, unservable
from gpufleet.agent.exposition import FamiliesFn
from gpufleet.extras import AGENT_MODULES, missing_extra
from gpufleet.logs import configure_logging
from gpufleet.agent.podresources import DEFAULT_SOCKET, kubelet_attributor
from gpufleet.agent.processes import ProcessTable
from gpufleet.agent.record import Recorder
from gpufleet.agent.store import SnapshotStore
from gpufleet.webconfig import WebConfig, WebConfigError, load_web_config
from gpufleet.agent.webserver import AgentHttpServer

if TYPE_CHECKING:
    from gpufleet.agent.nvml_reader import NvmlReader
    from gpufleet.agent.sampler import Sampler, StopSignal

# The NVML reader and the sampler import nvidia-ml-py: they load inside the functions, after main() has
# checked that the agent extra is installed, so that its absence is one line and not a traceback.

log = logging.getLogger(__name__)

# A scrape that arrives while another thread runs Python waits for the GIL at each hand-off (its wakeup,
# its read of the request): this long at most each, rather than Python's 5 ms.
SWITCH_INTERVAL_SECONDS = 0.0001
# SIGTERM ends the agent within this however its threads are blocked (an NVML call hung in the driver, a
# write to a hung file, a client that does not read): what has not stopped by then is left to exit with it.
SHUTDOWN_SECONDS = 5.0


class SettableClock:
    """Wall clock for --once on the simulator: starts at now and moves only when told."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move forward without sleeping."""
        self.now += seconds


@dataclass
class Runtime:
    """What main() built from the config; `cleanup` runs at exit."""

    node: str
    reader: NvmlReader
    attributor: InnerAttributor
    clock: Callable[[], float]
    wait: Callable[[float], None]
    cleanup: list[Callable[[], None]] = field(default_factory=list)
    web: WebConfig | None = None
    families: FamiliesFn | None = None  # what /metrics names the readings; None: gpufleet's names
    processes: ProcessTable | None = None  # per-process GPU memory; None: off


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the gpufleet-agent console script; returns the exit code."""
    missing = missing_extra("agent", AGENT_MODULES)
    if missing:
        # Even --help: every path of the agent, the simulator included, runs on nvidia-ml-py.
        sys.stderr.write(f"{PROG}: error: {missing}\n")
        return 2
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(args, scenarios=_builtin_scenarios() if {"-h", "--help"} & set(args) else ())
        if config.print_scenario:
            return print_scenario(config)
        configure_logging(config.log_level, config.log_format)
        runtime = build_runtime(config)
    except ConfigError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return 2
    except SystemExit as exc:  # --help and --version print and exit through argparse
        return int(exc.code or 0)
    try:
        return run_once(config, runtime) if config.once else serve(config, runtime)
    finally:
        for step in reversed(runtime.cleanup):
            step()


def _builtin_scenarios() -> tuple[str, ...]:
    from gpufleet.agent.sim.scenario import BUILTIN_SCENARIOS

    return BUILTIN_SCENARIOS


def print_scenario(config: AgentConfig) -> int:
    """--print-scenario: the scenario's nodes, jobs and incident timetable as one JSON document on stdout.

    How the demo (in the server, which never imports the agent) learns what will happen when.
    """
    from gpufleet.agent.sim import ScenarioError, load_scenario
    from gpufleet.agent.sim.scenario import timetable

    assert config.simulate is not None, "load_config refuses --print-scenario without --simulate"
    try:
        scenario = load_scenario(config.simulate)
    except ScenarioError as exc:
        raise ConfigError(f"--simulate: {exc}") from None
    sys.stdout.buffer.write(orjson.dumps(timetable(scenario)) + b"\n")
    sys.stdout.flush()
    return 0


def build_runtime(config: AgentConfig) -> Runtime:
    """The NVML object (pynvml or the simulator), the reader around it, job attribution and the web config."""
    from gpufleet.agent.nvml_reader import NvmlReader

    web = None
    if config.web_config_file and not config.once:
        # Read before NVML comes up: a broken file is a one-line error, not a half-started agent.
        try:
            web = load_web_config(config.web_config_file)
        except WebConfigError as exc:
            raise ConfigError(f"--web.config.file: {exc}") from None
    families = _dcgm_families(config) if config.metrics_names == "dcgm" else None
    procfs = config.procfs
    cleanup: list[Callable[[], None]] = []
    if config.simulate:
        nvml, node, clock = _simulator(config, config.simulate)
        if not config.hpc_job_mapping_dir:
            # The simulator writes a fake procfs so attribution runs exactly the code it runs on a real node.
            root = Path(tempfile.mkdtemp(prefix="gpufleet-sim-proc-"))
            cleanup.append(lambda: shutil.rmtree(root, ignore_errors=True))
            nvml.materialize_procfs(root)
            procfs = str(root)
        wait = clock.advance if isinstance(clock, SettableClock) else _sleep
    else:
        nvml, node, clock, wait = _pynvml(), config.node or default_node(), time.time, _sleep
    reader = NvmlReader(
        nvml,
        per_link_nvlink=config.nvlink_per_link,
        cpu_budget=_cpu_budget(config),
        interval_s=config.sample_interval,
        clock=clock,
        # A costed simulator's probes time what the real calls cost, not its own Python on top.
        cpu_clock_ns=nvml.thread_time_ns if config.simulate and config.simulate_nvml_costs else time.thread_time_ns,
    )
    procfs_attributor = JobAttributor(
        procfs,
        config.hpc_job_mapping_dir,
        env_vars=config.hpc_job_env_vars,
        rendezvous=config.hpc_job_rendezvous,
        node=node,
    )
    attributor: InnerAttributor = procfs_attributor
    socket = config.pod_resources_socket or (None if config.simulate else DEFAULT_SOCKET)
    if socket and not config.hpc_job_mapping_dir:
        kubelet = kubelet_attributor(
            socket,
            procfs_attributor,
            node=node,
            pod_labels=config.pod_labels,
            refresh_s=config.pod_resources_refresh,
            environ=os.environ,
        )
        cleanup.append(kubelet.close)
        attributor = kubelet
    processes = None
    if config.processes_per_gpu:
        processes = ProcessTable(procfs, per_gpu=config.processes_per_gpu, per_node=config.processes_per_node)
    return Runtime(
        node=node,
        reader=reader,
        attributor=attributor,
        clock=clock,
        wait=wait,
        cleanup=cleanup,
        web=web,
        families=families,
        processes=processes,
    )


def _dcgm_families(config: AgentConfig) -> FamiliesFn:
    """--metrics.names dcgm: the counters file read at start (a bad one is a one-line error), and the fields
    it lists that this agent serves no series for named once."""
    try:
        counters = load_counters(config.dcgm_counters)
    except CountersError as exc:
        raise ConfigError(f"--metrics.dcgm-counters: {exc}") from None
    missing = unservable(counters)
    if missing:
        log.info(
            "dcgm counters this agent does not serve: no series for them (docs/agent.md)",
            extra={"counters": list(missing), "file": config.dcgm_counters or "default"},
        )
    return DcgmFamilies(counters)


def _cpu_budget(config: AgentConfig) -> float:
    """The NVML read budget: as set, else the default. A simulator without --simulate.nvml-costs costs its own
    Python, not what NVML would: tiers fitted to that would only make a run depend on the machine's speed,
    so by default it reads everything every cycle (a whole core's budget)."""
    if config.sampling_cpu_budget is not None:
        return config.sampling_cpu_budget
    return 1.0 if config.simulate and not config.simulate_nvml_costs else DEFAULT_CPU_BUDGET


def _simulator(config: AgentConfig, scenario_name: str) -> tuple[Any, str, Callable[[], float]]:
    from gpufleet.agent.sim import ScenarioError, SimNvml, load_scenario

    try:
        scenario = load_scenario(scenario_name)
    except ScenarioError as exc:
        raise ConfigError(f"--simulate: {exc}") from None
    node = config.node or scenario.nodes[0]
    if node not in scenario.nodes:
        raise ConfigError(
            f"--node: {node!r} is not a node of scenario {config.simulate!r} (nodes: {', '.join(scenario.nodes)})"
        )
    # --once samples twice an interval apart (GPM needs two samples); the simulator need not really wait.
    # Starting one interval in the past makes the printed (second) sample's time "now".
    clock: Callable[[], float] = SettableClock(time.time() - config.sample_interval) if config.once else time.time
    # block_on_events: the XID thread's event wait must block as the driver's does, even on the settable clock.
    nvml: Any = SimNvml(
        scenario, node=node, clock=clock, epoch=config.simulate_epoch, seed=config.simulate_seed, block_on_events=True
    )
    if config.simulate_nvml_costs:
        from gpufleet.agent.sim.costs import CostedNvml

        nvml = CostedNvml(nvml)
    return nvml, node, clock


def _pynvml() -> Any:
    try:
        import pynvml
    except ImportError:
        raise ConfigError(missing_extra("agent", AGENT_MODULES) or "nvidia-ml-py cannot be imported") from None
    return pynvml


def _sleep(seconds: float) -> None:
    threading.Event().wait(seconds)


def run_once(config: AgentConfig, runtime: Runtime) -> int:
    """Sample twice an interval apart (so GPM SM activity has a value), print the second snapshot."""
    from gpufleet.agent.sampler import Sampler

    store = SnapshotStore(config.snapshots_retention)
    sampler = Sampler(
        runtime.reader,
        store,
        node=runtime.node,
        interval=config.sample_interval,
        attributor=runtime.attributor,
        clock=runtime.clock,
        families=runtime.families,
        processes=runtime.processes,
    )
    try:
        if sampler.run_once() is None:
            return _once_failed(sampler)
        runtime.wait(config.sample_interval)
        snapshot = sampler.run_once()
        if snapshot is None:
            return _once_failed(sampler)
    finally:
        sampler.stop()
    sys.stdout.buffer.write(orjson.dumps(snapshot.to_dict(), option=orjson.OPT_INDENT_2) + b"\n")
    sys.stdout.flush()
    if config.record:
        recorder = Recorder(config.record)
        recorder.write(orjson.dumps(snapshot.to_dict()))
        recorder.close()
    return 0


def _once_failed(sampler: Sampler) -> int:
    health = sampler.health()
    reason = health.nvml_error_detail or health.nvml_error or "sampling failed (see log)"
    sys.stderr.write(f"{PROG}: error: no sample: {reason}\n")
    return 1


def serve(config: AgentConfig, runtime: Runtime) -> int:
    """Run until SIGTERM/SIGINT: HTTP first (so health answers while NVML comes up), then sampling."""
    from gpufleet.agent.sampler import Sampler, StopSignal

    store = SnapshotStore(config.snapshots_retention, clock=runtime.clock)
    try:
        server = AgentHttpServer(
            store,
            host=config.listen_host,
            port=config.listen_port,
            interval=config.sample_interval,
            clock=runtime.clock,
            web=runtime.web,
            limits=config.connection_limits(),
        )
    except OSError as exc:
        sys.stderr.write(
            f"{PROG}: error: --web.listen-address: cannot listen on "
            f"{config.listen_host}:{config.listen_port}: {exc.strerror or exc}\n"
        )
        return 2
    recorder = Recorder(config.record) if config.record else None
    stop = StopSignal()
    # Files of other processes and their containers are read on a thread of their own: a process stuck in
    # the kernel must not stop sampling. A job shows one cycle after its processes first do.
    attributor = BackgroundAttributor(runtime.attributor)
    sampler = Sampler(
        runtime.reader,
        store,
        node=runtime.node,
        interval=config.sample_interval,
        attributor=attributor,
        recorder=recorder,
        clock=runtime.clock,
        stop=stop,
        families=runtime.families,
        processes=runtime.processes,
        rendered_ahead=server.prepare,
    )
    hangup = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    # SIGHUP would end the agent by default, and systemd counts that as a clean exit, never restarting it;
    # logrotate sends it after moving a file away.
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda *_: hangup.set())
    steady_interpreter()
    server.start()
    sampler.start()
    log.info(
        "agent started",
        extra={
            "node": runtime.node,
            "version": __version__,
            "port": server.port,
            "address": server.host,
            "interval_seconds": config.sample_interval,
            "simulate": config.simulate,
            "record": config.record,
            "tls": server.tls,
            "basic_auth": server.auth is not None,
        },
    )
    try:
        while not _wait_for_signal(stop, hangup):
            if hangup.is_set():
                hangup.clear()
                if recorder is not None:
                    recorder.reopen()
                log.info(
                    "SIGHUP: record file reopened; TLS and auth files are re-read when they change",
                    extra={"record": config.record},
                )
    finally:
        _stop_within(SHUTDOWN_SECONDS, sampler, attributor, recorder, server)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        log.info("agent stopped", extra={"node": runtime.node})
    return 0


def steady_interpreter(switch_interval_seconds: float = SWITCH_INTERVAL_SECONDS) -> None:
    """Set the interpreter up for serving: the GIL handed over within `switch_interval_seconds`, and what
    start-up built (modules, configuration, the reader, the renderer) frozen out of the collector's reach.
    A full collection of those ~30,000 objects holds the GIL for several milliseconds, in which no scrape
    is answered; frozen, it walks only what serving has made since."""
    sys.setswitchinterval(switch_interval_seconds)
    gc.collect()
    gc.freeze()


def _wait_for_signal(stop: StopSignal, hangup: threading.Event) -> bool:
    """Block until a signal's handler has run; True once stop is set. The handlers run on this (the main)
    thread only when it runs Python, and a signal the kernel hands to another thread does not interrupt a
    wait here: the interpreter's wakeup descriptor, which every signal writes to, does. No timed wakeups,
    which would cost an idle agent more CPU than its scrapes."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:  # not the main thread: fall back to polling
        return stop.wait(0.5)
    try:
        while not stop.is_set() and not hangup.is_set():
            select.select([reader], [], [])
            reader.recv(4096)
    finally:
        signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()
    return stop.is_set()


def _stop_within(
    seconds: float,
    sampler: Sampler,
    attributor: BackgroundAttributor,
    recorder: Recorder | None,
    server: AgentHttpServer,
) -> None:
    """Stop sampling, attribution, recording and serving, all within `seconds`: each step gets what is left.
    Every thread the agent starts is a daemon, so one left blocked does not hold the exit up."""
    end = time.monotonic() + seconds

    def left() -> float:
        return max(0.1, end - time.monotonic())

    sampler.stop(timeout=left())
    attributor.close(timeout=min(1.0, left()))
    if recorder is not None:
        recorder.close(timeout=left())
    server.close(timeout=left())


if __name__ == "__main__":
    sys.exit(main())
