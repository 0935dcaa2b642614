"""Health: node_unreachable, gpu_lost, xid and ecc.

node_unreachable: the node's newest sample lags the evaluation time by more than unreachable_seconds
beyond its usual lag (a node whose clock runs behind keeps its usual lag and is not flagged).
gpu_lost: a GPU reports up=false, or vanished from snapshots its node still sends.
xid / ecc: increases of cumulative counters (reset-safe, from the windows) fire at once and clear after
a quiet period; pending or failed row remapping keeps ecc open.
"""

from __future__ import annotations

import numpy as np

from gpufleet.server.alerts import AlertKind, Severity
from gpufleet.server.engine.arrays import grown
from gpufleet.server.engine.config import EngineConfig
from gpufleet.server.engine.detectors import Context, FingerprintIndex, Finding, Outcome, hung, subject_fingerprint
from gpufleet.server.engine.detectors.spec import Detection, Detector, KindSpec
from gpufleet.server.engine.tick import Tick
from gpufleet.server.engine.xids import XID_CRITICAL, XID_MEANINGS
from gpufleet.server.engine.windows import B_REMAP_FAILURE, B_REMAP_PENDING, B_UP, CounterEvent
from gpufleet.server.engine.rules import Rule, evaluate

UNREACHABLE = Rule(
    name="node_unreachable_late",
    doc="the node's newest sample lags the evaluation by more than the threshold beyond its usual lag",
    signal="lag_excess_seconds",
    op=">",
    margin="unreachable_seconds",
)
GPU_DOWN = Rule(
    name="gpu_lost_down",
    doc="the GPU reported up=false in at least one sample of the bin",
    signal="down_share",
    op=">",
    margin=None,
)
XID_QUIET = Rule(
    name="xid_quiet",
    doc="no new event of the alert's XID code on its GPU for the quiet period (clears)",
    signal="quiet_seconds",
    margin="xid_clear_seconds",
)
ECC_QUIET = Rule(
    name="ecc_quiet",
    doc="no new uncorrected ECC error on the GPU for the quiet period (clears, unless a remap is pending)",
    signal="quiet_seconds",
    margin="ecc_clear_seconds",
)
RULES: tuple[Rule, ...] = (UNREACHABLE, GPU_DOWN, XID_QUIET, ECC_QUIET)


class HealthState:
    """Per-node usual lag, recent counter events, and fingerprint lookups."""

    def __init__(self) -> None:
        self.lag_base = np.full(0, np.nan)
        self.node_fp_list: list[str] = []
        self.events: list[CounterEvent] = []
        self.xid_last: dict[tuple[int, int], tuple[float, int]] = {}
        self.ecc_last: dict[int, tuple[float, int]] = {}
        self.node_fps: dict[str, int] = {}
        self.lost_index = FingerprintIndex(AlertKind.GPU_LOST)
        self.ecc_index = FingerprintIndex(AlertKind.ECC)
        self.xid_fps: dict[str, tuple[int, int]] = {}

    def forget(self, slots: set[int], nid: int | None) -> None:
        """Drop what is kept about a forgotten node's GPUs; its usual lag is learned again if it returns."""
        self.events = [e for e in self.events if e.slot not in slots]
        self.xid_last = {k: v for k, v in self.xid_last.items() if k[0] not in slots}
        self.ecc_last = {k: v for k, v in self.ecc_last.items() if k not in slots}
        if nid is not None and nid < len(self.lag_base):
            self.lag_base[nid] = np.nan


def detect(tick: Tick, state: HealthState, context: Context) -> dict[AlertKind, Outcome]:
    """All health outcomes for this tick (the context's counter events are this tick's new ones)."""
    state.events.extend(context.events)
    due = [e for e in state.events if e.time < tick.t]
    state.events = [e for e in state.events if e.time >= tick.t]
    return {
        AlertKind.NODE_UNREACHABLE: _unreachable(tick, state),
        AlertKind.GPU_LOST: _gpu_lost(tick, state),
        AlertKind.XID: _xid(tick, state, [e for e in due if e.kind == "xid"]),
        AlertKind.ECC: _ecc(tick, state, [e for e in due if e.kind == "ecc"]),
    }


