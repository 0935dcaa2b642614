"""straggler through the engine: the culprit is named, never its waiting peers; decoys stay quiet."""

from __future__ import annotations

import numpy as np
import pytest

from gpufleet.server.replay import run_replay
from tests.server.engine_samples import MAX_HZ, T0, cluster_lines


def _by_kind(lines):
    out: dict[str, list] = {}
    for a in run_replay(lines):
        out.setdefault(a.kind.value, []).append(a)
    return out


def _in_step(override, nodes=None, draw=1):
    """The same trace with every running GPU's SM activity and power wobbling with the step phase of the
    job, as synchronous ranks do (each sample catches a little more compute or collective, on all of
    them at once): without attribution, that is what makes them one inferred job. `nodes`: the job's
    nodes (default: all); the others keep their steady readings. `draw`: the job's own random draw of
    its wobbles (another draw, another job)."""
    wobbles = (1.0 + np.random.default_rng(draw).uniform(-0.03, 0.03, 4096)).tolist()

    def patched(t, node, gpu):
        kw = dict(override(t, node, gpu))
        if kw.get("utilization_ratio", 0.98) < 0.05 or (nodes is not None and node not in nodes):
            return kw
        wobble = wobbles[int(t / 5.0) % len(wobbles)]
        if kw.get("sm_active_ratio", 0.80) is not None:
            kw["sm_active_ratio"] = kw.get("sm_active_ratio", 0.80) * wobble
        kw["power_watts"] = kw.get("power_watts", 500.0) * wobble
        return kw

    return patched


def _slow_gpu(t, node, gpu):
    """From 400 s GPU n1/3 runs 25 % slower clocks; everyone else waits for it."""
    if t < 400 or t >= 800:
        return {}
    if node == "n1" and gpu == 3:
        return {"sm_clock_hertz": 1.48e9, "sm_active_ratio": 0.80, "power_watts": 430.0}
    return {"sm_active_ratio": 0.62, "power_watts": 410.0}


def test_slow_gpu_is_named_and_peers_are_not():
    alerts = _by_kind(cluster_lines(1000, override=_slow_gpu))
    (s,) = alerts["straggler"]
    assert (s.node, s.gpu, s.hpc_job) == ("n1", 3, "j1")
    # straggler_for_seconds after it began to stand out in its newest readings, not after the medians.
    assert T0 + 425 <= s.started <= T0 + 440
    assert s.resolved is not None
    ev = s.evidence
    assert ev["sm_clock_ratio"] < ev["peer_median_sm_clock_ratio"]
    assert 0.15 < ev["estimated_job_slowdown_ratio"] < 0.35
    assert ev["gpu_hours_lost"] > 0
    assert "comm_bound" not in alerts and "input_bound" not in alerts


def test_pre_hopper_without_sm_activity_falls_back_to_power_and_clocks():
    def no_sm(t, node, gpu):
        kw = _slow_gpu(t, node, gpu)
        kw["sm_active_ratio"] = None
        return kw

    (s,) = _by_kind(cluster_lines(1000, override=no_sm))["straggler"]
    assert (s.node, s.gpu) == ("n1", 3)
    assert s.evidence["slowdown_measured_by"] == "power"


def test_host_bound_node_is_a_node_level_straggler():
    def starved(t, node, gpu):
        if t < 400:
            return {}
        if node == "n1":
            return {"utilization_ratio": 0.70, "sm_active_ratio": 0.55, "power_watts": 380.0}
        return {"sm_active_ratio": 0.60, "power_watts": 400.0}

    lines = cluster_lines(900, nodes=3, override=starved)
    (s,) = _by_kind(lines)["straggler"]
    assert (s.node, s.gpu) == ("n1", None)
    assert s.evidence["pattern"] == "host_idle"


def _starved_rank(t, node, gpu):
    """From 400 s GPU n1/3 waits on its own host each step; its peers spin in the collective meanwhile."""
    if t < 400 or t >= 800:
        return {}
    if (node, gpu) == ("n1", 3):
        return {"utilization_ratio": 0.78, "sm_active_ratio": 0.60, "power_watts": 400.0}
    return {"sm_active_ratio": 0.62, "power_watts": 410.0}


def test_rank_idling_on_its_host_is_named_not_read_as_comm_bound():
    # Everybody's SM activity drops, utilization stays high job-wide and nobody is busier than the
    # rest: only the one GPU idling while the others spin says who holds the job back.
    alerts = _by_kind(cluster_lines(1000, override=_starved_rank))
    (s,) = alerts["straggler"]
    assert (s.node, s.gpu, s.hpc_job) == ("n1", 3, "j1")
    assert T0 + 400 < s.started <= T0 + 460 and s.resolved is not None
    assert s.evidence["pattern"] == "host_idle" and "host" in s.summary
    assert s.evidence["utilization_ratio"] < s.evidence["peer_median_utilization_ratio"]
    assert set(alerts) == {"straggler"}


