"""This session's write endpoints refuse fields they would not write (400 naming each, nothing changed), like the
other APIs (:class:`apps.core.serializers.StrictFieldsMixin`): before, ``PATCH /api/v1/client-keys/{id}/
{"name": ...}`` answered 200 and renamed nothing, a client's own ``key`` on create was dropped for a generated one,
and the rotate / silence verbs ignored misspelt options (``{"keep_prevous": false}`` rotated keeping the old token)."""

from __future__ import annotations

import pytest

from apps.accounts.models import ClientApiKey
from apps.operations.models import Action
from apps.telemetry.models import Alert, AlertRule, AlertSilence

pytestmark = pytest.mark.django_db
UNKNOWN = ["Unknown field: it is not part of this resource."]


def test_client_key_create_refuses_a_key_of_the_clients_own_and_read_only_fields(admin_api):
    r = admin_api.post("/api/v1/client-keys/", {"name": "team-a", "key": "my-own-key", "use_count": 5}, format="json")
    assert (r.status_code, r.json()) == (400, {"key": UNKNOWN, "use_count": ["This field is read-only."]})
    assert ClientApiKey.objects.count() == 0


def test_client_key_update_refuses_a_rename_instead_of_ignoring_it(admin_api):
    pk = admin_api.post("/api/v1/client-keys/", {"name": "team-a"}, format="json").json()["id"]
    r = admin_api.patch(f"/api/v1/client-keys/{pk}/", {"name": "team-b", "burst": 2}, format="json")
    assert (r.status_code, r.json()) == (400, {"name": [
        "A key's name cannot change: create a key with the new name, then revoke this one."]})
    assert list(ClientApiKey.objects.values_list("name", "burst")) == [("team-a", None)]
    r = admin_api.post(f"/api/v1/client-keys/{pk}/rotate/", {"grace": 60}, format="json")
    assert (r.status_code, r.json()) == (400, {"grace": UNKNOWN})
    assert ClientApiKey.objects.get().rotated_at is None


def test_worker_token_rotation_refuses_a_misspelt_option(admin_api, pool):
    token = pool.worker_token
    r = admin_api.post(f"/api/v1/pools/{pool.pk}/rotate-worker-token/", {"keep_prevous": False}, format="json")
    assert (r.status_code, r.json()) == (400, {"keep_prevous": UNKNOWN})
    pool.refresh_from_db()
    assert (pool.worker_token, Action.objects.count()) == (token, 0)


def test_alert_silence_refuses_an_unknown_field(operator_api, pool):
    rule = AlertRule.objects.get(name="kv-cache-usage-critical", pool=None)
    alert = Alert.objects.create(rule=rule, pool=pool, severity="critical", started_at="2026-12-01T12:00:00Z",
                                 value=0.97)
    r = operator_api.post(f"/api/v1/alerts/{alert.pk}/silence/", {"duration_s": 600, "until": "tomorrow"},
                          format="json")
    assert (r.status_code, r.json()) == (400, {"until": UNKNOWN})
    assert AlertSilence.objects.count() == 0


def test_a_boolean_is_not_a_number_of_requests_per_second_or_seconds_of_grace(admin_api):
    """DRF's FloatField took ``true`` as 1.0: a key got a rate of 1 request/s, a rotation a 1 s grace."""
    r = admin_api.post("/api/v1/client-keys/", {"name": "team-a", "rate_per_s": True}, format="json")
    assert (r.status_code, r.json()) == (400, {"rate_per_s": ["A valid number is required."]})
    pk = admin_api.post("/api/v1/client-keys/", {"name": "team-a"}, format="json").json()["id"]
    r = admin_api.post(f"/api/v1/client-keys/{pk}/rotate/", {"grace_s": True}, format="json")
    assert (r.status_code, r.json()) == (400, {"grace_s": ["A valid number is required."]})
    assert ClientApiKey.objects.get().rotated_at is None
