"""apps.core.serializers.ValuesRepresentation: a ModelSerializer's output from ``values()`` rows, or a refusal at
build time for a field a column cannot represent."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Group, User
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone
from rest_framework import serializers

from apps.core.serializers import ValuesRepresentation

pytestmark = pytest.mark.django_db


class UserSerializer(serializers.ModelSerializer):
    class Meta:
        model = User
        fields = ["id", "username", "email", "is_active", "last_login", "date_joined"]


class UserWithExtrasSerializer(serializers.ModelSerializer):
    login = serializers.CharField(source="username")
    first_group = serializers.CharField(default="")

    class Meta:
        model = User
        fields = ["login", "first_group", "last_login"]


def test_a_row_is_represented_as_the_serializer_represents_the_instance_none_included():
    joined = dt.datetime(2025, 12, 31, 23, 0, 0, 5, tzinfo=dt.UTC)
    never = User.objects.create(username="ana", email="", date_joined=joined)
    once = User.objects.create(username="bo", email="bo@example.org", is_active=False, date_joined=joined,
                               last_login=joined + dt.timedelta(seconds=1))
    representation = ValuesRepresentation(UserSerializer)
    assert representation.columns == ["id", "username", "email", "is_active", "last_login", "date_joined"]
    rows = list(User.objects.filter(pk__in=[never.pk, once.pk]).order_by("pk").values(*representation.columns))
    with timezone.override("Europe/Paris"):
        got = [representation.represent(row) for row in rows]
        assert got == UserSerializer(User.objects.order_by("pk"), many=True).data
    assert got[0] == {"id": never.pk, "username": "ana", "email": "", "is_active": True, "last_login": None,
                      "date_joined": "2026-01-01T00:00:00.000005+01:00"}


def test_renamed_and_provided_fields_are_read_and_copied():
    user = User.objects.create(username="cy")
    representation = ValuesRepresentation(UserWithExtrasSerializer, provided=["first_group"])
    assert representation.columns == ["username", "last_login"]
    row = User.objects.filter(pk=user.pk).values(*representation.columns).get()
    assert representation.represent({**row, "first_group": ["kept", "as is"]}) == {
        "login": "cy", "first_group": ["kept", "as is"], "last_login": None}
    with pytest.raises(KeyError):
        representation.represent(row)


class MethodFieldSerializer(serializers.ModelSerializer):
    shout = serializers.SerializerMethodField()

    class Meta:
        model = User
        fields = ["username", "shout"]

    def get_shout(self, user: User) -> str:
        return user.username.upper()


class DottedSourceSerializer(serializers.ModelSerializer):
    first_group = serializers.CharField(source="groups.first.name")

    class Meta:
        model = User
        fields = ["first_group"]


class PropertySerializer(serializers.ModelSerializer):
    anonymous = serializers.BooleanField(source="is_anonymous")

    class Meta:
        model = User
        fields = ["anonymous"]


class ManyToManySerializer(serializers.ModelSerializer):
    class Meta:
        model = User
        fields = ["groups"]


class NestedSerializer(serializers.ModelSerializer):
    class GroupSerializer(serializers.ModelSerializer):
        class Meta:
            model = Group
            fields = ["name"]

    groups = GroupSerializer(many=True)

    class Meta:
        model = User
        fields = ["groups"]


class ForeignKeyAsTextSerializer(serializers.ModelSerializer):
    user = serializers.CharField()

    class Meta:
        model = LogEntry
        fields = ["user"]


@pytest.mark.parametrize(("serializer_class", "message"), [
    (MethodFieldSerializer, "MethodFieldSerializer.shout (SerializerMethodField) cannot be represented"),
    (DottedSourceSerializer, "DottedSourceSerializer.first_group: source 'groups.first.name' is not a column"),
    (PropertySerializer, "PropertySerializer.anonymous: source 'is_anonymous' is not a column of User"),
    (ManyToManySerializer, "ManyToManySerializer.groups (ManyRelatedField) cannot be represented"),
    (NestedSerializer, "NestedSerializer.groups (ListSerializer) cannot be represented"),
    (ForeignKeyAsTextSerializer, "ForeignKeyAsTextSerializer.user (CharField) does not match its column "
                                 "LogEntry.user (ForeignKey)"),
])
def test_a_field_a_column_cannot_represent_is_refused_when_built(serializer_class, message):
    with pytest.raises(ImproperlyConfigured, match=re.escape(message)):
        ValuesRepresentation(serializer_class)


def test_a_provided_name_the_serializer_does_not_read_is_refused():
    with pytest.raises(ImproperlyConfigured, match=r"UserSerializer has no readable fields \['tracks'\]"):
        ValuesRepresentation(UserSerializer, provided=["tracks"])
