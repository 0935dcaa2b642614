"""Incidents: which open alerts share a cause (server/incidents.py), how the grouping follows the alerts
over time, and what the store, the Alertmanager payload and the notifier make of it."""

from __future__ import annotations

import asyncio
import sqlite3
from dataclasses import replace

import httpx
import orjson

from gpufleet.server.alerts import AlertKind, AlertState, IncidentRole, Transition
from gpufleet.server.incidents import IncidentTracker, Membership, group, incidents
from gpufleet.server.notify.alertmanager import AlertmanagerNotifier, rfc3339, to_alertmanager
from gpufleet.server.store import AlertQuery, AlertStore
from tests.server.live_fakes import make_alert

CAUSE, EFFECT = IncidentRole.CAUSE, IncidentRole.EFFECT


def test_heat_leads_the_straggler_it_makes_on_its_own_gpu() -> None:
    heat = make_alert(1, kind=AlertKind.THERMAL_THROTTLE, node="dgx-02", gpu=5)
    slow = make_alert(2, node="dgx-02", gpu=5, hpc_job="71002")
    elsewhere = make_alert(3, node="dgx-02", gpu=4, hpc_job="71002")
    got = group([slow, heat, elsewhere])
    assert got == {
        heat.id: Membership(heat.id, CAUSE),
        slow.id: Membership(heat.id, EFFECT),
        elsewhere.id: Membership(elsewhere.id, CAUSE),  # another GPU's straggler is a problem of its own
    }


def test_an_xid_leads_the_ecc_errors_of_its_gpu_whichever_came_first() -> None:
    ecc = make_alert(1, kind=AlertKind.ECC, node="node-a", gpu=6)
    xid = make_alert(2, kind=AlertKind.XID, node="node-a", gpu=6)
    assert group([ecc, xid]) == {xid.id: Membership(xid.id, CAUSE), ecc.id: Membership(xid.id, EFFECT)}


def test_a_lost_gpu_leads_everything_on_it_and_a_node_cause_everything_on_its_node() -> None:
    xid = make_alert(1, kind=AlertKind.XID, node="n", gpu=1)
    lost = make_alert(2, kind=AlertKind.GPU_LOST, node="n", gpu=1)
    heat = make_alert(3, kind=AlertKind.THERMAL_THROTTLE, node="n", gpu=1)
    slow = make_alert(4, node="n", gpu=1)
    assert {a: m.incident for a, m in group([xid, lost, heat, slow]).items()} == dict.fromkeys(
        (xid.id, lost.id, heat.id, slow.id), lost.id
    )
    down = make_alert(5, kind=AlertKind.NODE_UNREACHABLE, node="m", gpu=None, hpc_job=None)
    on_it = [make_alert(6 + i, node="m", gpu=i) for i in range(3)]
    got = group([down, *on_it])
    assert [got[a.id] for a in on_it] == [Membership(down.id, EFFECT)] * 3


def test_a_job_wide_alert_follows_the_cause_on_a_gpu_of_its_job() -> None:
    heat = make_alert(1, kind=AlertKind.THERMAL_THROTTLE, node="dgx-02", gpu=5, hpc_job="71002")
    comm = make_alert(2, kind=AlertKind.COMM_BOUND, node=None, gpu=None, hpc_job="71002")
    other = make_alert(3, kind=AlertKind.INPUT_BOUND, node=None, gpu=None, hpc_job="9")
    got = group([heat, comm, other])
    assert (got[comm.id], got[other.id]) == (Membership(heat.id, EFFECT), Membership(other.id, CAUSE))


def test_resolved_alerts_are_not_grouped_and_lone_alerts_lead_themselves() -> None:
    heat = make_alert(1, kind=AlertKind.THERMAL_THROTTLE, node="n", gpu=0, state=AlertState.RESOLVED)
    slow = make_alert(2, node="n", gpu=0)
    assert group([heat, slow]) == {slow.id: Membership(slow.id, CAUSE)}


def test_of_two_causes_of_a_kind_on_one_gpu_the_older_leads() -> None:
    first = make_alert(1, kind=AlertKind.XID, node="n", gpu=0)
    second = make_alert(2, kind=AlertKind.XID, node="n", gpu=0)
    assert group([second, first])[second.id] == Membership(first.id, EFFECT)


def test_incidents_list_each_cause_with_its_effects() -> None:
    heat = make_alert(1, kind=AlertKind.THERMAL_THROTTLE, node="dgx-02", gpu=5)
    slow = make_alert(2, node="dgx-02", gpu=5)
    lone = make_alert(3, node="dgx-09", gpu=1)
    view, _ = IncidentTracker().step((heat, slow, lone), ())
    listed = incidents(view)
    assert [(i.id, i.cause.id, [e.id for e in i.effects]) for i in listed] == [
        (lone.id, lone.id, []),
        (heat.id, heat.id, [slow.id]),
    ]


