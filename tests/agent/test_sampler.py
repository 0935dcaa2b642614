"""Sampler with a stub reader and an injected clock: publishing, backoff and recovery, contained failures."""

from __future__ import annotations

import threading
import logging

import orjson

from gpufleet.agent.attribution import JobAttributor
from gpufleet.agent.nvml_reader import NvmlUnavailable
from gpufleet.agent.record import Recorder
from gpufleet.agent.sampler import Sampler
from gpufleet.agent.store import SnapshotStore
from tests.agent.fakes import FakeClock, FakeStop, StubReader


def make(reader=None, **kwargs):
    clock = FakeClock()
    store = SnapshotStore()
    reader = reader or StubReader()
    sampler = Sampler(
        reader, store, node="dgx-017", clock=clock.time, monotonic=clock.monotonic, jitter=lambda: 0.5, **kwargs
    )
    return sampler, reader, store, clock


def test_cycle_publishes_snapshot_json_and_metrics():
    sampler, reader, store, clock = make()
    snap = sampler.run_once()
    assert snap is not None and snap.time == clock.now and snap.node == "dgx-017"
    assert snap.driver_version == "550.54.15" and snap.sample_duration_seconds is not None
    pub = store.latest()
    assert pub.snapshot is snap
    assert orjson.loads(pub.snapshot_json) == snap.to_dict()
    assert b'gpufleet_agent_nvml_up{node="dgx-017"} 1.0' in pub.metrics
    assert b"gpufleet_gpu_utilization_ratio" in pub.metrics
    assert pub.health.capabilities[1]["memory_temperature_celsius"] is False


def test_init_failure_backs_off_doubling_then_recovers():
    reader = StubReader()
    reader.open_failures = 3
    sampler, reader, store, clock = make(reader)
    assert sampler.run_once() is None
    pub = store.latest()
    assert not pub.health.nvml_up and pub.health.nvml_error == "NvmlUnavailable"
    assert b'gpufleet_agent_nvml_up{node="dgx-017"} 0.0' in pub.metrics
    assert b"gpufleet_gpu_" not in pub.metrics
    # jitter 0.5 means exactly the base delay: 1 s, then 2 s, then 4 s.
    delays = [sampler.next_open_delay]
    for _ in (2.0, 4.0):
        clock.advance(0.5)
        assert sampler.run_once() is None  # not due yet: no open attempt
        clock.advance(delays[-1] - 0.5)
        assert sampler.run_once() is None
        delays.append(sampler.next_open_delay)
    assert delays == [1.0, 2.0, 4.0]
    assert reader.opened == 3
    clock.advance(4.0)
    assert sampler.run_once() is not None
    assert store.latest().health.nvml_up and store.latest().health.nvml_error is None
    health = store.latest().health
    assert health.errors[("nvml_open", "NvmlUnavailable")] == 3
    assert health.errors[("nvml_init", "driver_not_loaded")] == 3  # the reader's own count, merged


def test_backoff_is_capped_and_jittered():
    reader = StubReader()
    reader.open_failures = 100
    sampler, reader, store, clock = make(reader, backoff_max=60.0)
    sampler._jitter = lambda: 1.0  # +25 %
    seen = []
    for _ in range(12):
        clock.advance(sampler.next_open_delay)
        sampler.run_once()
        seen.append(sampler.next_open_delay)
    assert seen[:3] == [1.25, 2.5, 5.0]
    assert max(seen) == 60.0 and seen[-1] == 60.0
    sampler._jitter = lambda: 0.0  # -25 %
    clock.advance(60)
    sampler.run_once()
    assert sampler.next_open_delay == 45.0


def test_nvml_vanishing_mid_run_reopens_next_cycle():
    sampler, reader, store, clock = make()
    assert sampler.run_once() is not None

    def vanish():
        raise NvmlUnavailable("driver gone")

    reader.read_effects = [vanish]
    assert sampler.run_once() is None
    assert not store.latest().health.nvml_up and reader.closed == 1
    # /snapshot keeps the last good one; /metrics drops the GPU series while NVML is down.
    assert store.latest().snapshot is not None and b"gpufleet_gpu_up" not in store.latest().metrics
    clock.advance(1)
    assert sampler.run_once() is not None and reader.opened == 2