def test_rank_idling_on_its_host_from_the_first_minute_of_a_trace_that_starts_mid_job_is_named():
    # The job runs from the trace's first sample; GPU n1/3 waits on its host from +60 s. It had learned
    # for 55 s, short of the 90 s a GPU learns before it is judged, and it learns nothing while it idles:
    # it was never judged, its gap of 0.2 is under the cross-section's doubled margin, and the job's
    # drop read as comm_bound.
    alerts = _by_kind(cluster_lines(900, override=lambda t, n, g: _starved_rank(t + 340, n, g)))
    (s,) = alerts["straggler"]
    assert (s.node, s.gpu, s.evidence["pattern"]) == ("n1", 3, "host_idle") and s.started <= T0 + 60 + 150
    assert set(alerts) == {"straggler"}


def test_rank_idling_most_of_each_step_is_named_once():
    # Below the "busy" line (utilization 0.5) it is still the job's culprit: one alert, kept until it
    # recovers, not one per dip around that line.
    def deep(t, node, gpu):
        kw = _starved_rank(t, node, gpu)
        if (node, gpu) == ("n1", 3) and kw:
            kw.update(utilization_ratio=0.5 if int(t) % 20 else 0.42, sm_active_ratio=0.4, power_watts=330.0)
        return kw

    alerts = _by_kind(cluster_lines(1000, override=deep))
    (s,) = alerts["straggler"]
    assert (s.node, s.gpu) == ("n1", 3) and T0 + 800 <= s.resolved <= T0 + 900
    assert set(alerts) == {"straggler"}


def test_rank_idling_on_its_host_is_named_without_sm_activity():
    def no_sm(t, node, gpu):
        return {**_starved_rank(t, node, gpu), "sm_active_ratio": None}

    alerts = _by_kind(cluster_lines(1000, override=no_sm))
    assert [(a.node, a.gpu) for a in alerts["straggler"]] == [("n1", 3)]
    assert set(alerts) == {"straggler"}


def test_rank_less_utilized_all_along_is_structural_not_a_straggler():
    # Rank 0 doing some host-side work every step from the start (a gap past the idle margin, short of
    # twice it) is the job's shape: a later job-wide comm slowdown is comm_bound, not blamed on it. So is
    # one a little less utilized (a gap learned as its offset).
    for util in (0.80, 0.90):

        def rank0(t, node, gpu, util=util):
            kw = {"utilization_ratio": util} if (node, gpu) == ("n0", 0) else {}
            if 400 <= t < 700:
                kw.update(sm_active_ratio=0.6, power_watts=420.0)
            return kw

        alerts = _by_kind(cluster_lines(900, override=rank0))
        assert "straggler" not in alerts and "comm_bound" in alerts, util


def test_rank_idling_on_its_host_from_the_job_start_is_named():
    # No healthy period to learn from: peers spinning at full utilization while one rank idles a third
    # of each step are waiting for it.
    def from_start(t, node, gpu):
        if t >= 600:
            return {}
        if (node, gpu) == ("n1", 3):
            return {"utilization_ratio": 0.66, "sm_active_ratio": 0.5, "power_watts": 380.0}
        return {"sm_active_ratio": 0.55, "power_watts": 400.0}

    alerts = _by_kind(cluster_lines(900, override=from_start))
    (s,) = alerts["straggler"]
    assert (s.node, s.gpu) == ("n1", 3) and s.started <= T0 + 200
    assert s.resolved is not None and s.resolved <= T0 + 700
    assert set(alerts) == {"straggler"}


def test_node_idling_on_its_host_from_the_job_start_is_named():
    # No healthy period: n1's host starves all its GPUs from the job's first step, idling them 0.27 more
    # than n0's, which spin waiting. While it warms up, the node learns its starvation as offset (up to the
    # 0.05 cap); read less that, the gap fell short of twice node_idle_gap and the node was never named.
    def from_start(t, node, gpu):
        if t >= 600:
            return {}
        if node == "n1":
            return {"utilization_ratio": 0.71, "sm_active_ratio": 0.45, "power_watts": 360.0}
        return {"sm_active_ratio": 0.5, "power_watts": 380.0}

    alerts = _by_kind(cluster_lines(900, override=from_start))
    (s,) = alerts["straggler"]
    assert (s.node, s.gpu) == ("n1", None) and s.evidence["pattern"] == "host_idle"
    assert s.started <= T0 + 200 and s.resolved is not None and s.resolved <= T0 + 700
    assert set(alerts) == {"straggler"}


