"""Appends each snapshot as one JSON line (the trace format); a failing disk never stops sampling."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import BinaryIO

log = logging.getLogger(__name__)

# A full disk fails every second; say so at most this often.
_WARN_EVERY_SECONDS = 60.0


class Recorder:
    """Writes `snapshot_json + b"\\n"` per call and flushes, so a crash loses at most one line."""

    def __init__(self, path: str | os.PathLike[str], *, monotonic=time.monotonic) -> None:
        self._path = os.fspath(path)
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._file: BinaryIO | None = None
        self._errors = 0
        self._last_warning = float("-inf")
        self._closed = False

    @property
    def path(self) -> str:
        """The trace file."""
        return self._path

    @property
    def errors(self) -> int:
        """Lines that could not be written."""
        return self._errors

    def write(self, snapshot_json: bytes) -> bool:
        """Append one line; returns False (logged and counted) when opening or writing fails."""
        with self._lock:
            if self._closed:
                return False
            try:
                if self._file is not None and self._moved():
                    log.info("record file moved away, starting a new one", extra={"path": self._path})
                    self._drop_file()
                if self._file is None:
                    self._file = open(self._path, "ab")  # noqa: SIM115 - held open across writes
                self._file.write(snapshot_json + b"\n")
                self._file.flush()
                return True
            except (OSError, ValueError) as exc:
                self._fail(exc)
                return False

    def _moved(self) -> bool:
        """Whether the path no longer names the open file: logrotate (or a person) renamed or deleted it.
        Checked before every write, as logging's WatchedFileHandler does: one stat a second costs nothing,
        and the agent then needs no signal to follow a rotation."""
        assert self._file is not None
        try:
            on_disk = os.stat(self._path)
        except FileNotFoundError:
            return True
        held = os.fstat(self._file.fileno())
        return (on_disk.st_dev, on_disk.st_ino) != (held.st_dev, held.st_ino)

    def reopen(self) -> None:
        """Start writing the path afresh at the next write (SIGHUP: what log rotation sends)."""
        with self._lock:
            self._drop_file()

    def _fail(self, exc: Exception) -> None:
        self._errors += 1
        # Reopen on the next write: the file may have been rotated away or the disk remounted.
        self._drop_file()
        now = self._monotonic()
        if now - self._last_warning >= _WARN_EVERY_SECONDS:
            self._last_warning = now
            log.warning(
                "cannot write snapshot record",
                extra={"path": self._path, "error": repr(exc), "failed_writes": self._errors},
            )

    def _drop_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None

    def close(self, timeout: float = -1) -> bool:
        """Flush and close; later writes are ignored (idempotent). False when a write still blocked after
        `timeout` seconds (a file on a hung mount, a FIFO swapped in): the file is then left to that write."""
        self._closed = True
        if not self._lock.acquire(timeout=timeout):
            log.warning("record file write blocked; left open", extra={"path": self._path})
            return False
        try:
            self._drop_file()
        finally:
            self._lock.release()
        return True
