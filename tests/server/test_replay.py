"""Replay: run_replay semantics and the `gpufleet-server replay` command line."""

from __future__ import annotations

import gzip
import io
import logging
import random
import sys
import tracemalloc

import orjson
import pytest

from gpufleet.server.engine import Engine
from gpufleet.server import contract
from gpufleet.server.replay import MALFORMED_LOGGED, _load, _node_spans, alert_json, bounded_lines, main, run_replay
from bench.evaluation import scenarios
from tests.server.engine_samples import T0, cluster_lines
from bench.evaluation.tracegen import generate


def _hot(t, node, gpu):
    return {"temperature_celsius": 86.0} if (node, gpu) == ("n0", 6) and t >= 200 else {}


def test_line_order_does_not_matter_and_open_alerts_have_no_resolved():
    lines = cluster_lines(400, override=_hot)
    shuffled = lines[:]
    random.Random(3).shuffle(shuffled)
    a, b = run_replay(lines), run_replay(shuffled)
    assert [x.to_dict() for x in a] == [x.to_dict() for x in b]
    (alert,) = a
    assert alert.kind.value == "thermal_throttle" and alert.resolved is None and alert.started >= T0 + 230


def test_the_closing_log_line_counts_the_gpu_samples_and_states_the_rate(caplog):
    lines = cluster_lines(400, override=_hot)
    caplog.set_level(logging.INFO, logger="gpufleet.server.replay")
    run_replay(lines + [b"{broken"])
    (done,) = [r for r in caplog.records if r.getMessage() == "replay done"]
    gpus = sum(len(orjson.loads(line)["gpus"]) for line in lines)
    assert (done.alerts, done.gpu_samples) == (1, gpus)
    assert done.ticks > 0 and done.seconds > 0
    # seconds is rounded to the millisecond in the record; the rate is taken before rounding.
    assert abs(done.gpu_samples_per_second * done.seconds - gpus) <= done.gpu_samples_per_second * 0.0005 + 1


def test_the_windows_are_sized_once_for_every_gpu_of_the_trace():
    # 72 GPUs, more than the windows hold before they grow. n1's GPU 7 reports only from 200 s on; n8
    # joins at 300 s; n0's GPU 3 leaves at 100 s.
    def churn(t, node, gpu):
        gone = (
            (node == "n1" and gpu == 7 and t < 200)
            or (node == "n8" and t < 300)
            or (node == "n0" and gpu == 3 and t >= 100)
        )
        return {"_absent": True} if gone else {}

    samples, _ = _load([("trace", cluster_lines(400, nodes=9, override=churn))])
    gpus = sum(len(span.indices) for span in _node_spans(samples)[0].values())
    assert gpus == 72
    engine = Engine()
    engine.reserve(gpus)
    rings = engine.windows.acc
    for s in samples:
        engine.ingest(s)
    engine.advance(samples[-1].time + 60)
    assert engine.windows.n == 72 and engine.windows.acc is rings  # never regrown


def _shifted(lines: list[bytes], node: str, seconds: float) -> list[bytes]:
    out = []
    for line in lines:
        d = orjson.loads(line)
        if d["node"] == node:
            d["time"] += seconds
        out.append(orjson.dumps(d))
    return out


@pytest.mark.parametrize("seconds", [-60.0, 45.0, 120.0])
def test_a_node_whose_clock_is_off_is_lined_up_with_the_others(caplog, seconds):
    # Left as recorded, the trace ends sooner in sample time for the nodes whose clocks run behind,
    # and those read as unreachable for its last seconds.
    lines = _shifted(cluster_lines(900, nodes=3), "n1", seconds)
    caplog.set_level(logging.WARNING, logger="gpufleet.server.replay")
    assert run_replay(lines) == []
    (note,) = [r for r in caplog.records if r.getMessage() == "node clock offset taken out"]
    assert note.node == "n1" and abs(note.offset_seconds - seconds) <= 5.0


