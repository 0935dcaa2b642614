"""The engine settings table of docs/detection.md, generated from EngineConfig so it cannot drift.

Each row is one EngineConfig field: its key, default, unit (from the name's suffix and type) and what it
is (the comment lines right above the field in server/engine/config.py). `python -m bench.engine_settings`
rewrites the table between `<!-- settings:begin -->` and `<!-- settings:end -->`; `--check` only says
whether it is current (exit 1 when not).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
from pathlib import Path

from gpufleet.server.engine import EngineConfig
from gpufleet.server.engine import config as config_module

DOC = Path(__file__).resolve().parent.parent / "docs" / "detection.md"
BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"
COMMAND = "python -m bench.engine_settings"

# Unit by the field name's ending, first match wins; ratios and utilizations are shares from 0 to 1.
_UNITS = (
    ("_seconds", "s"),
    ("_celsius", "°C"),
    ("_percentile", "percentile"),
    ("_sigmas", "std. deviations"),
    ("_utilization", "ratio 0-1"),
    ("_ratio", "ratio 0-1"),
    ("_gap", "utilization 0-1"),
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


def current_block(text: str) -> str | None:
    """What the doc holds between the markers, or None without both markers in order."""
    if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def rewrite(text: str, body: str) -> str:
    """The doc with the table between the markers replaced; ValueError if the markers are missing."""
    if current_block(text) is None:
        raise ValueError(f"{BEGIN} ... {END} not found")
    head, rest = text.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{body}\n{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    ap.add_argument("--doc", type=Path, default=DOC, help="markdown file holding the markers")
    ap.add_argument("--check", action="store_true", help="exit 1 if the table is not current; write nothing")
    args = ap.parse_args(argv)
    text = args.doc.read_text()
    body = render()
    if current_block(text) is None:
        print(f"{args.doc}: {BEGIN} ... {END} not found", file=sys.stderr)
        return 2
    if args.check:
        if current_block(text) != body:
            print(f"{args.doc}: engine settings table is stale; run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.doc.write_text(rewrite(text, body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
