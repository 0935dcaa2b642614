"""Scenario files (YAML or JSON): nodes, jobs across nodes and timed incidents, validated into frozen dataclasses."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from gpufleet.agent.sim.hardware import MODELS, GpuModel
from gpufleet.agent.sim.mig import MigLayoutError, check_layout

SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"
BUILTIN_SCENARIOS: tuple[str, ...] = ("hgx-h100", "a100", "pcie", "demo", "cluster-incidents", "mig")

SCHEDULERS: tuple[str, ...] = ("slurm", "kubernetes")
# A training step's compute phase (GEMMs, attention, memory-bound kernels) draws 0.95 of the board's range
# from idle to its power limit at the maximum SM clock: under the limit, so training runs uncapped.
TRAINING_COMPUTE_INTENSITY = 0.95
GpuRef = tuple[str, int]


class ScenarioError(ValueError):
    """A scenario file or mapping is unreadable or invalid; the message names the bad key and value."""


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One node: its name, GPU model and GPU count."""

    name: str
    model: GpuModel
    gpu_count: int
    # GPUs in MIG mode: (GPU index, its GPU instances' profile names), agent.sim.mig.
    mig: tuple[tuple[int, tuple[str, ...]], ...] = ()


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A synchronous data-parallel training job spanning GPUs on one or more nodes."""

    id: str
    gpus: tuple[GpuRef, ...]
    start_s: float
    end_s: float | None
    step_time_s: float
    compute_fraction: float
    memory_used_bytes: int | None
    ramp_up_s: float
    wind_down_s: float
    user: str
    # Who launched it, which decides what its processes' environment and cgroup say (agent attribution).
    scheduler: str = "slurm"
    # Dynamic power of the compute phase at the maximum SM clock, in units of the board's power limit minus
    # its idle power. Above about 1 the job wants more than the limit and the power governor lowers clocks
    # (physics.governor_clock_ratio): dense bf16 matmuls on an H100 are about 1.43.
    compute_intensity: float = TRAINING_COMPUTE_INTENSITY

    @property
    def nodes(self) -> tuple[str, ...]:
        """The job's nodes in placement order."""
        return tuple(dict.fromkeys(node for node, _ in self.gpus))

    def active(self, t: float) -> bool:
        """Whether the job runs at scenario time t."""
        return self.start_s <= t and (self.end_s is None or t < self.end_s)


@dataclass(frozen=True, slots=True)
class Incident:
    """A timed fault; `gpus` is the resolved target set, `job` is set for job-level kinds."""

    kind: str
    start_s: float
    end_s: float | None
    gpus: tuple[GpuRef, ...]
    job: str | None = None
    factor: float = 1.0
    ambient_rise_c: float = 0.0
    speed_factor: float = 1.0
    silent: bool = True
    power_brake: bool = False
    input_wait_ratio: float = 0.0
    watts: float = 0.0
    code: int = 0
    count: int = 0
    error: str = "driver_not_loaded"
    corrected: int = 0
    uncorrected: int = 0
    nodes: tuple[str, ...] = ()
    # link_errors: NVLink replays (each after a CRC flit error) and PCIe replays over the incident.
    nvlink_replays: int = 0
    pcie_replays: int = 0

    def active(self, t: float) -> bool:
        """Whether the incident is in effect at scenario time t."""
        return self.start_s <= t and (self.end_s is None or t < self.end_s)


