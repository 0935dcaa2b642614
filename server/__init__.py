"""gpufleet server: pulls agents, detects stragglers, throttling and communication stalls."""

from gpufleet import __version__  # noqa: F401 - one version for the distribution