def test_node_waiting_for_a_node_starved_from_the_start_is_not_named_once_it_recovered():
    # n1's host starves its GPUs from the job's first step; n0's GPUs spin meanwhile, 0.21 above the job's
    # median utilization. Learned as their usual, that read as "idling 0.21 below it" once n1 recovered,
    # and a later job-wide slowdown named n0 host-bound at equal utilization.
    def from_start_then_slowdown(t, node, gpu):
        if t < 600:
            if node == "n1":
                return {"utilization_ratio": 0.55, "sm_active_ratio": 0.35, "power_watts": 360.0}
            return {"sm_active_ratio": 0.5, "power_watts": 380.0}
        if 700 <= t < 820:
            return {"sm_active_ratio": 0.70, "power_watts": 460.0}
        return {}

    alerts = _by_kind(cluster_lines(1100, override=from_start_then_slowdown))
    (s,) = alerts["straggler"]
    assert (s.node, s.gpu) == ("n1", None) and s.resolved is not None and s.resolved <= T0 + 700


def test_gpu_slowed_in_the_first_minute_of_a_trace_that_starts_mid_job_is_named():
    # The job runs at full speed from the trace's first sample (recorded mid-job). From +30 s GPU n1/3
    # computes while its peers wait: their SM activity 0.66 against its 0.80, 21 % above them, 16 % beyond
    # the 5 % a learned offset may keep, under the doubled margin that names a culprit without a baseline.
    # Taken for a job starting, its first 45 s were kept out of its baseline, which then learned only the
    # slowed job: the GPU was never named.
    def slowed(t, node, gpu):
        if not 30 <= t < 600:
            return {}
        if (node, gpu) == ("n1", 3):
            return {"power_watts": 510.0}
        return {"sm_active_ratio": 0.66, "power_watts": 440.0}

    alerts = _by_kind(cluster_lines(900, override=slowed))
    (s,) = alerts["straggler"]
    assert (s.node, s.gpu) == ("n1", 3) and s.started <= T0 + 30 + 150
    assert s.resolved is not None and s.resolved <= T0 + 700
    assert set(alerts) == {"straggler"}


