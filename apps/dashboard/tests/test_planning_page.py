"""The planning page: operators get the import, profile and apply controls, viewers the same data without them;
the pools and links to choose from are in the page's JSON (two queries)."""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from apps.dashboard import selectors
from apps.fleet.services import cluster_link_create
from apps.planning.selectors import PAGE_WORKLOAD

pytestmark = pytest.mark.django_db

CONTROLS = ('id="profile-import"', 'id="profile-measure"', 'id="plan-apply"')


def test_operator_sees_controls_and_viewer_sees_none(make_pool, make_cluster, cluster, operator_session,
                                                     viewer_session):
    decode = make_pool("decode", role="decode")
    prefill = make_pool("prefill", role="prefill", cluster=make_cluster("dc-b"))
    link = cluster_link_create(source=prefill.cluster, destination=cluster, bandwidth_gbps=10, rtt_ms=5)
    page = operator_session.get("/planning/").content.decode()
    assert all(c in page for c in CONTROLS)
    assert '<a href="/planning/">Planning</a>' in page
    viewed = viewer_session.get("/planning/")
    assert viewed.status_code == 200
    assert not any(c in viewed.content.decode() for c in CONTROLS)
    with CaptureQueriesContext(connection) as queries:
        choices = selectors.planning_choices()
    assert len(queries) == 2
    assert [(p["id"], p["role"], p["cluster"]) for p in choices["pools"]] == [
        (decode.pk, "decode", "dc-a"), (prefill.pk, "prefill", "dc-b")]
    assert choices["links"] == [{"id": link.pk, "source": "dc-b", "source_id": prefill.cluster_id,
                                 "destination": "dc-a", "destination_id": cluster.pk, "bandwidth_gbps": 10.0,
                                 "rtt_ms": 5.0}]
    for field, key in (("plan-prompt-median", "prompt_median"), ("plan-rate", "rate_per_s"),
                       ("plan-tpot", "tpot_slo_s")):
        assert f'id="{field}" type="number"' in page
        assert f'value="{PAGE_WORKLOAD[key]}"' in page.split(f'id="{field}"')[1].split(">")[0]
    embedded = page.split('<script id="planning-data" type="application/json">')[1].split("</script>")[0]
    assert json.loads(embedded) == choices