def test_unexpected_exception_is_counted_and_sampling_continues(caplog):
    caplog.set_level(logging.WARNING)
    sampler, reader, store, clock = make()

    def boom():
        raise KeyError("bug")

    reader.read_effects = [boom, None]
    assert sampler.run_once() is None
    assert sampler.nvml_up
    assert store.latest().health.errors[("cycle", "KeyError")] == 1
    assert b'gpufleet_agent_errors_total{error="KeyError",node="dgx-017",reading="cycle"} 1.0' in store.latest().metrics
    assert sampler.run_once() is not None
    assert any("sampling cycle failed" in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_repeating_failure_is_logged_once_a_minute(caplog):
    caplog.set_level(logging.WARNING)
    sampler, reader, store, clock = make()

    def boom():
        raise KeyError("bug")

    reader.read_effects = [boom] * 70
    for _ in range(70):
        sampler.run_once()
        clock.advance(1)
    assert store.latest().health.errors[("cycle", "KeyError")] == 70
    assert len([r for r in caplog.records if "sampling cycle failed" in r.getMessage()]) == 2


def test_run_loop_keeps_a_drift_free_schedule():
    clock = FakeClock()
    reader = StubReader()
    stop = FakeStop(clock, cycles=5)
    sampler = Sampler(
        reader, SnapshotStore(), node="n", interval=1.0, clock=clock.time, monotonic=clock.monotonic, stop=stop
    )

    def slow():
        clock.advance(0.25)  # each read takes a quarter second

    reader.read_effects = [slow] * 5
    sampler.run()
    assert reader.reads == 5
    assert stop.waits == [0.75] * 5  # the cycle's own duration is subtracted, so ticks do not drift


def test_run_loop_skips_ticks_after_an_overrun():
    clock = FakeClock()
    reader = StubReader()
    stop = FakeStop(clock, cycles=2)
    sampler = Sampler(
        reader, SnapshotStore(), node="n", interval=1.0, clock=clock.time, monotonic=clock.monotonic, stop=stop
    )
    reader.read_effects = [lambda: clock.advance(3.5), None]
    sampler.run()
    assert stop.waits[0] == 0.5  # back on the grid, not a burst of catch-up cycles
    assert sampler.health().errors[("cycle", "overrun")] == 3


def test_attribution_from_procfs_lands_in_the_snapshot(tmp_path):
    (tmp_path / "4001").mkdir()
    (tmp_path / "4001" / "environ").write_bytes(b"HOME=/root\0SLURM_JOB_ID=4242\0")
    reader = StubReader(pids={0: (4001,)})
    sampler, reader, store, clock = make(reader, attributor=JobAttributor(tmp_path))
    snap = sampler.run_once()
    assert [g.hpc_job for g in snap.gpus] == ["4242", None]
    assert b'hpc_job="4242"' in store.latest().metrics


def test_record_failure_is_counted_and_does_not_stop_sampling(tmp_path):
    recorder = Recorder(tmp_path / "no-such-dir" / "trace.jsonl")
    sampler, reader, store, clock = make(recorder=recorder)
    assert sampler.run_once() is not None
    assert sampler.run_once() is not None
    assert store.latest().health.errors[("record", "write_failed")] == 2


def test_record_writes_each_snapshot_as_a_line(tmp_path):
    path = tmp_path / "trace.jsonl"
    sampler, reader, store, clock = make(recorder=Recorder(path))
    for _ in range(3):
        sampler.run_once()
        clock.advance(1)
    lines = path.read_bytes().splitlines()
    assert [orjson.loads(line)["time"] for line in lines] == [1763800000.0, 1763800001.0, 1763800002.0]


def test_stop_closes_the_reader():
    sampler, reader, store, clock = make()
    sampler.run_once()
    sampler.stop()
    assert reader.closed == 1 and not sampler.nvml_up


def test_real_thread_publishes_and_stops():
    store = SnapshotStore()
    reader = StubReader()
    published = []
    original = store.publish

    def publish(p):
        original(p)
        published.append(p)
        if len(published) >= 2:
            sampler._stop.set()

    store.publish = publish
    sampler = Sampler(reader, store, node="n", interval=0.1)
    sampler.start()
    sampler._thread.join(timeout=10)
    assert not sampler._thread.is_alive()
    sampler.stop()
    assert len(published) >= 2 and reader.closed == 1


class CountingRenderer:
    """Stands in for exposition.Renderer: counts renders, fails when told to."""

    def __init__(self) -> None:
        self.renders = 0
        self.fail = False

    def render(self, snapshot, health, activity) -> bytes:
        self.renders += 1
        if self.fail:
            raise KeyError("broken family")
        return f"body {self.renders}\n".encode()


def test_a_snapshot_is_rendered_only_when_read_and_only_once():
    sampler, _, store, _ = make()
    renderer = sampler._bodies._renderer = CountingRenderer()
    for _ in range(15):
        sampler.run_once()
    assert renderer.renders == 0  # nobody scraped
    pub = store.latest()
    assert pub.metrics == pub.metrics == b"body 1\n" and renderer.renders == 1


def test_a_failing_render_serves_the_last_good_body_and_is_counted():
    sampler, _, store, _ = make()
    renderer = sampler._bodies._renderer = CountingRenderer()
    sampler.run_once()
    assert store.latest().metrics == b"body 1\n"
    renderer.fail = True
    sampler.run_once()
    assert store.latest().metrics == b"body 1\n"
    assert sampler.health().errors[("render", "KeyError")] == 1


def test_health_carries_the_readers_nvml_cost_and_periods():
    reader = StubReader()
    reader.nvml_seconds = {"nvmlDeviceGetFieldValues": 0.25}
    reader.reading_periods = {"energy_joules_total": 60.0}
    sampler, _, store, _ = make(reader)
    sampler.run_once()
    body = store.latest().metrics
    assert b'gpufleet_agent_nvml_seconds_total{call="nvmlDeviceGetFieldValues",node="dgx-017"} 0.25' in body
    assert b'gpufleet_agent_reading_period_seconds{node="dgx-017",reading="energy_joules_total"} 60.0' in body


def test_steady_scrapes_find_their_snapshot_rendered_ahead_by_the_sampler():
    sampler, _, store, clock = make()
    renderer = sampler._bodies._renderer = CountingRenderer()
    found_rendered = []
    for second in range(1, 91):  # 1 s samples, a scrape every 15 s at 0.6 s past the sample
        sampler.run_once()
        if second % 15 == 0:
            clock.advance(0.6)
            body = store.latest().rendered
            found_rendered.append(body.rendered)
            body.get()
            clock.advance(0.4)
        else:
            clock.advance(1.0)
    # The first two scrapes set the period; every later one finds its text ready, and no render is wasted.
    assert found_rendered == [False, False, True, True, True, True]
    assert renderer.renders == 6


def test_a_text_rendered_ahead_is_published_only_once_it_is_ready():
    prepared = []
    sampler, _, store, clock = make(rendered_ahead=lambda text: prepared.append((text, store.latest().rendered.text)))
    for second in range(1, 46):  # 1 s samples, a scrape every 15 s
        sampler.run_once()
        if prepared:
            text, served_meanwhile = prepared[0]
            # Compressed (rendered_ahead) while the publication before was still the one served; published
            # with its text ready for the scrape.
            assert served_meanwhile is not text
            assert store.latest().ready_metrics() is text
            return
        if second % 15 == 0:
            _ = store.latest().metrics  # a scrape reads it
        clock.advance(1.0)
    raise AssertionError("the steady scraper never made the sampler render ahead")


def test_a_rendered_text_is_read_while_the_next_one_renders():
    sampler, _, store, clock = make()
    sampler.run_once()
    pub = store.latest()
    _ = pub.metrics  # rendered and read once: a scrape found it
    sampler.run_once()
    newer = store.latest()
    newer.rendered._render_locked()  # rendered, as ahead of its scrape, and not read yet
    with sampler._bodies._lock:  # the sampler rendering a further text
        assert newer.ready_metrics() == newer.rendered.text is not None


def test_a_missed_guess_costs_one_render_and_the_scrape_renders_as_before():
    sampler, _, store, clock = make()
    renderer = sampler._bodies._renderer = CountingRenderer()
    for at in (15, 30):
        while clock.mono < 1000.0 + at:
            sampler.run_once()
            clock.advance(1.0)
        _ = store.latest().metrics  # a scrape reads the body
    for _ in range(30):  # the scraper went away: one render ahead, then none
        sampler.run_once()
        clock.advance(1.0)
    assert renderer.renders == 3


def test_a_stop_signal_frees_every_waiter_and_stays_set():
    from gpufleet.agent.sampler import StopSignal

    stop = StopSignal()
    assert not stop.is_set() and stop.wait(0) is False
    stop.set()
    stop.set()  # a second set (a signal during shutdown) is harmless
    assert stop.is_set() and stop.wait(0) is True and stop.wait(None) is True and stop.wait(5) is True


def test_waiters_blocked_on_a_stop_signal_all_return_when_it_is_set():
    from gpufleet.agent.sampler import StopSignal

    stop, results = StopSignal(), []
    threads = [threading.Thread(target=lambda: results.append(stop.wait(None))) for _ in range(3)]
    for thread in threads:
        thread.start()
    stop.set()
    for thread in threads:
        thread.join(10)
    assert results == [True, True, True]
