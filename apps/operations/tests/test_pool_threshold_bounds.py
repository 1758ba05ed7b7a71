"""A pool's remote-prefill threshold bounds (issue 24): written through the API and the admin like the other pool
settings, validated with a clear 400, and carried in the routing table to the router, which parses them back."""

import pytest

from apps.fleet.models import Pool
from apps.fleet.routing_table import routing_table_content
from apps.fleet.selectors import cluster_link_list, routing_pools
from apps.fleet.services import cluster_link_create
from apps.operations.admin import PoolAdminForm
from inference_worker.router.table import RoutingTable, ThresholdBounds

MIN, MAX = "remote_threshold_min_tokens", "remote_threshold_max_tokens"


def test_an_admin_sets_and_clears_the_bounds_and_the_table_carries_only_those_set(admin_api, make_pool):
    decode, prefill = make_pool("decode"), make_pool("prefill", role="prefill")
    r = admin_api.patch(f"/api/v1/pools/{decode.pk}/", {MIN: 512, MAX: 8192}, format="json")
    assert r.status_code == 200, r.json()
    assert (r.json()[MIN], r.json()[MAX]) == (512, 8192)
    assert admin_api.get(f"/api/v1/pools/{prefill.pk}/").json()[MIN] is None
    entries = {p["name"]: p for p in routing_table_content(routing_pools(), cluster_link_list())["pools"]}
    assert (entries["decode"][MIN], entries["decode"][MAX]) == (512, 8192)
    assert MIN not in entries["prefill"] and MAX not in entries["prefill"]

    r = admin_api.patch(f"/api/v1/pools/{decode.pk}/", {MIN: None}, format="json")
    assert (r.status_code, r.json()[MIN], r.json()[MAX]) == (200, None, 8192)
    decode.refresh_from_db()
    assert (decode.remote_threshold_min_tokens, decode.remote_threshold_max_tokens) == (None, 8192)


def test_the_router_reads_the_published_bounds(make_pool, make_cluster):
    make_pool("decode", **{MIN: 100, MAX: 100})
    make_pool("prefill", role="prefill", cluster=make_cluster("dc-b"))
    cluster_link_create(source=Pool.objects.get(name="prefill").cluster, destination=Pool.objects.get(name="decode").cluster,
                        bandwidth_gbps=10.0, rtt_ms=5.0)
    content = routing_table_content(routing_pools(), cluster_link_list())
    table = RoutingTable.from_dict({"version": 1, **content})
    assert table.pool_bounds == {"decode": ThresholdBounds(100, 100)}
    assert [(x.source, x.target, x.bandwidth_gbps, x.utilisation) for x in table.links] == [
        ("dc-b", "dc-a", 10.0, 0.0)]


@pytest.mark.parametrize(("body", "errors"), [
    ({MIN: 9000, MAX: 100}, {MIN: ["Must be <= remote_threshold_max_tokens (100), got 9000: lower it or raise "
                                   "the maximum."]}),
    ({MIN: -1}, {MIN: ["Ensure this value is greater than or equal to 0."]}),
    ({MAX: "lots"}, {MAX: ["A valid integer is required."]}),
    ({MAX: 1.5}, {MAX: ["A valid integer is required."]}),
])
def test_bad_bounds_are_a_400_naming_the_field(admin_api, make_pool, body, errors):
    pool = make_pool("decode")
    r = admin_api.patch(f"/api/v1/pools/{pool.pk}/", body, format="json")
    assert (r.status_code, r.json()) == (400, errors)
    pool.refresh_from_db()
    assert (pool.remote_threshold_min_tokens, pool.remote_threshold_max_tokens) == (None, None)


def test_a_minimum_above_the_stored_maximum_is_a_400(admin_api, make_pool):
    pool = make_pool("decode", **{MAX: 1024})
    r = admin_api.patch(f"/api/v1/pools/{pool.pk}/", {MIN: 2048}, format="json")
    assert (r.status_code, r.json()) == (400, {MIN: ["Must be <= remote_threshold_max_tokens (1024), got 2048: "
                                                     "lower it or raise the maximum."]})
    r = admin_api.patch(f"/api/v1/pools/{pool.pk}/", {MIN: 2048, MAX: 4096}, format="json")
    assert (r.status_code, r.json()[MIN], r.json()[MAX]) == (200, 2048, 4096)


def test_the_bounds_need_the_role_the_other_pool_settings_need(viewer_api, operator_api, make_pool):
    """PATCH /api/v1/pools/{id}/ is the admin's (PoolViewSet.write_role), for the bounds as for every setting."""
    pool = make_pool("decode")
    for api in (viewer_api, operator_api):
        assert api.patch(f"/api/v1/pools/{pool.pk}/", {MIN: 1}, format="json").status_code == 403


def test_the_admin_form_refuses_a_minimum_above_the_maximum(make_pool):
    pool = make_pool("decode")
    data = {f: getattr(pool, f) for f in PoolAdminForm.Meta.fields}
    data.update(cluster=pool.cluster_id, model_version=pool.model_version_id, node_selector="{}", tolerations="[]",
                schedule_overrides="[]", **{MIN: 300, MAX: 200})
    form = PoolAdminForm(data, instance=pool)
    assert not form.is_valid()
    assert form.errors[MIN] == ["remote_threshold_min_tokens (300) must be <= remote_threshold_max_tokens (200)."]
    data.update(**{MIN: 200, MAX: 300})
    form = PoolAdminForm(data, instance=pool)
    assert form.is_valid(), form.errors
    form.save()
    pool.refresh_from_db()
    assert (pool.remote_threshold_min_tokens, pool.remote_threshold_max_tokens) == (200, 300)
