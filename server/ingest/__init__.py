"""Ingest: the sample sources (base: what every one is to the server; puller: the agents, pulled;
prometheus: their series read from Prometheus) and where the agents are (targets)."""