def test_straggler_from_the_job_start_hovering_at_the_margin_is_one_alert():
    # No healthy period: GPU n1/3 computes more than its peers from the job's first step, at first 23 %
    # more (0.615 against their 0.5: under the doubled margin that names a culprit without a baseline),
    # then in stretches of 150 s at 32 % (0.66, above it) and 23 % again. Without hysteresis on that
    # cross-sectional evidence, each stretch below cleared the alert and the next one above opened another.
    def hovering(t, node, gpu):
        if t >= 1050:
            return {}
        if (node, gpu) == ("n1", 3):
            above = t >= 300 and ((t - 300) // 150) % 2 == 0
            return {"sm_active_ratio": 0.66 if above else 0.615, "power_watts": 520.0}
        return {"sm_active_ratio": 0.5, "power_watts": 420.0}

    alerts = _by_kind(cluster_lines(1350, override=hovering))
    (s,) = alerts["straggler"]
    assert (s.node, s.gpu) == ("n1", 3) and T0 + 300 < s.started <= T0 + 360
    assert s.resolved is not None and T0 + 1050 < s.resolved <= T0 + 1150
    assert set(alerts) == {"straggler"}


def test_rank_stopped_while_the_others_wait_is_named_not_read_as_comm_bound():
    # Rank 0 stops computing for two minutes (a checkpoint it writes alone, a stall on its host, its
    # process gone) while every other rank spins in the collective: somebody stands out, so this is not
    # a job-wide communication slowdown, and the idle rank is the one holding the job.
    def pause(t, node, gpu):
        if 400 <= t < 520:
            if (node, gpu) == ("n0", 0):
                return {"utilization_ratio": 0.02, "sm_active_ratio": 0.01, "power_watts": 120.0}
            return {"sm_active_ratio": 0.05, "power_watts": 250.0}
        return {}

    alerts = _by_kind(cluster_lines(900, override=pause))
    (s,) = alerts["straggler"]
    assert (s.node, s.gpu) == ("n0", 0) and s.evidence["pattern"] == "host_idle"
    assert s.started <= T0 + 460 and s.resolved is not None
    assert set(alerts) == {"straggler"}


def test_unused_gpu_of_the_allocation_is_not_a_straggler():
    # A job given 16 GPUs that runs on 15: the idle one is not holding anybody back.
    def unused(t, node, gpu):
        if (node, gpu) == ("n1", 7):
            return {"utilization_ratio": 0.0, "sm_active_ratio": 0.0, "power_watts": 70.0}
        return {"sm_active_ratio": 0.6, "power_watts": 420.0} if 400 <= t < 700 else {}

    assert "straggler" not in _by_kind(cluster_lines(900, override=unused))


def test_structural_offsets_present_all_along_are_ignored():
    def structural(t, node, gpu):
        kw = {"sm_clock_hertz": 1.75e9, "temperature_celsius": 75.0} if (node, gpu) == ("n0", 2) else {}
        if 400 <= t < 700:  # a job-wide comm slowdown later must not blame the odd GPU
            kw.update(sm_active_ratio=0.6, power_watts=420.0)
        return kw

    alerts = _by_kind(cluster_lines(900, override=structural))
    assert "straggler" not in alerts


def test_brief_jitter_is_ignored():
    def jitter(t, node, gpu):
        if 400 <= t < 420:
            return {"sm_clock_hertz": 1.4e9} if (node, gpu) == ("n0", 6) else {"sm_active_ratio": 0.6}
        return {}

    assert "straggler" not in _by_kind(cluster_lines(700, override=jitter))


def test_a_host_stalling_twice_briefly_is_not_named_but_longer_stalls_are():
    # Node n1's host stalls for 15 s, runs 10 s, stalls 15 s more; the other nodes wait meanwhile. Its
    # GPUs read normal again at once after each stall, while the other nodes' 30 s medians hold their
    # wait for 15 s more: on those medians alone the node stood out for 30 s and was named. Two 25 s
    # stalls are long enough. (Two 20 s stalls were named too until the ticks between them stopped
    # counting towards the 30 s `for`: the node then held back its job 40 s of 50, each spell shorter
    # than `for`.)
    def stalls(seconds):
        def override(t, node, gpu):
            if 400 <= t < 400 + seconds or 410 + seconds <= t < 410 + 2 * seconds:
                if node == "n1":
                    return {"utilization_ratio": 0.55, "sm_active_ratio": 0.45, "power_watts": 350.0}
                return {"sm_active_ratio": 0.55, "power_watts": 400.0}
            return {}

        return override

    assert "straggler" not in _by_kind(cluster_lines(900, nodes=3, override=stalls(15)))
    assert "straggler" not in _by_kind(cluster_lines(900, nodes=3, override=stalls(20)))
    (s,) = _by_kind(cluster_lines(900, nodes=3, override=stalls(25)))["straggler"]
    assert (s.node, s.gpu) == ("n1", None)


def test_uniform_power_cap_makes_nobody_stand_out():
    def capped(t, node, gpu):
        if t >= 400:
            return {
                "power_watts": 380.0,
                "power_limit_watts": 400.0,
                "sm_clock_hertz": 1.6e9,
                "throttle_reasons": 0x4,
                "sm_active_ratio": None,
            }
        return {"sm_active_ratio": None}

    assert _by_kind(cluster_lines(900, override=capped)) == {}


def test_gpus_of_another_job_are_not_peers():
    def two_jobs(t, node, gpu):
        kw = {"hpc_job": "a" if gpu < 4 else "b"}
        if gpu >= 4:
            kw.update(sm_active_ratio=0.35, power_watts=250.0, utilization_ratio=0.7)
        return kw

    assert _by_kind(cluster_lines(900, override=two_jobs)) == {}


def test_unattributed_gpus_fall_back_to_node_peers_and_say_so():
    (s,) = _by_kind(cluster_lines(1000, override=_slow_gpu, job=None))["straggler"]
    assert (s.node, s.gpu, s.hpc_job) == ("n1", 3, None)
    assert s.evidence["peer_group"] == "node_model" and "attribution" in s.evidence["note"]
    assert s.evidence["peer_group_inferred"] is True and s.summary.endswith("(peers inferred: no hpc_job attribution)")


def test_unattributed_gpus_moving_together_are_one_inferred_job_and_say_so():
    (s,) = _by_kind(cluster_lines(1000, override=_in_step(_slow_gpu), job=None))["straggler"]
    assert (s.node, s.gpu, s.hpc_job) == ("n1", 3, None)
    # Both nodes' GPUs are its peers: the job, not the node.
    assert s.evidence["peer_group"] == "inferred_job" and s.evidence["peer_group_size"] == 16
    assert s.evidence["peer_group_inferred"] is True and "peers inferred" in s.summary


def test_attributed_straggler_says_nothing_of_inferred_peers():
    (s,) = _by_kind(cluster_lines(1000, override=_in_step(_slow_gpu)))["straggler"]
    assert s.hpc_job == "j1" and "peer_group_inferred" not in s.evidence and "inferred" not in s.summary


def test_unattributed_gpu_braked_in_the_first_minute_of_a_trace_is_named():
    # No attribution, the work running from the trace's first sample; GPU n1/3's power brake engages at
    # +40 s (bits, clocks 30 % down) while its node peers wait. Nothing is learned from a GPU with its
    # clocks cut, so it never finished learning, and without a job the cross-section did not apply: the
    # brake was never named.
    def braked(t, node, gpu):
        if t < 40 or t >= 600:
            return {}
        if (node, gpu) == ("n1", 3):
            return {"sm_clock_hertz": 0.7 * MAX_HZ, "throttle_reasons": 0x88, "power_watts": 330.0}
        return {"sm_active_ratio": 0.6, "power_watts": 410.0}

    (s,) = _by_kind(cluster_lines(900, override=braked, job=None))["straggler"]
    assert (s.node, s.gpu, s.hpc_job) == ("n1", 3, None) and s.evidence["pattern"] == "gpu_clocks_cut"
    assert s.started <= T0 + 40 + 120 and s.resolved is not None


@pytest.mark.parametrize(
    "bits,causes,words",
    [
        (0x88, ["hw_slowdown_or_power_brake"], "power brake, not heat"),
        (0x48, ["hw_thermal_slowdown"], "HW thermal slowdown (heat)"),
        (0x20, ["sw_thermal_slowdown"], "SW thermal slowdown (heat)"),
        (
            0x8C,
            ["hw_slowdown_or_power_brake", "sw_power_cap"],
            "power brake, not heat (power delivery, or power draw too high); SW power cap",
        ),
    ],
)
def test_a_gpu_whose_clocks_are_cut_is_named_with_what_cut_them(bits, causes, words):
    # What an operator does next depends on it: cooling for heat, the power supply for a brake.
    def cut(t, node, gpu):
        if t < 400 or t >= 800:
            return {}
        if (node, gpu) == ("n1", 3):
            return {"sm_clock_hertz": 0.7 * MAX_HZ, "throttle_reasons": bits, "power_watts": 330.0}
        return {"sm_active_ratio": 0.6, "power_watts": 410.0}

    (s,) = _by_kind(cluster_lines(1000, override=cut))["straggler"]
    assert (s.node, s.gpu, s.evidence["pattern"]) == ("n1", 3, "gpu_clocks_cut")
    assert s.evidence["throttle_causes"] == causes and words in s.summary


def test_a_straggler_with_no_throttle_bits_names_no_cause():
    (s,) = _by_kind(cluster_lines(1000, override=_slow_gpu))["straggler"]
    assert s.evidence["throttle_causes"] == [] and "throttle" not in s.summary


def _lost_at_380(busy: bool):
    """_slow_gpu without attribution, and GPU n0/7 falls off the bus at 380 s, after running work or idle."""

    def override(t, node, gpu):
        if (node, gpu) != ("n0", 7):
            return _slow_gpu(t, node, gpu)
        kw = {} if busy else {"utilization_ratio": 0.0, "sm_active_ratio": 0.0, "power_watts": 60.0}
        return {**kw, "up": t < 380}

    return override


def test_an_unattributed_gpu_lost_while_busy_hangs_every_group_of_its_model_but_an_idle_one_nobody():
    # Without attribution a lost GPU's job is unknown: every unattributed group of its model is taken as
    # hung, so n1/3 goes unnamed (the price of not naming a spinning GPU of the hung job). A spare GPU
    # that ran nothing hangs nobody, and n1/3 is named.
    busy = _by_kind(cluster_lines(1000, override=_lost_at_380(True), job=None))
    assert [(a.node, a.gpu) for a in busy["gpu_lost"]] == [("n0", 7)] and "straggler" not in busy
    idle = _by_kind(cluster_lines(1000, override=_lost_at_380(False), job=None))
    assert [(a.node, a.gpu) for a in idle["gpu_lost"]] == [("n0", 7)]
    assert [(a.node, a.gpu) for a in idle["straggler"]] == [("n1", 3)]


def test_an_unattributed_gpu_lost_while_busy_hangs_only_the_inferred_job_it_was_in():
    # Two unattributed jobs, each moving in its own step phase: n0's and n1's. GPU n0/7 falls off the bus
    # at 380 s while busy; its job hangs, but n1's job is another, and its straggler n1/3 is named.
    def n1_slows(t, node, gpu):
        if node == "n0":
            return {"up": t < 380} if gpu == 7 else {}
        if not 400 <= t < 800:
            return {}
        if gpu == 3:
            return {"sm_clock_hertz": 1.48e9, "sm_active_ratio": 0.80, "power_watts": 430.0}
        return {"sm_active_ratio": 0.62, "power_watts": 410.0}

    two_jobs = _in_step(_in_step(n1_slows, nodes=("n0",)), nodes=("n1",), draw=2)
    alerts = _by_kind(cluster_lines(1000, override=two_jobs, job=None))
    assert [(a.node, a.gpu) for a in alerts["gpu_lost"]] == [("n0", 7)]
    (s,) = alerts["straggler"]
    assert (s.node, s.gpu) == ("n1", 3) and s.evidence["peer_group"] == "inferred_job"


def _two_unattributed_jobs(t, node, gpu):
    """No hpc_job anywhere: GPUs 0-3 of each node run one job, GPUs 4-7 a lighter one (from 200 s)."""
    if gpu >= 4:
        if t < 200:
            return {"utilization_ratio": 0.0, "sm_active_ratio": 0.0, "power_watts": 70.0}
        return {"sm_active_ratio": 0.5, "power_watts": 330.0}
    if 500 <= t < 800:  # the first job waits for its silently slow GPU n1/1
        if (node, gpu) == ("n1", 1):
            return {"sm_active_ratio": 0.75}
        return {"sm_active_ratio": 0.5, "power_watts": 360.0}
    return {}


def test_unattributed_second_job_starting_on_a_node_is_not_a_straggler():
    def no_incident(t, node, gpu):
        return _two_unattributed_jobs(min(t, 499.0), node, gpu)

    assert _by_kind(cluster_lines(1000, override=no_incident, job=None)) == {}


def test_unattributed_node_with_two_jobs_never_names_the_other_job():
    # When the first job waits, the second job's GPUs all stand out against the node's mixed median,
    # and a node median between two clusters moves with a single GPU: neither makes them culprits.
    alerts = _by_kind(cluster_lines(1000, override=_two_unattributed_jobs, job=None))
    named = {(a.node, a.gpu) for a in alerts.get("straggler", [])}
    assert named <= {("n1", 1)}
    assert set(alerts) <= {"straggler"}


def test_unattributed_node_is_not_named_for_one_gpu_between_two_jobs():
    # Pre-Hopper (power only), two like jobs on every node, no hpc_job. When the first job waits for
    # n0/3, n0's median power sits with the second job's GPUs and n1's between the two: the node
    # medians differ by half the gap, yet only one of n0's GPUs is any busier.
    def like_jobs(t, node, gpu):
        kw = {"sm_active_ratio": None, "power_watts": 400.0}
        if 500 <= t < 800 and gpu < 4 and (node, gpu) != ("n0", 3):
            kw["power_watts"] = 340.0
        return kw

    alerts = _by_kind(cluster_lines(1000, override=like_jobs, job=None))
    assert {(a.node, a.gpu) for a in alerts.get("straggler", [])} <= {("n0", 3)}


def _shared_node(first_job, second_job=None):
    """Pre-Hopper (power only), one node, no hpc_job: GPUs 0-3 run one job at 400 W, GPUs 4-7 another at
    350 W. From 500 s to 800 s first_job(gpu) and second_job(gpu) give the watts that GPU draws instead."""

    def override(t, node, gpu):
        watts = 400.0 if gpu < 4 else 350.0
        if 500 <= t < 800:
            watts = (first_job if gpu < 4 else second_job or (lambda g: None))(gpu) or watts
        return {"sm_active_ratio": None, "power_watts": watts}

    return override


def test_unattributed_silent_straggler_beside_another_job_on_its_node_is_named():
    # GPU 3 slows without clock cut or bits: GPUs 0-2 wait (12 % less power), GPU 3 computes through the
    # time it used to wait (4 % more). The other job's GPUs hold the node median where it was.
    slow = _shared_node(lambda g: 416.0 if g == 3 else 350.0)
    (s,) = _by_kind(cluster_lines(1000, nodes=1, override=slow, job=None))["straggler"]
    assert (s.node, s.gpu, s.hpc_job) == ("n0", 3, None)
    assert T0 + 500 < s.started <= T0 + 600 and s.resolved is not None
    ev = s.evidence
    assert ev["peer_group"] == "node_model" and ev["waiting_peers"] == [0, 1, 2]
    assert 0.1 < ev["estimated_job_slowdown_ratio"] < 0.15


def test_unattributed_shared_node_names_nobody_when_no_one_gpu_alone_works_harder():
    # One job's GPUs all sink (a communication slowdown or a cap): nobody rises. They sink while the other
    # job's GPUs all rise together (a phase of that job): no one GPU stands apart. One job's GPUs all rise:
    # nobody sank.
    decoys = [
        _shared_node(lambda g: 350.0),
        _shared_node(lambda g: 350.0, lambda g: 370.0),
        _shared_node(lambda g: None, lambda g: 370.0),
    ]
    for decoy in decoys:
        assert _by_kind(cluster_lines(1000, nodes=1, override=decoy, job=None)) == {}


def test_unattributed_nodes_of_separate_jobs_do_not_blame_each_other():
    # No hpc_job; n0 runs one job, the other nodes another, lighter one. n0's job turns communication-
    # bound (SM activity and power drop, utilization stays): the other nodes are busier than n0 while
    # n0 "waits", but nobody waits for them.
    def n0_slows(t, node, gpu):
        if node != "n0":
            return {"sm_active_ratio": 0.62, "power_watts": 430.0}
        if 500 <= t < 800:
            return {"sm_active_ratio": 0.5, "power_watts": 360.0}
        return {}

    assert _by_kind(cluster_lines(1000, nodes=2, override=n0_slows, job=None)) == {}
    assert _by_kind(cluster_lines(1000, nodes=3, override=n0_slows, job=None)) == {}


def test_unattributed_host_bound_node_of_a_half_node_job_is_named():
    # No hpc_job; one job on GPUs 0-3 of each of 3 nodes, GPUs 4-7 idle all along. Counted in the node
    # medians, the idle GPUs would put every node at half idle and hide n1 starving.
    def starved(t, node, gpu):
        if gpu >= 4:
            return {"utilization_ratio": 0.0, "sm_active_ratio": 0.0, "power_watts": 70.0}
        if t < 500:
            return {}
        if node == "n1":
            return {"utilization_ratio": 0.55, "sm_active_ratio": 0.45, "power_watts": 330.0}
        return {"sm_active_ratio": 0.5, "power_watts": 360.0}

    (s,) = _by_kind(cluster_lines(1000, nodes=3, override=_in_step(starved), job=None))["straggler"]
    assert (s.node, s.gpu) == ("n1", None)
    assert s.evidence["pattern"] == "host_idle" and s.evidence["peer_group"] == "inferred_job"
    assert s.evidence["peer_group_inferred"] is True and "peers inferred" in s.summary
    # Without co-movement the GPUs of one model across nodes may be several jobs: compared with them all,
    # n1 is named for idling on its host while the other nodes' GPUs wait, spinning (no node that merely
    # idles is: tests/server/test_unattributed_fallback.py).
    (s,) = _by_kind(cluster_lines(1000, nodes=3, override=starved, job=None))["straggler"]
    assert (s.node, s.gpu) == ("n1", None) and s.evidence["pattern"] == "host_idle"
    assert s.evidence["peer_group"] == "cluster_model" and "no job inferred" in s.evidence["note"]


def test_unattributed_slow_node_of_one_job_is_named():
    # No hpc_job; one job on every GPU of 3 nodes. n1 is slow as a whole: its GPUs stay busy while the
    # other nodes' GPUs wait. The nodes ran alike while healthy, as one job's nodes do.
    def slow_node(t, node, gpu):
        if 500 <= t < 800 and node != "n1":
            return {"sm_active_ratio": 0.6, "power_watts": 420.0}
        return {}

    (s,) = _by_kind(cluster_lines(1000, nodes=3, override=_in_step(slow_node), job=None))["straggler"]
    assert (s.node, s.gpu) == ("n1", None)
    assert s.evidence["pattern"] == "node_slow" and "attribution" in s.evidence["note"]
    assert s.evidence["peer_group_inferred"] is True and "peers inferred" in s.summary


def test_unattributed_host_starved_node_is_named_beside_a_node_whose_job_just_ended():
    # No hpc_job. n0 and n1 run one job; n2 ran other work until its job ended at 400 s, and idles since.
    # n1 then idles 30 % of each step on its host while n0 waits. n2, busy minutes ago but running no
    # kernels now, is not one of the nodes n1 is compared with: counted, the median of the three nodes'
    # utilization (1.0, 0.7, 0.0) was n1's own, and n1 never stood out.
    def starved(t, node, gpu):
        if node == "n2" and t >= 400:
            return {"utilization_ratio": 0.0, "sm_active_ratio": 0.0, "power_watts": 70.0}
        if not 500 <= t < 800:
            return {}
        if node == "n1":
            return {"utilization_ratio": 0.7, "sm_active_ratio": 0.35, "power_watts": 300.0}
        return {"sm_active_ratio": 0.35, "power_watts": 300.0}

    lines = cluster_lines(1000, nodes=3, override=_in_step(starved, nodes=("n0", "n1")), job=None)
    (s,) = _by_kind(lines)["straggler"]
    assert (s.node, s.gpu) == ("n1", None)
    assert s.evidence["pattern"] == "host_idle" and s.evidence["peer_group"] == "inferred_job"
    assert T0 + 500 < s.started < T0 + 600 and s.resolved is not None


def test_unattributed_host_starved_for_25_minutes_stays_named_until_it_recovers():
    # The starved GPUs are not busy for longer than unattributed_idle_seconds and leave the node-level
    # comparison: that is "unknown", which never clears an open alert.
    def starved(t, node, gpu):
        if not 500 <= t < 2000:
            return {}
        if node == "n1":
            return {"utilization_ratio": 0.3, "sm_active_ratio": 0.25, "power_watts": 250.0}
        return {"sm_active_ratio": 0.5, "power_watts": 360.0}

    (s,) = _by_kind(cluster_lines(2400, nodes=3, override=_in_step(starved), job=None))["straggler"]
    assert (s.node, s.gpu) == ("n1", None)
    assert s.started < T0 + 600 and s.resolved is not None and s.resolved >= T0 + 2000


def test_unattributed_node_rank_check_is_not_passed_by_small_power_differences():
    # As above, with the second job's GPUs on n1 drawing 3 % more power than on n0 all along (silicon):
    # a few per cent between single GPUs is no reason to call their node busier.
    def like_jobs(t, node, gpu):
        kw = {"sm_active_ratio": None, "power_watts": 412.0 if node == "n1" and gpu >= 4 else 400.0}
        if 500 <= t < 800 and gpu < 4 and (node, gpu) != ("n1", 1):
            kw["power_watts"] = 340.0
        return kw

    alerts = _by_kind(cluster_lines(1000, override=like_jobs, job=None))
    assert {(a.node, a.gpu) for a in alerts.get("straggler", [])} <= {("n1", 1)}


def test_a_job_hung_by_a_crashed_node_names_no_straggler_on_power():
    # Pre-Hopper (power only, no energy counter). From 400 s node n2 is gone and the job hangs in its
    # collective: every GPU left spins at near idle power. GPU 4 on n0 draws 12 W more than the rest,
    # 12 % over its peers, but it fell as far from its own usual power as they did: it is no culprit.
    def crashed(t, node, gpu):
        if t < 400:
            return {"sm_active_ratio": None}
        if node == "n2":
            return {"_absent": True}
        watts = 112.0 if (node, gpu) == ("n0", 4) else 100.0
        return {"sm_active_ratio": None, "power_watts": watts, "utilization_ratio": 1.0}

    alerts = _by_kind(cluster_lines(900, nodes=3, override=crashed))
    assert "straggler" not in alerts
    (down,) = alerts["node_unreachable"]
    assert down.node == "n2"


def test_a_power_only_straggler_under_an_operator_cap_is_named():
    # Pre-Hopper, no energy counter. From 200 s an operator caps the job (limit 350 W, clocks lower,
    # the power-cap bit); from 450 s GPU 3 on n1 is slow: it keeps drawing the capped 350 W while its
    # peers, waiting, drop to 290 W. Its power is 0.7 of its uncapped usual level, and still the culprit.
    def capped(t, node, gpu):
        kw = {"sm_active_ratio": None}
        if t >= 200:
            kw.update(power_limit_watts=350.0, power_watts=350.0, sm_clock_hertz=0.8 * MAX_HZ, throttle_reasons=0x4)
        if 450 <= t < 850 and (node, gpu) != ("n1", 3):
            kw["power_watts"] = 290.0
        return kw

    (s,) = _by_kind(cluster_lines(1000, override=capped))["straggler"]
    assert (s.node, s.gpu) == ("n1", 3)
    assert T0 + 450 < s.started <= T0 + 530


def test_a_straggler_is_a_warning_in_a_small_job_and_critical_where_its_job_loses_much():
    """Severity from cost: the same ~25 % slow GPU costs a 16-GPU job ~4 GPU-hours per hour (warning), a
    64-GPU job ~16 (critical, over critical_loss_gpu_hours_per_hour)."""
    (small,) = _by_kind(cluster_lines(1000, override=_slow_gpu))["straggler"]
    (large,) = _by_kind(cluster_lines(1000, nodes=8, override=_slow_gpu))["straggler"]
    assert small.severity.value == "warning"
    assert large.severity.value == "critical"
    lowered = [
        a for a in run_replay(cluster_lines(1000, override=_slow_gpu), {"critical_loss_gpu_hours_per_hour": 2.0})
    ]
    assert [a.severity.value for a in lowered if a.kind == "straggler"] == ["critical"]


def test_the_straggler_summary_says_who_waits_for_whom_with_the_peers_number_against_the_culprits():
    (s,) = _by_kind(cluster_lines(1000, override=_slow_gpu))["straggler"]
    assert s.summary.startswith(
        "GPU 3 on n1 is the slow one: it is still computing while its 15 peers wait for it "
        "(SM activity 0.80 against 0.62); its SM clock runs at 75 % of max against 100 %. "
        "Job j1 loses ~"
    ), s.summary
    assert "holds back" not in s.summary and " vs " not in s.summary
    (idle,) = _by_kind(cluster_lines(1000, override=_starved_rank))["straggler"]
    assert "it idles, waiting on its host, while its 15 peers wait for it (utilization " in idle.summary


def test_a_straggler_whose_links_retry_names_the_retries_and_only_its_own():
    def retrying(t, node, gpu):
        kw = {**_slow_gpu(t, node, gpu), "pcie_replays_total": 7, "nvlink_replay_errors_total": 3}
        if (node, gpu) == ("n1", 3) and t >= 380:
            kw["nvlink_replay_errors_total"] = 3 + int(t - 380)  # a replay a second over its links
        if (node, gpu) == ("n0", 0) and t >= 380:
            kw["pcie_replays_total"] = 7 + int(t - 380)  # another GPU's PCIe link retries too
        return kw

    (s,) = _by_kind(cluster_lines(1000, override=retrying))["straggler"]
    assert (s.node, s.gpu) == ("n1", 3)
    retries = s.evidence["link_retries"]
    assert list(retries) == ["nvlink_replay"] and 20 <= retries["nvlink_replay"] <= 80
    assert f"its links retry ({retries['nvlink_replay']} NVLink replays in the last 5 min)" in s.summary
    (plain,) = _by_kind(cluster_lines(1000, override=_slow_gpu))["straggler"]
    assert "link_retries" not in plain.evidence and "links retry" not in plain.summary
