"""Target discovery: static lists, file_sd reloads, DNS fan-out."""

from __future__ import annotations

import json
import os

import pytest

from gpufleet.server.ingest.targets import (
    CombinedTargets,
    DnsTargets,
    FileSdTargets,
    StaticTargets,
    TargetError,
    parse_address,
    parse_file_sd,
)


def test_parse_address_normalises_and_rejects() -> None:
    assert parse_address(" dgx-01:9471 ") == "dgx-01:9471"
    assert parse_address("[::1]:9471") == "[::1]:9471"
    assert parse_address("dgx-01", default_port=9471) == "dgx-01:9471"
    for bad in ("dgx-01", "dgx-01:0", "dgx-01:99999", ":9471", "dgx-01:http"):
        with pytest.raises(TargetError, match="HOST:PORT"):
            parse_address(bad)


def test_static_targets_dedupe_and_sort() -> None:
    assert StaticTargets.parse("b:2, a:1,,b:2").targets() == ["a:1", "b:2"]
    with pytest.raises(TargetError):
        StaticTargets.parse("a:1,oops:http")


def test_a_bare_host_means_the_agent_default_port() -> None:
    assert StaticTargets.parse("dgx-01,dgx-02:9500").targets() == ["dgx-01:9471", "dgx-02:9500"]
    assert parse_file_sd(b"- targets: [dgx-01, 'dgx-02:1']\n") == ["dgx-01:9471", "dgx-02:1"]
    dns = DnsTargets("agents.gpufleet.svc", resolver=lambda host: ["10.0.0.7"])
    assert dns.targets() == ["10.0.0.7:9471"]


def test_file_sd_json_and_yaml() -> None:
    js = json.dumps([{"targets": ["a:1", "b:2"], "labels": {"rack": "r1"}}, {"targets": ["c:3"]}]).encode()
    assert parse_file_sd(js) == ["a:1", "b:2", "c:3"]
    assert parse_file_sd(b"- targets: ['x:9471']\n  labels: {a: b}\n") == ["x:9471"]
    assert parse_file_sd(b"") == []
    for bad in (b"{not json", b'{"targets": []}', b"- 3\n", b"- targets: x:1\n"):
        with pytest.raises(TargetError):
            parse_file_sd(bad)


def test_file_sd_reloads_on_change_and_keeps_last_good(tmp_path) -> None:
    path = tmp_path / "agents.json"
    path.write_text(json.dumps([{"targets": ["a:1"]}]))
    source = FileSdTargets(path)
    assert source.targets() == ["a:1"]
    path.write_text(json.dumps([{"targets": ["a:1", "b:2"]}]))
    os.utime(path, ns=(1, 2_000_000_000))  # force a different mtime even on coarse filesystems
    assert source.targets() == ["a:1", "b:2"]
    path.write_text("[{broken")
    os.utime(path, ns=(1, 3_000_000_000))
    assert source.targets() == ["a:1", "b:2"]
    path.unlink()
    assert source.targets() == ["a:1", "b:2"]


def test_file_sd_same_stamp_is_not_reread(tmp_path) -> None:
    path = tmp_path / "agents.yaml"
    path.write_text("- targets: ['a:1']\n")
    os.utime(path, ns=(1, 5_000_000_000))
    source = FileSdTargets(path)
    assert source.targets() == ["a:1"]
    path.write_text("- targets: ['z:1']\n")  # same size, mtime restored: not re-read
    os.utime(path, ns=(1, 5_000_000_000))
    assert source.targets() == ["a:1"]


def test_dns_targets_fan_out_and_survive_failure() -> None:
    answers: list[object] = [["10.0.0.2", "10.0.0.1", "fd00::1"], OSError("NXDOMAIN"), ["10.0.0.3"]]
    seen: list[str] = []

    def resolver(host: str) -> list[str]:
        seen.append(host)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]

    source = DnsTargets("agents.gpu.svc:9471", resolver=resolver)
    assert source.targets() == ["10.0.0.1:9471", "10.0.0.2:9471", "[fd00::1]:9471"]
    assert source.targets() == ["10.0.0.1:9471", "10.0.0.2:9471", "[fd00::1]:9471"]
    assert source.targets() == ["10.0.0.3:9471"]
    assert seen == ["agents.gpu.svc"] * 3


def test_combined_union() -> None:
    combined = CombinedTargets([StaticTargets(("a:1", "b:2")), DnsTargets("x:9", resolver=lambda h: ["b"])])
    assert combined.targets() == ["a:1", "b:2", "b:9"]
