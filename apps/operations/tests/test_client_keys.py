"""Client API keys in the control plane (issue 19): ``/api/v1/client-keys/`` (admin only), its audit Actions, and
the routing table's ``client_keys`` (hashes of the active keys; a new version, also in the routers' Redis copy,
on every change)."""

import datetime
import hashlib
import json

import pytest
from django.utils import timezone

from apps.accounts.models import ClientApiKey
from apps.accounts.services import client_key_uses_record
from apps.fleet.routing_table_cache import PATH, _client, routing_table_cache_clear
from apps.fleet.selectors import routing_table_current
from apps.fleet.services import routing_table_publish
from apps.operations.client_keys import client_key_import, client_key_rotate
from apps.operations.models import Action
from inference_worker.router.auth import ApiKeys
from inference_worker.router.table import RoutingTable as RouterTable

URL = "/api/v1/client-keys/"
TOKEN = "svc-token-client-keys"


def sha(key):
    return hashlib.sha256(key.encode()).hexdigest()


def routed():
    return routing_table_current().content["client_keys"]


def create(api, **body):
    return api.post(URL, {"name": "team-a", **body}, format="json")


@pytest.mark.django_db
def test_create_returns_the_key_once_and_stores_only_its_sha256(admin_api):
    r = create(admin_api, rate_per_s=5, burst=10, allowed_models=["gemma-3-270m"])
    assert r.status_code == 201, r.json()
    body = r.json()
    key = body["key"]
    assert key.startswith("fck_") and len(key) == 47 and body["prefix"] == key[:12]
    assert {k: body[k] for k in ("name", "active", "rate_per_s", "burst", "allowed_models", "use_count",
                                 "revoked_at", "last_used_at")} == {
        "name": "team-a", "active": True, "rate_per_s": 5.0, "burst": 10, "allowed_models": ["gemma-3-270m"],
        "use_count": 0, "revoked_at": None, "last_used_at": None}
    row = ClientApiKey.objects.get()
    assert row.key_sha256 == sha(key) and key not in json.dumps(list(ClientApiKey.objects.values()), default=str)
    listed = admin_api.get(URL).json()
    assert listed["count"] == 1 and "key" not in listed["results"][0] and "key_sha256" not in listed["results"][0]
    assert "key" not in admin_api.get(f"{URL}{row.pk}/").json()
    assert routed() == [{"name": "team-a", "key_sha256": sha(key), "rate_per_s": 5.0, "burst": 10,
                         "models": ["gemma-3-270m"]}]
    table = routing_table_current()  # what a router makes of it
    router_keys = ApiKeys([]).with_table_keys(RouterTable.from_dict({"version": table.version,
                                                                      **table.content}).client_keys)
    found = router_keys.authenticate(f"Bearer {key}")
    assert (found.name, found.models, found.bucket.rate_per_s, found.bucket.burst) == (
        "team-a", frozenset({"gemma-3-270m"}), 5.0, 10.0)
    action = Action.objects.get()
    assert (action.kind, action.target_type, action.target_id, action.status, action.requested_by.username) == (
        "client_key.create", "client_key", str(row.pk), "succeeded", "ada")
    assert action.params == {"name": "team-a", "prefix": key[:12], "rate_per_s": 5.0, "burst": 10,
                             "allowed_models": ["gemma-3-270m"]}


@pytest.mark.django_db
@pytest.mark.parametrize("body, field, message", [
    ({"name": "Team A"}, "name", "Use lowercase letters"),
    ({"rate_per_s": 0}, "rate_per_s", "greater than or equal to 1e-09"),
    ({"rate_per_s": "fast"}, "rate_per_s", "A valid number is required."),
    ({"burst": 5}, "__all__", "burst needs rate_per_s."),
    ({"rate_per_s": 1, "burst": 0}, "burst", "greater than or equal to 1"),
    ({"allowed_models": "gemma"}, "allowed_models", 'Expected a list of items but got type "str".'),
    ({"allowed_models": ["a", "a"]}, "allowed_models", "allowed_models must name each model once"),
])
def test_bad_input_is_a_400_naming_the_field_and_creates_nothing(admin_api, body, field, message):
    r = create(admin_api, **body)
    assert r.status_code == 400, r.json()
    errors = r.json()
    assert message in " ".join(errors.get(field) or errors.get("non_field_errors", [])), errors
    assert not ClientApiKey.objects.exists() and not Action.objects.exists()


@pytest.mark.django_db
def test_a_taken_name_is_a_400(admin_api):
    assert create(admin_api).status_code == 201
    r = create(admin_api)
    assert (r.status_code, r.json()) == (400, {"name": ["client api key with this name already exists."]})


