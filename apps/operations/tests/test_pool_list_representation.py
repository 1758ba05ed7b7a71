"""``GET /api/v1/pools/`` reads ``values()`` rows (apps.fleet.api.serializers.pool_list_representation): its
body is byte for byte what DRF's generic list with ``PoolSerializer`` gives, for every field variety, filter,
ordering and page."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from django.db import connection
from django.db.models.sql.compiler import SQLCompiler
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.mixins import ListModelMixin
from rest_framework.test import APIRequestFactory, force_authenticate

from apps.accounts.services import user_create_with_role
from apps.core.pagination import Pagination
from apps.fleet import selectors as fleet_selectors
from apps.fleet.api.serializers import PoolSerializer, pool_list_representation, pool_values_representation
from apps.fleet.models import Pool, PoolTrack
from apps.fleet.services import cluster_create, pool_create
from apps.operations.api.views import PoolViewSet

pytestmark = pytest.mark.django_db


class SerializerPoolViewSet(PoolViewSet):
    """The reference: DRF's own list, model instances with their prefetched tracks through ``PoolSerializer``."""

    def get_queryset(self):
        return fleet_selectors.pool_list_serialized()

    list = ListModelMixin.list


@pytest.fixture
def fleet(make_model_version):
    """Pools covering every field's varieties: defaults and set values, empty and nested JSON, non-ASCII text,
    floats that print differently (0.1, 1e-07, 12345.678), both booleans, every role and engine, microsecond
    timestamps, no track, one, and several tracks with extra args and inactive ones."""
    v1, v2 = make_model_version("v1"), make_model_version("v2")
    local = cluster_create(name="dc-a", kind="local", agent_url="http://127.0.0.1:9300")
    kube = cluster_create(name="dc-b", kind="kubernetes", namespace="ferry", kubeconfig_path="/nonexistent")
    plain = pool_create(name="decode", cluster=local, role="decode", model_version=v1, replicas=2)
    pool_create(name="prefill", cluster=local, role="prefill", model_version=v2, replicas=0, gpu_kind="nvidia-h200",
                gpu_count=8, cpu="500m", memory="16Gi", node_selector={"ferry.io/gpu": "h200", "zone": ""},
                tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                autoscaling_enabled=True, min_replicas=0, max_replicas=12, autoscaling_signal="kv_cache_usage",
                autoscaling_target=0.1, scale_up_stabilization_s=30, scale_down_stabilization_s=600,
                schedule_overrides=[{"start": "22:00", "end": "06:00", "replicas": 1, "days": ["sat", "sun"]}],
                schedule_time_zone="Asia/Shanghai", drain_timeout_s=86_400)
    blue_green = pool_create(name="colocated", cluster=kube, role="colocated", model_version=v1, replicas=3,
                             engine="vllm", autoscaling_target=1e-07)
    PoolTrack.objects.create(pool=blue_green, name="green", model_version=v2, replicas=2, weight=0, active=False,
                             extra_args="--max-num-seqs 8 --note 'é ü'")
    canary = pool_create(name="canary", cluster=kube, role="colocated", model_version=v1, replicas=1,
                         engine="sglang", autoscaling_target=12345.678)
    PoolTrack.objects.filter(pool=canary).update(weight=90)
    PoolTrack.objects.create(pool=canary, name="canary", model_version=v2, replicas=4, weight=10)
    # written directly (no service path writes these): no track at all, JSON nested past labels
    Pool.objects.filter(pk=plain.pk).update(schedule_overrides=[{"nested": {"a": [1, 2.5, None, True]}}],
                                            node_selector={"label": "naïve"},
                                            updated_at=timezone.now().replace(microsecond=123456))
    bare = Pool.objects.create(name="bare", cluster=local, role="decode", model_version=v2, memory="1Gi")
    Pool.objects.filter(pk=bare.pk).update(created_at=dt.datetime(2024, 2, 29, 23, 59, 59, 1, tzinfo=dt.UTC))
    return Pool.objects.order_by("id")


@pytest.fixture
def viewer(db):
    return user_create_with_role(username="vera", role="viewer").user


def _list(view_class, user, query: str) -> tuple[int, bytes]:
    request = APIRequestFactory().get(f"/api/v1/pools/{query}", HTTP_ACCEPT="application/json")
    force_authenticate(request, user=user)
    response = view_class.as_view({"get": "list"})(request)
    response.render()
    return response.status_code, response.content


@pytest.mark.parametrize("query", [
    "", "?page=1", "?ordering=-name", "?ordering=created_at", "?page_size=2", "?page_size=2&page=2",
    "?page_size=2&page=3", "?page_size=2&page=last", "?page_size=500", "?role=colocated", "?cluster_name=dc-b",
    "?autoscaling_enabled=true", "?name=bare", "?role=colocated&ordering=-id&page_size=1&page=2",
    "?page_size=2&page=4", "?page_size=0", "?role=encoder",
])
def test_the_pools_list_answers_as_the_serializer_does_byte_for_byte(fleet, viewer, query):
    fast = _list(PoolViewSet, viewer, query)
    reference = _list(SerializerPoolViewSet, viewer, query)
    assert fast == reference
    if fast[0] == 200 and query in ("", "?page_size=500"):
        assert json.loads(fast[1])["count"] == 5


