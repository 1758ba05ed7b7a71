"""API tokens are stored hashed (django-rest-knox, SHA-512), rotate, and tokens from before keep working."""

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from knox.models import AuthToken
from rest_framework.test import APIClient

from apps.accounts.services import user_create_with_role

pytestmark = pytest.mark.django_db


def _status(token: str) -> int:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client.get("/api/v1/pools/").status_code


def _database_text() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT digest || ' ' || token_key FROM knox_authtoken")
        return " ".join(row[0] for row in cursor.fetchall())


def test_token_is_stored_only_as_a_digest_and_rotation_revokes_it():
    created = user_create_with_role(username="tess", role="viewer")
    assert len(created.token) == 64 and _status(created.token) == 200
    assert created.token not in _database_text()  # only its SHA-512 and 15-character lookup key
    assert _status(created.token[:-1] + ("0" if created.token[-1] != "0" else "1")) == 401
    out = StringIO()
    call_command("ferry_user", "--rotate-token", "tess", stdout=out)
    new = out.getvalue().split("token: ")[1].strip()
    assert (_status(created.token), _status(new), AuthToken.objects.filter(user=created.user).count()) == (401, 200, 1)


def test_migration_moves_a_clear_text_token_in_place_and_drops_the_clear_text_table():
    """A token issued before this release (DRF authtoken: 40 hex characters in clear) keeps working."""
    user = user_create_with_role(username="legacy", role="operator").user
    executor = MigrationExecutor(connection)
    executor.migrate([("accounts", None)])  # before the move
    legacy = "0123456789abcdef0123456789abcdef01234567"
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE authtoken_token (key varchar(40) PRIMARY KEY, created timestamptz NOT NULL, "
                       "user_id integer NOT NULL)")
        cursor.execute("INSERT INTO authtoken_token VALUES (%s, now(), %s)", [legacy, user.pk])
    executor = MigrationExecutor(connection)
    executor.migrate([("accounts", "0001_api_tokens_hashed")])
    assert "authtoken_token" not in connection.introspection.table_names()
    assert legacy not in _database_text()
    assert _status(legacy) == 200


def test_a_request_costs_one_token_query_and_an_expired_token_is_refused_and_deleted(django_assert_num_queries):
    """knox's own authentication read every token of the user on each request (its cleanup of expired ones);
    Ferry's reads the request's token with its user, once, and still refuses and deletes an expired token."""
    from datetime import timedelta

    from django.utils import timezone
    from rest_framework.test import APIRequestFactory

    from apps.accounts.authentication import TokenAuthentication

    created = user_create_with_role(username="quinn", role="viewer")
    user_create_with_role(username="other", role="viewer")
    AuthToken.objects.create(created.user)  # a second token of the same user
    request = APIRequestFactory().get("/", HTTP_AUTHORIZATION=f"Token {created.token}")
    with django_assert_num_queries(1):
        user, _ = TokenAuthentication().authenticate(request)
    assert user == created.user
    AuthToken.objects.filter(user=created.user).update(expiry=timezone.now() - timedelta(seconds=1))
    assert _status(created.token) == 401
    assert AuthToken.objects.filter(user=created.user).count() == 1  # the expired one used is deleted
