"""The straggler detector as the engine runs it: its kind, its state's hooks, and what it tells the
workload detector after it (detect() itself is in the package's __init__)."""

from __future__ import annotations

import numpy as np

from gpufleet.server.alerts import AlertKind
from gpufleet.server.engine.config import EngineConfig
from gpufleet.server.engine.detectors import Context, job_groups
from gpufleet.server.engine.detectors.spec import Detection, Detector, KindSpec
from gpufleet.server.engine.detectors.straggler import detect
from gpufleet.server.engine.detectors.straggler.policy import RULES
from gpufleet.server.engine.detectors.straggler.state import StragglerState
from gpufleet.server.engine.groups import GroupRegistry
from gpufleet.server.engine.tick import Tick
from gpufleet.server.engine.windows import Windows


def _detect(tick: Tick, state: StragglerState, context: Context) -> Detection:
    """detect(), with the groups it explains (those of the jobs it names now or has an alert open in), the
    groups where someone stands out, idles, or is named."""
    result = detect(tick, state, context)
    jobs = {f.hpc_job for f in result.outcome.findings.values()}
    jobs |= context.alerts.open_jobs((AlertKind.STRAGGLER,))
    return Detection(
        outcomes={AlertKind.STRAGGLER: result.outcome},
        explained=job_groups(tick.registry, jobs),
        standout=result.standout_groups,
        idling=result.idle_groups,
        singled_out=result.standout_groups | result.named_groups,
    )


def _forget(state: StragglerState, slots: np.ndarray, *_: object) -> None:
    state.forget(slots)


def _recycle(state: StragglerState, gid: int, _old: tuple, registry: GroupRegistry, windows: Windows) -> None:
    state.recycle(gid, registry.job(gid), windows.node_names)


def _prune(state: StragglerState, keep: set[str], config: EngineConfig) -> None:
    state.index.prune(keep, config.index_prune_ratio)


DETECTOR: Detector[StragglerState] = Detector(
    name="straggler",
    kinds=(
        KindSpec(
            kind=AlertKind.STRAGGLER,
            advice="Its peers wait for it at every synchronisation, so the whole job runs at its pace: "
            "drain it, or restart the job without it.",
            for_setting="straggler_for_seconds",
            clear_setting="straggler_clear_seconds",
            costs=True,
            early_run_counts=True,
            without=(
                ("throttle_reasons", "cannot say what cut a GPU's clocks (heat, power brake, power cap)"),
                ("sm_clock_max_hertz", "cannot see a GPU's clocks cut below its peers'"),
                ("sm_active_ratio", "measures slowdowns by power, which moves less than SM activity"),
            ),
        ),
    ),
    rules=RULES,
    state=StragglerState,
    detect=_detect,
    forget_node=_forget,
    restart=_forget,
    recycle=_recycle,
    prune=_prune,
)
