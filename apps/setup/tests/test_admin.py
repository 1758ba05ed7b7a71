"""The admin: every registered model's changelist and add page render for an admin-role user;
admin forms and actions go through the services."""

import json

import pytest
from django.contrib import admin
from django.test import Client
from django.urls import reverse

from apps.accounts.services import user_create_with_role
from apps.catalog.models import ModelVersion
from apps.conftest import GEMMA_LIKE_CONFIG, SHA_A
from apps.fleet.models import Cluster
from apps.operations.models import Action

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_browser(db) -> Client:
    created = user_create_with_role(username="root", role="admin")  # staff via the admin group, not superuser
    client = Client()
    client.force_login(created.user)
    return client


def test_every_changelist_and_add_page_renders(admin_browser, pool):
    Action.objects.create(kind="pool.scale", target_type="pool", target_id=str(pool.pk), pool=pool)
    checked = []
    for model, model_admin in admin.site._registry.items():
        meta = model._meta
        changelist = admin_browser.get(reverse(f"admin:{meta.app_label}_{meta.model_name}_changelist"))
        assert changelist.status_code == 200, meta.label
        add = admin_browser.get(reverse(f"admin:{meta.app_label}_{meta.model_name}_add"))
        can_add = model_admin.has_add_permission(changelist.wsgi_request)
        assert add.status_code == (200 if can_add else 403), meta.label
        checked.append(meta.label)
    assert {"catalog.ModelVersion", "fleet.Cluster", "fleet.ClusterLink", "fleet.Pool", "rollouts.RolloutPlan",
            "operations.Action", "auth.User", "auth.Group"} <= set(checked)


def test_change_pages_render(admin_browser, pool):
    for obj in (pool, pool.cluster, pool.model_version):
        url = reverse(f"admin:{obj._meta.app_label}_{obj._meta.model_name}_change", args=[obj.pk])
        assert admin_browser.get(url).status_code == 200
    page = admin_browser.get(reverse("admin:catalog_modelversion_change", args=[pool.model_version.pk]))
    assert "8192 tokens: 31.5 MiB vs 144.0 MiB (4.57x)" in page.content.decode()


def test_admin_add_cluster_validates_per_kind_and_saves(admin_browser):
    url = reverse("admin:fleet_cluster_add")
    bad = admin_browser.post(url, {"name": "dc-z", "kind": "local", "labels": "{}"})
    assert bad.status_code == 200
    assert "Local clusters need the agent URL." in bad.content.decode()
    ok = admin_browser.post(url, {"name": "dc-z", "kind": "local", "agent_url": "http://127.0.0.1:9300",
                                  "labels": "{}"})
    assert ok.status_code == 302
    assert Cluster.objects.get(name="dc-z").agent_url == "http://127.0.0.1:9300"


def test_admin_scale_action_creates_actions_through_the_service(admin_browser, pool):
    url = reverse("admin:fleet_pool_changelist")
    r = admin_browser.post(url, {"action": "scale_up_one", "_selected_action": [pool.pk]}, follow=True)
    assert r.status_code == 200
    action = Action.objects.get()
    assert (action.kind, action.params, action.requested_by.username) == ("pool.scale", {"replicas": 3}, "root")
    r = admin_browser.post(url, {"action": "scale_up_one", "_selected_action": [pool.pk]}, follow=True)
    assert "already has action" in r.content.decode()
    assert Action.objects.count() == 1
    r = admin_browser.post(reverse("admin:operations_action_changelist"),
                           {"action": "cancel_actions", "_selected_action": [action.pk]}, follow=True)
    action.refresh_from_db()
    assert action.status == "cancelled"


def test_admin_registers_model_version_from_pasted_config(admin_browser):
    r = admin_browser.post(reverse("admin:catalog_modelversion_add"), {
        "name": "gemma-like", "version": "v7", "weights_uri": "s3://m", "sha256": SHA_A,
        "config": json.dumps(GEMMA_LIKE_CONFIG),
    })
    assert r.status_code == 302, r.content.decode()[:2000]
    assert ModelVersion.objects.get(version="v7").num_sliding_layers == 15
    r = admin_browser.post(reverse("admin:catalog_modelversion_add"), {"name": "x", "version": "v1",
                                                                       "config": "{not json"})
    assert "Not valid JSON" in r.content.decode()
