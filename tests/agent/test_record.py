"""Recorder: one flushed JSON line per snapshot; write failures counted and survived."""

from __future__ import annotations

import logging

from gpufleet.agent.record import Recorder


def test_appends_one_line_per_write(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b'{"old":1}\n')
    rec = Recorder(path)
    assert rec.write(b'{"a":1}') and rec.write(b'{"b":2}')
    # Flushed per line: readable before close.
    assert path.read_bytes() == b'{"old":1}\n{"a":1}\n{"b":2}\n'
    rec.close()
    assert not rec.write(b'{"c":3}')
    assert rec.errors == 0


def test_unwritable_path_is_counted_not_raised(tmp_path, caplog):
    rec = Recorder(tmp_path / "missing-dir" / "trace.jsonl")
    with caplog.at_level(logging.WARNING):
        assert not rec.write(b"{}")
        assert not rec.write(b"{}")
    assert rec.errors == 2
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1  # rate-limited


def test_recovers_when_the_directory_appears(tmp_path):
    target = tmp_path / "later" / "trace.jsonl"
    rec = Recorder(target)
    assert not rec.write(b"{}")
    target.parent.mkdir()
    assert rec.write(b'{"x":1}')
    assert target.read_bytes() == b'{"x":1}\n'
    rec.close()


def test_follows_a_rotation_by_rename_or_delete(tmp_path):
    """logrotate's default: rename the file away and expect the writer to start a new one."""
    path = tmp_path / "trace.jsonl"
    rec = Recorder(path)
    assert rec.write(b'{"a":1}')
    path.rename(tmp_path / "trace.jsonl.1")
    assert rec.write(b'{"b":2}')
    path.unlink()
    assert rec.write(b'{"c":3}')
    rec.close()
    assert (tmp_path / "trace.jsonl.1").read_bytes() == b'{"a":1}\n'
    assert path.read_bytes() == b'{"c":3}\n' and rec.errors == 0


def test_copytruncate_and_reopen_keep_appending_to_the_path(tmp_path):
    path = tmp_path / "trace.jsonl"
    rec = Recorder(path)
    assert rec.write(b'{"a":1}')
    path.write_bytes(b"")  # logrotate copytruncate: same file, emptied
    assert rec.write(b'{"b":2}')
    rec.reopen()  # what SIGHUP asks for
    assert rec.write(b'{"c":3}')
    rec.close()
    assert path.read_bytes() == b'{"b":2}\n{"c":3}\n'
