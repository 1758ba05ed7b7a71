"""Serializer plumbing shared by the apps' APIs.

DRF drops a request field that a serializer does not write (read-only or unknown) without a word, so a client
that sends ``PATCH /api/v1/pools/{id}/ {"tracks": [...]}`` got 200 and nothing changed.
:class:`StrictFieldsMixin` answers 400 instead, naming each such field and, where one exists, how to change it.
:class:`EmptyBodySerializer` (:func:`empty_body_check`) does the same for a verb that takes no body.
:class:`StrictFloatField` refuses a boolean where a number belongs (DRF's FloatField reads ``true`` as 1.0).
:class:`StrictPrimaryKeyRelatedField` takes whole-number ids only (``1.5`` found object 1, ``1e400`` was a 500); the
mixin makes it a ModelSerializer's generated relation field too.
:class:`ValuesRepresentation` gives a serializer's output from ``QuerySet.values()`` rows (hot list endpoints).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, ClassVar

from django.core.exceptions import FieldDoesNotExist, ImproperlyConfigured
from django.db import models
from rest_framework import serializers
from rest_framework.relations import PKOnlyObject

FORM_ONLY_FIELDS = frozenset({"csrfmiddlewaretoken"})
"""Keys a browser's form post carries beside the resource's fields (Django's CSRF token): never "unknown"."""


class StrictPrimaryKeyRelatedField(serializers.PrimaryKeyRelatedField):
    """A PrimaryKeyRelatedField that takes a whole number (or its digits as a string) only.

    DRF's passes the value to the database lookup: ``1.5`` found object 1 (a fractional id started a real profiling
    sweep of pool 1), ``true`` object 1, and ``1e400`` (infinity) raised ``OverflowError``, a 500.

    Raises (from ``to_internal_value``):
        ValidationError: "Incorrect type. Expected pk value, received <type>." for a boolean, a float or anything
            but an int or a string of digits; DRF's "does not exist" for an id no object has.
    """

    def to_internal_value(self, data: Any) -> Any:  # noqa: ANN401 - DRF's signature
        if isinstance(data, bool) or not (isinstance(data, int) or (isinstance(data, str) and data.isdigit())):
            self.fail("incorrect_type", data_type=type(data).__name__)
        return super().to_internal_value(data)


class StrictFieldsMixin:
    """Refuse a write that carries fields the serializer will not write (HTTP 400, one message per field).

    ``how_to_change`` maps a read-only or unknown field to where it is changed (e.g. ``"tracks": "... rollouts
    ..."``); other read-only fields say "read-only", unknown ones :attr:`unknown_field_message`. Reads are
    unaffected. The answer also carries the other fields' errors, so a client fixes every field in one round.

    Raises (from ``is_valid(raise_exception=True)``):
        ValidationError: HTTP 400 ``{field: [message], ...}``, naming every refused field.
    """

    how_to_change: ClassVar[Mapping[str, str]] = {}
    serializer_related_field = StrictPrimaryKeyRelatedField  # a ModelSerializer's generated relations
    unknown_field_message: ClassVar[str] = "Unknown field: it is not part of this resource."

    def to_internal_value(self, data: Any) -> Any:  # noqa: ANN401 - DRF's signature
        if isinstance(data, Mapping):
            fields = self.fields  # type: ignore[attr-defined]
            errors = {}
            for name in data:
                if name in FORM_ONLY_FIELDS:
                    continue
                field = fields.get(name)
                if field is not None and not field.read_only:
                    continue
                default = self.unknown_field_message if field is None else "This field is read-only."
                errors[name] = [self.how_to_change.get(name, default)]
            if errors:
                # One round: the fields' own errors (a missing required field...) come with these.
                try:
                    super().to_internal_value(data)  # type: ignore[misc]
                except serializers.ValidationError as exc:
                    if isinstance(exc.detail, Mapping):
                        errors = {**exc.detail, **errors}
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)  # type: ignore[misc]


class EmptyBodySerializer(StrictFieldsMixin, serializers.Serializer):
    """The body of a verb that takes no options (``POST .../start/``, ``.../cancel/``...): none, ``{}`` or a browser
    form's CSRF token. Any field is refused rather than ignored: a client that sends ``{"force": true}`` to a verb
    without a ``force`` option learns so instead of getting the plain verb."""

    unknown_field_message = "Unknown field: this request takes no fields (send no body or {})."


def empty_body_check(data: Any) -> None:  # noqa: ANN401 - whatever the parser gave (request.data)
    """Check that a body-less verb got no fields: ``data`` is ``request.data``.

    Raises:
        ValidationError: HTTP 400 naming each field of ``data`` (:class:`EmptyBodySerializer`), or DRF's
            "Invalid data. Expected a dictionary" when the body is JSON but not an object.
    """
    EmptyBodySerializer(data=data).is_valid(raise_exception=True)


