"""gpufleet: the core both daemons share (configuration syntax, web config, logging, the snapshot vocabulary)."""

__version__ = "0.1.0"
