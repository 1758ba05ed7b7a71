"""Bounded numeric query parameters: filtersets and the few hand-read parameters answer 400, never 500 or 200.

A number in a query string is checked against the range of what it is compared with before it reaches the
database: an integer filter on an integer column (or on a relation whose key is an integer) accepts only whole
numbers within that column's range on the connected database (``connection.ops.integer_field_range``, e.g.
-2**63..2**63-1 for a ``BigAutoField`` on PostgreSQL), and a float filter only finite values. Out of range or
malformed -> 400 with the field's message (``?pool=9223372036854775808``, ``?cluster=-4.2e19``, ``1e400``).
The bounds are written into the OpenAPI schema (``minimum``/``maximum``) so clients and the API fuzz test see
them.
"""

from __future__ import annotations

import math

import django_filters
from django import forms
from django.db import connection, models
from django_filters.rest_framework import DjangoFilterBackend
from django_filters.utils import get_model_field
from drf_spectacular.drainage import set_override
from rest_framework.exceptions import ValidationError

INTEGER_FIELDS = (models.IntegerField, models.AutoField)


def integer_range(model_field: models.Field) -> tuple[int, int]:
    """(min, max) an integer column holds on the connected database; a relation uses its target's key."""
    if model_field.is_relation:
        model_field = model_field.target_field
    low, high = connection.ops.integer_field_range(model_field.get_internal_type())
    # Unbounded on a backend that reports None: fall back to the signed 64-bit range every engine Ferry uses has.
    return (-(2**63) if low is None else low, 2**63 - 1 if high is None else high)


def _target_field(filterset_model: type[models.Model] | None, filter_: django_filters.Filter) -> models.Field | None:
    if filterset_model is None or not filter_.field_name:
        return None
    return get_model_field(filterset_model, filter_.field_name)


class IntegerFilter(django_filters.NumberFilter):
    """A whole-number filter with bounds (a ``NumberFilter`` would accept ``4.2e19`` as a Decimal)."""

    field_class = forms.IntegerField


class FloatFilter(django_filters.NumberFilter):
    """A finite-float filter (Django's ``FloatField`` rejects NaN and infinities)."""

    field_class = forms.FloatField


class FilterSet(django_filters.FilterSet):
    """Base of every Ferry filterset: numeric filters are bounded by the column they compare with.

    Integer-typed filters (declared ``NumberFilter``s and those generated from ``Meta.fields``) become
    :class:`IntegerFilter` with ``min_value``/``max_value`` from :func:`integer_range`; float columns become
    :class:`FloatFilter`. Relation filters (``ModelChoiceFilter``) keep their lookup (an unknown id is a 400
    "Select a valid choice") and get the key's bounds in the schema.
    """

    @classmethod
    def get_filters(cls):
        filters = super().get_filters()
        model = cls._meta.model
        for name, filter_ in list(filters.items()):
            model_field = _target_field(model, filter_)
            if model_field is None:
                continue
            key_field = model_field.target_field if model_field.is_relation else model_field
            if isinstance(filter_, django_filters.ModelChoiceFilter | django_filters.ModelMultipleChoiceFilter):
                if isinstance(key_field, INTEGER_FIELDS):
                    low, high = integer_range(key_field)
                    set_override(filter_, "field", {"type": "integer", "minimum": low, "maximum": high})
                continue
            if not isinstance(filter_, django_filters.NumberFilter) or filter_.method is not None:
                continue
            if isinstance(key_field, INTEGER_FIELDS):
                low, high = integer_range(key_field)
                replacement = IntegerFilter(field_name=filter_.field_name, lookup_expr=filter_.lookup_expr,
                                            label=filter_._label, exclude=filter_.exclude, distinct=filter_.distinct,
                                            min_value=low, max_value=high)
                set_override(replacement, "field", {"type": "integer", "minimum": low, "maximum": high})
            elif isinstance(key_field, models.FloatField):
                replacement = FloatFilter(field_name=filter_.field_name, lookup_expr=filter_.lookup_expr,
                                          label=filter_._label, exclude=filter_.exclude, distinct=filter_.distinct)
                set_override(replacement, "field", {"type": "number", "format": "double"})
            else:
                continue
            replacement.model = model
            replacement.parent = None
            filters[name] = replacement
        return filters


def query_int(query_params, name: str, *, default: int, min_value: int, max_value: int) -> int:
    """An integer query parameter within [min_value, max_value]; absent -> ``default``.

    Raises ``rest_framework.exceptions.ValidationError`` (400) with ``{name: [message]}`` when the value is not
    a whole number written in decimal digits or is out of range.
    """
    raw = query_params.get(name)
    if raw is None:
        return default
    text = raw.strip()
    digits = text[1:] if text[:1] in "+-" else text
    if not digits.isdecimal() or len(digits) > 20 or not min_value <= int(text) <= max_value:
        raise ValidationError({name: [f"must be an integer from {min_value} to {max_value}, got {raw[:40]!r}"]})
    return int(text)


def query_float(query_params, name: str, *, min_value: float, max_value: float) -> float | None:
    """A finite float query parameter within [min_value, max_value]; absent -> ``None``.

    Raises ``ValidationError`` (400) for text that is not a number, NaN, infinities (``1e400`` overflows to
    ``inf``) and values out of range.
    """
    raw = query_params.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not min_value <= value <= max_value:
        raise ValidationError({name: [f"must be a finite number from {min_value:g} to {max_value:g}, got {raw[:40]!r}"]})
    return value


class FilterBackend(DjangoFilterBackend):
    """django-filter's DRF backend, without building the filterset for a request with no query parameters.

    With no parameters every filter gets an empty value and leaves the queryset as it is, but building the
    filterset, its form and their fields (deep copies of every filter) and validating that form was about a seventh
    of the CPU of a ``GET /api/v1/pools/`` (issue 21); routers and dashboards list without parameters.
    Any parameter (a filter's, or ``page``/``ordering``) goes through django-filter as before.
    """

    def filter_queryset(self, request, queryset, view):  # noqa: ANN001, ANN201 - DRF's signature
        if not request.query_params:
            return queryset
        return super().filter_queryset(request, queryset, view)
