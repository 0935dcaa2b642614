"""The CPU each NVML function costs the agent, counted per call as it happens.

`MeteredNvml` stands between the reader and pynvml (or the simulator): every nvml* function it hands
out adds the calling thread's CPU time spent inside it to a per-function total, which the agent
exports as gpufleet_agent_nvml_seconds_total{call}. Thread CPU time, not wall time: a call that waits
in the driver costs nothing, a call that spins costs what it spins. Constants and structures pass
through untouched; each wrapper is built once, on first use, and calls the function the object holds
at that moment.
"""

from __future__ import annotations

import threading
import time
from types import MappingProxyType
from typing import Any, Callable, Mapping


class MeteredNvml:
    """Forwards to a pynvml-compatible object, summing thread CPU seconds per nvml* function."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._ns: dict[str, int] = {}
        self._last = threading.local()  # each thread's last call: (function, ns)

    def last_call_ns(self, name: str) -> int:
        """Thread CPU ns of this thread's last call, when that call was `name`; else 0. Read once: a
        second ask without a call in between answers 0."""
        last = getattr(self._last, "call", None)
        self._last.call = None
        return last[1] if last is not None and last[0] == name else 0

    def attribute(self, name: str, shares: Mapping[str, int]) -> None:
        """Move ns counted under `name` to `name/part`, e.g. a field-value batch's time to its fields."""
        with self._lock:
            moved = min(sum(shares.values()), self._ns.get(name, 0))
            self._ns[name] = self._ns.get(name, 0) - moved
            for part, ns in shares.items():
                key = f"{name}/{part}"
                self._ns[key] = self._ns.get(key, 0) + ns

    @property
    def seconds(self) -> Mapping[str, float]:
        """NVML function -> thread CPU seconds spent in it so far."""
        with self._lock:
            return MappingProxyType({name: ns / 1e9 for name, ns in self._ns.items()})

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if isinstance(value, (int, str, type)):  # constants and structures: kept, so later lookups are plain
            setattr(self, name, value)
            return value
        if not name.startswith("nvml") or not callable(value):
            return value
        wrapped = self._metered(name)
        setattr(self, name, wrapped)  # later lookups find it without __getattr__
        return wrapped

    def _metered(self, name: str) -> Callable[..., Any]:
        clock, lock, totals, inner, last = time.thread_time_ns, self._lock, self._ns, self._inner, self._last

        def call(*args: Any, **kwargs: Any) -> Any:
            started = clock()
            try:
                # Looked up per call: whatever the object holds now (tests swap functions in).
                return getattr(inner, name)(*args, **kwargs)
            finally:
                spent = clock() - started
                last.call = (name, spent)
                with lock:
                    totals[name] = totals.get(name, 0) + spent

        call.__name__ = name
        return call
