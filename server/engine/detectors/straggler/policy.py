"""The straggler detector's policy, as declared rules (see gpufleet.server.engine.rules).

The machinery (stages.py, gpus.py, nodes.py) computes the named arrays: per GPU its deviations from its peer
group's medians, its excesses beyond its learned offsets, its own usual levels, its group's spreads; per
(group, node) pair the node's readings against the other nodes'. These rules say which of those make a
culprit, at which margins. Every margin is an EngineConfig setting; rules evaluated at the two scales
(1 and straggler_weak_margin_ratio) give the full margins that name a culprit and the weaker ones that
keep it named and hold comm_bound back. `scaled=False` marks a plain cut-off, the same at both scales.
"""

from __future__ import annotations

from gpufleet.server.engine.rules import Rule

_BITS = "straggler_bits_confirm_ratio"
_CROSS = "straggler_cross_margin_ratio"
# Peer-comparison margins widen with the group's own robust spread of that excess (gpus.learn).
_NOISE = "straggler_noise_sigmas"

# A culprit GPU against its own learned offset from its peers (arrays per GPU: sm_excess, power_excess,
# clock_deficit are its excess over its peers' medians beyond its offset, oriented culprit-up).
ACTIVITY: tuple[Rule, ...] = (
    Rule(
        name="straggler_sm_excess",
        doc="SM activity above the peers' beyond its learned offset, while it keeps its own usual activity",
        signal="sm_excess",
        margin="straggler_sm_excess",
        gates=("sm_kept",),
        spread="sm_spread",
        sigmas=_NOISE,
        scale_spread=True,
    ),
    Rule(
        name="straggler_power_excess",
        doc="where SM activity is unsupported: power above the peers' beyond its offset, keeping its usual power",
        signal="power_excess",
        margin="straggler_power_excess",
        gates=("sm_unsupported", "power_kept"),
        spread="power_spread",
        sigmas=_NOISE,
        scale_spread=True,
    ),
)
# The culprit signals other than the activity excess alone: clocks and slowdown bits.
HARDWARE: tuple[Rule, ...] = (
    Rule(
        name="straggler_clock_deficit",
        doc="SM clock below the peers' beyond its learned offset",
        signal="clock_deficit",
        margin="straggler_clock_deficit",
        spread="clock_spread",
        sigmas=_NOISE,
        scale_spread=True,
    ),
    Rule(
        name="straggler_bits_clock",
        doc="slowdown bits its peers lack, confirmed by a clock deficit of part of the margin",
        signal="clock_deficit",
        margin="straggler_clock_deficit",
        factor=_BITS,
        gates=("own_bits",),
    ),
    Rule(
        name="straggler_bits_sm",
        doc="slowdown bits its peers lack, confirmed by an SM-activity excess of part of the margin",
        signal="sm_excess",
        margin="straggler_sm_excess",
        factor=_BITS,
        gates=("own_bits",),
    ),
    Rule(
        name="straggler_bits_power",
        doc="slowdown bits its peers lack, confirmed by a power excess of part of the margin",
        signal="power_excess",
        margin="straggler_power_excess",
        factor=_BITS,
        gates=("own_bits",),
    ),
    Rule(
        name="straggler_bits_unclocked",
        doc="slowdown bits its peers lack on a GPU that reports no SM clock (nothing to confirm them)",
        signal="slow_share",
        margin="straggler_slow_bits_share",
        scaled=False,
        gates=("clock_unsupported",),
        unless=("peer_bits",),
    ),
)
# Without a baseline: the cross-section alone (peers spinning far below one GPU's activity wait for it).
# Fixed margins only: without learned offsets each GPU's structural offset is in its excess, and so in
# the group's spread, which would hold back a culprit present from the job's start.
CROSS_SECTION: tuple[Rule, ...] = (
    Rule(
        name="straggler_cross_sm_excess",
        doc="a job's GPU with SM activity twice the margin above its peers' (no baseline needed)",
        signal="sm_excess",
        margin="straggler_sm_excess",
        factor=_CROSS,
        gates=("in_job", "sm_supported"),
    ),
    Rule(
        name="straggler_cross_power_excess",
        doc="where SM activity is unsupported: a job's GPU with power the margin above its peers'",
        signal="power_excess",
        margin="straggler_power_excess",
        gates=("in_job", "sm_unsupported"),
    ),
)
# One rank waiting on its own host: utilization below its peers' while they spin.
RANK_IDLE: tuple[Rule, ...] = (
    Rule(
        name="straggler_rank_idle",
        doc="a job's GPU idling below its peers' utilization beyond its learned offset (host-bound rank)",
        signal="idle_excess",
        margin="node_idle_gap",
        gates=("starved",),
        spread="idle_spread",
        sigmas=_NOISE,
        scale_spread=True,
    ),
    Rule(
        name="straggler_rank_idle_cross",
        doc="a job's computing GPU idling twice the margin below its peers' utilization (no baseline needed)",
        signal="idle_gap",
        margin="node_idle_gap",
        factor=_CROSS,
        scaled=False,
        gates=("starved", "computing"),
    ),
)
# Standing out by activity alone holds comm_bound back only beyond the noise of the group's excesses.
BEYOND_NOISE: tuple[Rule, ...] = (
    Rule(
        name="straggler_beyond_noise",
        doc="activity excess beyond this many robust standard deviations of its group's excesses",
        signal="excess_sigmas",
        margin="straggler_standout_sigmas",
        scaled=False,
    ),
)
# A GPU found standing out still does in its newest readings (evaluated at the weaker margins).
STANDING_NOW: tuple[Rule, ...] = (
    Rule(
        name="straggler_now_sm_excess",
        doc="newest SM activity still above the peers' beyond its offset",
        signal="sm_excess",
        margin="straggler_sm_excess",
    ),
    Rule(
        name="straggler_now_power_excess",
        doc="newest power still above the peers' beyond its offset (SM activity unsupported)",
        signal="power_excess",
        margin="straggler_power_excess",
        gates=("sm_unsupported",),
    ),
    Rule(
        name="straggler_now_clock_deficit",
        doc="newest SM clock still below the peers' beyond its offset",
        signal="clock_deficit",
        margin="straggler_clock_deficit",
    ),
    Rule(
        name="straggler_now_idle",
        doc="newest utilization still below the peers' (beyond its offset, or raw)",
        signal="idle_excess",
        margin="node_idle_gap",
    ),
    Rule(
        name="straggler_now_bits",
        doc="slowdown bits in its newest readings",
        signal="slow_share",
        margin="straggler_slow_bits_share",
        scaled=False,
    ),
)

