"""``manage.py ferry_prometheus_targets``: the observed workers as a Prometheus ``file_sd`` target file."""

import io
import json
from datetime import UTC, datetime

import pytest
from django.core.management import call_command

from apps.fleet.models import Replica
from apps.fleet.services import cluster_create, pool_create


@pytest.mark.django_db
def test_prometheus_targets_lists_observed_workers_with_endpoints(tmp_path, make_model_version):
    cluster = cluster_create(name="here", kind="local", agent_url="http://127.0.0.1:8100")
    pool = pool_create(name="decode", cluster=cluster, role="decode", model_version=make_model_version("v1"),
                       replicas=2)
    now = datetime.now(UTC)
    Replica.objects.create(pool=pool, track="stable", name="decode-stable-1", endpoint="http://127.0.0.1:41002",
                           ready=True, last_seen=now)
    Replica.objects.create(pool=pool, track="stable", name="decode-stable-0", endpoint="http://127.0.0.1:41001",
                           ready=False, last_seen=now)
    Replica.objects.create(pool=pool, track="canary", name="decode-canary-0", endpoint="", last_seen=now)
    out = tmp_path / "targets" / "workers.json"
    call_command("ferry_prometheus_targets", "--out", str(out), stdout=io.StringIO())
    assert json.loads(out.read_text()) == [
        {"targets": ["127.0.0.1:41001"],
         "labels": {"ferry_pool": "decode", "ferry_track": "stable", "ferry_replica": "decode-stable-0"}},
        {"targets": ["127.0.0.1:41002"],
         "labels": {"ferry_pool": "decode", "ferry_track": "stable", "ferry_replica": "decode-stable-1"}},
    ]
    assert [p.name for p in out.parent.iterdir()] == ["workers.json"]  # no temporary file left behind
