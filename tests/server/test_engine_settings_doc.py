"""docs/detection.md's settings table is what bench.docgen.engine_settings generates from EngineConfig."""

from __future__ import annotations

import dataclasses


from bench.docgen import engine_settings
from gpufleet.server.engine import EngineConfig


def test_the_documented_settings_table_is_generated_from_engine_config():
    block = engine_settings.SETTINGS.current(engine_settings.DOC.read_text())
    assert block is not None, (
        f"{engine_settings.SETTINGS.begin} ... {engine_settings.SETTINGS.end} missing from docs/detection.md"
    )
    assert block == engine_settings.render(), (
        f"docs/detection.md's settings table is stale: run `make engine-settings-doc` ({engine_settings.COMMAND})"
    )


def test_every_setting_says_what_it_is():
    comments = engine_settings.field_comments()
    missing = [f.name for f in dataclasses.fields(EngineConfig) if not comments.get(f.name)]
    assert not missing, f"EngineConfig fields without a comment line above them: {missing}"


def test_a_row_carries_the_default_and_unit_of_its_field():
    rows = {
        line.split("|")[1].strip(" `"): line.split("|")[2:4]
        for line in engine_settings.render().splitlines()
        if line.startswith("| `")
    }
    assert [c.strip() for c in rows["thermal_temperature_celsius"]] == ["83", "°C"]
    assert [c.strip() for c in rows["straggler_min_group"]] == ["3", "count"]
    assert [c.strip() for c in rows["workload_capped_clock_ratio"]] == ["0.98", "ratio 0-1"]
    assert len(rows) == len(dataclasses.fields(EngineConfig))


def test_rewrite_replaces_only_the_table_and_check_notices_a_stale_one(tmp_path):
    doc = tmp_path / "detection.md"
    doc.write_text(
        f"# Detection\n\nbefore\n\n{engine_settings.SETTINGS.begin}\nold table\n{engine_settings.SETTINGS.end}\n\n"
        f"{engine_settings.RULES.begin}\n{engine_settings.RULES.end}\n\nafter\n"
    )
    assert engine_settings.main(["--doc", str(doc), "--check"]) == 1
    assert engine_settings.main(["--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Detection\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert engine_settings.SETTINGS.current(text) == engine_settings.render()
    rules = engine_settings.RULES.current(text)
    assert rules == engine_settings.render_rules()
    assert engine_settings.main(["--doc", str(doc), "--check"]) == 0


def test_a_doc_without_the_markers_is_refused(tmp_path):
    doc = tmp_path / "detection.md"
    doc.write_text("# Detection\n")
    assert engine_settings.main(["--doc", str(doc)]) == 2
    assert doc.read_text() == "# Detection\n"


def test_the_documented_rules_reference_is_generated_from_the_declarations():
    block = engine_settings.RULES.current(engine_settings.DOC.read_text())
    assert block is not None, "the rules markers are missing from docs/detection.md"
    assert block == engine_settings.render_rules(), (
        f"docs/detection.md's rules reference is stale: run `{engine_settings.COMMAND}`"
    )


def test_a_rule_row_quotes_its_margin_default_noise_and_gates():
    rows = {
        line.split("|")[1].strip(" `"): line
        for line in engine_settings.render_rules().splitlines()
        if line.startswith("| `")
    }
    drop = rows["comm_bound_sm_drop"]
    assert "`workload_drop` (0.15)" in drop and "`workload_noise_sigmas` (3) × `noise`" in drop
    assert "not `standout`" in drop
    assert "`comm_min_utilization` (0.8) − `comm_clear_utilization_gap` (0.1)" in rows["comm_bound_stopped_spinning"]


def test_the_doc_stays_a_reference_of_a_few_hundred_lines():
    assert len(engine_settings.DOC.read_text().splitlines()) < 600
