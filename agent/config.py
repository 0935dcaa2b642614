"""Agent configuration: dotted flags, GPUFLEET_AGENT_* environment and a YAML file, in that precedence."""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
import stat
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from gpufleet.agent import __version__
from gpufleet.agent.attribution import DEFAULT_ENV_VARS
from gpufleet.agent.connections import ConnectionLimits
from gpufleet.config import (
    ConfigError,
    OneLineParser,
    layered,
    parse_bool,
    parse_duration,
    parse_listen_address,
    read_config_file,
)
from gpufleet.config import env_name as _env_name
from gpufleet.agent.tiers import DEFAULT_CPU_BUDGET

PROG = "gpufleet-agent"
ENV_PREFIX = "GPUFLEET_AGENT_"
DEFAULT_PORT = 9471  # 9400 is dcgm-exporter, 9835 nvidia_gpu_exporter
MIN_RETENTION_SECONDS = 120.0
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("json", "text")
POD_LABEL_SOURCES = ("api-server", "pod-name")
METRICS_NAMES = ("gpufleet", "dcgm")
_LIMITS = ConnectionLimits()
_ENV_VAR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Everything the agent is told, validated."""

    listen_host: str = ""
    listen_port: int = DEFAULT_PORT
    sample_interval: float = 1.0
    # Fraction of one core the sampler's NVML reads may use; costlier readings are read less often.
    # None: DEFAULT_CPU_BUDGET on real NVML; see build_runtime for the simulator.
    sampling_cpu_budget: float | None = None
    # None until resolved: the hostname, or with --simulate the scenario's first node.
    node: str | None = None
    simulate: str | None = None
    simulate_epoch: float | None = None
    simulate_seed: int = 0
    simulate_nvml_costs: bool = False
    snapshots_retention: float = 300.0
    record: str | None = None
    once: bool = False
    hpc_job_mapping_dir: str | None = None
    hpc_job_env_vars: tuple[str, ...] = DEFAULT_ENV_VARS
    hpc_job_rendezvous: bool = True
    procfs: str = "/proc"
    # None: the kubelet's own socket on real NVML, none with --simulate (see build_runtime).
    pod_resources_socket: str | None = None
    pod_labels: str = "api-server"
    pod_resources_refresh: float = 5.0
    nvlink_per_link: bool = False
    # /metrics under gpufleet's names, or dcgm-exporter's (agent.dcgm_names) from a counters file.
    metrics_names: str = "gpufleet"
    dcgm_counters: str | None = None
    # Per-process GPU memory (agent.processes): the processes with most memory on each GPU, and on the
    # node; 0 per GPU turns it off.
    processes_per_gpu: int = 4
    processes_per_node: int = 32
    log_level: str = "info"
    log_format: str = "json"
    web_config_file: str | None = None
    web_read_header_timeout: float = _LIMITS.read_header_timeout_seconds
    web_keep_alive_timeout: float = _LIMITS.keep_alive_timeout_seconds
    web_write_timeout: float = _LIMITS.write_timeout_seconds
    web_max_connections: int = _LIMITS.max_connections
    web_max_connections_per_address: int = _LIMITS.max_connections_per_address
    web_max_requests: int = _LIMITS.max_requests
    web_max_large_answers: int = _LIMITS.max_large_answers
    config_file: str | None = None
    print_scenario: bool = False

    def connection_limits(self) -> ConnectionLimits:
        """The HTTP server's bounds."""
        return ConnectionLimits(
            read_header_timeout_seconds=self.web_read_header_timeout,
            keep_alive_timeout_seconds=self.web_keep_alive_timeout,
            write_timeout_seconds=self.web_write_timeout,
            max_connections=self.web_max_connections,
            max_connections_per_address=self.web_max_connections_per_address,
            max_requests=self.web_max_requests,
            max_large_answers=self.web_max_large_answers,
        )


# --- value parsers: each takes a flag string, env string or YAML value, returns the typed value ----------
# Booleans, durations and addresses are spelled as core's config module spells them, as the server's are.


def _interval(value: Any) -> float:
    seconds = parse_duration(value)
    if not 0.1 <= seconds <= 3600:
        raise ValueError(f"must be between 0.1 and 3600 seconds, got {value!r}")
    return seconds


def _cpu_budget(value: Any) -> float:
    """A fraction of one core, '0.003', or a percentage, '0.3%'."""
    text = _text(value) if not isinstance(value, (int, float)) or isinstance(value, bool) else str(value)
    percent = text.endswith("%")
    try:
        number = float(text.removesuffix("%"))
    except ValueError:
        raise ValueError(f"must be a fraction of one core (0.003) or a percentage (0.3%), got {value!r}") from None
    fraction = number / 100 if percent else number
    if not 0.0001 <= fraction <= 1.0:
        raise ValueError(f"must be between 0.0001 and 1 of a core (0.01% to 100%), got {value!r}")
    return fraction


