"""The demo fleet (apps.setup.demo) and ``manage.py ferry_setup``: what they create, and that re-running creates nothing."""

import hashlib
import io
import json

import pytest
from django.core.management import call_command
from django_celery_beat.models import PeriodicTask

from apps.catalog.models import ModelVersion
from apps.fleet.models import Cluster, ClusterLink, Pool
from apps.setup.demo import demo_fleet_load
from apps.telemetry.models import AlertRule
from inference_worker.model.prepare import read_manifest
from inference_worker.registry import model_cache_dir

pytestmark = pytest.mark.django_db


def test_demo_fleet_has_two_datacenters_linked_at_10_gbps_and_two_model_artifacts():
    fleet = demo_fleet_load(agent_url="http://127.0.0.1:8100", replicas=1)
    assert sorted(fleet.created) == sorted([
        "model version gemma-3-270m:v1", "model version gemma-3-270m:v2", "cluster dc-prefill", "cluster dc-decode",
        "link dc-prefill->dc-decode", "link dc-decode->dc-prefill",
        "pool dc-prefill/prefill (prefill, 1 replica(s))", "pool dc-decode/decode (decode, 1 replica(s))",
    ])
    v1, v2 = ModelVersion.objects.get(version="v1"), ModelVersion.objects.get(version="v2")
    assert (v1.sha256, v2.sha256) == (read_manifest(model_cache_dir() / "gemma-3-270m")["sha256"],
                                      read_manifest(model_cache_dir() / "gemma-3-270m@bf16")["sha256"])
    assert v1.sha256 != v2.sha256
    assert (v1.dtype, v2.dtype) == ("float32", "bfloat16")
    assert (v1.num_sliding_layers, v1.num_full_layers, v1.sliding_window) == (15, 3, 512)
    assert list(Cluster.objects.values_list("name", "kind", "datacenter", "agent_url")) == [
        ("dc-decode", "local", "dc-decode", "http://127.0.0.1:8100"),
        ("dc-prefill", "local", "dc-prefill", "http://127.0.0.1:8100"),
    ]
    assert sorted(ClusterLink.objects.values_list("source__name", "destination__name", "bandwidth_gbps", "rtt_ms")) == [
        ("dc-decode", "dc-prefill", 10.0, 2.0), ("dc-prefill", "dc-decode", 10.0, 2.0)]
    pools = {p.name: p for p in Pool.objects.select_related("cluster", "model_version")}
    assert {n: (p.cluster.name, p.role, p.model_version.version, p.replicas, p.drain_timeout_s)
            for n, p in pools.items()} == {"prefill": ("dc-prefill", "prefill", "v1", 1, 60),
                                           "decode": ("dc-decode", "decode", "v1", 1, 60)}
    ttft = AlertRule.objects.get(pool=pools["decode"], name="ttft-p99-high")
    assert (ttft.threshold, ttft.enabled) == (10.0, True)
    assert AlertRule.objects.get(pool=pools["prefill"], name="gpu-utilization-low").enabled is False


def test_reloading_the_demo_creates_nothing_keeps_replicas_and_follows_the_agent_port():
    demo_fleet_load(agent_url="http://127.0.0.1:8100", replicas=1)
    Pool.objects.get(name="decode").tracks.update(replicas=2)  # an operator scaled it
    counts = [m.objects.count() for m in (ModelVersion, Cluster, ClusterLink, Pool, AlertRule)]
    again = demo_fleet_load(agent_url="http://127.0.0.1:9100", replicas=1)
    assert again.created == []
    assert [m.objects.count() for m in (ModelVersion, Cluster, ClusterLink, Pool, AlertRule)] == counts
    assert again.pools["decode"].replicas == 2
    assert set(Cluster.objects.values_list("agent_url", flat=True)) == {"http://127.0.0.1:9100"}


def test_ferry_setup_creates_users_once_periodic_tasks_and_prints_a_json_summary():
    out = io.StringIO()
    call_command("ferry_setup", "--json", "--replicas", "0", stdout=out)
    summary = json.loads(out.getvalue().splitlines()[-1].removeprefix("FERRY_SETUP_JSON "))
    users = {u["username"]: u for u in summary["users"]}
    assert (users["operator"]["role"], users["admin"]["role"]) == ("operator", "admin")
    assert len(users["operator"]["password"]) >= 12 and len(users["operator"]["token"]) == 64
    assert {name: p["replicas"] for name, p in summary["pools"].items()} == {"prefill": 0, "decode": 0}
    assert set(PeriodicTask.objects.values_list("task", flat=True)) >= {
        "operations.reconcile", "operations.autoscale", "rollouts.tick", "telemetry.prune_alerts"}
    out = io.StringIO()
    call_command("ferry_setup", "--json", "--no-demo", stdout=out)
    again = {u["username"]: u for u in json.loads(out.getvalue().splitlines()[-1].split(" ", 1)[1])["users"]}
    # tokens are stored hashed: a later run cannot print them (README: ferry_user --rotate-token)
    assert again["operator"] == {**users["operator"], "password": None, "token": None}
    assert PeriodicTask.objects.filter(task="rollouts.tick").count() == 1


def test_ferry_setup_stores_the_launchers_client_key_as_a_hash():
    """Issue 19: ``make run``'s client key becomes the control plane's ``make-run`` key (hash only), routed to the
    routers in the table (reruns and a new hash: ``test_import_is_idempotent_and_a_new_hash_replaces_the_old``)."""
    from apps.accounts.models import ClientApiKey
    from apps.fleet.selectors import routing_table_current

    digest = hashlib.sha256(b"fck_launcher-key").hexdigest()
    out = io.StringIO()
    call_command("ferry_setup", "--no-demo", "--client-key-sha256", digest, stdout=out)
    assert "client API key make-run: stored (hash only)" in out.getvalue()
    assert list(ClientApiKey.objects.values_list("name", "key_sha256", "revoked_at")) == [("make-run", digest, None)]
    assert routing_table_current().content["client_keys"] == [
        {"name": "make-run", "key_sha256": digest, "rate_per_s": None, "burst": None}]
