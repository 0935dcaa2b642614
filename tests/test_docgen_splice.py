"""bench.docgen.splice: the one way a generated block goes into a doc, whatever generator writes it."""

from __future__ import annotations

import pytest

from bench.docgen.splice import Section

RESULTS = Section("results", "## Results")


def test_only_the_lines_between_the_markers_change():
    text = f"# Doc\n\nintro\n\n## Results\n\n{RESULTS.begin}\nold\n{RESULTS.end}\n\nnotes kept\n\n## Next\n"
    new = RESULTS.splice(text, "\nnew table\n")
    assert (
        new == f"# Doc\n\nintro\n\n## Results\n\n{RESULTS.begin}\nnew table\n{RESULTS.end}\n\nnotes kept\n\n## Next\n"
    )
    assert RESULTS.current(new) == "new table"
    assert RESULTS.splice(new, "new table") == new


def test_a_heading_without_markers_has_its_section_replaced_up_to_the_next_heading_of_its_level():
    text = "# Doc\n\n## Results\n\nhand-written figures\n\n### Detail\n\nmore\n\n## Next\n\nkept\n"
    new = RESULTS.splice(text, "table")
    assert new == f"# Doc\n\n## Results\n\n{RESULTS.begin}\ntable\n{RESULTS.end}\n\n## Next\n\nkept\n"


def test_a_doc_without_the_heading_gets_heading_and_block_at_the_end_and_a_bare_section_its_block():
    assert (
        RESULTS.splice("# Doc\n\nintro\n", "t")
        == f"# Doc\n\nintro\n\n## Results\n\n{RESULTS.begin}\nt\n{RESULTS.end}\n"
    )
    bare = Section("crosscheck:hard")
    assert bare.splice("# Doc\n", "t") == "# Doc\n\n<!-- crosscheck:hard:begin -->\nt\n<!-- crosscheck:hard:end -->\n"


def test_markers_out_of_order_or_alone_are_no_block():
    assert RESULTS.current(f"{RESULTS.end}\nx\n{RESULTS.begin}\n") is None
    assert RESULTS.current(f"{RESULTS.begin}\nx\n") is None
    assert RESULTS.current(f"a\n{RESULTS.begin}\n\nx\n\n{RESULTS.end}\n") == "x"


def test_write_starts_a_missing_doc_only_when_given_its_title(tmp_path):
    doc = tmp_path / "docs" / "evaluation.md"
    with pytest.raises(FileNotFoundError):
        RESULTS.write(doc, "t")
    RESULTS.write(doc, "t", "Evaluation")
    assert doc.read_text() == f"# Evaluation\n\n## Results\n\n{RESULTS.begin}\nt\n{RESULTS.end}\n"
    RESULTS.write(doc, "u")
    assert RESULTS.current(doc.read_text()) == "u"