def _seconds_between(low: float, high: float) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        seconds = parse_duration(value)
        if not low <= seconds <= high:
            raise ValueError(f"must be between {low:g} and {high:g} seconds, got {value!r}")
        return seconds

    return parse


_refresh = _seconds_between(1, 3600)
_retention = _seconds_between(MIN_RETENTION_SECONDS, 86400)
_timeout = _seconds_between(0.01, 3600)


def _count(value: Any) -> int:
    number = _seed(value)
    if not 1 <= number <= 65536:
        raise ValueError(f"must be an integer from 1 to 65536, got {value!r}")
    return number


def _count_or_off(value: Any) -> int:
    number = _seed(value)
    if not 0 <= number <= 1024:
        raise ValueError(f"must be an integer from 0 (off) to 1024, got {value!r}")
    return number


def _epoch(value: Any) -> float:
    seconds = _number(value)
    if seconds < 0:
        raise ValueError(f"must be unix seconds >= 0, got {value!r}")
    return seconds


def _seed(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"must be an integer, got {value!r}")
    try:
        return int(str(value).strip(), 10)
    except ValueError:
        raise ValueError(f"must be an integer, got {value!r}") from None


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = _text(value).lower()
        if text not in options:
            raise ValueError(f"must be one of {', '.join(options)}, got {value!r}")
        return text

    return parse


def _path(value: Any) -> str:
    text = _text(value)
    if "\0" in text:
        raise ValueError("must not contain NUL")
    return text


def _record_file(value: Any) -> str:
    """A file the agent can append to: checked at start, not at the first write a second later."""
    path = _path(value)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"folder {folder} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder")
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
        # Opening a FIFO blocks until something reads it; a device or socket is no trace either.
        raise ValueError(f"{path} is not a regular file")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"cannot write {path}")
    if not os.path.exists(path) and not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"cannot create a file in {folder}")
    return path


def _env_vars(value: Any) -> tuple[str, ...]:
    """'A,B' (flag, environment) or a YAML list -> ('A', 'B'), in order, each a valid variable name."""
    items = value if isinstance(value, list) else _text(value).split(",")
    names: list[str] = []
    for item in items:
        name = _text(item)
        if not _ENV_VAR_NAME.match(name):
            raise ValueError(f"{name!r} is not an environment variable name")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("must name at least one variable")
    return tuple(names)


def _node(value: Any) -> str:
    text = _text(value)
    if any(c.isspace() for c in text) or len(text) > 253:
        raise ValueError(f"must be a host-like name without spaces (at most 253 characters), got {value!r}")
    return text


