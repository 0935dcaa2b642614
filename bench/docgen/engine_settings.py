"""The engine settings table and the rules reference of docs/detection.md, generated so they cannot drift.

Settings: each row is one EngineConfig field: its key, default, unit (from the name's suffix and type)
and what it is (the comment lines right above the field in server/engine/config.py). Rules: per detector,
each rule it declares (policy.declared_rules): name, what it says, when it holds (signal, margin setting
and its default, spread and sigmas) and its gates. `python -m bench.docgen.engine_settings` rewrites both between
their markers (`<!-- settings:begin -->` ... `<!-- settings:end -->`, `<!-- rules:begin -->` ...
`<!-- rules:end -->`); `--check` only says whether they are current (exit 1 when not).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
from pathlib import Path

from gpufleet.server.engine import EngineConfig, policy
from gpufleet.server.engine import config as config_module
from gpufleet.server.engine.rules import Rule

from bench.docgen.splice import Section

DOC = Path(__file__).resolve().parents[2] / "docs" / "detection.md"
SETTINGS = Section("settings")
RULES = Section("rules")
COMMAND = "python -m bench.docgen.engine_settings"

# Unit by the field name's ending, first match wins; ratios and utilizations are shares from 0 to 1.
_UNITS = (
    ("_seconds", "s"),
    ("_celsius", "°C"),
    ("_percentile", "percentile"),
    ("_sigmas", "std. deviations"),
    ("_utilization", "ratio 0-1"),
    ("_ratio", "ratio 0-1"),
    ("_gap", "utilization 0-1"),
    ("_factor", "multiple"),
    ("_ticks", "ticks"),
    ("_gpu_hours_per_hour", "GPU-hours per hour"),
)


def field_comments() -> dict[str, str]:
    """Each EngineConfig field's comment: the `#` lines right above it, joined into one sentence."""
    source = inspect.getsource(config_module)
    lines = source.splitlines()
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == EngineConfig.__name__)
    comments: dict[str, str] = {}
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        block: list[str] = []
        i = node.lineno - 2
        while i >= 0 and lines[i].strip().startswith("#"):
            block.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        comments[node.target.id] = " ".join(block)
    return comments


def unit(field: dataclasses.Field) -> str:
    """The unit a field is given in."""
    for suffix, name in _UNITS:
        if field.name.endswith(suffix):
            return name
    if field.type in (int, "int"):
        return "count"
    if field.name == "disabled_rules":
        return "rule names"
    return "ratio 0-1"


def _number(value: object) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else "none"


def _default(field: dataclasses.Field) -> object:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def render() -> str:
    """The markdown table, one row per EngineConfig field in declaration order."""
    comments = field_comments()
    rows = [
        f"Generated from `EngineConfig` (server/engine/config.py) by `{COMMAND}`.",
        "",
        "| setting | default | unit | what it is |",
        "|---|---|---|---|",
    ]
    for f in dataclasses.fields(EngineConfig):
        text = comments.get(f.name, "").replace("|", "\\|")
        rows.append(f"| `{f.name}` | {_number(_default(f))} | {unit(f)} | {text} |")
    return "\n".join(rows)


def _setting(name: str | None) -> str:
    """A setting with its default, as the rules reference quotes it."""
    if name is None:
        return "0"
    default = _default(next(f for f in dataclasses.fields(EngineConfig) if f.name == name))
    return f"`{name}` ({_number(default)})"


def holds_when(rule: Rule) -> str:
    """The rule's condition in one line: signal, comparison, threshold, and its noise term."""
    threshold = _setting(rule.margin)
    if rule.factor is not None:
        threshold = f"{_setting(rule.factor)} × {threshold}"
    for less in rule.less:
        threshold = f"{threshold} − {_setting(less)}"
    if rule.reference is not None:
        threshold = f"`{rule.reference}` + {threshold}" if rule.margin else f"`{rule.reference}`"
        if rule.less and not rule.margin:
            threshold += " − " + " − ".join(_setting(x) for x in rule.less)
    op = {">=": "≥", ">": ">", "<": "<"}[rule.op]
    text = f"`{rule.signal}` {op} {threshold}"
    if rule.spread is not None:
        noise = f"{_setting(rule.sigmas)} × `{rule.spread}`"
        if rule.spread_signal is None:
            text = f"`{rule.signal}` {op} max({threshold}, {noise})"
        else:
            text += f", and `{rule.spread_signal}` ≥ {noise}"
    return text


def render_rules() -> str:
    """The rules reference: one table per detector, one row per declared rule in declaration order."""
    rows = [
        f"Generated from the detectors' `RULES` (server/engine/policy.py) by `{COMMAND}`. A rule holds when "
        "its condition and all its gates hold and none of its `unless` gates; a gate named like a rule is "
        "that rule's result. Settings are quoted with their defaults; a NaN signal never holds, a NaN "
        "spread leaves the margin alone.",
    ]
    for detector, rules in policy.declared_rules().items():
        rows += ["", f"**{detector}**", ""]
        if not rules:
            rows.append("No declared rules.")
            continue
        rows += ["| rule | what it says | holds when | gates |", "|---|---|---|---|"]
        for rule in rules:
            gates = [f"`{g}`" for g in rule.gates] + [f"not `{g}`" for g in rule.unless]
            doc = rule.doc.replace("|", "\\|")
            rows.append(f"| `{rule.name}` | {doc} | {holds_when(rule)} | {', '.join(gates) or '–'} |")
    return "\n".join(rows)


def blocks() -> tuple[tuple[Section, str], ...]:
    """(section, body) of every generated block."""
    return ((SETTINGS, render()), (RULES, render_rules()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    ap.add_argument("--doc", type=Path, default=DOC, help="markdown file holding the markers")
    ap.add_argument("--check", action="store_true", help="exit 1 if the table is not current; write nothing")
    args = ap.parse_args(argv)
    text = args.doc.read_text()
    for section, body in blocks():
        if section.current(text) is None:
            print(f"{args.doc}: {section.begin} ... {section.end} not found", file=sys.stderr)
            return 2
        if args.check and section.current(text) != body:
            print(f"{args.doc}: the block {section.begin} is stale; run `{COMMAND}`", file=sys.stderr)
            return 1
        text = section.splice(text, body)
    if not args.check:
        args.doc.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