def _unreachable(tick: Tick, state: HealthState) -> Outcome:
    """Nodes whose newest sample is too old relative to their usual lag (vectorised over nodes)."""
    cfg = tick.config
    w = tick.windows
    last = w.node_last_time
    n_nodes = len(last)
    if len(state.lag_base) < n_nodes:
        state.lag_base = grown(state.lag_base, n_nodes, np.nan)
        for nid in range(len(state.node_fp_list), n_nodes):
            fp = subject_fingerprint(AlertKind.NODE_UNREACHABLE, w.node_names[nid], None, None)
            state.node_fp_list.append(fp)
            state.node_fps[fp] = nid
    lag = np.maximum(tick.t - last, 0.0)
    base = np.where(np.isnan(state.lag_base), lag, state.lag_base)
    late = evaluate((UNREACHABLE,), {"lag_excess_seconds": lag - base}, cfg)[UNREACHABLE.name]
    known = ~np.isnan(lag)
    update = known & ~late
    drift = cfg.unreachable_lag_drift_ratio * cfg.tick_seconds
    state.lag_base[update] = np.minimum(lag[update], base[update] + drift)
    out = Outcome()
    for nid in (late & known).nonzero()[0].tolist():
        node = w.node_names[nid]
        out.add(
            Finding(
                AlertKind.NODE_UNREACHABLE,
                node,
                None,
                None,
                None,
                Severity.CRITICAL,
                f"node {node} sent no sample for {lag[nid]:.0f} s",
                {
                    "last_sample_time": float(last[nid]),
                    "silent_seconds": round(float(lag[nid]), 1),
                    "usual_lag_seconds": round(float(base[nid]), 1),
                    "threshold_seconds": cfg.unreachable_seconds,
                    "gpus": _gpus_on(w, nid),
                },
                live_summary=True,  # it quotes silent_seconds, which keeps counting while it fires
            )
        )

    def test(fp: str) -> bool | None:
        nid = state.node_fps.get(fp)
        return None if nid is None or not known[nid] else not bool(late[nid])

    out.clear = test
    return out


def _gpus_on(w, nid: int) -> int:
    """How many GPUs the node had."""
    return int(np.count_nonzero(w.slot_node_id[: w.n] == nid))


def _gpu_lost(tick: Tick, state: HealthState) -> Outcome:
    """GPUs reporting up=false, or missing from snapshots their node still sends."""
    cfg = tick.config
    w = tick.windows
    n = w.n
    up = tick.latest[B_UP]
    present = tick.seen(cfg.bins(cfg.gpu_lost_seconds))
    node_now = np.zeros(len(w.node_names), dtype=bool)
    node_now[w.slot_node_id[:n][tick.held[0]]] = True
    vanished = ~present & node_now[w.slot_node_id[:n]]
    # `up` is the bin's mean: one sample of up=false in it is enough. A GPU that falls off the bus can
    # take its node's agent down seconds later, and the next bin may never come (one such sample, then
    # 4.5 minutes of silence: judged on the mean, gpu_lost fired only when the node came back).
    down = evaluate((GPU_DOWN,), {"down_share": 1.0 - up}, cfg)[GPU_DOWN.name]
    back = up >= 1.0
    out = Outcome()
    for slot in (down | vanished).nonzero()[0].tolist():
        why = (
            "the driver reports it down"
            if down[slot]
            else f"its node has sent no reading of it for {cfg.gpu_lost_seconds:.0f} s"
        )
        job = _job_of(tick, slot)
        out.add(
            Finding(
                AlertKind.GPU_LOST,
                w.slot_node[slot],
                w.slot_index[slot],
                w.slot_uuid[slot],
                job,
                Severity.CRITICAL,
                f"GPU {w.slot_index[slot]} on {w.slot_node[slot]} is lost: {why}"
                + (f"; job {job} cannot go on without it" if job else ""),
                {
                    "up": None if up[slot] != up[slot] else bool(up[slot] >= cfg.gpu_up_share_ratio),
                    "missing": bool(vanished[slot]),
                },
            )
        )

    def test(fp: str) -> bool | None:
        hit = state.lost_index.get(w, fp)
        if hit is None:
            return None
        slot = hit[0]
        return True if back[slot] else None

    out.clear = test
    return out


def _job_of(tick: Tick, slot: int) -> str | None:
    """The job a failing GPU belongs to: its current one, else the one it left within the last
    gpu_lost_seconds (an agent that finds no process on a dead or crashed GPU reports no job for it from
    the same sample, while the job's other ranks hang)."""
    w = tick.windows
    code = w.slot_job[slot]
    if code < 0 and tick.t - w.slot_job_since[slot] <= tick.config.gpu_lost_seconds + tick.config.tick_seconds:
        code = w.slot_last_job[slot]
    return w.job_names[code] if code >= 0 else None


def _xid(tick: Tick, state: HealthState, events: list[CounterEvent]) -> Outcome:
    """One alert per GPU and XID code; open while events keep coming, clear after a quiet period."""
    cfg = tick.config
    w = tick.windows
    for e in events:
        for code in e.codes or (-1,):
            prev = state.xid_last.get((e.slot, code), (0.0, 0))[1]
            state.xid_last[(e.slot, code)] = (e.time, prev + (e.delta if len(e.codes) <= 1 else 1))
    out = Outcome()
    fresh = {(e.slot, c) for e in events for c in (e.codes or (-1,))}
    for slot, code in sorted(fresh):
        when, count = state.xid_last[(slot, code)]
        meaning = XID_MEANINGS.get(code, "unknown XID code" if code >= 0 else "XID code not reported")
        f = Finding(
            AlertKind.XID,
            w.slot_node[slot],
            w.slot_index[slot],
            w.slot_uuid[slot],
            _job_of(tick, slot),
            Severity.CRITICAL if code in XID_CRITICAL else Severity.WARNING,
            f"GPU {w.slot_index[slot]} on {w.slot_node[slot]} reported XID {code if code >= 0 else '?'}: {meaning}",
            {"code": code if code >= 0 else None, "meaning": meaning, "count": count, "last_event_time": when},
            extra=str(code),
        )
        state.xid_fps[f.fingerprint] = (slot, code)
        out.add(f)

    def test(fp: str) -> bool | None:
        hit = state.xid_fps.get(fp)
        if hit is None:
            return None
        when = state.xid_last.get(hit, (tick.t, 0))[0]
        return _quiet(XID_QUIET, tick.t - when, cfg)

    out.clear = test
    return out