def _number(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"must be a number, got {value!r}")
    try:
        number = float(str(value).strip())
    except ValueError:
        raise ValueError(f"must be a number of seconds, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"must be finite, got {value!r}")
    return number


def _text(value: Any) -> str:
    if value is None or isinstance(value, (dict, list)):
        raise ValueError(f"must be a string, got {value!r}")
    text = str(value).strip()
    if not text:
        raise ValueError("must not be empty")
    return text


@dataclass(frozen=True, slots=True)
class _Option:
    key: str  # the flag name without dashes, also the YAML key
    field: str  # AgentConfig attribute
    parse: Callable[[Any], Any]
    help: str
    metavar: str | None = None  # None means a boolean switch


OPTIONS: tuple[_Option, ...] = (
    _Option(
        "web.listen-address",
        "listen_host",
        parse_listen_address,
        f"address to serve /metrics and the snapshot API on (default :{DEFAULT_PORT})",
        "HOST:PORT",
    ),
    _Option(
        "web.config.file",
        "web_config_file",
        _path,
        "TLS and basic auth for the endpoints: a Prometheus exporter-toolkit web config (docs/agent.md)",
        "FILE",
    ),
    _Option(
        "web.read-header-timeout",
        "web_read_header_timeout",
        _timeout,
        "close a connection whose whole request head (TLS handshake included) has not arrived within this "
        f"(default {_LIMITS.read_header_timeout_seconds:g}s)",
        "DURATION",
    ),
    _Option(
        "web.keep-alive-timeout",
        "web_keep_alive_timeout",
        _timeout,
        f"close a keep-alive connection idle this long (default {_LIMITS.keep_alive_timeout_seconds:g}s)",
        "DURATION",
    ),
    _Option(
        "web.write-timeout",
        "web_write_timeout",
        _timeout,
        f"close a connection that has not taken its answer within this (default {_LIMITS.write_timeout_seconds:g}s)",
        "DURATION",
    ),
    _Option(
        "web.max-connections",
        "web_max_connections",
        _count,
        "most open connections; a new one beyond takes the place of the oldest still waiting for its request "
        f"(default {_LIMITS.max_connections})",
        "N",
    ),
    _Option(
        "web.max-connections-per-address",
        "web_max_connections_per_address",
        _count,
        f"most open connections from one client address, the same way (default {_LIMITS.max_connections_per_address})",
        "N",
    ),
    _Option(
        "web.max-requests",
        "web_max_requests",
        _count,
        f"requests answered at once; whole requests beyond wait their turn (default {_LIMITS.max_requests})",
        "N",
    ),
    _Option(
        "web.max-large-answers",
        "web_max_large_answers",
        _count,
        "/metrics and /snapshots answers in flight at once, bounding their memory; more are answered 503 "
        f"with Retry-After (default {_LIMITS.max_large_answers})",
        "N",
    ),
    _Option("sample.interval", "sample_interval", _interval, "seconds between NVML samples (default 1)", "SECONDS"),
    _Option(
        "sampling.cpu-budget",
        "sampling_cpu_budget",
        _cpu_budget,
        "CPU the NVML reads may use, a fraction of one core or a percentage; costlier readings are read "
        f"less often, detectors' readings at least every 2 s, all at least every 60 s (default {DEFAULT_CPU_BUDGET:g})",
        "FRACTION",
    ),
    _Option("node", "node", _node, "node name on every series and snapshot (default: hostname)", "NAME"),
    _Option("simulate", "simulate", _path, "use the NVML simulator: built-in scenario or a YAML/JSON file", "SCENARIO"),
    _Option(
        "simulate.epoch",
        "simulate_epoch",
        _epoch,
        "scenario time zero, unix seconds (default: agent start)",
        "UNIX_SECONDS",
    ),
    _Option("simulate.seed", "simulate_seed", _seed, "simulator random seed (default 0)", "N"),
    _Option(
        "simulate.nvml-costs",
        "simulate_nvml_costs",
        parse_bool,
        "each simulated NVML call burns the CPU the real call costs (H100, driver 580)",
    ),
    _Option(
        "snapshots.retention",
        "snapshots_retention",
        _retention,
        "seconds of snapshots kept for /snapshots?since= (default 300, at least 120)",
        "SECONDS",
    ),
    _Option("record", "record", _record_file, "append every snapshot as one JSON line to FILE", "FILE"),
    _Option("once", "once", parse_bool, "print one snapshot as JSON and exit"),
    _Option(
        "hpc-job-mapping-dir",
        "hpc_job_mapping_dir",
        _path,
        "dcgm-exporter style directory: one file per GPU index listing job ids (wins over /proc)",
        "DIR",
    ),
    _Option(
        "hpc-job-env-vars",
        "hpc_job_env_vars",
        _env_vars,
        "environment variables of a GPU's processes that name its job, first set wins "
        f"(default {','.join(DEFAULT_ENV_VARS)})",
        "VAR[,VAR...]",
    ),
    _Option(
        "hpc-job-rendezvous",
        "hpc_job_rendezvous",
        parse_bool,
        "without a job variable or Slurm cgroup, name a job by its ranks' rendezvous, MASTER_ADDR:MASTER_PORT "
        "or JAX_COORDINATOR_ADDRESS (default true)",
        "BOOL",
    ),
    _Option("path.procfs", "procfs", _path, "procfs mount point for job attribution (default /proc)", "DIR"),
    _Option(
        "kubernetes.pod-resources-socket",
        "pod_resources_socket",
        _path,
        "the kubelet's PodResources socket: where it exists, each GPU's pod (and job) comes from it, else from "
        "/proc (default /var/lib/kubelet/pod-resources/kubelet.sock; none with --simulate)",
        "PATH",
    ),
    _Option(
        "kubernetes.pod-labels",
        "pod_labels",
        _choice(POD_LABEL_SOURCES),
        "where a pod's job label is read: api-server (lists the node's pods; RBAC list pods), falling back to "
        "pod-name, or pod-name only (the pod's name less its controllers' suffixes) (default api-server)",
        "SOURCE",
    ),
    _Option(
        "kubernetes.refresh-interval",
        "pod_resources_refresh",
        _refresh,
        "seconds between the kubelet's answers taken, on the sampler's schedule (default 5)",
        "SECONDS",
    ),
    _Option("nvlink.per-link", "nvlink_per_link", parse_bool, "also export NVLink byte counters per link"),
    _Option(
        "metrics.names",
        "metrics_names",
        _choice(METRICS_NAMES),
        "what /metrics names the readings: gpufleet (gpufleet_gpu_*) or dcgm (dcgm-exporter's DCGM_FI_* names, "
        "units and labels, for its dashboards and alerts) (default gpufleet)",
        "NAMES",
    ),
    _Option(
        "metrics.dcgm-counters",
        "dcgm_counters",
        _path,
        "with --metrics.names dcgm: the DCGM fields to serve, a dcgm-exporter counters CSV "
        "(default: dcgm-exporter's default set)",
        "FILE",
    ),
    _Option(
        "metrics.processes-per-gpu",
        "processes_per_gpu",
        _count_or_off,
        "per-process GPU memory: the processes with most memory on each GPU, in the snapshot and as "
        "gpufleet_gpu_process_memory_used_bytes; 0 turns it off (default 4)",
        "N",
    ),
    _Option(
        "metrics.processes-max",
        "processes_per_node",
        _count,
        "per-process GPU memory: at most this many processes over the whole node, those with most memory (default 32)",
        "N",
    ),
    _Option("log.level", "log_level", _choice(LOG_LEVELS), "debug, info, warning or error (default info)", "LEVEL"),
    _Option("log.format", "log_format", _choice(LOG_FORMATS), "json or text (default json)", "FORMAT"),
)
_BY_KEY = {o.key: o for o in OPTIONS}
CONFIG_FILE_KEY = "config.file"


def env_name(key: str) -> str:
    """GPUFLEET_AGENT_ + the flag name upper-cased with dots and dashes as underscores."""
    return _env_name(ENV_PREFIX, key)


def build_parser(scenarios: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The flag parser; flags absent from argv are absent from the namespace (so env and file can fill in).

    `scenarios` are the simulator's built-in scenario names for --simulate's help; the caller looks them
    up only when help is asked for, so that reading the config never loads the simulator.
    """
    parser = OneLineParser(
        prog=PROG,
        description="gpufleet node agent: NVML sampling, /metrics and snapshots.",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--config.file", dest=CONFIG_FILE_KEY, metavar="FILE", help="YAML file whose keys are flag names without dashes"
    )
    for opt in OPTIONS:
        doc = opt.help
        if opt.key == "simulate" and scenarios:
            doc = doc.replace("built-in scenario", f"built-in scenario ({', '.join(scenarios)})")
        if opt.metavar is None:
            parser.add_argument(f"--{opt.key}", dest=opt.key, action="store_const", const=True, help=doc)
        else:
            parser.add_argument(f"--{opt.key}", dest=opt.key, metavar=opt.metavar, help=doc)
    parser.add_argument(
        "--print-scenario",
        dest="print_scenario",
        action="store_const",
        const=True,
        help="with --simulate: print the scenario's nodes, jobs and incident timetable as JSON and exit",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    return parser


def load_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None, scenarios: Sequence[str] = ()
) -> AgentConfig:
    """Flags > environment > config file > defaults, validated; ConfigError names the offending source."""
    environ = os.environ if environ is None else environ
    flags = vars(build_parser(scenarios).parse_args(list(argv) if argv is not None else None))
    print_scenario = bool(flags.pop("print_scenario", False))
    config_file = flags.pop(CONFIG_FILE_KEY, None) or environ.get(env_name(CONFIG_FILE_KEY)) or None
    file_values = read_config_file(config_file, _BY_KEY) if config_file else {}
    parsed = layered(
        {o.key: o.parse for o in OPTIONS},
        flags=flags,
        environ=environ,
        env_prefix=ENV_PREFIX,
        file_values=file_values,
        file_path=config_file,
    )
    values: dict[str, Any] = {}
    for key, value in parsed.items():
        if key == "web.listen-address":
            values["listen_host"], values["listen_port"] = value
        else:
            values[_BY_KEY[key].field] = value
    if values.get("dcgm_counters") and values.get("metrics_names") != "dcgm":
        raise ConfigError("--metrics.dcgm-counters needs --metrics.names dcgm")
    if print_scenario and "simulate" not in values:
        raise ConfigError("--print-scenario needs --simulate SCENARIO")
    return AgentConfig(config_file=config_file, print_scenario=print_scenario, **values)


def default_node(hostname: Callable[[], str] = socket.gethostname) -> str:
    """The short hostname, as node_exporter users see it in their dashboards."""
    name = (hostname() or "localhost").split(".", 1)[0]
    return name or "localhost"