class StrictFloatField(serializers.FloatField):
    """A FloatField that refuses JSON ``true``/``false`` (DRF's takes ``float(True)``, 1.0): a boolean where a number
    of seconds or requests/s belongs is a client's mistake, not a 1."""

    def to_internal_value(self, data: Any) -> float:  # noqa: ANN401 - DRF's signature
        if isinstance(data, bool):
            self.fail("invalid")
        return super().to_internal_value(data)


# DRF fields whose representation depends on the attribute's value alone (no instance, request or context), so
# they can represent a column read with ``QuerySet.values()``; subclasses (EmailField, BigIntegerField...) count.
VALUE_ONLY_FIELDS = (
    serializers.BooleanField, serializers.CharField, serializers.ChoiceField, serializers.IntegerField,
    serializers.FloatField, serializers.DecimalField, serializers.DateTimeField, serializers.DateField,
    serializers.TimeField, serializers.DurationField, serializers.JSONField, serializers.UUIDField,
)


class ValuesRepresentation:
    """What ``serializer_class(instance).data`` gives, built from a ``QuerySet.values()`` row of the instance.

    A list endpoint read hot (routers, dashboards) spends most of its CPU building a ``ModelSerializer``'s fields
    (per request), model instances and the attribute look-ups of each field. This reads the same columns as plain
    dicts and represents each with the serializer's own field (built once, here): ``field.to_representation`` of
    the column's value, ``None`` kept as ``None``, keys in the serializer's order — DRF's
    ``Serializer.to_representation`` step by step, without the instance.

    Args:
        serializer_class: a ``ModelSerializer``. Each readable field must be one of :data:`VALUE_ONLY_FIELDS` or a
            ``PrimaryKeyRelatedField`` whose ``source`` is a concrete field of the model (the relation's
            ``<name>_id`` column is read), or be named in ``provided``.
        provided: readable fields the caller computes (e.g. a nested list) and puts in the row under the field's
            name, already represented; :meth:`represent` copies them as they are.

    Raises:
        ImproperlyConfigured: a readable field is not representable from a column (a method field, a nested
            serializer not in ``provided``, a dotted or ``*`` source, a property, a file field...).
    """

    def __init__(self, serializer_class: type[serializers.ModelSerializer], *,
                 provided: Collection[str] = ()) -> None:
        model = serializer_class.Meta.model
        self.columns: list[str] = []
        """The ``values()`` names to read (model field names; relations by their ``_id`` column)."""
        self._plan: list[tuple[str, str, Callable[[Any], Any] | None]] = []
        unknown_provided = set(provided)
        for field in serializer_class()._readable_fields:
            name = field.field_name
            if name in provided:
                unknown_provided.discard(name)
                self._plan.append((name, name, None))
                continue
            primary_key = isinstance(field, serializers.PrimaryKeyRelatedField)
            if not (primary_key or isinstance(field, VALUE_ONLY_FIELDS)):
                raise ImproperlyConfigured(
                    f"{serializer_class.__name__}.{name} ({type(field).__name__}) cannot be represented from a "
                    f"column: name it in provided= and compute it, or serialize instances")
            model_field = self._model_field(serializer_class, model, field)
            if primary_key != model_field.is_relation:
                raise ImproperlyConfigured(
                    f"{serializer_class.__name__}.{name} ({type(field).__name__}) does not match its column "
                    f"{model.__name__}.{model_field.name} ({type(model_field).__name__})")
            if primary_key:
                column, represent = model_field.attname, self._primary_key_representation(field)
            else:
                column, represent = model_field.name, field.to_representation
            self.columns.append(column)
            self._plan.append((name, column, represent))
        if unknown_provided:
            raise ImproperlyConfigured(f"{serializer_class.__name__} has no readable fields {sorted(unknown_provided)}")

    @staticmethod
    def _model_field(serializer_class: type, model: type[models.Model], field: serializers.Field) -> models.Field:
        try:
            model_field = model._meta.get_field(field.source)
        except FieldDoesNotExist:
            model_field = None
        if model_field is None or not model_field.concrete or model_field.many_to_many:
            raise ImproperlyConfigured(
                f"{serializer_class.__name__}.{field.field_name}: source {field.source!r} is not a column of "
                f"{model.__name__}")
        return model_field

    @staticmethod
    def _primary_key_representation(field: serializers.PrimaryKeyRelatedField) -> Callable[[Any], Any]:
        def represent(pk: Any) -> Any:  # noqa: ANN401 - the related key, whatever its type
            return field.to_representation(PKOnlyObject(pk=pk))

        return represent

    def represent(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """The serializer's representation of the instance ``row`` was read from (``values(*self.columns)`` plus
        the ``provided`` fields).

        Raises:
            KeyError: ``row`` lacks a column or a provided field.
        """
        out = {}
        for name, column, represent in self._plan:
            value = row[column]
            out[name] = value if represent is None or value is None else represent(value)
        return out
