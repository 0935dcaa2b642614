"""gpufleet node agent: samples NVML, attributes GPUs to jobs, serves /metrics and snapshots."""

__version__ = "0.1.0"