@pytest.mark.django_db
def test_permission_matrix_viewers_and_operators_get_403_admins_200(admin_api, operator_api, viewer_api, client):
    pk = create(admin_api).json()["id"]
    for api in (viewer_api, operator_api):
        assert [api.get(URL).status_code, api.get(f"{URL}{pk}/").status_code,
                create(api, name="x").status_code,
                api.patch(f"{URL}{pk}/", {"rate_per_s": 1}, format="json").status_code,
                api.post(f"{URL}{pk}/rotate/").status_code, api.post(f"{URL}{pk}/revoke/").status_code] == [403] * 6
    assert client.get(URL).status_code == 401
    assert [admin_api.get(URL).status_code, admin_api.delete(f"{URL}{pk}/").status_code,
            admin_api.put(f"{URL}{pk}/", {"name": "team-a"}, format="json").status_code] == [200, 405, 405]
    assert ClientApiKey.objects.get().revoked_at is None and Action.objects.count() == 1


@pytest.mark.django_db
def test_rotate_without_grace_refuses_the_old_secret_at_once(admin_api):
    created = create(admin_api).json()
    r = admin_api.post(f"{URL}{created['id']}/rotate/", {}, format="json")
    assert r.status_code == 200
    new = r.json()["key"]
    assert new != created["key"] and r.json()["prefix"] == new[:12] and r.json()["previous_valid_until"] is None
    assert routed() == [{"name": "team-a", "key_sha256": sha(new), "rate_per_s": None, "burst": None}]
    assert Action.objects.filter(kind="client_key.rotate").get().params["grace_s"] == 0.0


@pytest.mark.django_db
def test_rotate_with_a_grace_period_routes_both_secrets_until_it_ends(admin_api):
    created = create(admin_api).json()
    r = admin_api.post(f"{URL}{created['id']}/rotate/", {"grace_s": 600}, format="json")
    new = r.json()["key"]
    assert sorted(e["key_sha256"] for e in routed()) == sorted([sha(created["key"]), sha(new)])
    version = routing_table_current().version
    ClientApiKey.objects.update(previous_valid_until=timezone.now() - datetime.timedelta(seconds=1))
    table, changed = routing_table_publish()  # the reconcile tick's publish after the grace period
    assert changed and table.version == version + 1
    assert [e["key_sha256"] for e in routed()] == [sha(new)]
    assert admin_api.post(f"{URL}{created['id']}/rotate/", {"grace_s": 10**9}, format="json").json() == {
        "grace_s": ["Ensure this value is less than or equal to 604800."]}


@pytest.mark.django_db
def test_revoke_removes_exactly_that_keys_hash_bumps_the_version_and_a_second_revoke_is_409(admin_api):
    a = create(admin_api).json()
    b = create(admin_api, name="team-b", rate_per_s=0.5).json()
    before = routing_table_current().version
    r = admin_api.post(f"{URL}{a['id']}/revoke/")
    assert (r.status_code, r.json()["active"]) == (200, False)
    assert routing_table_current().version == before + 1
    assert routed() == [{"name": "team-b", "key_sha256": sha(b["key"]), "rate_per_s": 0.5, "burst": None}]
    again = admin_api.post(f"{URL}{a['id']}/revoke/")
    assert again.status_code == 409 and "already revoked" in again.json()["detail"]
    assert admin_api.post(f"{URL}{a['id']}/rotate/").status_code == 409
    assert admin_api.patch(f"{URL}{a['id']}/", {"rate_per_s": 2}, format="json").status_code == 409
    assert [x.kind for x in Action.objects.order_by("id")] == ["client_key.create", "client_key.create",
                                                               "client_key.revoke"]
    listed = admin_api.get(URL, {"name": "team-a"}).json()["results"]
    assert [(k["name"], k["active"]) for k in listed] == [("team-a", False)]


@pytest.mark.django_db
def test_patch_changes_limits_only_and_publishes(admin_api):
    pk = create(admin_api, rate_per_s=1).json()["id"]
    r = admin_api.patch(f"{URL}{pk}/", {"rate_per_s": 2, "burst": 4, "name": "other"}, format="json")
    assert (r.status_code, list(r.json())) == (400, ["name"])  # a rename is refused, not ignored (strict fields)
    r = admin_api.patch(f"{URL}{pk}/", {"rate_per_s": 2, "burst": 4}, format="json")
    assert (r.status_code, r.json()["name"], r.json()["rate_per_s"], r.json()["burst"]) == (200, "team-a", 2.0, 4)
    assert (routed()[0]["rate_per_s"], routed()[0]["burst"]) == (2.0, 4)
    assert Action.objects.filter(kind="client_key.update").get().params["changes"] == ["burst", "rate_per_s"]