# A GPU whose standing against its job's median stepped up at one moment (steps.py; arrays per GPU: the
# rise between two stretches, its group's robust spread of rises; gates: it keeps its own usual activity,
# its job's median fell over the same stretches, the rise is a step and not a ramp).
STEP: tuple[Rule, ...] = (
    Rule(
        name="straggler_step",
        doc="activity against its job's median rose from one flat stretch to the next while the job's fell",
        signal="step_rise",
        margin="straggler_step_excess",
        spread="step_spread",
        sigmas="straggler_step_sigmas",
        gates=("kept", "job_fell", "flat", "not_ramp", "clear"),
    ),
)


def _clock_cut(prefix: str, subject: str) -> tuple[Rule, ...]:
    """Clocks cut below the peers' with slowdown bits the peers lack (either alone where the other is
    not reported); arrays: cut_deficit (the clock's shortfall against the peers'), slow_share."""
    return (
        Rule(
            name=f"{prefix}_clock_cut",
            doc=f"{subject} clock below the peers' by the clock margin, with slowdown bits they lack",
            signal="cut_deficit",
            margin="straggler_clock_deficit",
            scaled=False,
            gates=("own_bits",),
        ),
        Rule(
            name=f"{prefix}_clock_cut_unclocked",
            doc=f"{subject} slowdown bits the peers lack, where no SM clock is reported",
            signal="slow_share",
            margin="straggler_slow_bits_share",
            scaled=False,
            gates=("clock_unsupported",),
            unless=("peer_bits",),
        ),
        Rule(
            name=f"{prefix}_clock_cut_unbitted",
            doc=f"{subject} clock below the peers' by the clock margin, where no throttle reasons are reported",
            signal="cut_deficit",
            margin="straggler_clock_deficit",
            scaled=False,
            gates=("bits_unsupported",),
        ),
    )


