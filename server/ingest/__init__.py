"""Ingest: where the agents are (targets) and pulling their snapshots (puller)."""
