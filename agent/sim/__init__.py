"""A pynvml-compatible NVML simulator: scenario files, GPU models, physics and the NVML facade."""

from gpufleet.agent.sim.nvml import SimNvml
from gpufleet.agent.sim.scenario import BUILTIN_SCENARIOS, Scenario, ScenarioError, load_scenario, parse_scenario

__all__ = ["BUILTIN_SCENARIOS", "Scenario", "ScenarioError", "SimNvml", "load_scenario", "parse_scenario"]
