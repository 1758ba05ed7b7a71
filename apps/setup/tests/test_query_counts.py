"""Every list endpoint makes the same number of queries for 1 row and for 20 rows (no N+1)."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.fleet.models import Replica
from apps.fleet.services import cluster_create, cluster_link_create, pool_create
from apps.operations.services import action_create
from apps.rollouts.models import GateMeasurement
from apps.rollouts.services import rollout_plan_create
from apps.telemetry.models import Alert, AlertRule

pytestmark = pytest.mark.django_db


def _add_rows(i: int, model_version, target, base_cluster) -> None:
    cluster = cluster_create(name=f"dc-{i}", kind="local", agent_url="http://127.0.0.1:9300")
    cluster_link_create(source=base_cluster, destination=cluster, bandwidth_gbps=10, rtt_ms=5)
    prefill = pool_create(name="prefill", cluster=cluster, role="prefill", model_version=model_version, replicas=1)
    decode = pool_create(name="decode", cluster=cluster, role="decode", model_version=model_version, replicas=2)
    rollout = rollout_plan_create(name=f"r{i}", pools=[prefill, decode], target_model_version=target,
                                  strategy="canary", steps=[{"set_weight": 10}])
    now = timezone.now()
    for n in range(2):  # observed replicas (written by reconcile in production)
        Replica.objects.create(pool=decode, track="stable", name=f"decode-{n}", endpoint=f"http://10.0.{i}.{n}:8000",
                               ready=True, version="v1", last_seen=now)
    rule = AlertRule.objects.create(name="queue-deep", pool=decode, signal="num_requests_waiting", comparison=">",
                                    threshold=8)
    Alert.objects.create(rule=rule, pool=decode, severity="warning", started_at=now, value=9)
    GateMeasurement.objects.create(rollout=rollout, step_index=0, gate_index=0, pool=decode, track="canary",
                                   signal="error_rate", value=0.0, threshold=0.1, comparison="<", window_s=30,
                                   passed=True, measured_at=now)
    action_create(kind="pool.scale", target_type="pool", target_id=str(decode.pk), pool=decode,
                  params={"replicas": 3})


def _count(api, url) -> tuple[int, int]:
    with CaptureQueriesContext(connection) as ctx:
        r = api.get(url)
    assert r.status_code == 200
    return r.json()["count"], len(ctx.captured_queries)


ENDPOINTS = ["/api/v1/clusters/", "/api/v1/cluster-links/", "/api/v1/model-versions/", "/api/v1/pools/",
             "/api/v1/rollouts/", "/api/v1/actions/", "/api/v1/replicas/", "/api/v1/alert-rules/", "/api/v1/alerts/",
             "/api/v1/rollout-measurements/"]
# /api/v1/signals/ is not a list of rows: one Redis document (telemetry_snapshot), no database query.


def test_list_endpoints_make_the_same_number_of_queries_for_1_and_20_rows(viewer_api, make_model_version):
    v1, v2 = make_model_version("v1"), make_model_version("v2")
    base = cluster_create(name="hub", kind="local", agent_url="http://127.0.0.1:9300")
    _add_rows(0, v1, v2, base)
    one = {url: _count(viewer_api, url) for url in ENDPOINTS}
    for i in range(1, 20):
        _add_rows(i, v1, v2, base)
    for i in range(3, 21):
        make_model_version(f"v{i}")
    twenty = {url: _count(viewer_api, url) for url in ENDPOINTS}
    for url in ENDPOINTS:
        assert one[url][0] < twenty[url][0] >= 20, url
        assert one[url][1] == twenty[url][1], f"{url}: {one[url][1]} queries for 1 row, {twenty[url][1]} for 20"


def test_a_list_on_its_first_page_is_counted_without_count_and_longer_lists_page_as_before(viewer_api):
    for i in range(3):
        cluster_create(name=f"dc-{i}", kind="local", agent_url="http://127.0.0.1:9300")

    def get(url):
        with CaptureQueriesContext(connection) as ctx:
            body = viewer_api.get(url).json()
        counted = any("COUNT(" in q["sql"] for q in ctx.captured_queries)
        return body["count"], [c["name"] for c in body["results"]], body["next"] is not None, counted

    assert get("/api/v1/clusters/") == (3, ["dc-0", "dc-1", "dc-2"], False, False)
    assert get("/api/v1/clusters/?page_size=3") == (3, ["dc-0", "dc-1", "dc-2"], False, False)
    assert get("/api/v1/clusters/?page_size=2") == (3, ["dc-0", "dc-1"], True, True)
    assert get("/api/v1/clusters/?page_size=2&page=2") == (3, ["dc-2"], False, True)
    assert get("/api/v1/clusters/?kind=kubernetes") == (0, [], False, False)
    assert viewer_api.get("/api/v1/clusters/?page_size=2&page=3").status_code == 404


def test_list_endpoints_without_query_parameters_skip_the_filterset_and_answer_as_with_it(viewer_api,
                                                                                         make_model_version,
                                                                                         monkeypatch):
    """apps.core.filters.FilterBackend: no parameters, no filterset built; the body is the one django-filter's
    path gives (``?page=1`` has a parameter, so it goes through the filterset with every filter empty)."""
    import django_filters

    v1, v2 = make_model_version("v1"), make_model_version("v2")
    base = cluster_create(name="hub", kind="local", agent_url="http://127.0.0.1:9300")
    for i in range(2):
        _add_rows(i, v1, v2, base)
    built = []
    original = django_filters.FilterSet.__init__

    def counted(self, *args, **kwargs):
        built.append(type(self).__name__)
        original(self, *args, **kwargs)

    monkeypatch.setattr(django_filters.FilterSet, "__init__", counted)
    for url in ENDPOINTS:
        built.clear()
        plain = viewer_api.get(url)
        assert (plain.status_code, built) == (200, []), url
        through_filterset = viewer_api.get(f"{url}?page=1")
        assert (through_filterset.status_code, len(built)) == (200, 1), url
        assert plain.json() == through_filterset.json(), url
        assert plain.json()["count"] >= 2, url
