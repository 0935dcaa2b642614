"""The straggler detector's policy as declared rules: what they name, the interpreter's margin factors and
plain cut-offs, no threshold left in the detector's code, and switching rules off by name."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from gpufleet.server.engine import EngineConfig
from gpufleet.server.engine.detectors import straggler
from gpufleet.server.engine.detectors.straggler import policy
from gpufleet.server.engine.rules import Rule, evaluate, names
from gpufleet.server.replay import run_replay
from tests.server.engine_samples import cluster_lines
from tests.server.test_engine_straggler import _slow_gpu

STRAGGLER_DIR = Path(straggler.__file__).resolve().parent
SETTINGS = {f.name for f in dataclasses.fields(EngineConfig)}


def test_rules_are_exported_named_once_and_read_real_settings() -> None:
    assert straggler.RULES == policy.RULES
    assert len(names(straggler.RULES)) == len(straggler.RULES)
    for rule in straggler.RULES:
        assert rule.name.startswith("straggler_") and rule.doc
        for setting in (rule.margin, rule.factor, rule.sigmas):
            assert setting is None or setting in SETTINGS, (rule.name, setting)


def test_factor_multiplies_the_floor_and_unscaled_rules_ignore_scales() -> None:
    cfg = EngineConfig()
    half = Rule(name="half", doc="", signal="x", margin="straggler_sm_excess", factor="straggler_bits_confirm_ratio")
    plain = Rule(name="plain", doc="", signal="x", margin="straggler_sm_excess", scaled=False)
    x = np.array([0.02, 0.04, 0.06, 0.12, np.nan])
    out = evaluate((half, plain), {"x": x}, cfg, scales=np.array([[1.0], [0.6]]))
    # Half the 0.10 margin is 0.05, and 0.03 at the weaker scale; the plain cut-off is 0.10 at both.
    assert out["half"].tolist() == [[False, False, True, True, False], [False, True, True, True, False]]
    assert out["plain"].tolist() == [[False, False, False, True, False]] * 2


def _numbers(path: Path) -> list[tuple[int, float]]:
    tree = ast.parse(path.read_text())
    negated = {
        id(n.operand)
        for n in ast.walk(tree)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub) and isinstance(n.operand, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            value = -node.value if id(node) in negated else node.value
            if value not in (0, 1, -1):
                found.append((node.lineno, value))
    return found


@pytest.mark.parametrize("path", sorted(STRAGGLER_DIR.glob("*.py")), ids=lambda p: p.name)
def test_no_numeric_threshold_in_the_straggler_detector(path: Path) -> None:
    # Only structural 0, 1 and -1 (indexes, "1 - x", signs): every other number is an EngineConfig setting.
    assert _numbers(path) == []


def _stragglers(config: dict | None) -> list[tuple[str, int | None]]:
    return [
        (a.node, a.gpu)
        for a in run_replay(cluster_lines(1000, override=_slow_gpu), config)
        if a.kind.value == "straggler"
    ]


def test_switching_off_the_rules_that_name_a_gpu_leaves_it_unnamed() -> None:
    assert _stragglers(None) == [("n1", 3)]
    gpu_rules = policy.ACTIVITY + policy.HARDWARE + policy.CROSS_SECTION + policy.GPU_CLOCK_CUT + policy.STEP
    assert _stragglers({"disabled_rules": sorted(r.name for r in gpu_rules)}) == []
    # The clock rules alone off: its SM activity, 0.80 against its waiting peers' 0.62, still names it.
    clocks = policy.HARDWARE + policy.GPU_CLOCK_CUT
    assert _stragglers({"disabled_rules": sorted(r.name for r in clocks)}) == [("n1", 3)]


def test_newest_bins_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="straggler_newest_bins"):
        EngineConfig.from_mapping({"straggler_newest_bins": 0})


def test_scaled_spread_keeps_the_weaker_margin_a_share_of_the_widened_one() -> None:
    cfg = EngineConfig()
    rule = Rule(
        name="noisy",
        doc="",
        signal="x",
        margin="straggler_sm_excess",
        spread="s",
        sigmas="straggler_noise_sigmas",
        scale_spread=True,
    )
    # 3 x a 0.05 spread widens the 0.10 floor to 0.15, and the weaker margin to 0.6 x 0.15 = 0.09.
    out = evaluate((rule,), {"x": np.array([0.08, 0.12, 0.16]), "s": np.full(3, 0.05)}, cfg, np.array([[1.0], [0.6]]))
    assert out["noisy"].tolist() == [[False, False, True], [False, True, True]]


def _noisy_group(sd: float):
    """16 GPUs whose SM activity reads with relative noise sd; from 400 s all wait, and GPU n1/3 runs 13 %
    busier than the waiting peers (a culprit by the fixed 10 % margin)."""
    rng = np.random.default_rng(7)

    def override(t, node, gpu):
        level = 0.62 if t < 400 else 0.54
        if t >= 400 and (node, gpu) == ("n1", 3):
            level *= 1.13
        return {"sm_active_ratio": float(np.clip(level * (1 + sd * rng.standard_normal()), 0.0, 1.0))}

    return cluster_lines(900, override=override)


def _kinds(lines, config: dict | None) -> list[tuple[str, str | None, int | None]]:
    return [(a.kind.value, a.node, a.gpu) for a in run_replay(lines, config)]


def test_margins_widen_with_the_groups_own_noise() -> None:
    # Quiet readings: the fixed margin decides, and the GPU 13 % busier is named.
    assert _kinds(_noisy_group(0.05), None) == [("straggler", "n1", 3)]
    # Readings so noisy that 13 % lies within 3 robust standard deviations of the group's excesses: no GPU
    # is named. With the spread switched off (0 sigmas) the fixed margin alone names it.
    noisy = _noisy_group(0.15)
    assert [k for k in _kinds(noisy, None) if k[0] == "straggler"] == []
    assert _kinds(noisy, {"straggler_noise_sigmas": 0}) == [("straggler", "n1", 3)]