def _ecc(tick: Tick, state: HealthState, events: list[CounterEvent]) -> Outcome:
    """Uncorrected ECC errors increasing, or row remapping pending / failed."""
    cfg = tick.config
    w = tick.windows
    for e in events:
        prev = state.ecc_last.get(e.slot, (0.0, 0))[1]
        state.ecc_last[e.slot] = (e.time, prev + e.delta)
    pending = tick.latest[B_REMAP_PENDING] > 0
    failure = tick.latest[B_REMAP_FAILURE] > 0
    out = Outcome()
    fresh = {e.slot for e in events}
    for slot in sorted(fresh | set((pending | failure).nonzero()[0].tolist())):
        when, count = state.ecc_last.get(slot, (None, 0))
        why = []
        # The running count, whether or not this tick brought errors: the summary follows the alert while it
        # fires, and one that dropped the count on the ticks between errors read one way in the notification
        # sent as it fired and another on the pages and in replay.
        if count:
            why.append(f"{count} uncorrected ECC error{'' if count == 1 else 's'}")
        if pending[slot]:
            why.append("row remapping pending (reset needed)")
        if failure[slot]:
            why.append("row remapping failed")
        out.add(
            Finding(
                AlertKind.ECC,
                w.slot_node[slot],
                w.slot_index[slot],
                w.slot_uuid[slot],
                _job_of(tick, slot),
                Severity.CRITICAL,
                f"GPU {w.slot_index[slot]} on {w.slot_node[slot]}: " + ", ".join(why),
                {
                    "uncorrected_errors_new": count,
                    "last_error_time": when,
                    "remapped_rows_pending": bool(pending[slot]),
                    "remapped_rows_failure": bool(failure[slot]),
                },
                live_summary=True,
            )
        )

    def test(fp: str) -> bool | None:
        hit = state.ecc_index.get(w, fp)
        if hit is None:
            return None
        slot = hit[0]
        if pending[slot] or failure[slot]:
            return False
        if not tick.held[0][slot]:
            # No sample in this bin (sampling slower than the tick, a lost line): the remap flags are
            # unknown, not cleared. Read as cleared, a pending remap resolved and refired every other tick.
            return None
        when = state.ecc_last.get(slot, (None, 0))[0]
        return when is None or _quiet(ECC_QUIET, tick.t - when, cfg)

    out.clear = test
    return out


def _quiet(rule: Rule, seconds: float, cfg: EngineConfig) -> bool:
    """Whether a quiet rule holds for one alert quiet this many seconds."""
    return bool(evaluate((rule,), {"quiet_seconds": np.array([seconds])}, cfg)[rule.name][0])


def _detect(tick: Tick, state: HealthState, context: Context) -> Detection:
    """detect(), and what its lost GPUs and silent nodes mean for the jobs on them (see hung)."""
    outcomes = detect(tick, state, context)
    halted = hung.halted(tick, context, outcomes[AlertKind.GPU_LOST])
    silent = hung.jobs_on_silent_nodes(tick, context, outcomes[AlertKind.NODE_UNREACHABLE])
    return Detection(outcomes=outcomes, halted=halted, explained=halted, standout=silent, idling=silent)


def _forget_node(state: HealthState, slots: np.ndarray, nid: int | None) -> None:
    state.forget(set(slots.tolist()), nid)


DETECTOR: Detector[HealthState] = Detector(
    name="health",
    kinds=(
        KindSpec(
            kind=AlertKind.NODE_UNREACHABLE,
            advice="Its GPUs are not monitored: check the node, its network and gpufleet-agent there.",
        ),
        KindSpec(
            kind=AlertKind.GPU_LOST,
            advice="The GPU stopped answering (fell off the bus, XID 79 in the kernel log): drain the node.",
        ),
        KindSpec(
            kind=AlertKind.XID,
            advice="The driver reported an XID error: NVIDIA's XID catalogue says what the code means.",
        ),
        KindSpec(
            kind=AlertKind.ECC,
            advice="Its memory has uncorrectable errors: drain the GPU and check its remapped rows.",
            without=(
                (
                    "ecc_uncorrected_errors_total",
                    "no uncorrected ECC errors counted: only row remapping failures alert",
                ),
            ),
        ),
    ),
    rules=RULES,
    state=HealthState,
    detect=_detect,
    forget_node=_forget_node,
)
