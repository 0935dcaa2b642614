"""The engine on random contract-valid input: GPUs that come and go, duplicate and backward times, readings
missing or at their limits, jobs and models that change, 64-bit throttle masks. Whatever it makes of such
samples, it must neither raise nor warn (a warning in the server's log reads as a bug to an operator)."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest

from gpufleet.server.contract import ContractError, parse_snapshot
from gpufleet.server.engine import Engine, EngineConfig

READINGS = (
    "utilization_ratio",
    "sm_active_ratio",
    "temperature_celsius",
    "slowdown_temperature_celsius",
    "power_watts",
    "power_limit_watts",
    "energy_joules_total",
    "sm_clock_hertz",
    "sm_clock_max_hertz",
    "throttle_reasons",
    "xid_errors_total",
    "ecc_uncorrected_errors_total",
    "memory_temperature_celsius",
    "memory_max_operating_temperature_celsius",
)


def reading(rng: random.Random, name: str) -> float | int | None:
    if rng.random() < 0.08:
        return None
    if name.endswith("_ratio"):
        return rng.choice([0.0, 1.0, 1.5, rng.random()])
    if "temperature" in name:
        return rng.choice([30.0, 83.0, 95.0, rng.uniform(-60.0, 250.0)])
    if name == "throttle_reasons":
        return rng.choice([0, 0x1, 0x20, 0x40, 0x80, 0x8, 0x4, 2**63, 2**63 + 0x40, rng.randrange(2**16)])
    if name.endswith("_total"):
        return rng.choice([0.0, rng.uniform(0.0, 1e6), 1e15])
    if "clock" in name:
        return rng.choice([1.98e9, 1.0e9, 0.0, rng.uniform(0.0, 3e9)])
    return rng.uniform(0.0, 1000.0)


def snapshot(rng: random.Random, node: int, t: float) -> dict:
    gpus = []
    for i in range(rng.choice([1, 2, 4, 8, 8])):
        gpu = {
            "index": i if rng.random() > 0.03 else rng.randrange(16),
            "uuid": f"GPU-{node}-{i}" if rng.random() > 0.03 else f"GPU-{rng.randrange(99)}",
            "model": "NVIDIA H100 80GB HBM3" if rng.random() > 0.05 else "NVIDIA A100-SXM4-80GB",
            "hpc_job": ("1", "2", None)[node % 3] if rng.random() > 0.05 else rng.choice(["1", "2", "", 7, None]),
            "up": rng.random() > 0.03,
        }
        gpu.update({name: reading(rng, name) for name in READINGS})
        if rng.random() < 0.02:
            gpu.update(xid_errors_by_code={"79": 1, "13": rng.randrange(5)}, last_xid=79)
        gpus.append(gpu)
    return {"schema": 1, "node": f"n{node}", "time": t + rng.uniform(-2.0, 2.0), "gpus": gpus}


@pytest.mark.parametrize("seed", range(4))
def test_random_valid_samples_neither_raise_nor_warn(seed):
    rng = random.Random(seed)
    engine = Engine(EngineConfig())
    t = 1.7e9 + rng.random() * 1000
    with warnings.catch_warnings(), np.errstate(all="warn"):
        warnings.simplefilter("error")
        for _ in range(rng.randint(50, 110)):
            t += rng.choice([1.0, 1.0, 5.0, 0.0, -3.0, 30.0, 0.5, 200.0])
            for node in range(rng.randint(1, 5)):
                try:
                    engine.ingest(parse_snapshot(snapshot(rng, node, t)))
                except ContractError:
                    pass  # a duplicate GPU index: the contract's to refuse, not the engine's concern
            if rng.random() < 0.7:
                engine.advance(t + rng.choice([0.0, 5.0, 60.0, -10.0]))
                engine.jobs(), engine.nodes(), engine.alerts()
    assert engine.stats().ticks > 0
