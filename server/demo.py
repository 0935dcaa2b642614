"""`gpufleet-server demo`: simulated agents in separate processes, the server pulling them, alerts on screen.

The agents are `gpufleet-agent --simulate demo` processes started through the agent's own command
(the server never imports the agent), serving real loopback HTTP and sharing one scenario epoch so
their incidents line up; the scenario (two jobs; a cooling failure, a straggler and a communication
slowdown on a timetable) comes from `gpufleet-agent --simulate demo --print-scenario`. The server is
the real one, in this process, with a temporary SQLite file. The timetable is printed up front, then
each alert as it starts firing and as it resolves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence, TextIO

import httpx
import orjson

from gpufleet.logs import configure_logging
from gpufleet.server.alerts import Alert, AlertState, Severity, Transition
from gpufleet.server.settings import ServerSettings, parse_duration, parse_listen

log = logging.getLogger(__name__)

SCENARIO = "demo"
_RANK = {severity: rank for rank, severity in enumerate(Severity)}


class DemoError(RuntimeError):
    """The demo cannot start; str() is the one line to print, `code` the exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def sibling_command(script: str, module: str) -> list[str]:
    """How to run one of gpufleet's console scripts from this very installation: the script next to
    sys.executable (the venv's bin/, which need not be on PATH), else `python -m` its module."""
    path = Path(sys.executable).parent / script
    if path.is_file() and os.access(path, os.X_OK):
        return [str(path)]
    return [sys.executable, "-m", module]


def agent_command() -> list[str]:
    """The gpufleet-agent command of this installation."""
    return sibling_command("gpufleet-agent", "gpufleet.agent.cli")


def server_command() -> list[str]:
    """The gpufleet-server command of this installation, as a person would type it in another terminal."""
    return sibling_command("gpufleet-server", "gpufleet.server.cli")


@dataclass(frozen=True)
class Job:
    """A job of the scenario: its id and the (node, GPU index) pairs it runs on."""

    id: str
    gpus: tuple[tuple[str, int], ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(node for node, _ in self.gpus))


@dataclass(frozen=True)
class Incident:
    """One timed incident of the scenario, as the agent's --print-scenario describes it."""

    kind: str
    start_s: float
    end_s: float | None
    gpus: tuple[tuple[str, int], ...] = ()
    job: str | None = None
    nodes: tuple[str, ...] = ()
    silent: bool = True


