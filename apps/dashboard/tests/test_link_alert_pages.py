"""The link and alerts pages served by Django (no browser): their data, 404s, who sees the alert controls."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from django.db import connection
from django.test.utils import CaptureQueriesContext

from apps.dashboard import selectors
from apps.fleet.services import cluster_link_create, pool_create
from apps.telemetry.models import Alert, AlertRule, AlertSilence

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def _json_script(response, element_id: str):
    html = response.content.decode()
    opening = f'<script id="{element_id}" type="application/json">'
    start = html.index(opening) + len(opening)
    return json.loads(html[start:html.index("</script>", start)])


def test_link_page_names_the_pools_that_measure_each_direction(operator_session, make_cluster, model_version):
    a, b = make_cluster("dc-prefill"), make_cluster("dc-decode")
    prefill = pool_create(name="prefill", role="prefill", replicas=1, cluster=a, model_version=model_version)
    decode = pool_create(name="decode", role="decode", replicas=1, cluster=b, model_version=model_version)
    chat = pool_create(name="chat", role="colocated", replicas=1, cluster=a, model_version=model_version)
    link = cluster_link_create(source=a, destination=b, bandwidth_gbps=10.0, rtt_ms=2.0)
    with CaptureQueriesContext(connection) as queries:
        detail = selectors.link_detail(link.pk)
    assert len(queries) == 2
    end = {"cluster": "dc-prefill"}
    assert detail == {
        "id": link.pk, "source": {"id": a.pk, "name": "dc-prefill", "datacenter": "dc-prefill"},
        "destination": {"id": b.pk, "name": "dc-decode", "datacenter": "dc-decode"},
        "bandwidth_gbps": 10.0, "rtt_ms": 2.0,
        "forward_senders": [{"id": prefill.pk, "name": "prefill", "role": "prefill", **end}],
        "forward_receivers": [{"id": decode.pk, "name": "decode", "role": "decode", "cluster": "dc-decode"}],
        "reverse_senders": [],
        "reverse_receivers": [{"id": chat.pk, "name": "chat", "role": "colocated", **end}],
    }
    page = operator_session.get(f"/links/{link.pk}/")
    assert page.status_code == 200 and _json_script(page, "link-data") == detail
    assert b"/static/dashboard/vendor/plotly.min.js" in page.content
    fleet = operator_session.get("/")
    assert b'id="topology"' in fleet.content and b"dashboard/js/topology.js" in fleet.content
    assert operator_session.get("/links/424242/").status_code == 404


def test_alerts_page_lists_firing_then_resolved_and_only_operators_get_controls(operator_session, viewer_session,
                                                                                pool):
    rule = AlertRule.objects.get(name="kv-cache-usage-critical", pool=None)
    firing = Alert.objects.create(rule=rule, pool=pool, severity="critical", started_at=T0, value=0.97)
    old = Alert.objects.create(rule=rule, pool=pool, severity="critical", started_at=T0 - timedelta(hours=2),
                               ended_at=T0 - timedelta(hours=1), state="resolved", value=0.96)
    until = datetime.now(tz=UTC) + timedelta(hours=1)
    AlertSilence.objects.create(rule=rule, pool=pool, starts_at=datetime.now(tz=UTC), ends_at=until)
    with CaptureQueriesContext(connection) as queries:
        data = selectors.alert_page_rows()
    assert len(queries) == 2
    assert [(a["id"], a["state"], a["pool_name"], a["silenced_until"]) for a in data["alerts"]] == [
        (firing.pk, "firing", pool.name, until.isoformat()), (old.pk, "resolved", pool.name, until.isoformat())]
    assert data["silence_choices_s"] == [900, 3600, 14400, 86400]
    operator_page, viewer_page = operator_session.get("/alerts/"), viewer_session.get("/alerts/")
    assert operator_page.status_code == viewer_page.status_code == 200
    assert _json_script(viewer_page, "alerts-data") == data
    assert b"<th>Controls</th>" in operator_page.content and b"<th>Controls</th>" not in viewer_page.content
    assert b'href="/alerts/"' in viewer_page.content  # in the navigation of every page


def test_alerts_page_without_alerts_says_what_makes_them_fire(viewer_session):
    assert selectors.alert_page_rows()["alerts"] == []
    assert b"dashboard/js/alerts.js" in viewer_session.get("/alerts/").content