def test_an_alert_regrouped_without_a_transition_is_refreshed_and_resolves_under_its_last_incident() -> None:
    tracker = IncidentTracker()
    slow = make_alert(2, node="n", gpu=0)
    _, out = tracker.step((slow,), [Transition(slow, None)])
    assert (out[0].alert.incident, out[0].alert.role) == (slow.id, CAUSE)

    heat = make_alert(1, kind=AlertKind.THERMAL_THROTTLE, node="n", gpu=0)
    _, out = tracker.step((heat, slow), [Transition(heat, AlertState.PENDING)])
    assert [(t.alert.id, t.alert.incident, t.alert.role, t.previous) for t in out] == [
        (heat.id, heat.id, CAUSE, AlertState.PENDING),
        (slow.id, heat.id, EFFECT, AlertState.FIRING),  # the straggler joins the heat's incident
    ]
    _, out = tracker.step((heat,), [Transition(replace(slow, state=AlertState.RESOLVED), AlertState.FIRING)])
    assert [(t.alert.incident, t.alert.role) for t in out] == [(heat.id, EFFECT)]


def test_the_alertmanager_labels_carry_the_incident_and_a_regrouped_alert_ends_its_old_label_set() -> None:
    slow = replace(make_alert(2, node="n", gpu=0), incident="x", role=CAUSE)
    body = to_alertmanager(slow, now=2000.0, resend_interval_seconds=60.0, external_url="http://s")
    assert (body["labels"]["incident"], body["labels"]["role"]) == ("x", "cause")

    posts: list[list[dict]] = []
    transport = httpx.MockTransport(lambda r: posts.append(orjson.loads(r.content)) or httpx.Response(200))
    notifier = AlertmanagerNotifier("http://am:9093", transport=transport, clock=lambda: 2000.0)

    async def run() -> None:
        notifier.submit([Transition(slow, AlertState.PENDING)])
        await notifier.step()
        notifier.submit([Transition(replace(slow, incident="heat", role=EFFECT), AlertState.FIRING)])
        await notifier.step()
        await notifier.aclose()

    asyncio.run(run())
    sent = sorted(
        (a["labels"]["incident"], a["labels"]["role"], a["endsAt"] == rfc3339(slow.updated)) for a in posts[1]
    )
    assert sent == [("heat", "effect", False), ("x", "cause", True)]  # the old label set ended at once


def test_the_store_keeps_the_incident_and_filters_by_it(tmp_path) -> None:
    store = AlertStore(tmp_path / "a.db")
    heat = replace(make_alert(1, kind=AlertKind.THERMAL_THROTTLE), incident="h", role=CAUSE)
    slow = replace(make_alert(2), incident="h", role=EFFECT)
    store.upsert([heat, slow, make_alert(3)])
    assert store.get(slow.id) == slow
    page = store.query(AlertQuery(incident="h"))
    assert [a.id for a in page.alerts] == [slow.id, heat.id]
    store.close()


def test_an_older_store_gains_the_incident_columns(tmp_path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE alerts (id TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, kind TEXT NOT NULL, "
        "severity TEXT NOT NULL, state TEXT NOT NULL, node TEXT, gpu INTEGER, uuid TEXT, hpc_job TEXT, "
        "pending_since REAL NOT NULL, started REAL, resolved REAL, updated REAL NOT NULL, summary TEXT NOT NULL, "
        "evidence BLOB NOT NULL)"
    )
    db.execute(
        "INSERT INTO alerts VALUES ('a1', 'f', 'straggler', 'warning', 'firing', 'n', 0, NULL, 'j', 1.0, 2.0, "
        "NULL, 2.0, 's', '{}')"
    )
    db.commit()
    db.close()
    store = AlertStore(path)
    (old,) = store.open_alerts()
    assert (old.incident, old.role) == (None, None)
    store.upsert([replace(old, incident="a1", role=CAUSE)])
    assert store.get("a1").role is CAUSE
    store.close()


def test_an_effect_stays_in_its_incident_after_its_cause_resolves_and_the_incident_lists_it() -> None:
    tracker = IncidentTracker()
    heat = make_alert(1, kind=AlertKind.THERMAL_THROTTLE, node="n", gpu=0)
    slow = make_alert(2, node="n", gpu=0)
    tracker.step((heat, slow), ())
    view, out = tracker.step((slow,), [Transition(replace(heat, state=AlertState.RESOLVED), AlertState.FIRING)])
    assert [(a.id, a.incident, a.role) for a in view] == [(slow.id, heat.id, EFFECT)]  # not paged anew
    assert [(t.alert.id, t.alert.incident, t.alert.role) for t in out] == [(heat.id, heat.id, CAUSE)]
    (listed,) = incidents(view)
    assert (listed.id, listed.cause, [e.id for e in listed.effects]) == (heat.id, None, [slow.id])
    # A new cause covering it takes it over.
    ecc = make_alert(3, kind=AlertKind.ECC, node="n", gpu=0)
    view, _ = tracker.step((slow, ecc), ())
    assert {a.id: (a.incident, a.role) for a in view} == {ecc.id: (ecc.id, CAUSE), slow.id: (ecc.id, EFFECT)}


def test_after_a_restart_the_stored_incidents_are_known_and_nothing_is_re_sent() -> None:
    heat = replace(make_alert(1, kind=AlertKind.THERMAL_THROTTLE, node="n", gpu=0), incident="i", role=CAUSE)
    slow = replace(make_alert(2, node="n", gpu=0), incident="i", role=EFFECT)
    stored = [replace(heat, incident=heat.id), replace(slow, incident=heat.id)]
    tracker = IncidentTracker()
    tracker.restore(stored)
    view, out = tracker.step(tuple(stored), ())
    assert out == [] and list(view) == stored
