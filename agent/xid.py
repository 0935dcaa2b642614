"""XID events on a thread of their own, because NVML only delivers them through a blocking wait.

nvmlEventSetWait_v2 blocks up to a timeout, so it cannot share the sampler's timer. A daemon thread
waits in a loop and counts critical XID errors per GPU and code into a lock-protected store that the
reader copies on every poll. The store belongs to the reader and outlives the thread, so counts survive
an NVML re-initialisation. Stopping never waits longer than one wait timeout.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Hashable, Mapping

from gpufleet.agent.nvml_errors import TIMEOUT, ErrorCounts, error_code, error_name

log = logging.getLogger(__name__)

XID_READING = "xid_errors_total"
_MAX_BACKOFF_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class XidCounts:
    """XID events seen on one GPU since the agent started."""

    total: int = 0
    by_code: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))
    last: int | None = None


_NO_EVENTS = XidCounts()


class XidStore:
    """Per-GPU (by UUID) XID counts; written by the watcher thread, copied by the sampler."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_code: dict[str, Counter[int]] = {}
        # Each GPU's counts as the sampler reads them, made when an event arrives (rarely) rather than on
        # every read (every GPU, every cycle).
        self._counts: dict[str, XidCounts] = {}

    def record(self, uuid: str, code: int) -> None:
        """Count one XID event."""
        with self._lock:
            by_code = self._by_code.setdefault(uuid, Counter())
            by_code[code] += 1
            self._counts[uuid] = XidCounts(sum(by_code.values()), MappingProxyType(dict(by_code)), code)

    def get(self, uuid: str) -> XidCounts:
        """One GPU's counts, immutable (zero when it never had an event)."""
        return self._counts.get(uuid, _NO_EVENTS)


def handle_key(handle: Any) -> Hashable:
    """A key equal for two references to the same device handle.

    pynvml hands back a fresh ctypes pointer object in every event, so real handles compare by address;
    other (simulated) handles compare as themselves.
    """
    if isinstance(handle, (ctypes._Pointer, ctypes.c_void_p)):  # noqa: SLF001 - ctypes' pointer base
        return ("address", ctypes.cast(handle, ctypes.c_void_p).value)
    try:
        hash(handle)
    except TypeError:
        return ("id", id(handle))
    return ("object", handle)


class XidWatcher:
    """Registers GPUs for critical XID events and counts them on a daemon thread."""

    def __init__(self, nvml: Any, store: XidStore, errors: ErrorCounts, *, wait_ms: int) -> None:
        self._nvml = nvml
        self._store = store
        self._errors = errors
        self._wait_ms = wait_ms
        self._devices: dict[Hashable, str] = {}
        self._event_set: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._logged_errors: set[str] = set()

    @property
    def watched(self) -> frozenset[str]:
        """UUIDs of the GPUs whose XID events are counted."""
        return frozenset(self._devices.values())

    def register(self, handle: Any, uuid: str) -> None:
        """Ask NVML for this GPU's XID events; raises pynvml's NVMLError (e.g. NotSupported)."""
        if self._event_set is None:
            self._event_set = self._nvml.nvmlEventSetCreate()
        self._nvml.nvmlDeviceRegisterEvents(handle, self._nvml.nvmlEventTypeXidCriticalError, self._event_set)
        self._devices[handle_key(handle)] = uuid

    def start(self) -> None:
        """Start waiting for events, if any GPU was registered."""
        if not self._devices or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="gpufleet-xid", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (waiting at most one wait timeout) and free the event set."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._wait_ms / 1000.0 + 0.05)
            if self._thread.is_alive():
                # Freeing the set under a wait that never returns would crash the driver call; leak it.
                log.warning("xid watcher still inside an NVML wait; leaving its event set", extra={})
                return
        self._free_event_set()

    def _free_event_set(self) -> None:
        """Release the event set; errors are ignored since the library may already be gone."""
        event_set, self._event_set = self._event_set, None
        if event_set is None:
            return
        try:
            self._nvml.nvmlEventSetFree(event_set)
        except Exception:  # noqa: BLE001 - best effort on teardown
            log.debug("nvmlEventSetFree failed", exc_info=True)

    def _run(self) -> None:
        """Wait for events until stopped; back off on failures instead of spinning."""
        backoff = 0.0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                data = self._nvml.nvmlEventSetWait_v2(self._event_set, self._wait_ms)
            except Exception as exc:  # noqa: BLE001 - every failure must keep the thread alive
                backoff = self._on_wait_error(exc, backoff)
                self._stop.wait(backoff or self._unwaited(started))
                continue
            backoff = 0.0
            self._on_event(data)

    def _unwaited(self, started: float) -> float:
        """What is left of the wait timeout when a Timeout came back early (a non-blocking simulator):
        waiting it out here keeps the thread from spinning."""
        wait_s = self._wait_ms / 1000.0
        left = wait_s - (time.monotonic() - started)
        return left if left > wait_s / 2 else 0.0

    def _on_wait_error(self, exc: BaseException, backoff: float) -> float:
        """Count a failed wait, log its kind once, and return the next backoff (0 for a plain timeout)."""
        name = error_name(error_code(exc))
        if name == TIMEOUT:
            return 0.0
        self._errors.add(XID_READING, name)
        if name not in self._logged_errors:
            self._logged_errors.add(name)
            log.warning("xid event wait failed; backing off", extra={"error": name, "detail": str(exc)})
        first = max(self._wait_ms / 1000.0, 0.1)
        return min(_MAX_BACKOFF_SECONDS, backoff * 2 if backoff else first)

    def _on_event(self, data: Any) -> None:
        """Count one delivered event if it is a critical XID on a GPU we registered."""
        if not int(data.eventType) & int(self._nvml.nvmlEventTypeXidCriticalError):
            return
        uuid = self._devices.get(handle_key(data.device))
        if uuid is None:
            log.debug("xid event for an unknown device handle ignored", extra={"xid": int(data.eventData)})
            return
        code = int(data.eventData)
        self._store.record(uuid, code)
        log.warning("xid error", extra={"uuid": uuid, "xid": code})
