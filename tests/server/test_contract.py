"""The snapshot-contract parser: fast path, absent/null readings, and every rejection."""

from __future__ import annotations

import math

import orjson
import pytest

from gpufleet.server.contract import ContractError, parse_line, parse_lines, parse_snapshot
from tests.server.engine_samples import T0, healthy, snapshot_line


def _payload(**gpu_kw) -> dict:
    return orjson.loads(snapshot_line("n0", T0, [healthy(0, **gpu_kw), healthy(1)]))


def test_parses_agent_line_into_columns():
    s = parse_line(snapshot_line("n0", T0, [healthy(0), healthy(1, job="77")]))
    assert (s.node, s.time, s.indices, s.jobs) == ("n0", T0, (0, 1), ("j1", "77"))
    assert s.value(0, "utilization_ratio") == pytest.approx(0.98)
    assert s.value(1, "power_watts") == 500.0


def test_null_and_absent_readings_are_unsupported_not_zero():
    payload = _payload(sm_active_ratio=None)
    del payload["gpus"][1]["power_watts"]
    s = parse_snapshot(payload)
    assert s.value(0, "sm_active_ratio") is None
    assert s.value(1, "power_watts") is None
    assert s.value(1, "temperature_celsius") == 60.0


def test_unknown_fields_are_ignored_and_integer_job_becomes_text():
    payload = _payload()
    payload["future_field"] = {"x": 1}
    payload["gpus"][0]["brand_new_reading"] = 3
    payload["gpus"][0]["hpc_job"] = 4242
    assert parse_snapshot(payload).jobs[0] == "4242"


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda p: p.pop("node"), "node"),
        (lambda p: p.pop("time"), "time"),
        (lambda p: p.pop("gpus"), "gpus"),
        (lambda p: p.update(schema=2), "schema"),
        (lambda p: p.update(time="yesterday"), "time"),
        (lambda p: p["gpus"][0].update(utilization_ratio="0.5"), "utilization_ratio"),
        (lambda p: p["gpus"][0].update(power_watts=True), "power_watts"),
        (lambda p: p["gpus"][0].update(up=1), "up"),
        (lambda p: p["gpus"][0].update(temperature_celsius=900.0), "temperature_celsius"),
        (lambda p: p["gpus"][0].update(utilization_ratio=42.0), "utilization_ratio"),
        (lambda p: p["gpus"][0].update(power_watts=-5.0), "power_watts"),
        (lambda p: p["gpus"][1].update(index=0), "duplicate"),
        (lambda p: p["gpus"][0].update(uuid=7), "uuid"),
        (lambda p: p["gpus"][0].update(xid_errors_by_code=[1]), "xid"),
    ],
)
def test_schema_violations_are_rejected_with_a_reason(mutate, reason):
    payload = _payload()
    mutate(payload)
    with pytest.raises(ContractError, match=reason):
        parse_snapshot(payload)
    with pytest.raises(ContractError):
        parse_line(orjson.dumps(payload))


def test_nan_in_a_decoded_payload_is_rejected():
    payload = _payload()
    payload["gpus"][0]["power_watts"] = math.nan
    with pytest.raises(ContractError, match="power_watts"):
        parse_snapshot(payload)


def test_non_finite_json_and_garbage_are_rejected():
    for line in (b'{"schema":1,"node":"a","time":1e999,"gpus":[]}', b"{not json", b"[1,2]", b'"text"'):
        with pytest.raises(ContractError):
            parse_line(line)


def test_a_string_that_is_not_utf8_is_a_contract_error_and_parsing_goes_on():
    good = snapshot_line("n0", T0, [healthy(0)])
    bad = good.replace(b'"n0"', b'"n\xb80"')
    results = list(parse_lines([good, bad, good]))
    assert [type(r).__name__ for _, r in results] == ["NodeSample", "ContractError", "NodeSample"]
    assert "UTF-8" in str(results[1][1])


def test_oversized_line_is_rejected():
    with pytest.raises(ContractError, match="exceeds"):
        parse_line(b" " * (5 * 1024 * 1024))


