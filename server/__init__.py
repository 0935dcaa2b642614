"""gpufleet server: pulls agents, detects stragglers, throttling and communication stalls."""

__version__ = "0.1.0"
