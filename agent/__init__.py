"""gpufleet node agent: samples NVML, attributes GPUs to jobs, serves /metrics and snapshots."""

from gpufleet import __version__  # noqa: F401 - one version for the distribution