@dataclass(frozen=True)
class Scenario:
    """What the demo prints up front: the nodes, the jobs and the incident timetable."""

    name: str
    nodes: tuple[str, ...]
    jobs: tuple[Job, ...]
    incidents: tuple[Incident, ...]

    @classmethod
    def from_json(cls, data: Any) -> "Scenario":
        """From `gpufleet-agent --simulate NAME --print-scenario`'s output; ValueError if it is not that."""
        try:

            def refs(items: Any) -> tuple[tuple[str, int], ...]:
                return tuple((str(node), int(index)) for node, index in items)

            return cls(
                name=str(data["name"]),
                nodes=tuple(str(n) for n in data["nodes"]),
                jobs=tuple(Job(str(j["id"]), refs(j["gpus"])) for j in data["jobs"]),
                incidents=tuple(
                    Incident(
                        kind=str(i["kind"]),
                        start_s=float(i["start_s"]),
                        end_s=None if i.get("end_s") is None else float(i["end_s"]),
                        gpus=refs(i.get("gpus", ())),
                        job=i.get("job"),
                        nodes=tuple(i.get("nodes", ())),
                        silent=bool(i.get("silent", True)),
                    )
                    for i in data["incidents"]
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a scenario timetable ({exc.__class__.__name__}: {exc})") from None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_socket(listen: str | None) -> socket.socket:
    """The server's listening socket: `listen` if given, else 127.0.0.1:9472, else any free loopback port.

    Bound before anything starts, so a taken address fails at once and the printed URLs are the real ones.
    """
    from gpufleet.server.serve import listen_socket

    if listen:
        return listen_socket(parse_listen(listen))
    try:
        return listen_socket("127.0.0.1:9472")
    except OSError:
        return listen_socket("127.0.0.1:0")


# What each simulated incident looks like, and the alerts it should raise.
INCIDENT_TEXT = {
    "cooling_failure": ("cooling failure", "thermal_throttle, and straggler on the same GPU (it holds its job back)"),
    "slow_gpu": ("slow GPU", "straggler"),
    "host_starvation": ("host starving its GPUs", "straggler (node)"),
    "comm_slowdown": ("communication slowdown", "comm_bound"),
    "gpu_lost": ("GPU falls off the bus", "gpu_lost"),
    "xid": ("XID errors", "xid"),
    "ecc_errors": ("ECC errors", "ecc (for uncorrected errors)"),
    "power_cap": ("operator power cap", "nothing: a uniform cap is not a fault"),
    "counter_reset": ("counter reset", "nothing"),
    "link_errors": ("NVLink and PCIe link retries", "nothing alone; named in its GPU's straggler evidence"),
}
# Alerts fire 30-60 s after an incident starts and resolve 60-90 s after it ends (docs/detection.md).
RESOLVE_MARGIN_SECONDS = 90.0


def load_demo_scenario(timeout_seconds: float = 60.0) -> Scenario:
    """The demo scenario's timetable, asked of the agent command (the server never imports the agent).

    DemoError with the agent's own one-line complaint (a missing extra, say) when it cannot answer.
    """
    cmd = agent_command() + ["--simulate", SCENARIO, "--print-scenario"]
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_seconds, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DemoError(f"cannot run {' '.join(cmd)}: {exc}") from None
    if proc.returncode != 0:
        lines = proc.stderr.decode(errors="replace").strip().splitlines()
        reason = lines[-1] if lines else f"exit code {proc.returncode}"
        raise DemoError(reason, code=2 if proc.returncode == 2 else 1)
    try:
        return Scenario.from_json(orjson.loads(proc.stdout))
    except (orjson.JSONDecodeError, ValueError) as exc:
        raise DemoError(f"{' '.join(cmd)} printed no scenario timetable: {exc}") from None


def incident_subject(scenario: Scenario, incident: Incident) -> str:
    """ "dgx-02 GPU 5 (job 71001)", "dgx-01 GPUs 0,1", "job 71002" or "dgx-03"."""
    if incident.job is not None:
        return f"job {incident.job}"
    if not incident.gpus:
        return ", ".join(incident.nodes) or "all nodes"
    nodes = tuple(dict.fromkeys(node for node, _ in incident.gpus))
    if len(nodes) > 1:
        return f"{len(incident.gpus)} GPUs on {', '.join(nodes)}"
    indices = [index for _, index in incident.gpus]
    where = f"{nodes[0]} GPU {indices[0]}" if len(indices) == 1 else f"{nodes[0]} GPUs {','.join(map(str, indices))}"
    jobs = sorted({job.id for job in scenario.jobs for ref in incident.gpus if ref in job.gpus})
    return where + (f" (job {', '.join(jobs)})" if jobs else "")


def timeline(scenario: Scenario, epoch: float) -> list[str]:
    """What will happen when, relative to the scenario epoch and on the local clock."""

    def at(offset: float) -> str:
        return f"+{offset:.0f}s ({time.strftime('%H:%M:%S', time.localtime(epoch + offset))})"

    lines = []
    for inc in sorted(scenario.incidents, key=lambda i: i.start_s):
        what, expect = INCIDENT_TEXT.get(inc.kind, (inc.kind.replace("_", " "), "-"))
        if inc.kind == "slow_gpu":
            what = "silently slow GPU" if inc.silent else "slow GPU with power-brake bits"
        until = "" if inc.end_s is None else f" until +{inc.end_s:.0f}s"
        lines.append(f"  {at(inc.start_s)}  {what} on {incident_subject(scenario, inc)}{until}  -> expect {expect}")
    ends = [i.end_s if i.end_s is not None else i.start_s for i in scenario.incidents]
    if ends:
        lines.append(
            f"  alerts fire 30-60s into each incident and resolve 1-2 min after it ends; "
            f"all calm by about {at(max(ends) + RESOLVE_MARGIN_SECONDS)}"
        )
    return lines


@dataclass
class Agent:
    """One simulated agent process."""

    node: str
    address: str
    process: subprocess.Popen[bytes]


def start_agents(nodes: Sequence[str], epoch: float) -> list[Agent]:
    """Launch one `gpufleet-agent --simulate demo` process per node on free loopback ports."""
    agents = []
    for node in nodes:
        address = f"127.0.0.1:{free_port()}"
        cmd = agent_command() + [
            "--simulate",
            SCENARIO,
            "--node",
            node,
            "--simulate.epoch",
            repr(epoch),
            "--web.listen-address",
            address,
            "--log.level",
            "warning",
        ]
        try:
            # Ctrl-C held back until the agent is on the list: arriving in between, it would leave an agent
            # that nothing stops, in its own session (where a terminal's Ctrl-C does not reach it either; the
            # demo stops the agents in order).
            with ctrl_c_deferred():
                process = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=_accept_ctrl_c,
                )
                agents.append(Agent(node, address, process))
        except BaseException:  # Ctrl-C, or no process to be had: nobody else knows of those started
            with uninterrupted():
                stop_agents(agents)
            raise
    return agents


@contextlib.contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """SIGINT blocked inside; one that came meanwhile is delivered (as KeyboardInterrupt) on the way out."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _accept_ctrl_c() -> None:
    """In the agent's process before it runs: it inherits the signal mask, but the deferral is the demo's."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def wait_for_agents(agents: Sequence[Agent], timeout_seconds: float = 30.0) -> None:
    """Block until every agent answers /healthz with 200; RuntimeError if one exits or time runs out."""
    deadline = time.monotonic() + timeout_seconds
    pending = list(agents)
    with httpx.Client(timeout=1.0) as client:
        while pending:
            for agent in list(pending):
                code = agent.process.poll()
                if code is not None:
                    raise RuntimeError(f"agent {agent.node} exited with code {code}")
                try:
                    if client.get(f"http://{agent.address}/healthz").status_code == 200:
                        pending.remove(agent)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(
                    f"agents not ready after {timeout_seconds:.0f}s: " + ", ".join(a.node for a in pending)
                )
            if pending:
                time.sleep(0.2)


def stop_agents(agents: Sequence[Agent], timeout_seconds: float = 5.0) -> None:
    """SIGTERM every agent, then SIGKILL whoever has not exited in time."""
    for agent in agents:
        if agent.process.poll() is None:
            agent.process.terminate()
    for agent in agents:
        try:
            agent.process.wait(timeout=timeout_seconds)
        except subprocess.TimeoutExpired:
            agent.process.kill()
            agent.process.wait()


def subject(alert: Alert) -> str:
    """ "dgx-03 GPU 5 (job 71001)", "dgx-02 (job 7)" or "job 71001"."""
    parts = []
    if alert.node:
        parts.append(alert.node + ("" if alert.gpu is None else f" GPU {alert.gpu}"))
    if alert.hpc_job:
        parts.append(f"(job {alert.hpc_job})" if parts else f"job {alert.hpc_job}")
    return " ".join(parts) or "-"


class TerminalPrinter:
    """A notifier that prints a line at every change of an alert's state: pending (its condition holds, not
    yet for long enough to fire), firing, a change of severity while it fires (warning to critical and
    back), resolved, and cleared (a pending one whose condition went away before it fired)."""

    name = "terminal"
    url = "stdout"  # where it delivers, as every notifier says: /metrics labels the counters by it

    def __init__(self, epoch: float, out: TextIO = sys.stdout) -> None:
        self.epoch = epoch
        self.out = out
        self.sent_total = self.failed_total = self.dropped_total = 0
        self.fired_total = self.resolved_total = 0
        self._shown: dict[str, Severity] = {}  # the severity last printed for each firing alert

    def line(self, alert: Alert, verb: str | None = None) -> str:
        """One readable line: PENDING, FIRING, RESOLVED (by default, the alert's state), RAISED/LOWERED or
        CLEARED, and when."""
        verb = verb or ("RESOLVED" if alert.state is AlertState.RESOLVED else "FIRING")
        at = {"PENDING": alert.pending_since, "FIRING": alert.started, "RESOLVED": alert.resolved}.get(
            verb, alert.updated
        )
        at = at if at is not None else alert.updated
        clock = time.strftime("%H:%M:%S", time.localtime(at))
        return (
            f"{clock} (+{at - self.epoch:5.0f}s) {verb:8s} {alert.kind.value:16s} {alert.severity.value:8s} "
            f"{subject(alert)}: {alert.summary}"
        )

    def submit(self, transitions: Sequence[Transition]) -> None:
        """Print each change of state, and of severity while firing; refreshes print nothing."""
        for t in transitions:
            alert, verb = t.alert, None
            if alert.state is AlertState.PENDING and t.previous is not AlertState.PENDING:
                verb = "PENDING"
            elif alert.state is AlertState.FIRING:
                shown = self._shown.get(alert.id)
                if t.previous is not AlertState.FIRING:
                    verb = "FIRING"
                    self.fired_total += 1
                elif shown is not None and shown is not alert.severity:
                    verb = "RAISED" if _RANK[alert.severity] > _RANK[shown] else "LOWERED"
                self._shown[alert.id] = alert.severity
            elif alert.state is AlertState.RESOLVED and t.previous in (AlertState.FIRING, None):
                verb = "RESOLVED"
                self.resolved_total += 1
                self._shown.pop(alert.id, None)
            elif alert.state is AlertState.RESOLVED and t.previous is AlertState.PENDING:
                verb = "CLEARED"  # it never fired: nobody was paged
            if verb is not None:
                print(self.line(alert, verb), file=self.out, flush=True)
                self.sent_total += 1

    async def run(self, stop: asyncio.Event) -> None:
        """Nothing to deliver in the background."""
        await stop.wait()

    async def aclose(self) -> None:
        """Nothing to close."""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The demo's few options."""
    parser = argparse.ArgumentParser(
        prog="gpufleet-server demo", description="Simulated GPU cluster with incidents, and the server watching it."
    )
    parser.add_argument(
        "--duration",
        type=parse_duration,
        default=None,
        metavar="SECONDS",
        help="exit by itself after this long (default: run until Ctrl-C)",
    )
    parser.add_argument(
        "--web.listen-address",
        dest="listen",
        default=None,
        metavar="HOST:PORT",
        help="server address (default 127.0.0.1:9472, or a free port if taken)",
    )
    parser.add_argument(
        "--pull.interval",
        dest="pull_interval",
        type=parse_duration,
        default=2.0,
        metavar="SECONDS",
        help="how often the server pulls the agents (default 2s)",
    )
    parser.add_argument(
        "--log.level", dest="log_level", default="warning", choices=("debug", "info", "warning", "error")
    )
    return parser.parse_args(list(argv))


async def _serve(server: "object", duration: float | None, sock: socket.socket) -> None:
    """Run uvicorn on `sock` until Ctrl-C, SIGTERM, a closed terminal (SIGHUP) or the duration elapses."""
    loop = asyncio.get_running_loop()

    def stop() -> None:
        server.should_exit = True  # type: ignore[attr-defined]

    # SIGHUP too: the agents run in their own sessions, so a closed terminal must reach them through us.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop)
    if duration is not None:
        loop.call_later(duration, stop)
    await server.serve(sockets=[sock])  # type: ignore[attr-defined]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; 0 on a clean stop (Ctrl-C included), 1 if the agents fail to start, 2 if the address is taken."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging(args.log_level, "text")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return _run(args)
    except KeyboardInterrupt:  # Ctrl-C at any step before the server took the signal over
        print("gpufleet demo: stopped", flush=True)
        return 0


def _run(args: argparse.Namespace) -> int:
    """Listen, ask for the scenario, start the agents and serve; the agents are stopped however it ends."""
    try:
        sock = server_socket(args.listen)
    except (OSError, ValueError) as exc:
        print(
            f"gpufleet-server demo: cannot listen on --web.listen-address {args.listen!r}: "
            f"{getattr(exc, 'strerror', None) or exc}",
            file=sys.stderr,
        )
        return 2
    with sock, tempfile.TemporaryDirectory(prefix="gpufleet-demo-", ignore_cleanup_errors=True) as workdir:
        try:
            scenario = load_demo_scenario()
        except DemoError as exc:
            print(f"gpufleet-server demo: {exc}", file=sys.stderr)
            return exc.code
        epoch = time.time()
        agents = start_agents(scenario.nodes, epoch)
        try:
            try:
                wait_for_agents(agents)
            except RuntimeError as exc:
                print(f"gpufleet-server demo: {exc}", file=sys.stderr)
                return 1
            return _serve_demo(args, sock, scenario, agents, epoch, workdir)
        finally:
            with uninterrupted():
                stop_agents(agents)


def _serve_demo(
    args: argparse.Namespace,
    sock: socket.socket,
    scenario: Scenario,
    agents: Sequence[Agent],
    epoch: float,
    workdir: str,
) -> int:
    """The real server over the agents, printing alerts, until stopped; then what the jobs lost."""
    from gpufleet.server.api import create_app
    from gpufleet.server.serve import build_runtime, uvicorn_server

    host, port = sock.getsockname()[:2]
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    settings = ServerSettings(
        listen_address=listen,
        targets=tuple(a.address for a in agents),
        storage_path=os.path.join(workdir, "alerts.db"),
        pull_interval_seconds=args.pull_interval,
        pull_timeout_seconds=min(4.0, args.pull_interval),
        log_level=args.log_level,
        log_format="text",
    )
    printer = TerminalPrinter(epoch)
    runtime = build_runtime(settings, extra_notifiers=[printer])
    print_banner(f"http://{listen}", scenario.nodes, scenario, epoch, args)
    asyncio.run(_serve(uvicorn_server(settings, create_app(settings, runtime=runtime)), args.duration, sock))
    print(
        f"gpufleet demo: stopped after {time.time() - epoch:.0f}s; "
        f"{printer.fired_total} alerts fired, {printer.resolved_total} resolved",
        flush=True,
    )
    losses = loss_summary(runtime.view.jobs)
    if losses:
        print(losses, flush=True)
    return 0


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Ctrl-C ignored inside: a second one must not cut the agents' shutdown short (they run in their own
    sessions, so nothing else would stop them)."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread, which alone receives Ctrl-C
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def loss_summary(jobs: Sequence[dict]) -> str:
    """One line: the GPU-hours each job lost while its alerts fired, by kind ('' without jobs)."""
    parts = []
    for job in sorted(jobs, key=lambda j: str(j.get("hpc_job"))):
        by_kind = job.get("gpu_hours_lost_by_kind") or {}
        detail = ", ".join(f"{kind} {hours:.2f}" for kind, hours in by_kind.items())
        parts.append(
            f"job {job.get('hpc_job')} {job.get('gpu_hours_lost') or 0.0:.2f}" + (f" ({detail})" if detail else "")
        )
    return "GPU-hours lost while alerts fired: " + "; ".join(parts) if parts else ""


