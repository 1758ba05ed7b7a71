"""TokenAuthentication: the (knox, hashed) token, its user and the user's role in one query."""

import pytest
from django.contrib.auth.models import Group, User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from knox.models import AuthToken
from rest_framework.exceptions import AuthenticationFailed

from apps.accounts.authentication import TokenAuthentication
from apps.accounts.roles import user_role

pytestmark = pytest.mark.django_db


def _token(username, *groups, superuser=False, active=True):
    user = User.objects.create_user(username, is_superuser=superuser, is_active=active)
    for name in groups:
        user.groups.add(Group.objects.get_or_create(name=name)[0])
    return AuthToken.objects.create(user)[1]


@pytest.mark.parametrize(("groups", "superuser", "role"), [
    (("viewer",), False, "viewer"),
    (("viewer", "operator"), False, "operator"),
    (("admin", "service"), False, "admin"),
    (("service",), False, None),
    ((), False, None),
    ((), True, "admin"),
])
def test_the_role_comes_with_the_token_in_one_query(groups, superuser, role):
    key = _token("u", *groups, superuser=superuser)
    with CaptureQueriesContext(connection) as queries:
        user, token = TokenAuthentication().authenticate_credentials(key.encode())
        assert (user.username, token.token_key, user_role(user)) == ("u", key[:15], role)
    assert len(queries) == 1


def test_unknown_tokens_and_inactive_users_are_refused_with_drfs_messages():
    inactive = _token("gone", "admin", active=False)
    with pytest.raises(AuthenticationFailed, match="Invalid token."):
        TokenAuthentication().authenticate_credentials(b"no-such-token")
    with pytest.raises(AuthenticationFailed, match="User inactive or deleted."):
        TokenAuthentication().authenticate_credentials(inactive.encode())


def test_the_api_answers_by_the_tokens_role(client):
    viewer, nobody = _token("v", "viewer"), _token("n")
    assert client.get("/api/v1/clusters/", HTTP_AUTHORIZATION=f"Token {viewer}").status_code == 200
    assert client.get("/api/v1/clusters/", HTTP_AUTHORIZATION=f"Token {nobody}").status_code == 403
    assert client.get("/api/v1/clusters/", HTTP_AUTHORIZATION="Token wrong").status_code == 401
    created = client.post("/api/v1/clusters/", {"name": "x", "kind": "local", "agent_url": "http://127.0.0.1:9300"},
                          content_type="application/json", HTTP_AUTHORIZATION=f"Token {viewer}")
    assert created.status_code == 403


def test_the_token_and_its_user_equal_the_orms_field_by_field_and_need_no_further_query(django_assert_num_queries):
    key = _token("u", "operator")
    User.objects.filter(username="u").update(first_name="Ünal", email="u@example.org", is_staff=True,
                                             last_login="2026-01-02T03:04:05.000006Z")
    AuthToken.objects.filter(token_key=key[:15]).update(expiry="2999-01-01T00:00:00Z")
    with django_assert_num_queries(1):
        user, token = TokenAuthentication().authenticate_credentials(key.encode())
        assert (token.user is user, user.username, user_role(user)) == (True, "u", "operator")
    orm_token = AuthToken.objects.select_related("user").get(token_key=key[:15])
    for model, got, want in ((AuthToken, token, orm_token), (User, user, orm_token.user)):
        for field in model._meta.concrete_fields:
            assert (field.attname, getattr(got, field.attname)) == (field.attname, getattr(want, field.attname))
        assert (got._state.adding, got._state.db) == (False, "default")
