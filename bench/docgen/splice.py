"""A generated section of a markdown doc: the lines between `<!-- NAME:begin -->` and `<!-- NAME:end -->`.

Every generator that writes figures or tables into a doc goes through `Section`, so the rest of the doc
(prose, notes written after a table) survives a new run, and `--check` style comparisons read the block
the same way it was written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Section:
    """The markers of one generated block, and the heading (`## Results`) it is filed under in a doc that
    lacks its markers; without a heading such a block is appended bare."""

    name: str
    heading: str = ""

    @property
    def begin(self) -> str:
        return f"<!-- {self.name}:begin -->"

    @property
    def end(self) -> str:
        return f"<!-- {self.name}:end -->"

    def current(self, text: str) -> str | None:
        """What the doc holds between the markers, or None without both markers in order."""
        if self.begin not in text or self.end not in text or text.index(self.begin) > text.index(self.end):
            return None
        return text.split(self.begin, 1)[1].split(self.end, 1)[0].strip("\n")

    def splice(self, text: str, body: str) -> str:
        """The doc with `body` between the markers. A doc without them gets heading and block: in place of
        the heading's section (up to the next heading of its level) where the heading is there, else at the
        end."""
        inner = body.strip("\n")
        block = f"{self.begin}\n{inner}\n{self.end}"
        if self.current(text) is not None:
            head, rest = text.split(self.begin, 1)
            return head + block + rest.split(self.end, 1)[1]
        section = f"{self.heading}\n\n{block}" if self.heading else block
        lines = text.splitlines()
        if not self.heading or self.heading not in lines:
            return text.rstrip("\n") + f"\n\n{section}\n"
        start = lines.index(self.heading)
        level = self.heading.split(" ", 1)[0] + " "
        stop = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(level)), len(lines))
        return "\n".join([*lines[:start], *section.splitlines(), "", *lines[stop:]]).rstrip("\n") + "\n"

    def write(self, doc: Path, body: str, title: str = "") -> None:
        """Splice `body` into the doc on disk; a doc that does not exist yet starts as `# {title}`."""
        if doc.exists():
            text = doc.read_text()
        elif title:
            text = f"# {title}\n"
        else:
            raise FileNotFoundError(doc)
        doc.parent.mkdir(parents=True, exist_ok=True)
        doc.write_text(self.splice(text, body))
