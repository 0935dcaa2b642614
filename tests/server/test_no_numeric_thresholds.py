"""No numeric threshold in a detector's source: every number a detector compares with is a named
EngineConfig setting (its comment says why it has its value), and every declared rule names settings
that exist."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from gpufleet.server.engine import EngineConfig
from gpufleet.server.engine import policy

DETECTORS = Path(__file__).resolve().parents[2] / "server" / "engine" / "detectors"
# Structural numbers: an empty count, one of something, and the "none" code (-1 is 1 negated).
ALLOWED = (0, 1)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of the module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def numeric_literals(source: str) -> list[tuple[int, object]]:
    """(line, value) of each int or float constant other than 0 and 1, docstrings left out."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and id(node) not in docs
        and type(node.value) in (int, float)
        and node.value not in ALLOWED
    )


def test_the_scan_finds_what_it_must_and_only_that():
    source = '"""Docstring: 0.85 of 3 GPUs."""\nx = -1 + 0 * 1.0\ny = a >= 0.3\nz = b[-2]\nw = True\n'
    assert numeric_literals(source) == [(3, 0.3), (4, 2)]


@pytest.mark.parametrize(
    "path", sorted(DETECTORS.rglob("*.py")), ids=lambda p: str(p.relative_to(DETECTORS.parent.parent.parent))
)
def test_no_numeric_threshold_in_a_detector(path: Path):
    found = numeric_literals(path.read_text())
    where = ", ".join(f"{path.relative_to(DETECTORS.parent.parent.parent)}:{line} ({value!r})" for line, value in found)
    assert not found, f"numbers outside EngineConfig (make each a named setting with a why-comment): {where}"


def test_every_rule_names_settings_that_exist_and_a_unique_name():
    names = policy.rule_names()  # raises ValueError on a name declared twice
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    rules = [rule for rules in policy.declared_rules().values() for rule in rules]
    assert len(names) == len(rules)
    for rule in rules:
        for setting in (rule.margin, rule.sigmas, rule.factor, *rule.less):
            assert setting is None or setting in fields, f"rule {rule.name} names no EngineConfig field {setting!r}"
        assert rule.doc, f"rule {rule.name} has no doc line"


def test_every_detector_declares_its_rules():
    declared = policy.declared_rules()
    for detector in ("thermal", "workload", "health"):
        assert declared[detector], f"{detector} declares no rule"
