"""The rule interpreter: margins as floors widened by a spread, gates, scales, NaN and switching off."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from gpufleet.server.engine import EngineConfig
from gpufleet.server.engine.rules import Rule, any_of, evaluate, names


@dataclass(frozen=True)
class _Cfg:
    margin: float = 0.1
    sigmas: float = 3.0
    disabled_rules: frozenset[str] = field(default_factory=frozenset)


EXCESS = Rule(name="excess", doc="stands out", signal="x", margin="margin")
NOISY = Rule(name="noisy", doc="stands out beyond noise", signal="x", margin="margin", spread="s", sigmas="sigmas")
GATED = Rule(name="gated", doc="gated", signal="x", margin="margin", gates=("g",), unless=("u",))


def test_floor_spread_and_nan() -> None:
    arrays = {"x": np.array([0.05, 0.1, 0.2, np.nan, 0.2]), "s": np.array([0.0, 0.0, 0.1, 0.0, np.nan])}
    out = evaluate((EXCESS, NOISY), arrays, _Cfg())
    assert out["excess"].tolist() == [False, True, True, False, True]
    # A spread of 0.1 at 3 sigmas widens the margin to 0.3: 0.2 no longer fires; a NaN spread keeps the floor.
    assert out["noisy"].tolist() == [False, True, False, False, True]


def test_gates_and_scales() -> None:
    arrays = {"x": np.array([0.07, 0.07, 0.2]), "g": np.array([True, True, False]), "u": np.array([False, True, False])}
    out = evaluate((GATED,), arrays, _Cfg(), scales=np.array([[1.0], [0.6]]))
    assert out["gated"].shape == (2, 3)
    assert out["gated"][0].tolist() == [False, False, False]
    assert out["gated"][1].tolist() == [True, False, False]


def test_disabled_rule_never_holds() -> None:
    arrays = {"x": np.array([1.0, 2.0])}
    out = evaluate(
        (EXCESS, GATED),
        {**arrays, "g": np.ones(2, bool), "u": np.zeros(2, bool)},
        _Cfg(disabled_rules=frozenset({"excess"})),
    )
    assert not out["excess"].any()
    assert out["gated"].all()
    assert any_of(out, ["excess", "gated"]).all()


def test_declarations_are_checked() -> None:
    with pytest.raises(ValueError, match="spread and sigmas"):
        Rule(name="bad", doc="", signal="x", margin="margin", spread="s")
    with pytest.raises(ValueError, match="declared twice"):
        names((EXCESS,), (EXCESS,))


def test_config_reads_disabled_rules() -> None:
    assert EngineConfig.from_mapping({"disabled_rules": ["a", "b"]}).disabled_rules == {"a", "b"}
    assert EngineConfig.from_mapping({"disabled-rules": "a, b"}).disabled_rules == {"a", "b"}
    with pytest.raises(ValueError, match="list of rule names"):
        EngineConfig.from_mapping({"disabled_rules": 3})


def test_engine_refuses_an_unknown_rule_name() -> None:
    from gpufleet.server.engine import Engine

    with pytest.raises(ValueError, match="no declared rule: nonsense"):
        Engine(EngineConfig(disabled_rules=frozenset({"nonsense"})))


@dataclass(frozen=True)
class _Limits:
    margin: float = 0.1
    share: float = 0.5
    gap: float = 2.0
    sigmas: float = 3.0
    disabled_rules: frozenset[str] = field(default_factory=frozenset)


def test_ops_factor_less_and_reference() -> None:
    x = np.array([0.04, 0.05, 0.1, np.nan])
    strict = Rule(name="strict", doc="", signal="x", margin="margin", op=">")
    below = Rule(name="below", doc="back under half the margin", signal="x", op="<", margin="margin", factor="share")
    out = evaluate((strict, below), {"x": x}, _Limits())
    assert out["strict"].tolist() == [False, False, False, False]  # reaching 0.1 exactly does not pass it
    assert out["below"].tolist() == [True, False, False, False]  # under 0.05; NaN is never below
    # A reading within `gap` of each subject's own limit, NaN limit never.
    near = Rule(name="near", doc="", signal="t", reference="limit", margin=None, less=("gap",))
    arrays = {"t": np.array([85.0, 84.9, 90.0]), "limit": np.array([87.0, 87.0, np.nan])}
    assert evaluate((near,), arrays, _Limits())["near"].tolist() == [True, False, False]


def test_a_spread_signal_must_clear_the_noise_beside_the_floor() -> None:
    rule = Rule(
        name="drop", doc="", signal="drop", margin="margin", spread="noise", sigmas="sigmas", spread_signal="sag"
    )
    arrays = {
        "drop": np.array([0.2, 0.2, 0.2, 0.05, 0.2]),
        "sag": np.array([0.1, 0.05, np.nan, 0.2, 0.1]),
        "noise": np.array([0.03, 0.03, 0.03, 0.0, np.nan]),
    }
    # Floor on the drop (0.1), 3 x noise on the sag; a NaN sag or noise leaves the floor alone.
    assert evaluate((rule,), arrays, _Limits())["drop"].tolist() == [True, False, True, False, True]


def test_new_fields_are_checked_and_list_their_settings() -> None:
    with pytest.raises(ValueError, match="op must be"):
        Rule(name="bad", doc="", signal="x", margin="margin", op="==")
    with pytest.raises(ValueError, match="takes no spread"):
        Rule(name="bad", doc="", signal="x", margin="margin", op="<", spread="s", sigmas="sigmas")
    with pytest.raises(ValueError, match="needs a spread"):
        Rule(name="bad", doc="", signal="x", margin="margin", spread_signal="y")
    rule = Rule(name="r", doc="", signal="x", margin="margin", factor="share", less=("gap",))
    assert rule.settings() == ("margin", "share", "gap")
