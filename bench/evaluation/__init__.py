"""The evaluation harness: the trace generator, the scenario catalog and probes, their scoring, the alert
digest and the cross-check on the agent's simulator."""
