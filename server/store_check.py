"""The alert store's check at start: SQLite's own integrity check, and what to do with a damaged file.

A damaged page (a disk error, a copy taken mid-write) may lie anywhere: in a page read at start, the
server would die in its restore; in one read later, every write and some reads would fail for as long
as it runs. Checked once before the store opens, the damage is dealt with where it is cheap: the file
is moved aside, named in the log, and a fresh store started (the engine re-raises what is still wrong
from the agents' buffers), or the start is refused, as --storage.on-corruption says.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import Callable

from gpufleet.server.store import AlertStore, StoreError

log = logging.getLogger(__name__)

MOVE_ASIDE = "move-aside"
REFUSE = "refuse"
ON_CORRUPTION = (MOVE_ASIDE, REFUSE)
_SQLITE_HEADER = b"SQLite format 3\x00"
# integrity_check also checks every index against its table; its cost grows with the file, so a large
# store gets quick_check (every page and record, not the index contents).
FULL_CHECK_MAX_BYTES = 256 * 1024 * 1024
_SIDE_FILES = ("-wal", "-shm")


def damage(path: str | Path, *, full_check_max_bytes: int = FULL_CHECK_MAX_BYTES) -> str | None:
    """What SQLite finds wrong with the store file, or None when it is sound, empty or not there yet. A file
    that is not SQLite at all is left to AlertStore, which refuses it: it is likely not ours to move."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            header = fh.read(len(_SQLITE_HEADER))
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreError(f"cannot open alert store {str(path)!r}: {exc.strerror or exc}") from None
    if header != _SQLITE_HEADER:
        return None
    pragma = "integrity_check" if size <= full_check_max_bytes else "quick_check"
    try:
        db = sqlite3.connect(path, isolation_level=None)
    except sqlite3.Error as exc:
        return str(exc)
    try:
        rows = [str(r[0]) for r in db.execute(f"PRAGMA {pragma}(20)").fetchall()]
    except sqlite3.Error as exc:
        return str(exc) or exc.__class__.__name__  # damage where the check starts: the schema page
    finally:
        db.close()
    if rows == ["ok"]:
        return None
    found = " ".join(" ".join(rows).split())  # one line: integrity_check's rows hold newlines
    return found if len(found) <= 200 else found[:200] + "..."


def open_checked(
    path: str | Path,
    *,
    on_corruption: str = MOVE_ASIDE,
    retention_seconds: float = 7 * 86400.0,
    clock: Callable[[], float] = time.time,
) -> AlertStore:
    """The alert store at `path`, checked first; a damaged one is moved aside (and a fresh one opened) or
    refused with StoreError, by `on_corruption`."""
    problem = damage(path)
    if problem is not None:
        if on_corruption == REFUSE:
            raise StoreError(
                f"alert store {str(path)!r} is damaged ({problem}); move it away, or start with "
                f"--storage.on-corruption {MOVE_ASIDE} to have that done"
            )
        copy = move_aside(Path(path), clock())
        log.error(
            "alert store damaged: moved aside, starting a fresh one",
            extra={"path": str(path), "copy": str(copy), "problem": problem},
        )
    return AlertStore(path, retention_seconds=retention_seconds)


def move_aside(path: Path, now: float) -> Path:
    """Rename the store and its WAL files to `<name>.damaged-<UTC time>[-n]`; returns the store's new name."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    copy = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while any(os.path.lexists(f"{copy}{side}") for side in ("", *_SIDE_FILES)):
        n += 1
        copy = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    try:
        os.rename(path, copy)  # first: when this fails nothing has moved, and the start is refused
        for side in _SIDE_FILES:  # then its WAL, which belongs to it and must not meet the fresh store
            if os.path.lexists(f"{path}{side}"):
                os.rename(f"{path}{side}", f"{copy}{side}")
    except OSError as exc:
        raise StoreError(
            f"alert store {str(path)!r} is damaged and cannot be moved aside: {exc.strerror or exc}"
        ) from None
    return copy