def test_a_node_whose_clock_is_off_is_lined_up_beside_nodes_at_other_phases(caplog):
    # Four nodes: n1 47 s ahead, n2 sampling 4.5 s into each interval, n3's last sample an interval
    # before the others'. The mean of the two middle last samples sat 7.25 s after n3's, beyond a
    # 5 s node's slack, so only half the nodes agreed and n1 was left 47 s off: its job's peers then
    # read as unreachable at the trace's end.
    lines = _shifted(_shifted(cluster_lines(900, nodes=4), "n1", 47.0), "n2", 4.5)
    lines = [line for line in lines if not (b'"node":"n3"' in line and orjson.loads(line)["time"] >= T0 + 895)]
    caplog.set_level(logging.WARNING, logger="gpufleet.server.replay")
    assert run_replay(lines) == []
    (note,) = [r for r in caplog.records if r.getMessage() == "node clock offset taken out"]
    assert note.node == "n1" and abs(note.offset_seconds - 47.0) <= 5.0


def test_a_node_whose_clock_is_off_is_lined_up_beside_a_node_that_lost_its_first_line(caplog):
    # 10 s sampling, four nodes: n3 60 s ahead, n2 sampling 9 s into each interval and missing its first
    # line, so its first sample came 19 s after the others' while its last agreed with theirs. Counted
    # out of step, it left only two of four nodes agreeing, and n3 was not lined up.
    lines = _shifted(_shifted(cluster_lines(900, interval=10.0, nodes=4), "n3", 60.0), "n2", 9.0)
    lines = [line for line in lines if not (b'"node":"n2"' in line and orjson.loads(line)["time"] < T0 + 10)]
    caplog.set_level(logging.WARNING, logger="gpufleet.server.replay")
    assert run_replay(lines) == []
    (note,) = [r for r in caplog.records if r.getMessage() == "node clock offset taken out"]
    assert note.node == "n3" and abs(note.offset_seconds - 60.0) <= 5.0


def test_a_node_sampled_faster_than_the_others_is_lined_up_too(caplog):
    # n1 samples every second, the others every 5 s: their last samples come up to 4 s before its own,
    # so its two ends disagree by that much against theirs.
    lines = cluster_lines(900, interval=1.0, nodes=3)
    thinned = [line for i, line in enumerate(lines) if b'"node":"n1"' in line or (i // 3) % 5 == 0]
    caplog.set_level(logging.WARNING, logger="gpufleet.server.replay")
    assert run_replay(_shifted(thinned, "n1", -60.0)) == []
    (note,) = [r for r in caplog.records if r.getMessage() == "node clock offset taken out"]
    assert note.node == "n1" and abs(note.offset_seconds + 60.0) <= 5.0


def test_a_node_that_falls_silent_or_joins_late_is_not_taken_for_a_clock_offset(caplog):
    def silent_or_late(t, node, gpu):
        return {"_absent": True} if (node == "n1" and t >= 840) or (node == "n2" and t < 120) else {}

    caplog.set_level(logging.WARNING, logger="gpufleet.server.replay")
    alerts = run_replay(cluster_lines(900, nodes=5, override=silent_or_late))
    assert [(a.kind.value, a.node) for a in alerts] == [("node_unreachable", "n1")]
    assert not [r for r in caplog.records if r.getMessage() == "node clock offset taken out"]


def test_agents_started_and_stopped_one_after_another_keep_their_clocks(caplog):
    # Each node's span is 20 s later than the one before: the ends do not agree, so no clock is "off".
    def staggered(t, node, gpu):
        k = int(node[1:])
        return {"_absent": True} if not 20 * k <= t < 840 + 20 * k else {}

    caplog.set_level(logging.WARNING, logger="gpufleet.server.replay")
    run_replay(cluster_lines(900, nodes=4, override=staggered))
    assert not [r for r in caplog.records if r.getMessage() == "node clock offset taken out"]


def test_a_trace_passed_twice_gives_the_alerts_of_one(caplog):
    # A power-braked GPU: each repeat's zero-second energy difference had no rate, so its bins mixed
    # instantaneous power into the average from energy, and the straggler fired 10 s earlier.
    trace = generate(scenarios.BY_NAME["power_brake"].build(3))
    once = [a.to_dict() for a in run_replay(trace.lines)]
    caplog.set_level(logging.WARNING, logger="gpufleet.server.replay")
    twice = [a.to_dict() for a in run_replay(list(trace.lines) * 2)]
    assert twice == once and [a["kind"] for a in once] == ["straggler"]
    (note,) = [r for r in caplog.records if r.getMessage() == "repeated snapshots dropped"]
    assert note.snapshots == len(trace.lines)


def test_str_lines_and_blank_lines_are_accepted():
    lines = [line.decode() for line in cluster_lines(400, override=_hot)] + ["", "\n"]
    assert len(run_replay(lines)) == 1


def test_cli_prints_one_json_object_per_alert_and_skips_bad_lines(tmp_path, capsys):
    lines = cluster_lines(400, override=_hot)
    f1, f2 = tmp_path / "n0.jsonl", tmp_path / "n1.jsonl"
    f1.write_bytes(b"\n".join(line for line in lines if b'"node":"n0"' in line) + b"\n{broken\n")
    f2.write_bytes(b"\n".join(line for line in lines if b'"node":"n1"' in line) + b"\n")
    assert main([str(f2), str(f1)]) == 0
    out, err = capsys.readouterr()
    (line,) = out.splitlines()
    obj = orjson.loads(line)
    assert {
        "kind",
        "severity",
        "node",
        "gpu",
        "uuid",
        "hpc_job",
        "started",
        "resolved",
        "summary",
        "evidence",
    } <= obj.keys()
    assert (obj["kind"], obj["node"], obj["gpu"], obj["resolved"]) == ("thermal_throttle", "n0", 6, None)
    assert "n0.jsonl" in err and "line" in err


def test_cli_reads_gzip_and_standard_input_alike(tmp_path, capsys, monkeypatch):
    data = b"\n".join(cluster_lines(400, override=_hot)) + b"\n"
    plain, packed = tmp_path / "t.jsonl", tmp_path / "t.jsonl.gz"
    plain.write_bytes(data)
    packed.write_bytes(gzip.compress(data))
    assert main([str(plain)]) == 0
    expected = capsys.readouterr().out
    assert len(expected.splitlines()) == 1
    assert main([str(packed)]) == 0
    assert capsys.readouterr().out == expected
    for stdin in (data, gzip.compress(data)):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(stdin))))
        assert main(["-"]) == 0
        assert capsys.readouterr().out == expected
    assert main(["-", "-"]) == 2 and "once" in capsys.readouterr().err


