"""thermal_throttle: a GPU at or above the temperature threshold, with its HBM at its own max operating
temperature, or with thermal throttle bits set.

The condition is read per bin (not smoothed) and must hold for thermal_for_seconds in the lifecycle, so a
few seconds' spike never fires. Critical when clocks are cut (HW thermal slowdown bit, or SM clock well
below max while thermally throttled), the GPU is within a margin of its own slowdown temperature, or its
HBM is at its limit. Clears below threshold - margin, HBM below its limit - margin, with no thermal bits
(hysteresis), held for thermal_clear_seconds. HBM reported without its limit (or not at all) is evidence
only, never a trigger.
"""

from __future__ import annotations

import numpy as np

from gpufleet.server.alerts import AlertKind, Severity
from gpufleet.server.engine.detectors import Context, Finding, FingerprintIndex, Outcome, job_groups, r3
from gpufleet.server.engine.detectors.spec import Detection, Detector, KindSpec
from gpufleet.server.engine.reduce import median
from gpufleet.server.engine.tick import Tick, smoothed_row
from gpufleet.server.engine.windows import (
    B_CLOCK_RATIO,
    B_HW_THERMAL,
    B_MEM_TEMP,
    B_TEMP,
    B_THERMAL,
    B_UTIL,
    L_MEM_MAX,
    L_SLOWDOWN,
)
from gpufleet.server.engine.rules import Rule, any_of, evaluate
from gpufleet.server.engine.units import PERCENT

# What makes a GPU hot. NaN on either side (no HBM sensor, no limit reported) compares false: never hot.
HOT_RULES: tuple[Rule, ...] = (
    Rule(
        name="thermal_hot_die",
        doc="the die temperature is at or above the threshold",
        signal="temperature_celsius",
        margin="thermal_temperature_celsius",
    ),
    Rule(
        name="thermal_hot_hbm",
        doc="HBM at its own max operating temperature (less a margin), whatever the die reads",
        signal="memory_temperature_celsius",
        reference="memory_max_celsius",
        margin=None,
        less=("thermal_memory_margin_celsius",),
    ),
    Rule(
        name="thermal_bits",
        doc="the driver reports a thermal throttle reason (SW or HW thermal slowdown) in the bin",
        signal="thermal_bits_share",
        op=">",
        margin=None,
    ),
)
# Still warm: an open alert resolves only once none of these holds (hysteresis under the hot rules).
WARM_RULES: tuple[Rule, ...] = (
    Rule(
        name="thermal_warm_die",
        doc="the die is within the clear margin under the threshold: the alert does not clear",
        signal="temperature_celsius",
        margin="thermal_temperature_celsius",
        less=("thermal_clear_margin_celsius",),
    ),
    Rule(
        name="thermal_warm_hbm",
        doc="HBM is within the clear margin under its limit: the alert does not clear",
        signal="memory_temperature_celsius",
        reference="memory_max_celsius",
        margin=None,
        less=("thermal_memory_margin_celsius", "thermal_clear_margin_celsius"),
    ),
)
# Clocks cut by heat (what that costs a job is its straggler's), and the GPU at its own limits: critical,
# the GPU brakes hard or shuts down next (engine/severity.py).
CRITICAL_RULES: tuple[Rule, ...] = (
    Rule(
        name="thermal_clock_cut",
        doc="a busy, thermally throttled GPU's SM clock is cut well under its max",
        signal="sm_clock_ratio",
        op="<",
        margin="thermal_clock_cut_ratio",
        gates=("thermal_bits", "busy"),
    ),
    Rule(
        name="thermal_near_slowdown",
        doc="the die is within a margin of the GPU's own slowdown temperature (critical)",
        signal="temperature_celsius",
        reference="slowdown_celsius",
        margin=None,
        less=("thermal_slowdown_margin_celsius",),
    ),
)
RULES: tuple[Rule, ...] = HOT_RULES + WARM_RULES + CRITICAL_RULES


def _arrays(tick: Tick) -> dict[str, np.ndarray]:
    """What the rules read, per GPU, from the newest bin (not smoothed: thermal_for_seconds holds it)."""
    w = tick.windows
    latest = tick.latest
    arrays = {
        "temperature_celsius": latest[B_TEMP],
        "memory_temperature_celsius": latest[B_MEM_TEMP],
        "memory_max_celsius": w.slot_limits[L_MEM_MAX, : w.n],
        "slowdown_celsius": w.slot_limits[L_SLOWDOWN, : w.n],
        "thermal_bits_share": latest[B_THERMAL],
        "sm_clock_ratio": latest[B_CLOCK_RATIO],
        "busy": latest[B_UTIL] >= tick.config.busy_utilization,
    }
    hot = evaluate(HOT_RULES, arrays, tick.config)
    arrays.update(hot)
    arrays["hot"] = any_of(hot, [r.name for r in HOT_RULES])
    return arrays


def detect(tick: Tick, state: FingerprintIndex, context: Context) -> Outcome:
    """Findings for every GPU whose newest bin is hot or thermally throttled (the state is the alerts'
    fingerprint index; nothing in the context matters to heat)."""
    cfg = tick.config
    arrays = _arrays(tick)
    warm = any_of(evaluate(WARM_RULES, arrays, cfg), [r.name for r in WARM_RULES])
    unknown = np.isnan(arrays["temperature_celsius"]) & np.isnan(arrays["thermal_bits_share"])
    on = arrays["hot"]
    clear = ~warm & ~arrays["thermal_bits"] & ~unknown
    arrays.update(evaluate(CRITICAL_RULES, arrays, cfg))
    critical = arrays["thermal_near_slowdown"]
    out = Outcome()
    for slot in on.nonzero()[0].tolist():
        out.add(_finding(tick, slot, arrays, bool(critical[slot])))

    def clear_test(fp: str) -> bool | None:
        hit = state.get(tick.windows, fp)
        if hit is None or hit[0] >= len(clear) or unknown[hit[0]]:
            return None
        return bool(clear[hit[0]])

    out.clear = clear_test
    return out


