"""Roles, tokens and the ``ferry_user`` command."""

from io import StringIO

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.core.management.base import CommandError
from rest_framework.test import APIClient

from apps.accounts.roles import role_at_least, user_role

pytestmark = pytest.mark.django_db


def test_role_groups_exist_after_migrate_with_admin_permissions():
    assert sorted(Group.objects.values_list("name", flat=True)) == ["admin", "operator", "viewer"]
    admin_perms = set(Group.objects.get(name="admin").permissions.values_list("codename", flat=True))
    assert {"add_pool", "delete_cluster", "change_modelversion", "view_action", "add_user"} <= admin_perms
    viewer_perms = set(Group.objects.get(name="viewer").permissions.values_list("codename", flat=True))
    assert {"view_action", "view_cluster", "view_clusterlink", "view_modelversion", "view_pool", "view_pooltrack",
            "view_rolloutplan"} <= viewer_perms
    assert all(codename.startswith("view_") for codename in viewer_perms)


def test_ferry_user_command_prints_password_and_a_working_token():
    out = StringIO()
    call_command("ferry_user", "--role", "operator", "olga", stdout=out)
    lines = dict(line.split(": ", 1) for line in out.getvalue().splitlines())
    assert (lines["user"], lines["role"]) == ("olga", "operator")
    user = User.objects.get(username="olga")
    assert user.check_password(lines["password"]) and not user.is_staff
    assert user_role(user) == "operator"
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {lines['token']}")
    assert client.get("/api/v1/pools/").status_code == 200


def test_ferry_user_existing_user_fails_unless_if_missing():
    call_command("ferry_user", "--role", "admin", "root2", stdout=StringIO())
    with pytest.raises(CommandError, match="User 'root2' already exists."):
        call_command("ferry_user", "--role", "admin", "root2", stdout=StringIO())
    out = StringIO()
    call_command("ferry_user", "--role", "admin", "--if-missing", "root2", stdout=out)
    assert out.getvalue().startswith("user root2 exists (password and token unchanged;")
    assert User.objects.get(username="root2").is_staff


def test_role_hierarchy(viewer_api, operator_api, admin_api):
    assert [role_at_least(viewer_api.user, r) for r in ("viewer", "operator", "admin")] == [True, False, False]
    assert [role_at_least(operator_api.user, r) for r in ("viewer", "operator", "admin")] == [True, True, False]
    assert [role_at_least(admin_api.user, r) for r in ("viewer", "operator", "admin")] == [True, True, True]
    with pytest.raises(ValueError, match="unknown role 'root'"):
        role_at_least(admin_api.user, "root")


def test_user_without_role_gets_403_and_anonymous_401(client):
    User.objects.create_user("nobody", password="x")
    c = APIClient()
    c.force_authenticate(User.objects.get(username="nobody"))
    r = c.get("/api/v1/clusters/")
    assert r.status_code == 403
    assert r.json()["detail"] == "This request needs the viewer role; you have no role."
    assert client.get("/api/v1/clusters/").status_code == 401
    assert APIClient().get("/api/v1/clusters/", HTTP_AUTHORIZATION="Token nope").status_code == 401


def test_session_auth_works_for_the_browser(client, viewer_api):
    client.force_login(viewer_api.user)
    assert client.get("/api/v1/clusters/").status_code == 200
