"""Snapshot-contract parser for the server: JSON lines or dicts -> validated, columnar NodeSample.

Only the readings the engine uses are extracted (unknown fields are skipped by the decoder; so is the
agent's optional per-GPU `slow_readings_age_seconds`, how old its slow-tier readings are), into one
float64 matrix per snapshot, so that ingest costs a couple of microseconds per GPU. Unsupported
readings (null or absent) become NaN in that matrix and never 0. Anything that violates the contract
(wrong type, implausible value, duplicate GPU) raises ContractError naming the field.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Annotated, Any, Iterable, Iterator, Literal, Mapping, Optional, Union

import msgspec
import numpy as np
from msgspec import Meta

from gpufleet.server.readings import READINGS, Reading
from gpufleet.server.uuids import duplicate_gpu_uuid

SCHEMA_VERSION: Literal[1] = 1
MAX_LINE_BYTES = 4 * 1024 * 1024
MAX_GPUS_PER_NODE = 256
MAX_NODE_NAME = 256
MAX_K8S_NAME = 253  # a Kubernetes object name (DNS subdomain) is at most 253 characters

# Column order of NodeSample.values: the reading table's (server/readings.py); the engine indexes the
# columns by name through COLUMN, once, at import.
FIELDS = tuple(r.name for r in READINGS)
N_FIELDS = len(FIELDS)
COLUMN: Mapping[str, int] = MappingProxyType({name: i for i, name in enumerate(FIELDS)})
_NAN = float("nan")
MAX_GPU_INDEX = 4096

# Keys of a GPU's object that are not readings, after the reading each follows on the wire (None: first).
_OTHER_KEYS: dict[str | None, tuple[str, ...]] = {
    None: ("index", "uuid", "model"),
    "up": ("hpc_job", "kubernetes_namespace", "kubernetes_pod"),
    "xid_errors_total": ("xid_errors_by_code",),
}
_OTHER_TYPES: dict[str, tuple[Any, ...]] = {
    "index": (Annotated[int, Meta(ge=0, lt=MAX_GPU_INDEX)],),
    "uuid": (str,),
    "model": (str,),
    "hpc_job": (Union[str, int, None], None),
    # Not readings: where alerts about the GPU are routed (the Kubernetes pod of its processes).
    "kubernetes_namespace": (Optional[Annotated[str, Meta(max_length=MAX_K8S_NAME)]], None),
    "kubernetes_pod": (Optional[Annotated[str, Meta(max_length=MAX_K8S_NAME)]], None),
    # Keys are strings in JSON and ints in the agent's own model: checked in _xid_map.
    "xid_errors_by_code": (Optional[dict[Any, Any]], None),
}


def field_order(table: tuple[Reading, ...]) -> tuple[str, ...]:
    """Every key of a GPU's object the server reads, in the order the agent writes them: msgspec looks for
    each key at the position after the previous one first (4 % fewer instructions parsing;
    docs/benchmarks.md, "The decoder's field order")."""
    out = list(_OTHER_KEYS[None])
    for r in table:
        out += (r.name, *_OTHER_KEYS.get(r.name, ()))
    return tuple(out)


def wire_type(r: Reading) -> tuple[Any, ...]:
    """(type, default) a reading decodes as: a flag a bool, anything else a float within the reading's
    limits, which NaN fails, so a NaN smuggled into a decoded payload is refused too (JSON itself cannot
    carry one). Absent defaults to NaN (unsupported); an explicit null decodes to None, which numpy also
    turns into NaN."""
    if r.limits is None:
        return (Optional[bool], _NAN)
    return (Optional[Annotated[float, Meta(ge=r.limits[0], le=r.limits[1])]], _NAN)


def gpu_struct(table: tuple[Reading, ...]) -> type[msgspec.Struct]:
    """The wire schema of one GPU, compiled once: msgspec validates types and ranges in C while decoding and
    skips every field the engine does not read without building Python objects for it."""
    types = {**_OTHER_TYPES, **{r.name: wire_type(r) for r in table}}
    return msgspec.defstruct("GpuRow", [(f, *types[f]) for f in field_order(table)], kw_only=True, gc=False)


def clamps(table: tuple[Reading, ...]) -> tuple[tuple[slice, float], ...]:
    """(columns, ceiling) for the readings read no higher than their clamp: runs of adjacent columns with
    one ceiling as one slice each, so that a batch costs one numpy call per run."""
    runs: list[list[Any]] = []
    for i, r in enumerate(table):
        if r.clamp is None:
            continue
        if runs and runs[-1][1] == i and runs[-1][2] == r.clamp:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1, r.clamp])
    return tuple((slice(start, stop), high) for start, stop, high in runs)


GPU_FIELD_ORDER = field_order(READINGS)
_CLAMPS = clamps(READINGS)
_GpuRow = gpu_struct(READINGS)


class _Snapshot(msgspec.Struct, gc=False):
    node: Annotated[str, Meta(min_length=1, max_length=MAX_NODE_NAME)]
    time: Annotated[float, Meta(ge=0.0, lt=1e11)]
    gpus: Annotated[list[_GpuRow], Meta(max_length=MAX_GPUS_PER_NODE)]  # type: ignore[valid-type]
    schema: Literal[1] = SCHEMA_VERSION


_DECODER = msgspec.json.Decoder(_Snapshot)
_astuple = msgspec.structs.astuple
# Positions in a decoded row's tuple: the matrix columns in FIELDS order, then the identity and XIDs.
_COLUMNS = [GPU_FIELD_ORDER.index(f) for f in FIELDS]
(_I_INDEX, _I_UUID, _I_MODEL, _I_JOB, _I_NAMESPACE, _I_POD, _I_XID) = map(
    GPU_FIELD_ORDER.index,
    ("index", "uuid", "model", "hpc_job", "kubernetes_namespace", "kubernetes_pod", "xid_errors_by_code"),
)
# Lines are turned into matrices in batches of about this many GPU rows: enough to amortise numpy's
# per-call cost, small enough that the batch's Python objects stay in the CPU cache.
CHUNK_GPUS = 512
CHUNK_LINES = 2048


class ContractError(ValueError):
    """A payload that violates the snapshot contract; str() is the reason."""


Pod = tuple[str, str]  # (namespace, pod name)


class NodeSample:
    """One validated snapshot of one node: identities per GPU plus a float matrix of readings."""

    __slots__ = ("node", "time", "indices", "uuids", "models", "jobs", "values", "xid_by_code", "pods")

    def __init__(
        self,
        node: str,
        time: float,
        indices: tuple[int, ...],
        uuids: tuple[str, ...],
        models: tuple[str, ...],
        jobs: tuple[str | None, ...],
        values: np.ndarray,
        xid_by_code: tuple[Mapping[int, int] | None, ...] | None = None,
        pods: tuple[Pod | None, ...] | None = None,
    ) -> None:
        self.node = node
        self.time = time
        self.indices = indices
        self.uuids = uuids
        self.models = models
        self.jobs = jobs
        self.values = values
        self.xid_by_code = xid_by_code
        self.pods = pods  # per GPU, the (namespace, pod) its processes run in; None where no GPU has one

    def __len__(self) -> int:
        return len(self.indices)

    def __repr__(self) -> str:
        return f"NodeSample(node={self.node!r}, time={self.time}, gpus={len(self.indices)})"

    def value(self, gpu_index: int, field: str) -> float | None:
        """One reading by GPU index and field name (None when unsupported); for tests and debugging."""
        row = self.indices.index(gpu_index)
        v = float(self.values[row, FIELDS.index(field)])
        return None if math.isnan(v) else v


def parse_line(line: bytes | str) -> NodeSample:
    """Parse one JSON line of the snapshot contract."""
    result = _build([_decode(line)])[0]
    if isinstance(result, ContractError):
        raise result
    return result


def parse_snapshot(payload: Any) -> NodeSample:
    """Validate one decoded snapshot object (NodeSnapshot.to_dict() shape)."""
    try:
        snapshot = msgspec.convert(payload, _Snapshot)
    except msgspec.ValidationError as exc:
        raise ContractError(str(exc)) from None
    result = _build([snapshot])[0]
    if isinstance(result, ContractError):
        raise result
    return result


def parse_lines(lines: Iterable[bytes | str]) -> Iterator[tuple[int, NodeSample | ContractError]]:
    """(1-based line number, sample or error) for every non-blank line; matrices are built in batches."""
    for linenos, items, _ in parse_batches(lines):
        yield from zip(linenos, items)


Batch = tuple[list[int], list[NodeSample | ContractError], int]


def parse_batches(lines: Iterable[bytes | str]) -> Iterator[Batch]:
    """parse_lines a batch at a time: (line numbers, the sample or error of each, how many are errors), so
    that a reader keeps a batch without errors whole instead of looking at each of its lines."""
    identities: dict = {}
    linenos: list[int] = []
    pending: list[Any] = []
    rows = bad = 0
    for lineno, line in enumerate(lines, 1):
        # isspace() stops at the first '{' where strip() would copy the whole line.
        if not line or line.isspace():
            continue
        try:
            decoded = _decode(line)
        except ContractError as exc:
            pending.append(exc)
            bad += 1
        else:
            pending.append(decoded)
            rows += len(decoded.gpus)
        linenos.append(lineno)
        if rows >= CHUNK_GPUS or len(pending) >= CHUNK_LINES:
            yield _batch(linenos, pending, bad, identities)
            linenos, pending = [], []
            rows = bad = 0
    if pending:
        yield _batch(linenos, pending, bad, identities)


def decode_line(line: bytes | str) -> Any:
    """Decode and type/range-check one line without building its sample (ContractError when it fails):
    the decoding stage alone, as benchmarks time it."""
    return _decode(line)


def _batch(linenos: list[int], pending: list[Any], bad: int, identities: dict) -> Batch:
    """A chunk of decoded lines (bad of them errors already) built in one vectorised pass, in line order."""
    if not bad:
        items = _build(pending, identities)
    else:
        built = iter(_build([item for item in pending if not isinstance(item, ContractError)], identities))
        items = [item if isinstance(item, ContractError) else next(built) for item in pending]
    return linenos, items, sum(isinstance(item, ContractError) for item in items)


def _decode(line: bytes | str) -> _Snapshot:
    """Decode and type/range-check one line."""
    if len(line) > MAX_LINE_BYTES:
        raise ContractError(f"line exceeds {MAX_LINE_BYTES} bytes")
    try:
        return _DECODER.decode(line)
    except msgspec.DecodeError as exc:
        raise ContractError(str(exc)) from None
    except UnicodeDecodeError:
        # msgspec checks UTF-8 inside strings only as it builds them, and raises this, not DecodeError.
        raise ContractError("a string in it is not valid UTF-8") from None


def _build(snapshots: list[_Snapshot], identities: dict | None = None) -> list[NodeSample | ContractError]:
    """NodeSamples for decoded snapshots: one float matrix for the whole batch, sliced per line
    (identities: shared node identities across batches, see _sample)."""
    identities = {} if identities is None else identities
    if not snapshots:
        return []
    rows = [_astuple(g) for s in snapshots for g in s.gpus]
    if rows:
        cols = list(zip(*rows))
        matrix = _matrix(cols, len(rows))
        for cols_clamped, high in _CLAMPS:
            np.minimum(matrix[:, cols_clamped], high, out=matrix[:, cols_clamped])
        odd_jobs = _needs_job_normalising(cols[_I_JOB])
    else:
        cols, matrix, odd_jobs = [()] * len(GPU_FIELD_ORDER), np.empty((0, N_FIELDS)), False
    has_xids = any(cols[_I_XID])
    out: list[NodeSample | ContractError] = []
    start = 0
    for s in snapshots:
        end = start + len(s.gpus)
        out.append(_sample(s, matrix, cols, start, end, odd_jobs, has_xids, identities))
        start = end
    return out


def _matrix(cols: list[tuple], n: int) -> np.ndarray:
    """The batch's readings, shape (n, N_FIELDS), from its decoded columns, one column at a time: a reading
    no line of the batch carries (its NaN default throughout) is filled without converting n floats, and
    np.fromiter converts the others at half np.array's cost per value. A column with an explicit null
    (None, which fromiter refuses) takes np.array, which turns it into NaN like the absent readings."""
    out = np.empty((N_FIELDS, n))
    for row, i in zip(out, _COLUMNS):
        col = cols[i]
        if col[0] is _NAN and col.count(_NAN) == n:
            row.fill(_NAN)
            continue
        try:
            row[:] = np.fromiter(col, np.float64, n)
        except TypeError:
            row[:] = np.array(col, dtype=np.float64)
    return out.T


def _needs_job_normalising(jobs: tuple) -> bool:
    """Jobs need per-line normalising only when some are integers or empty strings."""
    return "" in jobs or int in set(map(type, jobs))


def _sample(
    s: _Snapshot,
    matrix: np.ndarray,
    cols: list[tuple],
    start: int,
    end: int,
    odd_jobs: bool,
    has_xids: bool,
    identities: dict,
) -> NodeSample | ContractError:
    """One line's NodeSample from its slice of the batch's columns (has_xids: some line of the batch
    has XID counts by code). A node's identity (name, GPU indices, UUIDs, models, jobs) repeats line
    after line: `identities` maps it to one shared copy, so a trace's samples hold one set of those
    strings per node instead of one per line (most of replay's memory, and its page faults); it also
    maps each node name to the (key, identity) of its latest line."""
    key = (
        s.node,
        cols[_I_INDEX][start:end],
        cols[_I_UUID][start:end],
        cols[_I_MODEL][start:end],
        cols[_I_JOB][start:end],
        cols[_I_NAMESPACE][start:end],
        cols[_I_POD][start:end],
    )
    # A node's identity is most often its previous line's: compared with that first, the fresh strings
    # of the line are never hashed (hashing them for the lookup below cost as much as comparing).
    last = identities.get(s.node)
    if last is not None and last[0] == key:
        ident = last[1]
    else:
        ident = _identity(key, odd_jobs, identities)
        if isinstance(ident, ContractError):
            return ident
        identities[s.node] = (key, ident)
    node, indices, uuids, models, jobs, pods = ident
    xids = None
    xid_raw = cols[_I_XID][start:end] if has_xids else ()
    if any(xid_raw):
        try:
            xids = tuple(_xid_map(x) for x in xid_raw)
        except ContractError as exc:
            return exc
    return NodeSample(node, s.time, indices, uuids, models, jobs, matrix[start:end], xids, pods)


def _identity(key: tuple, odd_jobs: bool, identities: dict) -> tuple | ContractError:
    """The shared identity tuples for a line's identity key (checked and stored on first sight)."""
    ident = identities.get(key)
    if ident is None:
        indices = key[1]
        if len(set(indices)) != len(indices):
            return ContractError(f"duplicate gpu index in {indices!r}")
        if (twice := duplicate_gpu_uuid(key[2])) is not None:
            return ContractError(twice)
        jobs = tuple(_job(j) for j in key[4]) if odd_jobs else key[4]
        ident = identities[key] = key[:4] + (jobs, _pods(key[5], key[6]))
    return ident


def _pods(namespaces: tuple, names: tuple) -> tuple[Pod | None, ...] | None:
    """(namespace, pod) per GPU where the agent names both; None when no GPU of the line has a pod."""
    if not any(names):
        return None
    return tuple((ns, pod) if ns and pod else None for ns, pod in zip(namespaces, names))


def _job(value: Any) -> str | None:
    """hpc_job as a string; empty means unattributed."""
    if value is None or value == "":
        return None
    return str(value)


def _xid_map(value: Any) -> dict[int, int] | None:
    """XID counts by code; None when empty or absent."""
    if not value:
        return None
    try:
        out = {int(k): int(v) for k, v in value.items()}
    except (TypeError, ValueError):
        raise ContractError("xid_errors_by_code must map integer codes to counts") from None
    if any(v < 0 for v in out.values()):
        raise ContractError("xid_errors_by_code counts must be non-negative")
    return out
