"""Pool worker credentials in the control plane (issue 19): generated per pool (and by the data migration for
existing pools), never in the public pool API or pages, in the routing table only for the service token, rotated
by an admin verb that rolls the pool."""

from __future__ import annotations

import importlib

import pytest
from django.apps import apps as django_apps
from django.test import Client

from apps.fleet.models import Pool
from apps.fleet.routing_table import content_redacted
from apps.operations.backends import track_spec
from apps.operations.models import Action

pytestmark = pytest.mark.django_db
SERVICE_TOKEN = "svc-token-0123456789"


def test_every_pool_gets_its_own_url_safe_256_bit_token(make_pool):
    a, b = make_pool("decode-a"), make_pool("decode-b")
    assert len(a.worker_token) == len(b.worker_token) == 43 and a.worker_token != b.worker_token
    assert a.worker_token_previous == ""


def test_the_data_migration_gives_each_existing_pool_a_distinct_token(make_pool):
    make_pool("decode-a"), make_pool("decode-b")
    Pool.objects.update(worker_token="")  # as the rows were before 0008
    migration = importlib.import_module("apps.fleet.migrations.0008_pool_worker_token")
    migration.give_every_pool_a_token(django_apps, None)
    tokens = list(Pool.objects.values_list("worker_token", flat=True))
    assert len(set(tokens)) == 2 and all(len(t) == 43 for t in tokens)


def test_the_public_pool_api_and_the_pool_page_never_show_the_token(pool, admin_api, viewer_api):
    for client in (admin_api, viewer_api):
        for url in ("/api/v1/pools/", f"/api/v1/pools/{pool.pk}/"):
            response = client.get(url)
            assert response.status_code == 200
            assert pool.worker_token not in response.content.decode()
            assert "worker_token" not in response.content.decode()
    page = Client()
    page.force_login(admin_api.user)
    for url in (f"/pools/{pool.pk}/", "/", f"/admin/fleet/pool/{pool.pk}/change/"):
        response = page.get(url)
        assert response.status_code == 200, url
        assert pool.worker_token not in response.content.decode(), url


def test_the_routing_table_carries_the_token_for_the_service_token_only(pool, client, settings, viewer_api):
    settings.FERRY_SERVICE_TOKEN = SERVICE_TOKEN
    router = client.get("/api/v1/routing-table/", HTTP_AUTHORIZATION=f"Bearer {SERVICE_TOKEN}").json()
    assert router["pools"] == [{"name": "decode", "role": "decode", "datacenter": "dc-a",
                                "worker_token": pool.worker_token, "replicas": []}]
    viewer = viewer_api.get("/api/v1/routing-table/")
    assert viewer.json()["pools"] == [{"name": "decode", "role": "decode", "datacenter": "dc-a", "replicas": []}]
    assert pool.worker_token not in viewer.content.decode()
    assert content_redacted({"pools": [{"name": "p", "worker_token": "x", "worker_token_previous": "y"}]}) == {
        "pools": [{"name": "p"}]}


def test_admin_rotation_keeps_the_previous_token_and_rolls_the_pool(pool, admin_api, operator_api, client, settings):
    settings.FERRY_SERVICE_TOKEN = SERVICE_TOKEN
    old = pool.worker_token
    assert operator_api.post(f"/api/v1/pools/{pool.pk}/rotate-worker-token/").status_code == 403
    response = admin_api.post(f"/api/v1/pools/{pool.pk}/rotate-worker-token/", HTTP_IDEMPOTENCY_KEY="rot-1")
    assert response.status_code == 201
    body = response.json()
    assert (body["kind"], body["status"], body["params"]) == (
        "pool.apply", "pending", {"reason": "worker token rotated", "keep_previous": True})
    pool.refresh_from_db()
    assert pool.worker_token_previous == old and pool.worker_token not in (old, "")
    assert old not in response.content.decode() and pool.worker_token not in response.content.decode()
    # the replay of the same request rotates nothing
    again = admin_api.post(f"/api/v1/pools/{pool.pk}/rotate-worker-token/", HTTP_IDEMPOTENCY_KEY="rot-1")
    assert (again.status_code, again.json()["id"]) == (200, body["id"])
    assert Pool.objects.get(pk=pool.pk).worker_token == pool.worker_token
    # the pool.apply Action's spec gives workers both tokens; routers get both in the table
    spec = track_spec(pool, pool.tracks.get())
    assert (spec.worker_token, spec.worker_token_previous) == (pool.worker_token, old)
    table = client.get("/api/v1/routing-table/", HTTP_AUTHORIZATION=f"Bearer {SERVICE_TOKEN}").json()
    assert (table["pools"][0]["worker_token"], table["pools"][0]["worker_token_previous"]) == (pool.worker_token, old)


def test_rotation_without_grace_drops_the_old_token_and_a_busy_pool_rotates_nothing(pool, admin_api):
    Action.objects.all().delete()
    response = admin_api.post(f"/api/v1/pools/{pool.pk}/rotate-worker-token/", {"keep_previous": False},
                              format="json")
    assert response.status_code == 201
    pool.refresh_from_db()
    assert pool.worker_token_previous == ""
    current = pool.worker_token
    busy = admin_api.post(f"/api/v1/pools/{pool.pk}/rotate-worker-token/")  # the first pool.apply is pending
    assert busy.status_code == 409
    assert Pool.objects.get(pk=pool.pk).worker_token == current
    bad = admin_api.post(f"/api/v1/pools/{pool.pk}/rotate-worker-token/", {"keep_previous": "maybe"}, format="json")
    assert bad.status_code == 400
