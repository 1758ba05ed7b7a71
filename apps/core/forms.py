"""Helpers for admin forms that call services."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import NON_FIELD_ERRORS, ValidationError


def form_errors(exc: ValidationError, form_fields: dict[str, Any]) -> dict[str, list[str]]:
    """A service's ValidationError as a form error dict; keys the form lacks go to non-field errors."""
    if not hasattr(exc, "error_dict"):
        return {NON_FIELD_ERRORS: exc.messages}
    out: dict[str, list[str]] = {}
    for key, errors in exc.message_dict.items():
        target = key if key in form_fields else NON_FIELD_ERRORS
        prefix = "" if target == key or key in (NON_FIELD_ERRORS, "non_field_errors") else f"{key}: "
        out.setdefault(target, []).extend(prefix + e for e in errors)
    return out