def test_parse_lines_reports_bad_lines_by_number_and_keeps_going():
    good = snapshot_line("n0", T0, [healthy(0)])
    bad_type = orjson.dumps(_payload(sm_active_ratio="high"))
    results = list(parse_lines([good, b"", b"garbage", bad_type, good]))
    assert [n for n, _ in results] == [1, 3, 4, 5]
    kinds = [type(r).__name__ for _, r in results]
    assert kinds == ["NodeSample", "ContractError", "ContractError", "NodeSample"]


def test_batched_and_single_parsing_agree():
    lines = [snapshot_line(f"n{i}", T0 + i, [healthy(0, power_watts=100.0 + i), healthy(1)]) for i in range(5)]
    batched = [s for _, s in parse_lines(lines)]
    for line, b in zip(lines, batched):
        one = parse_line(line)
        assert (one.node, one.time) == (b.node, b.time)
        assert (one.values == b.values)[~(one.values != one.values)].all()


def test_ratio_slightly_above_one_is_clipped():
    assert parse_snapshot(_payload(utilization_ratio=1.02)).value(0, "utilization_ratio") == 1.0


def test_batches_split_by_gpu_rows_give_the_same_results_as_single_lines():
    # 400 two-GPU lines span several validation batches (CHUNK_GPUS rows each); the bad lines must
    # be rejected with the same reason wherever they fall, and their neighbours must still parse.
    lines = []
    for i in range(400):
        if i % 97 == 13:
            lines.append(orjson.dumps(_payload(temperature_celsius=900.0)))
        elif i % 89 == 7:
            lines.append(orjson.dumps(_payload(power_watts="300")))
        else:
            lines.append(snapshot_line(f"n{i % 7}", T0 + i, [healthy(0, power_watts=100.0 + i), healthy(1)]))
    batched = list(parse_lines(lines))
    assert [n for n, _ in batched] == list(range(1, 401))
    for line, (_, b) in zip(lines, batched):
        try:
            one = parse_line(line)
        except ContractError as exc:
            assert isinstance(b, ContractError) and str(b) == str(exc)
        else:
            assert (one.node, one.time, one.indices, one.jobs) == (b.node, b.time, b.indices, b.jobs)
            assert (one.values == b.values)[~(one.values != one.values)].all()
    assert sum(isinstance(b, ContractError) for _, b in batched) == 9


def test_lines_of_one_node_share_its_identity_and_a_job_change_is_kept():
    # 600 lines span several batches; the node's strings are held once, not once per line.
    lines = [snapshot_line("n0", T0 + i, [healthy(0), healthy(1, job="77" if i >= 300 else "j1")]) for i in range(600)]
    lines.append(snapshot_line("n0", T0 + 600, [healthy(0), healthy(0)]))  # duplicate index, same node
    parsed = [s for _, s in parse_lines(lines)]
    first, before, after, dup = parsed[0], parsed[299], parsed[300], parsed[-1]
    assert before.uuids is first.uuids and before.jobs is first.jobs and before.node is first.node
    assert (before.jobs, after.jobs) == (("j1", "j1"), ("j1", "77"))
    assert after.uuids == first.uuids
    assert isinstance(dup, ContractError) and "duplicate gpu index" in str(dup)


def test_the_decoder_expects_fields_in_the_order_the_agent_writes_them():
    # msgspec finds keys fastest in declaration order; every field the agent writes and the server reads
    # is declared in the agent's order.
    from dataclasses import fields

    from gpufleet.agent.model import GpuSample
    from gpufleet.server.contract import GPU_FIELD_ORDER

    written = [f.name for f in fields(GpuSample)]
    assert set(GPU_FIELD_ORDER) <= set(written)
    assert list(GPU_FIELD_ORDER) == [name for name in written if name in GPU_FIELD_ORDER]


def test_slow_reading_ages_from_the_agent_are_accepted_and_ignored():
    payload = _payload()
    payload["gpus"][0]["slow_readings_age_seconds"] = {"energy_joules_total": 37.0, "memory_used_bytes": 12.5}
    assert parse_snapshot(payload).value(0, "energy_joules_total") == parse_snapshot(_payload()).value(
        0, "energy_joules_total"
    )