def print_banner(base: str, nodes: Sequence[str], scenario: Scenario, epoch: float, args: argparse.Namespace) -> None:
    """Where to look, and what will happen when."""
    jobs = ", jobs " + ", ".join(f"{j.id} on {'+'.join(j.nodes)}" for j in scenario.jobs) if scenario.jobs else ""
    print(
        f"gpufleet demo: {len(nodes)} simulated nodes ({', '.join(nodes)}){jobs}; "
        f"scenario {SCENARIO!r}, pulled every {args.pull_interval:g}s",
        flush=True,
    )
    print(
        f"  alerts:  {base}/alerts\n  docs:    {base}/docs\n  metrics: {base}/metrics\n"
        f"  jobs:    {base}/jobs\n  in another terminal: {shlex.join(server_command())} status --url {base}",
        flush=True,
    )
    if scenario.incidents:
        print(
            "Timeline (scenario time since start; the jobs warm up first so the server learns their healthy baseline):",
            flush=True,
        )
        print("\n".join(timeline(scenario, epoch)), flush=True)
    stop = f"Stops by itself after {args.duration:g}s" if args.duration is not None else "Runs until Ctrl-C"
    print(f"{stop}; Ctrl-C stops everything. Alerts as they go pending, fire, change severity and resolve:", flush=True)
