"""Snapshot-contract parser for the server: JSON lines or dicts -> validated, columnar NodeSample.

Only the readings the engine uses are extracted (unknown fields are ignored), straight into one float64
matrix per snapshot, so that ingest costs a few microseconds per GPU. Unsupported readings (null or
absent) become NaN in that matrix and never 0. Anything that violates the contract raises ContractError.
"""

from __future__ import annotations

import math
from operator import itemgetter
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import orjson

SCHEMA_VERSION = 1
MAX_LINE_BYTES = 4 * 1024 * 1024
MAX_GPUS_PER_NODE = 256
MAX_NODE_NAME = 256

# Column order of NodeSample.values; the engine indexes by these constants.
NUMERIC_FIELDS = (
    "utilization_ratio",
    "sm_active_ratio",
    "temperature_celsius",
    "slowdown_temperature_celsius",
    "power_watts",
    "power_limit_watts",
    "energy_joules_total",
    "sm_clock_hertz",
    "sm_clock_max_hertz",
    "throttle_reasons",
    "xid_errors_total",
    "last_xid",
    "ecc_uncorrected_errors_total",
)
BOOL_FIELDS = ("up", "remapped_rows_pending", "remapped_rows_failure")
FIELDS = NUMERIC_FIELDS + BOOL_FIELDS
(UTIL, SM, TEMP, SLOWDOWN_TEMP, POWER, POWER_LIMIT, ENERGY, CLOCK, CLOCK_MAX, THROTTLE, XID_TOTAL,
 LAST_XID, ECC_UNCORRECTED, UP, REMAP_PENDING, REMAP_FAILURE) = range(len(FIELDS))
N_FIELDS = len(FIELDS)

# Plausible physical ranges; a value outside is a broken agent, not a reading to act on.
_LIMITS = {
    "utilization_ratio": (0.0, 1.5),
    "sm_active_ratio": (0.0, 1.5),
    "temperature_celsius": (-60.0, 250.0),
    "slowdown_temperature_celsius": (-60.0, 250.0),
    "power_watts": (0.0, 10_000.0),
    "power_limit_watts": (0.0, 10_000.0),
    "energy_joules_total": (0.0, 1e18),
    "sm_clock_hertz": (0.0, 1e11),
    "sm_clock_max_hertz": (0.0, 1e11),
    "throttle_reasons": (0.0, 2.0**64),
    "xid_errors_total": (0.0, 1e15),
    "last_xid": (0.0, 1e9),
    "ecc_uncorrected_errors_total": (0.0, 1e18),
    "up": (0.0, 1.0),
    "remapped_rows_pending": (0.0, 1.0),
    "remapped_rows_failure": (0.0, 1.0),
}
_LOW = np.array([_LIMITS[f][0] for f in FIELDS])
_HIGH = np.array([_LIMITS[f][1] for f in FIELDS])
_NONE_TYPE = type(None)
_NUMBER_TYPES = frozenset((int, float, _NONE_TYPE))
_BOOL_TYPES = frozenset((bool, type(None)))
_STR_TYPES = frozenset((str,))
_JOB_TYPES = frozenset((str, int, type(None)))
_IDENTITY_FIELDS = ("index", "uuid", "model", "hpc_job", "xid_errors_by_code")
_ROW_FIELDS = FIELDS + _IDENTITY_FIELDS
_get_row = itemgetter(*_ROW_FIELDS)
_N_NUMERIC = len(NUMERIC_FIELDS)
(_I_INDEX, _I_UUID, _I_MODEL, _I_JOB, _I_XID) = range(N_FIELDS, N_FIELDS + 5)
# Lines are validated in batches of about this many GPU rows: enough to amortise numpy's per-call
# cost over a batch, small enough that the batch's Python objects stay in the CPU cache (2,048-line
# batches were about 1.5 µs per GPU-sample slower).
CHUNK_GPUS = 512
CHUNK_LINES = 2048


class ContractError(ValueError):
    """A payload that violates the snapshot contract; str() is the reason."""


class NodeSample:
    """One validated snapshot of one node: identities per GPU plus a float matrix of readings."""

    __slots__ = ("node", "time", "indices", "uuids", "models", "jobs", "values", "xid_by_code")

    def __init__(self, node: str, time: float, indices: tuple[int, ...], uuids: tuple[str, ...],
                 models: tuple[str, ...], jobs: tuple[str | None, ...], values: np.ndarray,
                 xid_by_code: tuple[Mapping[int, int] | None, ...] | None = None) -> None:
        self.node = node
        self.time = time
        self.indices = indices
        self.uuids = uuids
        self.models = models
        self.jobs = jobs
        self.values = values
        self.xid_by_code = xid_by_code

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
    result = _build([_decode(line)], check_nan=False)[0]
    if isinstance(result, ContractError):
        raise result
    return result


