"""The agent's view of itself, published next to each snapshot: NVML state, error counts, capabilities."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

_EMPTY: Mapping[Any, Any] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class AgentHealth:
    """Agent state at one publication; immutable like the snapshot it travels with."""

    node: str
    version: str
    nvml_up: bool
    # Why NVML is down (exception class name), None while it is up or before the first attempt.
    nvml_error: str | None = None
    # The exception's message, for /healthz and --once ("nvmlInit failed: Driver Not Loaded").
    nvml_error_detail: str | None = None
    # (reading, error) -> cumulative count: the reader's own plus the agent's (cycle, record, attribution).
    errors: Mapping[tuple[str, str], int] = field(default_factory=lambda: _EMPTY)
    # GPU index -> reading name -> supported, probed once when NVML opens.
    capabilities: Mapping[int, Mapping[str, bool]] = field(default_factory=lambda: _EMPTY)
    # Sampling cycles attempted so far (successful or not).
    cycles_total: int = 0
    # NVML function -> thread CPU seconds the agent spent in it since start (agent.nvml_meter).
    nvml_seconds: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    # Read unit -> seconds between its reads, as fitted to the CPU budget at open (agent.tiers).
    reading_periods: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