def test_a_trace_saved_by_a_windows_editor_replays_like_the_original(tmp_path, capsys, monkeypatch):
    # A byte-order mark and CRLF line ends: the BOM, left in, turned the first snapshot into a
    # malformed line.
    data = b"\n".join(cluster_lines(400, override=_hot)) + b"\n"
    plain = tmp_path / "t.jsonl"
    plain.write_bytes(data)
    assert main([str(plain)]) == 0
    expected = capsys.readouterr().out
    windows = b"\xef\xbb\xbf" + data.replace(b"\n", b"\r\n")
    saved, packed = tmp_path / "w.jsonl", tmp_path / "w.jsonl.gz"
    saved.write_bytes(windows)
    packed.write_bytes(gzip.compress(windows))
    for args in ([str(saved)], [str(packed)], ["-"]):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(windows))))
        assert main(args) == 0
        out, err = capsys.readouterr()
        assert out == expected and "malformed" not in err


def test_a_compressed_trace_that_breaks_off_replays_what_was_read(tmp_path, capsys):
    # A file still being written, or a bad copy: the stream ends without its end-of-stream marker.
    packed = gzip.compress(b"\n".join(cluster_lines(400, override=_hot)) + b"\n")
    trace = tmp_path / "cut.jsonl.gz"
    trace.write_bytes(packed[:-200])
    assert main([str(trace)]) == 0
    out, err = capsys.readouterr()
    assert [orjson.loads(line)["kind"] for line in out.splitlines()] == ["thermal_throttle"]
    assert "compressed trace breaks off" in err and "cut.jsonl.gz" in err


def test_a_compressed_trace_broken_in_its_header_is_logged_and_the_others_replayed(tmp_path, capsys):
    # gzip's magic, then garbage: it breaks while the header is read, before any line.
    broken, good = tmp_path / "broken.jsonl.gz", tmp_path / "good.jsonl"
    broken.write_bytes(b"\x1f\x8b\x08garbage")
    good.write_bytes(b"\n".join(cluster_lines(400, override=_hot)) + b"\n")
    assert main([str(broken), str(good)]) == 0
    out, err = capsys.readouterr()
    assert [orjson.loads(line)["kind"] for line in out.splitlines()] == ["thermal_throttle"]
    assert "compressed trace breaks off" in err and "broken.jsonl.gz" in err