def parse_snapshot(payload: Any) -> NodeSample:
    """Validate one decoded snapshot object (NodeSnapshot.to_dict() shape)."""
    result = _build([_header(payload)], check_nan=True)[0]
    if isinstance(result, ContractError):
        raise result
    return result


def parse_lines(lines: Iterable[bytes | str]) -> Iterator[tuple[int, NodeSample | ContractError]]:
    """(1-based line number, sample or error) for every non-blank line; validation is batched."""
    pending: list[tuple[int, Any]] = []
    rows = 0
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            decoded = _decode(line)
        except ContractError as exc:
            pending.append((lineno, exc))
        else:
            pending.append((lineno, decoded))
            rows += len(decoded[2])
        if rows >= CHUNK_GPUS or len(pending) >= CHUNK_LINES:
            yield from _flush(pending)
            pending = []
            rows = 0
    yield from _flush(pending)


def _flush(pending: list[tuple[int, Any]]) -> Iterator[tuple[int, NodeSample | ContractError]]:
    """Validate a chunk of decoded lines in one vectorised pass, keeping line order."""
    good = [item for _, item in pending if not isinstance(item, ContractError)]
    built = iter(_build(good, check_nan=False))
    for lineno, item in pending:
        yield lineno, (item if isinstance(item, ContractError) else next(built))


def _decode(line: bytes | str) -> tuple[str, float, list[tuple]]:
    """JSON-decode one line and pull out its header and raw per-GPU rows."""
    if len(line) > MAX_LINE_BYTES:
        raise ContractError(f"line of {len(line)} bytes exceeds {MAX_LINE_BYTES}")
    try:
        payload = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ContractError(f"invalid JSON: {exc}") from None
    return _header(payload)


def _header(payload: Any) -> tuple[str, float, list[tuple]]:
    """Check schema/node/time/gpus and extract one raw tuple per GPU (absent fields -> None)."""
    if not isinstance(payload, dict):
        raise ContractError("snapshot is not a JSON object")
    schema = payload.get("schema", SCHEMA_VERSION)
    if type(schema) is not int or schema != SCHEMA_VERSION:
        raise ContractError(f"unsupported schema {schema!r}")
    node = payload.get("node")
    if type(node) is not str or not node or len(node) > MAX_NODE_NAME:
        raise ContractError("node must be a non-empty string")
    t = payload.get("time")
    if type(t) not in (int, float) or not (0.0 <= t < 1e11):
        raise ContractError(f"time must be a finite unix time, got {t!r}")
    gpus = payload.get("gpus")
    if type(gpus) is not list:
        raise ContractError("gpus must be a list")
    if len(gpus) > MAX_GPUS_PER_NODE:
        raise ContractError(f"{len(gpus)} gpus exceeds {MAX_GPUS_PER_NODE}")
    try:
        rows = list(map(_get_row, gpus))
    except (KeyError, TypeError):
        rows = _rows_with_absent_fields(gpus)
    return node, float(t), rows


def _rows_with_absent_fields(gpus: list) -> list[tuple]:
    """Field-by-field extraction for GPUs that omit fields (absent = unsupported)."""
    rows = []
    for i, g in enumerate(gpus):
        if not isinstance(g, dict):
            raise ContractError(f"gpu {i} is not an object")
        rows.append(tuple(g.get(f) for f in _ROW_FIELDS))
    return rows


def _build(decoded: list[tuple[str, float, list[tuple]]], *, check_nan: bool) -> list[NodeSample | ContractError]:
    """Turn decoded lines into NodeSamples; a chunk with a type error is redone line by line."""
    if not decoded:
        return []
    all_rows = [row for _, _, rows in decoded for row in rows]
    try:
        matrix, cols = _columns(all_rows, check_nan)
    except ContractError as exc:
        if len(decoded) == 1:
            return [exc]
        return [_build([d], check_nan=check_nan)[0] for d in decoded]
    with np.errstate(invalid="ignore"):
        bad_rows = np.flatnonzero(((matrix < _LOW) | (matrix > _HIGH)).any(axis=1))
    np.minimum(matrix[:, UTIL:SM + 1], 1.0, out=matrix[:, UTIL:SM + 1])
    out: list[NodeSample | ContractError] = []
    start = 0
    first_bad = int(bad_rows[0]) if len(bad_rows) else -1
    for node, t, rows in decoded:
        end = start + len(rows)
        if start <= first_bad < end:
            out.append(_range_error(matrix, first_bad, start))
            later = bad_rows[bad_rows >= end]
            first_bad = int(later[0]) if len(later) else -1
        else:
            out.append(_sample(node, t, matrix, cols, start, end))
        start = end
    return out