@dataclass(frozen=True, slots=True)
class Scenario:
    """A whole simulated cluster."""

    name: str
    description: str
    duration_s: float | None
    ambient_c: float
    driver_version: str
    cuda_driver_version: int
    node_specs: tuple[NodeSpec, ...]
    jobs: tuple[JobSpec, ...]
    incidents: tuple[Incident, ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        """Node names in file order."""
        return tuple(n.name for n in self.node_specs)

    def node(self, name: str) -> NodeSpec:
        """The node called name; ScenarioError when there is none."""
        for spec in self.node_specs:
            if spec.name == name:
                return spec
        raise ScenarioError(f"node {name!r} is not in scenario {self.name!r} (nodes: {', '.join(self.nodes)})")

    def job(self, job_id: str) -> JobSpec:
        """The job with this id; ScenarioError when there is none."""
        for job in self.jobs:
            if job.id == job_id:
                return job
        raise ScenarioError(f"job {job_id!r} is not in scenario {self.name!r}")


def load_scenario(name_or_path: str | os.PathLike[str]) -> Scenario:
    """Load a built-in scenario by name, or a .yaml/.yml/.json scenario file by path."""
    text_name = os.fspath(name_or_path)
    if text_name in BUILTIN_SCENARIOS:
        path = SCENARIO_DIR / f"{text_name}.yaml"
    else:
        path = Path(text_name)
        if not path.is_file():
            raise ScenarioError(
                f"scenario {text_name!r} is neither a built-in ({', '.join(BUILTIN_SCENARIOS)}) nor a readable file"
            )
    return parse_scenario(_read_document(path), source=str(path))


def _read_document(path: Path) -> Any:
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ScenarioError(f"{path}: scenario files must end in .yaml, .yml or .json, not {suffix or 'nothing'!r}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{path}: cannot read scenario: {exc}") from exc
    try:
        return json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ScenarioError(f"{path}: not valid {suffix[1:].upper()}: {exc}") from exc


def parse_scenario(data: Any, source: str = "<scenario>") -> Scenario:
    """Validate a decoded scenario document; ScenarioError names the offending key path and value."""
    try:
        return _parse(data)
    except ScenarioError as exc:
        raise ScenarioError(f"{source}: {exc}") from None


# --- field readers -------------------------------------------------------------------------------------

_MISSING = object()


class _Obj:
    """A mapping being validated, remembering its key path and which keys were consumed."""

    def __init__(self, data: Any, path: str):
        if not isinstance(data, Mapping):
            raise ScenarioError(f"{path or 'scenario'}: expected a mapping, got {_show(data)}")
        self.data = data
        self.path = path
        self.used: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def raw(self, name: str, default: Any = _MISSING) -> Any:
        self.used.add(name)
        if name in self.data and self.data[name] is not None:
            return self.data[name]
        if default is _MISSING:
            raise ScenarioError(f"{self.key(name)}: required key is missing")
        return default

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def number(
        self,
        name: str,
        default: Any = _MISSING,
        *,
        low: float | None = None,
        high: float | None = None,
        low_open: bool = False,
    ) -> Any:
        value = self.raw(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ScenarioError(f"{self.key(name)}: expected a number, got {_show(value)}")
        if low is not None and (value < low or (low_open and value == low)):
            raise ScenarioError(f"{self.key(name)}: must be {'>' if low_open else '>='} {low}, got {value!r}")
        if high is not None and value > high:
            raise ScenarioError(f"{self.key(name)}: must be <= {high}, got {value!r}")
        return float(value)

    def integer(self, name: str, default: Any = _MISSING, *, low: int | None = None) -> Any:
        value = self.raw(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ScenarioError(f"{self.key(name)}: expected an integer, got {_show(value)}")
        if low is not None and value < low:
            raise ScenarioError(f"{self.key(name)}: must be >= {low}, got {value!r}")
        return value

    def text(self, name: str, default: Any = _MISSING) -> Any:
        value = self.raw(name, default)
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise ScenarioError(f"{self.key(name)}: expected a string, got {_show(value)}")
        value = str(value)
        if not value.strip():
            raise ScenarioError(f"{self.key(name)}: must not be empty")
        return value

    def flag(self, name: str, default: bool) -> bool:
        value = self.raw(name, default)
        if not isinstance(value, bool):
            raise ScenarioError(f"{self.key(name)}: expected true or false, got {_show(value)}")
        return value

    def items(self, name: str, default: Any = _MISSING) -> list[Any]:
        value = self.raw(name, default)
        if not isinstance(value, list):
            raise ScenarioError(f"{self.key(name)}: expected a list, got {_show(value)}")
        return value

    def done(self, allowed: set[str] | None = None) -> None:
        allowed = self.used if allowed is None else allowed | self.used
        for name in self.data:
            if name not in allowed:
                raise ScenarioError(f"{self.key(str(name))}: unknown key (allowed: {', '.join(sorted(allowed))})")


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}"


# --- document structure --------------------------------------------------------------------------------


def _parse(data: Any) -> Scenario:
    top = _Obj(data, "")
    name = top.text("name", "scenario")
    description = top.text("description", "-")
    duration = top.number("duration_s", None, low=0, low_open=True)
    ambient = top.number("ambient_c", 27.0, low=-10, high=60)
    driver = top.text("driver_version", "550.90.07")
    cuda = top.integer("cuda_driver_version", 12040, low=1000)
    nodes = _parse_nodes(top.items("nodes"))
    jobs = tuple(_parse_job(_Obj(item, f"jobs[{i}]"), nodes) for i, item in enumerate(top.items("jobs", [])))
    _check_jobs(jobs)
    incidents = tuple(
        _parse_incident(_Obj(item, f"incidents[{i}]"), nodes, jobs) for i, item in enumerate(top.items("incidents", []))
    )
    top.done()
    return Scenario(name, description, duration, ambient, driver, cuda, nodes, jobs, incidents)


def _parse_nodes(items: list[Any]) -> tuple[NodeSpec, ...]:
    if not items:
        raise ScenarioError("nodes: at least one node is required")
    specs: list[NodeSpec] = []
    for i, item in enumerate(items):
        obj = _Obj(item, f"nodes[{i}]")
        name = obj.text("name")
        model_key = obj.text("model", "h100-sxm").lower()
        if model_key not in MODELS:
            raise ScenarioError(f"{obj.key('model')}: unknown GPU model {model_key!r} (known: {', '.join(MODELS)})")
        count = obj.integer("gpus", 8, low=1)
        if count > 64:
            raise ScenarioError(f"{obj.key('gpus')}: at most 64 GPUs per node, got {count}")
        mig = _parse_mig(obj, MODELS[model_key], count)
        obj.done()
        if any(s.name == name for s in specs):
            raise ScenarioError(f"{obj.key('name')}: duplicate node name {name!r}")
        specs.append(NodeSpec(name, MODELS[model_key], count, mig))
    return tuple(specs)


def _parse_mig(obj: _Obj, model: GpuModel, count: int) -> tuple[tuple[int, tuple[str, ...]], ...]:
    """`mig: [{gpu: N, instances: [PROFILE, ...]}, ...]`: the node's GPUs in MIG mode and their instances."""
    out: dict[int, tuple[str, ...]] = {}
    for i, item in enumerate(obj.items("mig", [])):
        entry = _Obj(item, f"{obj.key('mig')}[{i}]")
        gpu = entry.integer("gpu", low=0)
        if gpu >= count or gpu in out:
            raise ScenarioError(f"{entry.key('gpu')}: GPU {gpu} does not exist or is listed twice")
        names = tuple(str(p) for p in entry.items("instances", []))
        try:
            check_layout(model, names)
        except MigLayoutError as exc:
            raise ScenarioError(f"{entry.key('instances')}: {exc}") from None
        entry.done()
        out[gpu] = names
    return tuple(sorted(out.items()))


def _node_by_name(nodes: tuple[NodeSpec, ...], name: str, key: str) -> NodeSpec:
    for spec in nodes:
        if spec.name == name:
            return spec
    raise ScenarioError(f"{key}: unknown node {name!r} (nodes: {', '.join(s.name for s in nodes)})")


def _gpu_list(obj: _Obj, spec: NodeSpec) -> tuple[int, ...]:
    """The `gpu`/`gpus` selection of obj on node spec (all GPUs when neither is given)."""
    if obj.has("gpu") and obj.has("gpus"):
        raise ScenarioError(f"{obj.key('gpu')}: give either gpu or gpus, not both")
    if obj.has("gpu"):
        raw = [obj.raw("gpu")]
        key = obj.key("gpu")
    elif obj.has("gpus"):
        raw = obj.items("gpus")
        key = obj.key("gpus")
    else:
        obj.used.update(("gpu", "gpus"))
        return tuple(range(spec.gpu_count))
    out: list[int] = []
    for value in raw:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < spec.gpu_count:
            raise ScenarioError(
                f"{key}: GPU index {value!r} does not exist on node {spec.name!r} (0..{spec.gpu_count - 1})"
            )
        if value in out:
            raise ScenarioError(f"{key}: GPU index {value} listed twice")
        out.append(value)
    if not out:
        raise ScenarioError(f"{key}: must list at least one GPU")
    return tuple(out)


def _parse_job(obj: _Obj, nodes: tuple[NodeSpec, ...]) -> JobSpec:
    job_id = obj.text("id")
    gpus: list[GpuRef] = []
    for i, item in enumerate(obj.items("nodes")):
        key = f"{obj.key('nodes')}[{i}]"
        if isinstance(item, str):
            spec = _node_by_name(nodes, item, key)
            picked: tuple[int, ...] = tuple(range(spec.gpu_count))
        else:
            place = _Obj(item, key)
            spec = _node_by_name(nodes, place.text("node"), place.key("node"))
            picked = _gpu_list(place, spec)
            place.done()
        for index in picked:
            if (spec.name, index) in gpus:
                raise ScenarioError(f"{key}: GPU {spec.name}/{index} is placed twice in job {job_id!r}")
            gpus.append((spec.name, index))
    if not gpus:
        raise ScenarioError(f"{obj.key('nodes')}: a job needs at least one node")
    start = obj.number("start_s", 0.0, low=0)
    end = obj.number("end_s", None)
    if end is not None and end <= start:
        raise ScenarioError(f"{obj.key('end_s')}: must be after start_s ({start}), got {end}")
    step = obj.number("step_time_s", 0.8, low=0.01, high=600)
    compute = obj.number("compute_fraction", 0.8, low=0.05, high=0.99)
    intensity = obj.number("compute_intensity", TRAINING_COMPUTE_INTENSITY, low=0.05, high=4.0)
    memory_gib = obj.number("memory_used_gib", None, low=0, low_open=True)
    ramp = obj.number("ramp_up_s", 60.0, low=0)
    wind = obj.number("wind_down_s", 20.0, low=0)
    user = obj.text("user", "sim")
    scheduler = obj.text("scheduler", "slurm")
    if scheduler not in SCHEDULERS:
        raise ScenarioError(f"{obj.key('scheduler')}: must be one of {', '.join(SCHEDULERS)}, got {scheduler!r}")
    obj.done()
    memory = None if memory_gib is None else int(memory_gib * 1024**3)
    for node, _ in gpus:
        model = _node_by_name(nodes, node, obj.key("nodes")).model
        if memory is not None and memory > model.memory_total_bytes - model.memory_reserved_bytes:
            raise ScenarioError(f"{obj.key('memory_used_gib')}: {memory_gib} GiB does not fit on {model.name}")
    return JobSpec(job_id, tuple(gpus), start, end, step, compute, memory, ramp, wind, user, scheduler, intensity)


def _check_jobs(jobs: tuple[JobSpec, ...]) -> None:
    """Job ids are unique and no GPU runs two jobs at once."""
    for i, job in enumerate(jobs):
        for other in jobs[:i]:
            if other.id == job.id:
                raise ScenarioError(f"jobs[{i}].id: duplicate job id {job.id!r}")
            shared = set(job.gpus) & set(other.gpus)
            if shared and _overlap(job.start_s, job.end_s, other.start_s, other.end_s):
                node, index = sorted(shared)[0]
                raise ScenarioError(
                    f"jobs[{i}].nodes: GPU {node}/{index} already runs job {other.id!r} at the same time"
                )


def _overlap(a0: float, a1: float | None, b0: float, b1: float | None) -> bool:
    return a0 < (math.inf if b1 is None else b1) and b0 < (math.inf if a1 is None else a1)


# --- incidents -------------------------------------------------------------------------------------------


def _parse_incident(obj: _Obj, nodes: tuple[NodeSpec, ...], jobs: tuple[JobSpec, ...]) -> Incident:
    kind = obj.text("kind")
    parser = _INCIDENT_PARSERS.get(kind)
    if parser is None:
        known = ", ".join(_INCIDENT_PARSERS)
        raise ScenarioError(f"{obj.key('kind')}: unknown incident kind {kind!r} (known: {known})")
    start = obj.number("start_s", low=0)
    end = obj.number("end_s", None)
    if end is not None and end <= start:
        raise ScenarioError(f"{obj.key('end_s')}: must be after start_s ({start}), got {end}")
    fields = parser(obj, nodes, jobs)
    obj.done()
    return Incident(kind=kind, start_s=start, end_s=end, **fields)


def _gpu_targets(
    obj: _Obj, nodes: tuple[NodeSpec, ...], jobs: tuple[JobSpec, ...], *, allow_job: bool = False
) -> dict[str, Any]:
    """Resolve node/gpu(s) or (where allowed) job into the incident's GPU set."""
    if allow_job and obj.has("job"):
        if obj.has("node"):
            raise ScenarioError(f"{obj.key('job')}: give either node or job, not both")
        job = _job_by_id(obj, jobs)
        return {"gpus": job.gpus, "job": job.id}
    if obj.has("job"):
        raise ScenarioError(f"{obj.key('job')}: this incident kind targets a node or GPUs, not a job")
    spec = _node_by_name(nodes, obj.text("node"), obj.key("node"))
    return {"gpus": tuple((spec.name, i) for i in _gpu_list(obj, spec))}


def _job_by_id(obj: _Obj, jobs: tuple[JobSpec, ...]) -> JobSpec:
    job_id = obj.text("job")
    for job in jobs:
        if job.id == job_id:
            return job
    raise ScenarioError(f"{obj.key('job')}: unknown job {job_id!r} (jobs: {', '.join(j.id for j in jobs) or 'none'})")


def _cooling_failure(obj: _Obj, nodes, jobs) -> dict[str, Any]:
    out = _gpu_targets(obj, nodes, jobs)
    out["factor"] = obj.number("resistance_factor", 2.6, low=1.0)
    out["ambient_rise_c"] = obj.number("ambient_rise_c", 0.0, low=0, high=60)
    return out


def _slow_gpu(obj: _Obj, nodes, jobs) -> dict[str, Any]:
    out = _gpu_targets(obj, nodes, jobs)
    out["speed_factor"] = obj.number("speed_factor", 0.75, low=0.05, high=1.0)
    out["power_brake"] = obj.flag("power_brake", False)
    out["silent"] = obj.flag("silent", not out["power_brake"])
    if out["silent"] and out["power_brake"]:
        raise ScenarioError(f"{obj.key('silent')}: a silent slow GPU cannot also show power_brake bits")
    return out


def _host_starvation(obj: _Obj, nodes, jobs) -> dict[str, Any]:
    out = _gpu_targets(obj, nodes, jobs)
    out["input_wait_ratio"] = obj.number("input_wait_ratio", 0.6, low=0, low_open=True, high=20)
    return out


def _comm_slowdown(obj: _Obj, nodes, jobs) -> dict[str, Any]:
    job = _job_by_id(obj, jobs)
    return {"gpus": job.gpus, "job": job.id, "factor": obj.number("factor", 3.0, low=1.0, high=100)}


def _gpu_lost(obj: _Obj, nodes, jobs) -> dict[str, Any]:
    return _gpu_targets(obj, nodes, jobs)


def _xid(obj: _Obj, nodes, jobs) -> dict[str, Any]:
    out = _gpu_targets(obj, nodes, jobs)
    out["code"] = obj.integer("code", low=1)
    out["count"] = obj.integer("count", 1, low=1)
    if out["count"] > 100000:
        raise ScenarioError(f"{obj.key('count')}: at most 100000 events, got {out['count']}")
    return out


def _counter_reset(obj: _Obj, nodes, jobs) -> dict[str, Any]:
    if obj.has("end_s"):
        raise ScenarioError(f"{obj.key('end_s')}: a counter_reset happens at start_s and has no end")
    return _gpu_targets(obj, nodes, jobs)


def _power_cap(obj: _Obj, nodes, jobs) -> dict[str, Any]:
    out = _gpu_targets(obj, nodes, jobs, allow_job=True)
    out["watts"] = obj.number("watts", low=50, high=2000)
    return out


_INIT_ERRORS = ("driver_not_loaded", "library_not_found", "unknown", "no_permission")


def _nvml_init_failure(obj: _Obj, nodes, jobs) -> dict[str, Any]:
    error = obj.text("error", "driver_not_loaded")
    if error not in _INIT_ERRORS:
        raise ScenarioError(f"{obj.key('error')}: unknown error {error!r} (known: {', '.join(_INIT_ERRORS)})")
    if obj.has("gpu") or obj.has("gpus"):
        raise ScenarioError(f"{obj.key('gpu')}: nvml_init_failure targets whole nodes")
    if obj.has("node"):
        names: tuple[str, ...] = (_node_by_name(nodes, obj.text("node"), obj.key("node")).name,)
    else:
        names = tuple(n.name for n in nodes)
    return {"gpus": (), "nodes": names, "error": error}


def _ecc_errors(obj: _Obj, nodes, jobs) -> dict[str, Any]:
    out = _gpu_targets(obj, nodes, jobs)
    out["corrected"] = obj.integer("corrected", 0, low=0)
    out["uncorrected"] = obj.integer("uncorrected", 0, low=0)
    return out


def _link_errors(obj: _Obj, nodes, jobs) -> dict[str, Any]:
    out = _gpu_targets(obj, nodes, jobs)
    out["nvlink_replays"] = obj.integer("nvlink_replays", 0, low=0)
    out["pcie_replays"] = obj.integer("pcie_replays", 0, low=0)
    return out


_INCIDENT_PARSERS: dict[str, Callable[..., dict[str, Any]]] = {
    "cooling_failure": _cooling_failure,
    "slow_gpu": _slow_gpu,
    "host_starvation": _host_starvation,
    "comm_slowdown": _comm_slowdown,
    "gpu_lost": _gpu_lost,
    "xid": _xid,
    "counter_reset": _counter_reset,
    "power_cap": _power_cap,
    "nvml_init_failure": _nvml_init_failure,
    "ecc_errors": _ecc_errors,
    "link_errors": _link_errors,
}
INCIDENT_KINDS: tuple[str, ...] = tuple(_INCIDENT_PARSERS)


def timetable(scenario: Scenario) -> dict[str, Any]:
    """The scenario as plain JSON data: nodes, jobs and where and when each incident happens.

    `gpufleet-agent --simulate NAME --print-scenario` prints it; the server's demo reads it from there
    rather than importing the simulator.
    """
    return {
        "name": scenario.name,
        "nodes": list(scenario.nodes),
        "jobs": [
            {"id": job.id, "nodes": list(job.nodes), "gpus": [[node, index] for node, index in job.gpus]}
            for job in scenario.jobs
        ],
        "incidents": [
            {
                "kind": inc.kind,
                "start_s": inc.start_s,
                "end_s": inc.end_s,
                "job": inc.job,
                "gpus": [[node, index] for node, index in inc.gpus],
                "nodes": list(inc.nodes),
                "silent": inc.silent,
            }
            for inc in scenario.incidents
        ],
    }
