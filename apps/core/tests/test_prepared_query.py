"""apps.core.queries.PreparedQuery: the ORM's query compiled once, run with new values, rows as values() gives."""

from __future__ import annotations

import datetime as dt

import pytest
from django.contrib.auth.models import Group, User
from django.contrib.postgres.aggregates import ArrayAgg
from django.core.exceptions import ImproperlyConfigured
from django.db import connection
from django.db.models import JSONField, Q, Value
from django.db.models.functions import Cast
from django.db.models.sql.compiler import SQLCompiler
from django.test.utils import CaptureQueriesContext

from apps.core.queries import PreparedQuery

pytestmark = pytest.mark.django_db


def users_named(*, username: str, other: str, group: str):
    """A join, an aggregate with a FILTER, a constant with a converter (JSON decoding) and a datetime column."""
    return (User.objects.filter(username__in=[username, other]).order_by("id")
            .values("id", "username", "date_joined")
            .annotate(groups=ArrayAgg("groups__name", filter=Q(groups__name=group), default=[], order_by="groups__name"),
                      payload=Cast(Value('{"a": [1, 2.5, null]}'), output_field=JSONField())))


@pytest.fixture
def people():
    admins, viewers = Group.objects.create(name="admins"), Group.objects.create(name="viewers")
    ana = User.objects.create(username="ana", date_joined=dt.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=dt.UTC))
    ana.groups.add(admins, viewers)
    User.objects.create(username="ana-twin")
    User.objects.create(username="bo").groups.add(viewers)


def test_rows_are_what_the_querysets_values_give_for_any_parameter_values(people):
    prepared = PreparedQuery(users_named)
    for username, other, group in [("ana", "ana-twin", "admins"), ("ana", "bo", "viewers"), ("bo", "", "viewers"),
                                   ("bo", "bo", "admins"), ("nobody", "", "admins"), ("o'brien; --", "%", "admins")]:
        values = {"username": username, "other": other, "group": group}
        assert prepared.rows(**values) == list(users_named(**values))
    ana, twin = prepared.rows(username="ana", other="ana-twin", group="admins")
    assert (ana["username"], ana["groups"], ana["payload"], ana["date_joined"]) == (
        "ana", ["admins"], {"a": [1, 2.5, None]}, dt.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=dt.UTC))
    assert (twin["username"], twin["groups"]) == ("ana-twin", [])


def test_the_query_is_compiled_once_and_each_run_is_one_logged_query(people, monkeypatch):
    compiled = []
    original = SQLCompiler.as_sql

    def counted(self, *args, **kwargs):
        compiled.append(self.query.model.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SQLCompiler, "as_sql", counted)
    prepared = PreparedQuery(users_named)
    with CaptureQueriesContext(connection) as queries:
        for username in ("ana", "bo", "ana"):
            prepared.rows(username=username, other="", group="viewers")
    assert (compiled, len(queries)) == (["User"], 3)


def test_a_build_that_is_not_a_values_query_or_alters_a_parameter_is_refused():
    def instances(*, username: str):
        return User.objects.filter(username=username)

    def contains(*, username: str):
        return User.objects.filter(username__contains=username).values("id")

    def unused(*, username: str):
        return User.objects.values("id")

    def suffixed(*, username: str):
        return User.objects.filter(username=f"{username}-twin").values("id")

    with pytest.raises(ImproperlyConfigured, match=r"instances must return a QuerySet.values\(...\) query"):
        PreparedQuery(instances).rows(username="ana")
    with pytest.raises(ImproperlyConfigured, match=r"contains: parameters \['username'\] do not reach the SQL"):
        PreparedQuery(contains).rows(username="ana")
    with pytest.raises(ImproperlyConfigured, match=r"unused: parameters \['username'\] do not reach the SQL"):
        PreparedQuery(unused).rows(username="ana")
    with pytest.raises(ImproperlyConfigured, match=r"suffixed: parameters \['username'\] do not reach the SQL"):
        PreparedQuery(suffixed).rows(username="ana")
    with pytest.raises(TypeError, match=r"expected parameters \['group', 'other', 'username'\], got \['user'\]"):
        PreparedQuery(users_named).rows(user="ana")