def _finding(tick: Tick, slot: int, arrays: dict[str, np.ndarray], critical: bool) -> Finding:
    """Evidence and severity for one hot GPU."""
    cfg = tick.config
    w = tick.windows
    latest = tick.latest
    temp = float(latest[B_TEMP, slot])
    slowdown = float(w.slot_limits[L_SLOWDOWN, slot])
    clock = float(latest[B_CLOCK_RATIO, slot])
    util = float(latest[B_UTIL, slot])
    hw = float(latest[B_HW_THERMAL, slot])
    thermal_bits = float(latest[B_THERMAL, slot])
    hbm = float(latest[B_MEM_TEMP, slot])
    hbm_max = float(w.slot_limits[L_MEM_MAX, slot])
    cut_by_bits = hw > 0
    cut_clock = bool(arrays["thermal_clock_cut"][slot])
    near_limit = bool(arrays["thermal_near_slowdown"][slot])
    hbm_hot = bool(arrays["thermal_hot_hbm"][slot])
    critical = critical or hbm_hot  # at its own limits; cut clocks cost what the straggler says
    reasons = [
        r
        for r, hit in (("hw_thermal_slowdown", hw > 0), ("sw_thermal_slowdown", thermal_bits > 0 and not hw > 0))
        if hit
    ]
    gid = tick.groups.gid[slot]
    peer_temp = float("nan")
    if gid >= 0:
        peers = smoothed_row(tick, B_TEMP, np.flatnonzero(tick.groups.gid == gid))
        peer_temp = median(peers[~np.isnan(peers)])
    job_code = w.slot_job[slot]
    job = w.job_names[job_code] if job_code >= 0 else None
    why = []
    if temp == temp:
        why.append(f"{temp:.0f} °C (alerts from {cfg.thermal_temperature_celsius:.0f} °C)")
    if hbm_hot:
        why.append(f"HBM {hbm:.0f} °C (its max operating {hbm_max:.0f} °C)")
    if hw > 0:
        why.append("the hardware brakes it for heat")
    elif thermal_bits > 0:
        why.append("the driver slows it for heat")
    if clock == clock and clock < 1.0:
        why.append(f"its SM clock at {clock * PERCENT:.0f} % of max")
    evidence = {
        "temperature_celsius": r3(temp),
        "threshold_celsius": cfg.thermal_temperature_celsius,
        "slowdown_temperature_celsius": r3(slowdown),
        "memory_temperature_celsius": r3(hbm),
        "memory_max_operating_temperature_celsius": r3(hbm_max),
        "memory_at_limit": bool(hbm_hot),
        "peer_median_temperature_celsius": r3(peer_temp),
        "throttle_reasons": reasons,
        "sm_clock_ratio": r3(clock),
        "utilization_ratio": r3(util),
        "clocks_cut": bool(cut_by_bits or cut_clock),
        "near_slowdown_limit": bool(near_limit),
        "estimated_clock_loss_ratio": r3(1.0 - clock) if clock == clock and clock < 1.0 else 0.0,
    }
    return Finding(
        AlertKind.THERMAL_THROTTLE,
        w.slot_node[slot],
        w.slot_index[slot],
        w.slot_uuid[slot],
        job,
        Severity.CRITICAL if critical else Severity.WARNING,
        f"GPU {w.slot_index[slot]} on {w.slot_node[slot]} runs hot: " + ", ".join(why),
        evidence,
    )


def _detect(tick: Tick, state: FingerprintIndex, context: Context) -> Detection:
    """detect(), and the groups its heat explains: those of the GPUs found hot now and of the jobs with a
    thermal alert open (a job's drop while one of its GPUs is cut by heat is the heat's)."""
    outcome = detect(tick, state, context)
    gid = tick.groups.gid
    explained = job_groups(tick.registry, context.alerts.open_jobs((AlertKind.THERMAL_THROTTLE,)))
    for f in outcome.findings.values():
        slot = tick.windows.slot_of.get((f.node, f.gpu))
        if slot is not None and gid[slot] >= 0:
            explained.add(int(gid[slot]))
    return Detection(outcomes={AlertKind.THERMAL_THROTTLE: outcome}, explained=explained)


DETECTOR: Detector[FingerprintIndex] = Detector(
    name="thermal",
    kinds=(
        KindSpec(
            kind=AlertKind.THERMAL_THROTTLE,
            advice="The GPU cuts its clocks while this hot: check the node's cooling (fans, airflow, "
            "inlet temperature).",
            for_setting="thermal_for_seconds",
            clear_setting="thermal_clear_seconds",
            without=(
                ("throttle_reasons", "fires on temperature alone; clocks cut by heat below the threshold go unseen"),
                (
                    "slowdown_temperature_celsius",
                    "cannot tell a GPU near its own slowdown temperature: warning, not critical",
                ),
                ("sm_clock_max_hertz", "cannot measure how far heat cut the SM clock"),
                ("memory_max_operating_temperature_celsius", "HBM at its own limit does not trigger"),
            ),
        ),
    ),
    rules=RULES,
    state=lambda: FingerprintIndex(AlertKind.THERMAL_THROTTLE),
    detect=_detect,
)
