"""Serializer plumbing shared by the apps' APIs.

DRF drops a request field that a serializer does not write (read-only or unknown) without a word, so a client
that sends ``PATCH /api/v1/pools/{id}/ {"tracks": [...]}`` got 200 and nothing changed.
:class:`StrictFieldsMixin` answers 400 instead, naming each such field and, where one exists, how to change it.
:class:`StrictFloatField` refuses a boolean where a number belongs (DRF's FloatField reads ``true`` as 1.0).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from rest_framework import serializers


class StrictFieldsMixin:
    """Refuse a write that carries fields the serializer will not write (HTTP 400, one message per field).

    ``how_to_change`` maps a read-only field to where it is changed (e.g. ``"tracks": "... rollouts ..."``);
    other read-only fields say "read-only", unknown ones "unknown field". Reads are unaffected.
    """

    how_to_change: ClassVar[Mapping[str, str]] = {}

    def to_internal_value(self, data: Any) -> Any:  # noqa: ANN401 - DRF's signature
        if isinstance(data, Mapping):
            fields = self.fields  # type: ignore[attr-defined]
            errors = {}
            for name in data:
                field = fields.get(name)
                if field is not None and not field.read_only:
                    continue
                if field is None:
                    errors[name] = ["Unknown field: it is not part of this resource."]
                else:
                    errors[name] = [self.how_to_change.get(name, "This field is read-only.")]
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)  # type: ignore[misc]


class StrictFloatField(serializers.FloatField):
    """A FloatField that refuses JSON ``true``/``false`` (DRF's takes ``float(True)``, 1.0): a boolean where a number
    of seconds or requests/s belongs is a client's mistake, not a 1."""

    def to_internal_value(self, data: Any) -> float:  # noqa: ANN401 - DRF's signature
        if isinstance(data, bool):
            self.fail("invalid")
        return super().to_internal_value(data)
