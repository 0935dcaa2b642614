"""SQLite persistence of alerts: the open ones (restored into the engine on restart) and their history.

The engine decides; the store only records the latest state of every alert occurrence (one row per
alert id, upserted on each transition) and answers filtered, paginated queries for the API.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import orjson

from gpufleet.server.alerts import Alert, AlertKind, AlertState, IncidentRole, Severity
from gpufleet.server.ingest.identity import NodePin

log = logging.getLogger(__name__)

MAX_PAGE = 1000

_ALERTS_TABLE = """
CREATE TABLE IF NOT EXISTS {schema}alerts (
    id TEXT PRIMARY KEY,
    fingerprint TEXT NOT NULL,
    kind TEXT NOT NULL,
    severity TEXT NOT NULL,
    state TEXT NOT NULL,
    node TEXT,
    gpu INTEGER,
    uuid TEXT,
    hpc_job TEXT,
    pending_since REAL NOT NULL,
    started REAL,
    resolved REAL,
    updated REAL NOT NULL,
    summary TEXT NOT NULL,
    evidence BLOB NOT NULL,
    labels BLOB NOT NULL DEFAULT '{{}}',
    advice TEXT NOT NULL DEFAULT '',
    incident TEXT,
    role TEXT
);
"""
_SCHEMA = (
    _ALERTS_TABLE.format(schema="")
    + """
