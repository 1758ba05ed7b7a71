"""The model versions page: which pools (and tracks) run each version, and the register form for admins only."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from apps.accounts.services import user_create_with_role
from apps.dashboard import selectors
from apps.fleet.models import PoolTrack

pytestmark = pytest.mark.django_db


def test_each_version_lists_the_pools_and_tracks_that_run_it_in_two_queries(make_pool, make_model_version,
                                                                           model_version):
    decode, prefill = make_pool("decode", replicas=3), make_pool("prefill", role="prefill", replicas=1)
    v2, v3 = make_model_version("v2"), make_model_version("v3")
    PoolTrack.objects.create(pool=decode, name="canary", model_version=v2, replicas=1, weight=25)
    with CaptureQueriesContext(connection) as queries:
        running = selectors.model_version_pools()
    assert len(queries) == 2
    cluster = decode.cluster.name
    assert running == {
        model_version.pk: [
            {"id": decode.pk, "label": f"{cluster}/decode", "role": "decode",
             "tracks": [{"name": "stable", "replicas": 3, "weight": 100}]},
            {"id": prefill.pk, "label": f"{cluster}/prefill", "role": "prefill",
             "tracks": [{"name": "stable", "replicas": 1, "weight": 100}]}],
        v2.pk: [{"id": decode.pk, "label": f"{cluster}/decode", "role": "decode",
                 "tracks": [{"name": "canary", "replicas": 1, "weight": 25}]}],
    }
    assert v3.pk not in running


@pytest.mark.parametrize(("role", "has_form"), [("viewer", False), ("operator", False), ("admin", True)])
def test_only_admins_get_the_register_form(pool, role, has_form):
    created = user_create_with_role(username=f"u-{role}", role=role, password="correct-horse-battery-9")
    client = Client()
    client.force_login(created.user)
    page = client.get("/model-versions/").content.decode()
    assert ('id="mv-register"' in page, "model_versions.js" in page) == (has_form, has_form)
    assert f"{pool.cluster.name}/decode</a> (decode; stable 2 replicas, 100%)" in page