def test_cli_missing_file_and_bad_config_exit_2(tmp_path, capsys):
    assert main([str(tmp_path / "nope.jsonl")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 2
    assert f"trace is not a file: {tmp_path}" in capsys.readouterr().err
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(b"")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine:\n  thermal_for_secondz: 10\n")
    assert main([str(trace), "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "thermal_for_secondz" in err and len(err.strip().splitlines()) == 1


def test_cli_config_changes_thresholds(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(b"\n".join(cluster_lines(400, override=_hot)))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("thermal_temperature_celsius: 90\n")
    assert main([str(trace), "--config", str(cfg)]) == 0
    assert capsys.readouterr().out == ""


def test_every_alert_kind_serialises_to_plain_json():
    def busy(t, node, gpu):
        kw = {}
        if t >= 300:
            kw = {"sm_active_ratio": 0.6, "power_watts": 410.0}
            if (node, gpu) == ("n1", 3):
                kw = {"sm_clock_hertz": 1.4e9, "throttle_reasons": 0x40, "temperature_celsius": 88.0}
            if (node, gpu) == ("n0", 0):
                kw.update(xid_errors_total=1, last_xid=48, ecc_uncorrected_errors_total=2)
        return kw

    alerts = run_replay(cluster_lines(700, override=busy))
    assert {a.kind.value for a in alerts} >= {"straggler", "thermal_throttle", "xid", "ecc"}
    for a in alerts:
        obj = orjson.loads(alert_json(a))
        assert obj["kind"] == a.kind.value and isinstance(obj["evidence"], dict)


def _replay_peak_bytes(trace) -> int:
    """Peak Python/numpy allocation while the CLI replays one trace."""
    tracemalloc.start()
    try:
        assert main([str(trace)]) == 0
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_newline_less_trace_is_read_in_bounded_memory_and_the_lines_after_it_replayed(tmp_path, capsys, monkeypatch):
    # /dev/zero or a gzip bomb without a newline: read whole, such a "line" took gigabytes. With the line
    # limit lowered to 64 kB, 8 MB of zeros (plain and gzip) cost a line and the readers' buffers more
    # than the trace without them.
    monkeypatch.setattr(contract, "MAX_LINE_BYTES", 64 * 1024)
    good = b"\n".join(cluster_lines(400, override=_hot)) + b"\n"
    alone = tmp_path / "good.jsonl"
    alone.write_bytes(good)
    baseline = _replay_peak_bytes(alone)
    expected = capsys.readouterr().out
    data = b"\0" * (8 << 20) + b"\n" + good
    plain, packed = tmp_path / "zeros.jsonl", tmp_path / "zeros.jsonl.gz"
    plain.write_bytes(data)
    packed.write_bytes(gzip.compress(data))
    for trace in (plain, packed):
        peak = _replay_peak_bytes(trace)
        out, err = capsys.readouterr()
        assert out == expected and len(out.splitlines()) == 1
        (cut,) = [line for line in err.splitlines() if "line exceeds 65536 bytes" in line]
        assert trace.name in cut
        assert peak < baseline + (4 << 20)  # read whole, the zeros alone would be 8 MB


def test_bounded_lines_cuts_an_overlong_line_and_keeps_its_neighbours(monkeypatch):
    monkeypatch.setattr(contract, "MAX_LINE_BYTES", 10)
    lines = list(bounded_lines(io.BufferedReader(io.BytesIO(b"short\n" + b"x" * 100_000 + b"\nnext\nlast"))))
    assert lines == [b"short\n", b"x" * 11, b"next\n", b"last"]


def test_malformed_lines_are_logged_up_to_a_limit_then_counted(caplog):
    caplog.set_level(logging.WARNING, logger="gpufleet.server.replay")
    assert run_replay([b"{}"] * 5_000 + cluster_lines(60)) == []
    skipped = [r for r in caplog.records if r.getMessage() == "skipping malformed line"]
    assert len(skipped) == MALFORMED_LOGGED
    (more,) = [r for r in caplog.records if r.getMessage() == "more malformed lines skipped"]
    assert (more.malformed, more.not_logged) == (5_000, 5_000 - MALFORMED_LOGGED)


def test_replay_of_files_loads_no_database_client():
    """The database replay's client (httpx, asyncio, the ingest sources) is start-up that a replay of files
    never uses: it loads when --prometheus-url is given, not with the replay command."""
    import subprocess

    code = (
        "import sys, gpufleet.server.replay\n"
        "print(sorted(m for m in ('httpx', 'asyncio', 'gpufleet.server.ingest.base') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