CREATE INDEX IF NOT EXISTS alerts_state ON alerts(state);
CREATE INDEX IF NOT EXISTS alerts_order ON alerts(pending_since DESC, id);
CREATE INDEX IF NOT EXISTS alerts_resolved ON alerts(resolved);
CREATE TABLE IF NOT EXISTS target_nodes (
    target TEXT PRIMARY KEY,
    node TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS node_pins (
    node TEXT PRIMARY KEY,
    target TEXT NOT NULL,
    gpu_uuids BLOB NOT NULL,
    served REAL NOT NULL
);
"""
)

_COLUMNS = (
    "id, fingerprint, kind, severity, state, node, gpu, uuid, hpc_job, pending_since, started, "
    "resolved, updated, summary, evidence, labels, advice, incident, role"
)


class StoreError(RuntimeError):
    """The database file cannot be opened or has an incompatible layout."""


@dataclass(frozen=True, slots=True)
class AlertQuery:
    """Filters and a page; `since` keeps alerts still open or resolved at or after that time."""

    state: AlertState | None = None
    kind: AlertKind | None = None
    severity: Severity | None = None
    node: str | None = None
    gpu: int | None = None
    hpc_job: str | None = None
    incident: str | None = None
    since: float | None = None
    limit: int = 100
    offset: int = 0


@dataclass(frozen=True, slots=True)
class AlertPage:
    """One page of alerts, newest first, and how many match in all."""

    alerts: list[Alert]
    total: int


class AlertStore:
    """Alert rows in one SQLite file (WAL mode), safe to use from the engine task and API threads."""

    def __init__(
        self, path: str | Path, *, retention_seconds: float = 7 * 86400.0, max_resolved: int = 100_000
    ) -> None:
        self.path = str(path)
        self.retention_seconds = retention_seconds
        self.max_resolved = max_resolved
        self._lock = threading.Lock()
        self._unsaved = 0  # rows in unsaved.alerts
        # What failed last, by "read" and "write", until an operation of that kind succeeds: /healthz says it.
        self.failing: dict[str, str] = {}
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            _add_missing_columns(self._db)
            # Rows a failed write could not put on disk (a full disk): kept in memory, where the reads find
            # them too, until the retried write succeeds. Nothing that fired goes missing from /alerts.
            self._db.execute("ATTACH DATABASE ':memory:' AS unsaved")
            self._db.executescript(_ALERTS_TABLE.format(schema="unsaved."))
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open alert store {self.path!r}: {exc}") from None

    def close(self) -> None:
        """Close the database (idempotent)."""
        with self._lock:
            self._db.close()

    def upsert(self, alerts: Iterable[Alert]) -> int:
        """Write the latest state of each alert in one transaction; returns rows written."""
        rows = [_to_row(a) for a in alerts]
        if not rows:
            return 0
        placeholders = ", ".join("?" * len(rows[0]))
        with self._lock:
            try:
                with self._watch("write"), self._transaction():
                    self._db.executemany(
                        f"INSERT OR REPLACE INTO main.alerts ({_COLUMNS}) VALUES ({placeholders})", rows
                    )
            except sqlite3.Error:
                self._db.executemany(
                    f"INSERT OR REPLACE INTO unsaved.alerts ({_COLUMNS}) VALUES ({placeholders})", rows
                )
                self._unsaved = self._db.execute("SELECT COUNT(*) FROM unsaved.alerts").fetchone()[0]
                raise
            if self._unsaved:
                self._db.executemany("DELETE FROM unsaved.alerts WHERE id = ?", [(row[0],) for row in rows])
                self._unsaved = self._db.execute("SELECT COUNT(*) FROM unsaved.alerts").fetchone()[0]
        return len(rows)

    def open_alerts(self) -> list[Alert]:
        """Pending and firing alerts, oldest first: what the engine restores after a restart."""
        with self._lock, self._watch("read"):
            sql = (
                f"SELECT {_COLUMNS} FROM {self._alerts()} WHERE state IN ('pending', 'firing') "
                "ORDER BY pending_since, id"
            )
            return [_from_row(r) for r in self._db.execute(sql)]

    def get(self, alert_id: str) -> Alert | None:
        """One alert occurrence by id."""
        with self._lock, self._watch("read"):
            row = self._db.execute(f"SELECT {_COLUMNS} FROM {self._alerts()} WHERE id = ?", (alert_id,)).fetchone()
        return _from_row(row) if row else None

    def query(self, q: AlertQuery) -> AlertPage:
        """Filtered alerts, newest first, with the total count for pagination."""
        where, args = _where(q)
        limit = max(0, min(q.limit, MAX_PAGE))
        with self._lock, self._watch("read"):
            table = self._alerts()
            total = self._db.execute(f"SELECT COUNT(*) FROM {table} {where}", args).fetchone()[0]
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM {table} {where} ORDER BY pending_since DESC, id LIMIT ? OFFSET ?",
                (*args, limit, max(0, q.offset)),
            ).fetchall()
        return AlertPage([_from_row(r) for r in rows], total)

    def target_nodes(self) -> dict[str, str]:
        """The node name each agent target last reported, so a restart can name an agent that is down."""
        with self._lock, self._watch("read"):
            return dict(self._db.execute("SELECT target, node FROM target_nodes").fetchall())

    def remember_target_nodes(self, nodes: dict[str, str]) -> None:
        """Record (or update) the node names of some targets."""
        if nodes:
            with self._lock, self._watch("write"):
                with self._transaction():
                    self._db.executemany(
                        "INSERT OR REPLACE INTO target_nodes (target, node) VALUES (?, ?)", list(nodes.items())
                    )

    def node_pins(self) -> dict[str, NodePin]:
        """What each node's name was pinned to (its target, its GPU uuids, when it was last answered for)."""
        with self._lock, self._watch("read"):
            rows = self._db.execute("SELECT node, target, gpu_uuids, served FROM node_pins").fetchall()
        pins = {}
        for node, target, uuids, served in rows:
            with contextlib.suppress(orjson.JSONDecodeError, TypeError):  # a row edited by hand is no pin
                if isinstance(served, (int, float)):
                    pins[node] = NodePin(
                        target, frozenset(u for u in orjson.loads(uuids) if isinstance(u, str)), served
                    )
        return pins

    def remember_node_pins(self, pins: Mapping[str, NodePin | None]) -> None:
        """Record (or update, or with None delete) the pins of some nodes."""
        kept = [(node, p.target, orjson.dumps(sorted(p.gpu_uuids)), p.served) for node, p in pins.items() if p]
        dropped = [(node,) for node, p in pins.items() if p is None]
        if kept or dropped:
            with self._lock, self._watch("write"):
                with self._transaction():
                    self._db.executemany(
                        "INSERT OR REPLACE INTO node_pins (node, target, gpu_uuids, served) VALUES (?, ?, ?, ?)", kept
                    )
                    self._db.executemany("DELETE FROM node_pins WHERE node = ?", dropped)

    def prune(self, now: float) -> int:
        """Drop resolved alerts past the retention age or beyond the row cap; returns rows deleted."""
        with self._lock, self._watch("write"):
            with self._transaction():
                old = self._db.execute(
                    "DELETE FROM main.alerts WHERE state = 'resolved' AND resolved < ?", (now - self.retention_seconds,)
                ).rowcount
                extra = self._db.execute(
                    "DELETE FROM main.alerts WHERE id IN (SELECT id FROM main.alerts WHERE state = 'resolved' "
                    "ORDER BY resolved DESC LIMIT -1 OFFSET ?)",
                    (self.max_resolved,),
                ).rowcount
        if old or extra:
            log.info("alert history pruned", extra={"deleted": old + extra})
        return old + extra

    @contextlib.contextmanager
    def _watch(self, operation: str) -> Iterator[None]:
        """Note a failing read or write (and clear it once one succeeds), for /healthz. Called under the lock."""
        try:
            yield
        except sqlite3.Error as exc:
            self.failing[operation] = str(exc) or exc.__class__.__name__
            raise
        self.failing.pop(operation, None)

    def _alerts(self) -> str:
        """The table reads use: the file's rows, overlaid with the unsaved ones while there are any (only
        then, so that the usual reads keep the file's indexes). Called under the lock."""
        if not self._unsaved:
            return "main.alerts"
        return (
            "(SELECT * FROM main.alerts WHERE id NOT IN (SELECT id FROM unsaved.alerts) "
            "UNION ALL SELECT * FROM unsaved.alerts)"
        )

    def _transaction(self) -> "_Tx":
        """BEGIN/COMMIT around a block (the connection is in autocommit mode)."""
        return _Tx(self._db)


class _Tx:
    """Minimal transaction context for an autocommit connection."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN")

    def __exit__(self, exc_type: object, *_: object) -> None:
        if not exc_type:
            self._db.execute("COMMIT")
        elif self._db.in_transaction:
            # SQLite rolls back by itself on some errors (a full disk): a second ROLLBACK would raise and
            # hide the error that matters.
            self._db.execute("ROLLBACK")


def query_open(alerts: Iterable[Alert], q: AlertQuery) -> AlertPage:
    """The query answered from the open alerts alone (the engine's, in memory), newest first: what /alerts
    serves while the store cannot be read."""
    matching = [
        a
        for a in alerts
        if all(
            want is None or have == want
            for have, want in (
                (a.state, q.state),
                (a.kind, q.kind),
                (a.severity, q.severity),
                (a.node, q.node),
                (a.gpu, q.gpu),
                (a.hpc_job, q.hpc_job),
                (a.incident, q.incident),
            )
        )
        and (q.since is None or a.resolved is None or a.resolved >= q.since)
    ]
    matching.sort(key=lambda a: (-a.pending_since, a.id))
    offset = max(0, q.offset)
    return AlertPage(matching[offset : offset + max(0, min(q.limit, MAX_PAGE))], len(matching))


def _where(q: AlertQuery) -> tuple[str, list[object]]:
    """SQL WHERE clause and arguments for a query's filters."""
    clauses: list[str] = []
    args: list[object] = []
    for column, value in (("state", q.state), ("kind", q.kind), ("severity", q.severity)):
        if value is not None:
            clauses.append(f"{column} = ?")
            args.append(value.value)
    for column, plain in (("node", q.node), ("gpu", q.gpu), ("hpc_job", q.hpc_job), ("incident", q.incident)):
        if plain is not None:
            clauses.append(f"{column} = ?")
            args.append(plain)
    if q.since is not None:
        clauses.append("(resolved IS NULL OR resolved >= ?)")
        args.append(q.since)
    return ("WHERE " + " AND ".join(clauses) if clauses else ""), args


def _to_row(a: Alert) -> Sequence[object]:
    """An alert as a table row."""
    return (
        a.id,
        a.fingerprint,
        a.kind.value,
        a.severity.value,
        a.state.value,
        a.node,
        a.gpu,
        a.uuid,
        a.hpc_job,
        a.pending_since,
        a.started,
        a.resolved,
        a.updated,
        a.summary,
        orjson.dumps(dict(a.evidence), option=orjson.OPT_NON_STR_KEYS, default=str),
        orjson.dumps(dict(a.labels)),
        a.advice,
        a.incident,
        None if a.role is None else a.role.value,
    )


def _from_row(r: Sequence[Any]) -> Alert:
    """A table row as an alert."""
    return Alert(
        id=r[0],
        fingerprint=r[1],
        kind=AlertKind(r[2]),
        severity=Severity(r[3]),
        state=AlertState(r[4]),
        node=r[5],
        gpu=r[6],
        uuid=r[7],
        hpc_job=r[8],
        pending_since=r[9],
        started=r[10],
        resolved=r[11],
        updated=r[12],
        summary=r[13],
        evidence=orjson.loads(r[14]),
        labels=orjson.loads(r[15]),
        advice=r[16],
        incident=r[17],
        role=_role(r[18]),
    )


def _role(value: Any) -> IncidentRole | None:
    """A stored role; None for a row written before incidents (or edited by hand)."""
    try:
        return IncidentRole(value)
    except ValueError:
        return None


def _add_missing_columns(db: sqlite3.Connection) -> None:
    """Bring a store written by an older version up to the current table (columns only ever get added)."""
    have = {row[1] for row in db.execute("PRAGMA table_info(alerts)")}
    if "labels" not in have:
        db.execute("ALTER TABLE alerts ADD COLUMN labels BLOB NOT NULL DEFAULT '{}'")
    if "advice" not in have:
        db.execute("ALTER TABLE alerts ADD COLUMN advice TEXT NOT NULL DEFAULT ''")
    for column in ("incident", "role"):
        if column not in have:
            db.execute(f"ALTER TABLE alerts ADD COLUMN {column} TEXT")
