"""XID events: counted per GPU and code on the watcher thread, handed to read(), and a watcher that never spins."""

from __future__ import annotations

import ctypes
import logging

import pynvml
import pytest

from gpufleet.agent.nvml_errors import ErrorCounts
from gpufleet.agent.nvml_reader import NvmlReader
from gpufleet.agent.xid import XidStore, XidWatcher, handle_key
from tests.agent.fake_nvml import FakeNvml, h100


@pytest.fixture
def fake_and_reader():
    fake = FakeNvml([h100(0), h100(1)])
    reader = NvmlReader(fake, xid_wait_ms=20)
    reader.open()
    yield fake, reader
    reader.close()


def test_xid_events_counted_per_gpu_and_code(fake_and_reader):
    fake, reader = fake_and_reader
    for code in (79, 48, 79):
        fake.push_xid(1, code)
    fake.push_xid(0, 13)
    assert fake.wait_drained()
    gpu0, gpu1 = reader.read()
    assert (gpu1.xid_errors_total, dict(gpu1.xid_errors_by_code), gpu1.last_xid) == (3, {79: 2, 48: 1}, 79)
    assert (gpu0.xid_errors_total, dict(gpu0.xid_errors_by_code), gpu0.last_xid) == (1, {13: 1}, 13)


def test_xid_counts_survive_reopen(fake_and_reader):
    fake, reader = fake_and_reader
    fake.push_xid(0, 94)
    assert fake.wait_drained()
    reader.close()
    reader.open()
    fake.push_xid(0, 94)
    assert fake.wait_drained()
    gpu0 = reader.read()[0]
    assert gpu0.xid_errors_total == 2 and gpu0.counter_resets == ()


def test_event_for_unknown_handle_is_ignored(fake_and_reader, caplog):
    fake, reader = fake_and_reader
    caplog.set_level(logging.DEBUG, logger="gpufleet.agent.xid")
    fake.push_xid(None, 79, address=0xDEAD)
    assert fake.wait_drained()
    assert all(g.xid_errors_total == 0 for g in reader.read())
    assert any("unknown device handle" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)


def test_registration_not_supported_means_no_xid_reading(caplog):
    gpus = [h100(0), h100(1)]
    gpus[1].xid_supported = False
    fake = FakeNvml(gpus)
    caplog.set_level(logging.INFO, logger="gpufleet.agent.nvml_reader")
    reader = NvmlReader(fake, xid_wait_ms=20)
    reader.open()
    fake.push_xid(0, 31)
    assert fake.wait_drained()
    gpu0, gpu1 = reader.read()
    capabilities = reader.capabilities
    reader.close()
    assert gpu0.xid_errors_total == 1
    assert gpu1.xid_errors_total is None and gpu1.last_xid is None and dict(gpu1.xid_errors_by_code) == {}
    assert capabilities[1]["xid_errors_total"] is False and capabilities[0]["xid_errors_total"] is True
    lines = [r for r in caplog.records if r.getMessage() == "gpu readings unsupported"]
    assert [(r.gpu, r.unsupported) for r in lines] == [(1, ["xid_errors_total"])]
    assert dict(reader.errors) == {}


def test_no_gpu_supports_events_starts_no_thread():
    gpus = [h100(0)]
    gpus[0].xid_supported = False
    fake = FakeNvml(gpus)
    reader = NvmlReader(fake, xid_wait_ms=20)
    reader.open()
    reader.read()
    reader.close()
    assert fake.called("nvmlEventSetWait_v2") == 0


def test_wait_errors_are_counted_logged_once_and_survived(fake_and_reader, caplog):
    fake, reader = fake_and_reader
    caplog.set_level(logging.WARNING, logger="gpufleet.agent.xid")
    fake.push_wait_error(pynvml.NVML_ERROR_UNKNOWN)
    fake.push_wait_error(pynvml.NVML_ERROR_UNKNOWN)
    fake.push_xid(0, 79)
    assert fake.wait_drained()
    assert reader.errors[("xid_errors_total", "unknown")] == 2
    assert len([r for r in caplog.records if "backing off" in r.getMessage()]) == 1
    assert reader.read()[0].xid_errors_total == 1


def test_backoff_grows_and_resets_on_timeout():
    watcher = XidWatcher(FakeNvml(), XidStore(), ErrorCounts(), wait_ms=500)
    unknown = pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
    delays = [0.0]
    for _ in range(9):
        delays.append(watcher._on_wait_error(unknown, delays[-1]))
    assert delays[1:4] == [0.5, 1.0, 2.0] and delays[-1] == 60.0
    assert watcher._on_wait_error(pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT), 8.0) == 0.0


def test_close_stops_the_watcher_within_one_wait(fake_and_reader):
    fake, reader = fake_and_reader
    assert fake.wait_for_wait_calls(1)
    watcher = reader._xid
    reader.close()
    assert not watcher._thread.is_alive()
    assert fake.called("nvmlEventSetFree") == 1


def test_store_copies_are_immutable():
    store = XidStore()
    store.record("GPU-a", 79)
    counts = store.get("GPU-a")
    store.record("GPU-a", 79)
    assert counts.total == 1 and store.get("GPU-a").total == 2
    with pytest.raises(TypeError):
        counts.by_code[79] = 5  # type: ignore[index]
    assert store.get("GPU-b").total == 0 and store.get("GPU-b").last is None


def test_handle_key_compares_pointers_by_address():
    a = ctypes.cast(ctypes.c_void_p(0x1234), pynvml.c_nvmlDevice_t)
    b = ctypes.cast(ctypes.c_void_p(0x1234), pynvml.c_nvmlDevice_t)
    assert a is not b and handle_key(a) == handle_key(b)
    assert handle_key("sim-gpu-0") == handle_key("sim-gpu-0") != handle_key("sim-gpu-1")
    unhashable = ["x"]
    assert handle_key(unhashable) == handle_key(unhashable)