def _range_error(matrix: np.ndarray, row: int, start: int) -> ContractError:
    """Name the first out-of-range reading of a row."""
    col = int(np.argmax((matrix[row] < _LOW) | (matrix[row] > _HIGH)))
    return ContractError(f"gpu {row - start}: {FIELDS[col]}={matrix[row, col]!r} out of range")


def _columns(all_rows: list[tuple], check_nan: bool) -> tuple[np.ndarray, list[tuple]]:
    """Transpose rows into columns, type-check each column, convert readings to a float matrix."""
    if not all_rows:
        return np.empty((0, N_FIELDS)), [()] * len(_ROW_FIELDS) + [False]
    cols = list(zip(*all_rows))
    has_none = []
    for i in range(N_FIELDS):
        allowed = _NUMBER_TYPES if i < _N_NUMERIC else _BOOL_TYPES
        types = set(map(type, cols[i]))
        if not allowed.issuperset(types):
            bad = next(v for v in cols[i] if type(v) not in allowed)
            raise ContractError(f"{FIELDS[i]} has wrong type: {bad!r}")
        has_none.append(_NONE_TYPE in types)
    if not all(type(v) is int for v in cols[_I_INDEX]):
        raise ContractError("gpu index must be an integer")
    if not _STR_TYPES.issuperset(map(type, cols[_I_UUID])) or not _STR_TYPES.issuperset(map(type, cols[_I_MODEL])):
        raise ContractError("gpu uuid and model must be strings")
    job_types = set(map(type, cols[_I_JOB]))
    if not _JOB_TYPES.issuperset(job_types):
        raise ContractError("hpc_job must be a string or null")
    # Jobs need per-line normalising only when some are integers or empty strings.
    cols.append(int in job_types or "" in cols[_I_JOB])
    n = len(all_rows)
    matrix = np.empty((n, N_FIELDS))
    for i in range(N_FIELDS):
        col = cols[i]
        # fromiter is several times faster than np.array but cannot take None (unsupported readings).
        matrix[:, i] = np.array(col, dtype=np.float64) if has_none[i] else np.fromiter(col, np.float64, n)
    if check_nan and np.count_nonzero(np.isnan(matrix)) != sum(c.count(None) for c in cols[:N_FIELDS]):
        raise ContractError("NaN reading (unsupported readings must be null)")
    return matrix, cols


def _sample(node: str, t: float, matrix: np.ndarray, cols: list[tuple], start: int,
            end: int) -> NodeSample | ContractError:
    """One line's NodeSample from its slice of the chunk's columns."""
    indices = cols[_I_INDEX][start:end]
    if len(set(indices)) != len(indices):
        return ContractError(f"duplicate gpu index in {indices!r}")
    if indices and (min(indices) < 0 or max(indices) >= 4096):
        return ContractError(f"gpu index out of range in {indices!r}")
    jobs = cols[_I_JOB][start:end]
    if cols[-1]:
        jobs = tuple(_job(j) for j in jobs)
    xid_raw = cols[_I_XID][start:end]
    xids = None
    if any(xid_raw):
        try:
            xids = tuple(_xid_map(x) for x in xid_raw)
        except ContractError as exc:
            return exc
    return NodeSample(node, t, indices, cols[_I_UUID][start:end], cols[_I_MODEL][start:end], jobs,
                      matrix[start:end], xids)


def _job(value: Any) -> str | None:
    """hpc_job as a string; empty means unattributed."""
    if value is None or value == "":
        return None
    return str(value)


def _xid_map(value: Any) -> dict[int, int] | None:
    """XID counts by code; None when empty or absent."""
    if not value:
        return None
    if not isinstance(value, dict):
        raise ContractError("xid_errors_by_code must be an object")
    try:
        out = {int(k): int(v) for k, v in value.items()}
    except (TypeError, ValueError):
        raise ContractError("xid_errors_by_code must map integer codes to counts") from None
    if any(v < 0 for v in out.values()):
        raise ContractError("xid_errors_by_code counts must be non-negative")
    return out