@pytest.mark.django_db
def test_a_revoke_reaches_the_routers_redis_copy_of_the_table(admin_api, settings, client,
                                                              django_capture_on_commit_callbacks):
    settings.FERRY_SERVICE_TOKEN = TOKEN
    routing_table_cache_clear()
    try:
        with django_capture_on_commit_callbacks(execute=True):  # the copy is written after the commit
            pk = create(admin_api).json()["id"]
        with _client() as redis:
            cached = json.loads(redis.hget("ferry:routing-table", "body"))
        assert [e["name"] for e in cached["client_keys"]] == ["team-a"]
        with django_capture_on_commit_callbacks(execute=True):
            admin_api.post(f"{URL}{pk}/revoke/")
        with _client() as redis:
            after = json.loads(redis.hget("ferry:routing-table", "body"))
        assert (after["version"], after["client_keys"]) == (cached["version"] + 1, [])
        service = client.get(PATH, HTTP_AUTHORIZATION=f"Bearer {TOKEN}")  # the view agrees with the copy
        assert service.json() == after
    finally:
        routing_table_cache_clear()


@pytest.mark.django_db
def test_viewers_read_the_routing_table_without_the_client_keys(admin_api, viewer_api):
    create(admin_api)
    body = viewer_api.get(PATH).json()
    assert "client_keys" not in body and body["version"] == routing_table_current().version


@pytest.mark.django_db
def test_import_is_idempotent_and_a_new_hash_replaces_the_old(admin_api):
    row, changed = client_key_import(name="make-run", key_sha256=sha("k1"), requester="ferry_setup")
    assert changed and routed() == [{"name": "make-run", "key_sha256": sha("k1"), "rate_per_s": None, "burst": None}]
    assert client_key_import(name="make-run", key_sha256=sha("k1"), requester="ferry_setup")[1] is False
    assert client_key_import(name="make-run", key_sha256=sha("k2"), requester="ferry_setup")[1] is True
    assert [e["key_sha256"] for e in routed()] == [sha("k2")]
    assert [(a.kind, a.params["requester"]) for a in Action.objects.order_by("id")] == [
        ("client_key.import", "ferry_setup")] * 2


@pytest.mark.django_db
def test_uses_are_added_per_key_and_last_use_never_goes_back(admin_api):
    create(admin_api)
    t1 = timezone.now()
    assert client_key_uses_record(uses={"team-a": 3, "file-only": 5, "idle": 0}, at=t1) == 1
    assert client_key_uses_record(uses={"team-a": 2}, at=t1 - datetime.timedelta(minutes=1)) == 1
    row = ClientApiKey.objects.get()
    assert (row.use_count, row.last_used_at) == (5, t1)
    with pytest.raises(Exception, match="grace_s must be a number"):
        client_key_rotate(client_key=row, grace_s=float("nan"))


@pytest.mark.django_db
def test_admin_add_shows_the_key_once_and_revoke_action_goes_through_the_service(admin_api):
    from django.test import Client

    browser = Client()
    browser.force_login(admin_api.user)
    r = browser.post("/admin/accounts/clientapikey/add/", {"name": "team-z", "rate_per_s": "2", "burst": "3",
                                                          "allowed_models": "[]"}, follow=True)
    assert r.status_code == 200
    shown = [str(m) for m in r.context["messages"]]
    row = ClientApiKey.objects.get(name="team-z")
    key = shown[0].split(": ")[1].split(" ")[0]
    assert shown[0].startswith("Client key team-z: fck_") and sha(key) == row.key_sha256
    assert (row.rate_per_s, row.burst) == (2.0, 3)
    browser.post("/admin/accounts/clientapikey/", {"action": "revoke_keys", "_selected_action": [row.pk]})
    assert ClientApiKey.objects.get().revoked_at is not None and routed() == []
    assert [a.kind for a in Action.objects.order_by("id")] == ["client_key.create", "client_key.revoke"]


@pytest.mark.django_db
def test_list_costs_the_same_queries_for_one_key_or_many(admin_api, django_assert_num_queries):
    create(admin_api)
    with django_assert_num_queries(2):  # authentication (token, user, role in one), the page
        assert admin_api.get(URL).json()["count"] == 1
    for name in ("team-b", "team-c", "team-d"):
        create(admin_api, name=name)
    with django_assert_num_queries(2):
        assert admin_api.get(URL).json()["count"] == 4