GPU_CLOCK_CUT = _clock_cut("straggler_gpu", "the GPU's")
# Where a quarter or more of a group has bits its median clock is no reference: against the GPUs without.
GPU_CLOCK_CUT_VS_FREE: tuple[Rule, ...] = (
    Rule(
        name="straggler_gpu_clock_cut_vs_unbraked",
        doc="a GPU with bits, clock below the median of its group's GPUs without bits by the clock margin",
        signal="free_deficit",
        margin="straggler_clock_deficit",
        scaled=False,
        gates=("has_bits", "in_group"),
    ),
    Rule(
        name="straggler_gpu_bits_vs_unbraked",
        doc="a GPU with bits and no SM clock reported, in a group with GPUs without bits",
        signal="slow_share",
        margin="straggler_slow_bits_share",
        scaled=False,
        gates=("in_group", "clock_unsupported", "free_peers"),
    ),
)
# One job's GPUs in an unattributed node group sank below their own usual levels (waiting peers) ...
SHARED_SUNK: tuple[Rule, ...] = (
    Rule(
        name="straggler_shared_sunk_sm",
        doc="unattributed GPU whose SM activity sank the SM margin below its own usual level",
        signal="own_drop",
        margin="straggler_sm_excess",
        scaled=False,
        gates=("fallback", "sm_supported"),
    ),
    Rule(
        name="straggler_shared_sunk_power",
        doc="unattributed GPU whose power sank the power margin below its own usual level (SM unsupported)",
        signal="own_drop",
        margin="straggler_power_excess",
        scaled=False,
        gates=("fallback", "sm_unsupported"),
    ),
)
# ... while one GPU rose above its own: the shared-node culprit, beyond how far its level usually wanders
# (an expert whose load drifts rises above a level frozen while its job waits on a straggler elsewhere).
SHARED_RISE: tuple[Rule, ...] = (
    Rule(
        name="straggler_shared_rise_sm",
        doc="unattributed GPU whose SM activity rose part of the SM margin above its own usual level",
        signal="own_rise",
        margin="straggler_sm_excess",
        factor="straggler_shared_rise_ratio",
        gates=("fallback", "sm_supported"),
        unless=("sunk",),
        spread="own_spread",
        sigmas=_NOISE,
        scale_spread=True,
    ),
    Rule(
        name="straggler_shared_rise_power",
        doc="unattributed GPU whose power rose part of the power margin above its own usual level",
        signal="own_rise",
        margin="straggler_power_excess",
        factor="straggler_shared_rise_ratio",
        gates=("fallback", "sm_unsupported"),
        unless=("sunk",),
        spread="own_spread",
        sigmas=_NOISE,
        scale_spread=True,
    ),
)
# A node against the group's other nodes, beyond its learned offsets (arrays per (group, node) pair;
# node_busier is NaN where the node is not judged busy); "busier" widens with the pair's usual wander.
NODE: tuple[Rule, ...] = (
    Rule(
        name="straggler_node_idle",
        doc="a node idling below the other nodes' utilization beyond its offset while they wait (host-bound)",
        signal="node_idle",
        margin="node_idle_gap",
    ),
    Rule(
        name="straggler_node_sm_excess",
        doc="a node's median SM activity above the other nodes' beyond its offset while they wait",
        signal="node_busier",
        margin="straggler_sm_excess",
        gates=("by_sm",),
        spread="node_spread",
        sigmas=_NOISE,
        scale_spread=True,
    ),
    Rule(
        name="straggler_node_power_excess",
        doc="a node's median power above the other nodes' beyond its offset while they wait (SM unsupported)",
        signal="node_busier",
        margin="node_power_excess",
        gates=("by_power",),
        spread="node_spread",
        sigmas=_NOISE,
        scale_spread=True,
    ),
)
# Without a baseline (a node idle or slow from the job's start): twice the margins, as for a GPU.
NODE_CROSS: tuple[Rule, ...] = (
    Rule(
        name="straggler_node_idle_cross",
        doc="a job's node idling twice the margin below the other nodes' spinning ones (no baseline needed)",
        signal="node_gap",
        margin="node_idle_gap",
        factor=_CROSS,
        scaled=False,
        gates=("in_job", "steady"),
    ),
    Rule(
        name="straggler_node_sm_cross",
        doc="a job's busy node with SM activity twice the margin above the other nodes' (no baseline needed)",
        signal="node_act",
        margin="straggler_sm_excess",
        factor=_CROSS,
        scaled=False,
        gates=("in_job", "steady", "node_busy", "by_sm"),
    ),
    Rule(
        name="straggler_node_power_cross",
        doc="a job's busy node with power twice the margin above the other nodes' (no baseline needed)",
        signal="node_act",
        margin="node_power_excess",
        factor=_CROSS,
        scaled=False,
        gates=("in_job", "steady", "node_busy", "by_power"),
    ),
)
NODE_CLOCK_CUT = _clock_cut("straggler_node", "the node's median")

RULES: tuple[Rule, ...] = (
    ACTIVITY
    + HARDWARE
    + CROSS_SECTION
    + RANK_IDLE
    + BEYOND_NOISE
    + STANDING_NOW
    + GPU_CLOCK_CUT
    + GPU_CLOCK_CUT_VS_FREE
    + SHARED_SUNK
    + SHARED_RISE
    + NODE
    + NODE_CROSS
    + NODE_CLOCK_CUT
    + STEP
)
