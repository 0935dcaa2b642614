"""The repository describes the product as it is: no work-round names ("stop" and a number) in any
tracked text file.

git log keeps the history; docs, comments and tests say what the code does and why.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROUND_NAME = re.compile(rb"stop[ -][0-9]+", re.IGNORECASE)


def _tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name]


def _offenders(paths: list[Path], root: Path = ROOT) -> list[str]:
    """'path:line' of every line naming a round, in text files (anything with a NUL byte is skipped)."""
    found = []
    for path in paths:
        try:
            data = path.read_bytes()
        except (FileNotFoundError, IsADirectoryError):  # deleted in the worktree, or a submodule
            continue
        if b"\0" in data:
            continue
        for number, line in enumerate(data.splitlines(), 1):
            if ROUND_NAME.search(line):
                found.append(f"{path.relative_to(root)}:{number}")
    return found


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(),
    reason="needs git and a checkout to list the tracked files",
)
def test_no_tracked_text_file_names_a_work_round():
    offenders = _offenders(_tracked_files())
    assert not offenders, "'stop N' found (say what was measured, not when): " + ", ".join(offenders)


def test_the_check_finds_a_round_name_and_ignores_binaries(tmp_path):
    # Built from parts, so this file does not name a round itself.
    (tmp_path / "a.md").write_text("measured once\nAt Stop" + " 12 the engine\n")
    (tmp_path / "b.md").write_text("no stopwatch, stop-gap 5 s, bus stop\n")
    (tmp_path / "c.bin").write_bytes(b"\0stop" + b" 3")
    assert _offenders([tmp_path / "a.md", tmp_path / "b.md", tmp_path / "c.bin"], tmp_path) == ["a.md:2"]
