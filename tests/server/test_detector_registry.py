"""A detector is one declaration: a toy "memory leak" detector, defined here and nowhere else, runs in the
real Engine through its `detectors` argument: its kind fires after its declared `for` duration, resolves
after its clear duration, describes itself with its declared advice, keys its fingerprint by job, forgets a
removed node, goes through the store and the API's filters, and tells the detectors after it what it
concluded. Also: the standard registry's declarations are complete and consistent."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from gpufleet.server.alerts import AlertKind, AlertState, Severity, description, fingerprint
from gpufleet.server import readings
from gpufleet.server.contract import parse_line
from gpufleet.server.engine import Engine, EngineConfig, registry
from gpufleet.server.engine.detectors import Context, Finding, FingerprintIndex, Outcome, job_groups
from gpufleet.server.engine.detectors.spec import Detection, Detector, KindSpec
from gpufleet.server.engine.groups import JOB
from gpufleet.server.engine.tick import Tick
from gpufleet.server.ingest import dcgm
from gpufleet.server.store import AlertQuery, AlertStore
from tests.server.engine_samples import T0, cluster_lines

MEMORY_LEAK = AlertKind("memory_leak", job_keyed=True)
LEAK_ADVICE = "Its process holds ever more memory: restart the job before it runs out."
LEAK_WATTS = 600.0  # the toy's stand-in signal: a smoothed power above this "leaks"


class LeakState:
    """The toy's state: its alerts' fingerprint index, and what the engine told it to forget."""

    def __init__(self) -> None:
        self.index = FingerprintIndex(MEMORY_LEAK)
        self.forgotten: list[tuple[list[int], int | None]] = []
        self.seen_explained: list[frozenset[int]] = []


def _detect(tick: Tick, state: LeakState, context: Context) -> Detection:
    w = tick.windows
    power = tick.med["power"]
    out = Outcome()
    for slot in np.flatnonzero(power > LEAK_WATTS).tolist():
        code = int(w.slot_job[slot])
        out.add(
            Finding(
                MEMORY_LEAK,
                w.slot_node[slot],
                w.slot_index[slot],
                w.slot_uuid[slot],
                w.job_names[code] if code >= 0 else None,
                Severity.WARNING,
                f"GPU {w.slot_index[slot]} on {w.slot_node[slot]} leaks",
                {"power_watts": float(power[slot])},
            )
        )

    def clear(fp: str) -> bool | None:
        hit = state.index.get(w, fp)
        return None if hit is None or np.isnan(power[hit[0]]) else bool(power[hit[0]] <= LEAK_WATTS)

    out.clear = clear
    jobs = {f.hpc_job for f in out.findings.values()}
    return Detection(outcomes={MEMORY_LEAK: out}, explained=job_groups(tick.registry, jobs))


def _forget(state: LeakState, slots: np.ndarray, node_id: int | None) -> None:
    state.forgotten.append((sorted(slots.tolist()), node_id))


LEAK: Detector[LeakState] = Detector(
    name="memory_leak",
    kinds=(
        KindSpec(
            kind=MEMORY_LEAK,
            advice=LEAK_ADVICE,
            for_setting="thermal_for_seconds",
            clear_setting="thermal_clear_seconds",
            without=(("power_watts", "cannot see a leak"),),
        ),
    ),
    rules=(),
    state=LeakState,
    detect=_detect,
    forget_node=_forget,
)


def _spy_detect(tick: Tick, state: LeakState, context: Context) -> Detection:
    state.seen_explained.append(frozenset(context.explained))
    return Detection(outcomes={})


SPY: Detector[LeakState] = Detector(name="spy", kinds=(), rules=(), state=LeakState, detect=_spy_detect)


def _leaking(start: float, end: float, job_after: float | None = None):
    """GPU 2 of n1 draws more than LEAK_WATTS from `start` to `end` (s after T0); from `job_after` on, the
    cluster runs job j2 instead of j1."""

    def override(t: float, node: str, gpu: int) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        if (node, gpu) == ("n1", 2) and start <= t < end:
            kw["power_watts"] = 650.0
        if job_after is not None and t >= job_after:
            kw["hpc_job"] = "j2"
        return kw

    return override


def _run(engine: Engine, lines: list[bytes], step: float = 5.0) -> list:
    samples = [parse_line(line) for line in lines]
    out = []
    t, i = T0, 0
    end = max(s.time for s in samples) + step
    while t <= end:
        while i < len(samples) and samples[i].time < t:
            engine.ingest(samples[i])
            i += 1
        out += [tr for tr in engine.advance(t) if tr.alert.kind == MEMORY_LEAK]
        t += step
    return out


def _engine(**settings: Any) -> Engine:
    return Engine(EngineConfig.from_mapping(settings), detectors=registry.STANDARD + (LEAK,))


@pytest.mark.parametrize("for_seconds", [30.0, 90.0])
def test_a_new_detector_fires_after_its_declared_for_duration_and_resolves_after_its_clear_duration(for_seconds):
    engine = _engine(thermal_for_seconds=for_seconds, thermal_clear_seconds=60.0)
    transitions = _run(engine, cluster_lines(900, override=_leaking(200.0, 500.0)))
    states = [(tr.previous, tr.alert.state) for tr in transitions]
    assert states == [
        (None, AlertState.PENDING),
        (AlertState.PENDING, AlertState.FIRING),
        (AlertState.FIRING, AlertState.RESOLVED),
    ]
    pending, firing, resolved = (tr.alert for tr in transitions)
    assert firing.started - pending.pending_since == pytest.approx(for_seconds, abs=5.0)
    assert firing.started - pending.pending_since >= for_seconds
    # Clear for 60 s after the power fell (the smoothing lags it by up to smooth_seconds).
    assert resolved.resolved >= T0 + 500.0 + 60.0
    assert (firing.node, firing.gpu, firing.hpc_job) == ("n1", 2, "j1")


def test_its_alerts_say_its_declared_advice_and_keep_it_through_the_store(tmp_path):
    engine = _engine()
    transitions = _run(engine, cluster_lines(500, override=_leaking(200.0, 10_000.0)))
    alert = next(tr.alert for tr in transitions if tr.alert.state is AlertState.FIRING)
    assert alert.kind == "memory_leak" and alert.advice == LEAK_ADVICE
    assert description(alert).endswith(LEAK_ADVICE)
    store = AlertStore(tmp_path / "alerts.db")
    store.upsert([alert])
    (stored,) = store.query(AlertQuery(kind=AlertKind("memory_leak"))).alerts
    assert stored.kind == MEMORY_LEAK and stored.to_dict() == alert.to_dict()
    assert store.query(AlertQuery(kind=AlertKind.STRAGGLER)).total == 0


def test_its_fingerprint_is_keyed_by_job_as_declared():
    engine = _engine()
    transitions = _run(engine, cluster_lines(1200, override=_leaking(200.0, 10_000.0, job_after=600.0)))
    fired = {tr.alert.hpc_job: tr.alert for tr in transitions if tr.alert.state is AlertState.FIRING}
    assert set(fired) == {"j1", "j2"}  # the same GPU in a new job is a new problem
    assert fired["j1"].fingerprint != fired["j2"].fingerprint
    assert fired["j2"].fingerprint == fingerprint(MEMORY_LEAK, "n1", 2, "j2")


def test_a_removed_node_resolves_its_alerts_and_its_state_forgets_the_node():
    engine = _engine()
    _run(engine, cluster_lines(500, override=_leaking(200.0, 10_000.0)))
    assert any(a.kind == MEMORY_LEAK for a in engine.alerts())
    slots = sorted(engine.windows.slot_of[("n1", g)] for g in range(8))
    node_id = engine.windows.node_ids["n1"]
    transitions = engine.forget_node("n1", T0 + 600.0, "left discovery")
    assert [tr.alert.state for tr in transitions if tr.alert.kind == MEMORY_LEAK] == [AlertState.RESOLVED]
    assert not any(a.kind == MEMORY_LEAK for a in engine.alerts())
    assert engine.state("memory_leak").forgotten == [(slots, node_id)]


def test_a_detector_reads_what_the_ones_before_it_concluded_and_nothing_from_those_after():
    engine = Engine(EngineConfig(), detectors=(SPY, LEAK, dataclasses.replace(SPY, name="spy_after")))
    _run(engine, cluster_lines(500, override=_leaking(200.0, 10_000.0)))
    before, after = engine.state("spy").seen_explained, engine.state("spy_after").seen_explained
    j1 = engine.registry.ids[(JOB, "j1")]
    assert not any(before) and after[-1] == {j1}


def test_the_sources_say_what_a_new_detector_cannot_do_without_its_readings():
    effects = registry.missing_effects(registry.STANDARD + (LEAK,))
    assert effects["power_watts"] == (("memory_leak", "cannot see a leak"),)
    assert {k: v for k, v in effects.items() if k != "power_watts"} == dict(dcgm.MISSING_EFFECTS)


def test_a_registry_that_declares_a_kind_twice_or_names_no_setting_is_refused():
    with pytest.raises(ValueError, match="memory_leak"):
        Engine(detectors=(LEAK, dataclasses.replace(LEAK, name="again")))
    wrong = dataclasses.replace(LEAK, kinds=(dataclasses.replace(LEAK.kinds[0], for_setting="leak_for_seconds"),))
    with pytest.raises(ValueError, match="leak_for_seconds"):
        Engine(detectors=(wrong,))


def test_the_standard_registry_declares_every_kind_once_with_advice_and_existing_settings():
    specs = registry.kind_specs(registry.STANDARD)
    assert [s.kind for s in specs] == [
        "thermal_throttle",
        "node_unreachable",
        "gpu_lost",
        "xid",
        "ecc",
        "straggler",
        "comm_bound",
        "input_bound",
    ]
    assert all(s.advice.endswith(".") for s in specs)
    assert {s.kind for s in specs if s.kind.job_keyed} == {"straggler", "comm_bound", "input_bound"}
    registry.check(registry.STANDARD, EngineConfig())


def test_an_alert_restored_from_a_store_without_advice_takes_its_kinds(tmp_path):
    engine = _engine()
    _run(engine, cluster_lines(500, override=_leaking(200.0, 10_000.0)))
    (leak,) = [a for a in engine.alerts() if a.kind == MEMORY_LEAK]
    store = AlertStore(tmp_path / "alerts.db")
    store.upsert([dataclasses.replace(leak, advice="")])  # as a store written before alerts kept advice
    restarted = _engine()
    assert restarted.restore(store.open_alerts()) == 1
    assert restarted.alerts()[0].advice == LEAK_ADVICE


def test_the_standard_detectors_name_only_readings_of_the_reading_table():
    names = {r.name for r in readings.READINGS}
    assert set(registry.missing_effects(registry.STANDARD)) <= names