def test_the_pools_list_representation_equals_the_serializer_field_by_field_in_any_time_zone(fleet):
    pool_representation, track_representation = pool_values_representation()
    rows = list(fleet.values(*pool_representation.columns))
    tracks = fleet_selectors.pool_track_rows(pool_ids=[row["id"] for row in rows],
                                             columns=track_representation.columns)
    for zone in ("UTC", "Asia/Shanghai", "America/St_Johns"):
        with timezone.override(zone):
            fast = pool_list_representation(rows, tracks)
            reference = PoolSerializer(fleet_selectors.pool_list().order_by("id"), many=True).data
            assert len(fast) == len(reference) == 5
            for got, want in zip(fast, reference, strict=True):
                assert list(got) == list(want)  # the same keys in the same order
                for name in want:
                    assert (name, got[name]) == (name, want[name])
    with timezone.override("Asia/Shanghai"):
        bare = pool_list_representation([row for row in rows if row["name"] == "bare"], tracks)[0]
    assert (bare["created_at"], bare["replicas"], bare["tracks"]) == ("2024-03-01T07:59:59.000001+08:00", 0, [])
    canary = next(pool for pool in pool_list_representation(rows, tracks) if pool["name"] == "canary")
    assert (canary["replicas"], [(t["name"], t["weight"]) for t in canary["tracks"]]) == (
        5, [("canary", 10), ("stable", 90)])


def test_the_pools_list_reads_the_pools_and_their_tracks_in_two_queries_whatever_their_number(fleet, viewer):
    def tables() -> list[str]:
        user = type(viewer).objects.get(pk=viewer.pk)  # no role cached on it yet
        with CaptureQueriesContext(connection) as queries:
            status, _ = _list(PoolViewSet, user, "")
        assert status == 200
        return [query["sql"].split(" FROM ")[1].split()[0] for query in queries.captured_queries]

    # the user's role (a forced authentication has no token query to carry it), the page of pools, their tracks
    assert tables() == ['"auth_group"', '"fleet_pool"', '"fleet_pooltrack"']
    cluster = cluster_create(name="dc-c", kind="local", agent_url="http://127.0.0.1:9300")
    for i in range(10):
        pool_create(name=f"p{i}", cluster=cluster, role="decode", model_version=fleet[0].model_version,
                    replicas=1)
    assert tables() == ['"auth_group"', '"fleet_pool"', '"fleet_pooltrack"']


@pytest.mark.parametrize("page_size", [2, 5, 50])
def test_without_parameters_the_first_page_comes_from_queries_compiled_once(fleet, viewer, page_size, monkeypatch):
    """All pools on the first page: 2 queries compiled once per process; more: the general path (with COUNT)."""
    monkeypatch.setattr(Pagination, "page_size", page_size)
    compiled = []
    original = SQLCompiler.as_sql

    def counted(self, *args, **kwargs):
        compiled.append(self.query.model.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SQLCompiler, "as_sql", counted)
    assert _list(PoolViewSet, viewer, "") == _list(SerializerPoolViewSet, viewer, "")  # warms up
    compiled.clear()
    with CaptureQueriesContext(connection) as queries:
        status, body = _list(PoolViewSet, viewer, "")
    tables = [query["sql"].split(" FROM ")[1].split()[0] for query in queries.captured_queries]
    fits = page_size >= 5
    assert (status, json.loads(body)["count"], json.loads(body)["next"] is None) == (200, 5, fits)
    if fits:
        assert (compiled, tables) == ([], ['"fleet_pool"', '"fleet_pooltrack"'])
    else:  # the prepared first page, then the list with its count, page and tracks
        assert tables == ['"fleet_pool"', '"fleet_pooltrack"', '"fleet_pool"', '"fleet_pool"', '"fleet_pooltrack"']
        assert compiled == ["Pool", "Pool", "PoolTrack"]


def test_a_view_with_another_filter_backend_never_takes_the_first_page_path(fleet, viewer):
    class OnlyDecode(PoolViewSet.filter_backends[0]):
        def filter_queryset(self, request, queryset, view):
            return queryset.filter(role="decode")

    class FilteredPoolViewSet(PoolViewSet):
        filter_backends = [OnlyDecode, *PoolViewSet.filter_backends[1:]]

    status, body = _list(FilteredPoolViewSet, viewer, "")
    assert (status, [pool["name"] for pool in json.loads(body)["results"]]) == (200, ["decode", "bare"])


def test_without_pagination_the_list_is_the_serializers_list(fleet, viewer):
    class Unpaged(PoolViewSet):
        pagination_class = None

    class UnpagedReference(SerializerPoolViewSet):
        pagination_class = None

    for query in ("", "?role=colocated"):
        status, body = _list(Unpaged, viewer, query)
        assert (status, body) == _list(UnpagedReference, viewer, query)
    assert [pool["name"] for pool in json.loads(body)] == ["colocated", "canary"]
