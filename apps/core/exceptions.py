"""DRF exception handler: domain and database errors become 4xx responses, never a 500.

Mapping: Django ``ValidationError`` -> 400 with field messages; ``DataError`` (a value the
database cannot store) -> 400; :class:`~apps.core.errors.ConflictError`, ``ProtectedError`` and
``IntegrityError`` (a uniqueness or foreign-key constraint) -> 409 with a message; a body over
``DATA_UPLOAD_MAX_MEMORY_SIZE`` (Django's ``RequestDataTooBig``, else an HTML 400 page) -> 413; no pooled database
connection free within the pool's timeout (the web process under more load than it can serve) -> 503 with
``Retry-After``.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import DataError, IntegrityError, OperationalError
from django.db.models import ProtectedError, RestrictedError
from psycopg_pool import PoolTimeout
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.serializers import as_serializer_error
from rest_framework.views import exception_handler as drf_exception_handler

from apps.core.errors import ConflictError


class Conflict(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "The request conflicts with the current state."
    default_code = "conflict"


class Busy(exceptions.APIException):
    status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    default_detail = "The server is busy: no database connection became free in time. Retry shortly."
    default_code = "busy"


class BodyTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "body_too_large"


RETRY_AFTER_S = 1


def _protected_message(exc: ProtectedError | RestrictedError) -> str:
    # a set: sorted so the message is the same whatever the primary keys' hashes
    objs = sorted(exc.protected_objects if isinstance(exc, ProtectedError) else exc.restricted_objects,
                  key=lambda obj: (str(obj._meta.verbose_name), str(obj)))
    names = ", ".join(f"{obj._meta.verbose_name} {obj}" for obj in objs[:5])
    more = f" and {len(objs) - 5} more" if len(objs) > 5 else ""
    return f"Cannot delete: still in use by {names}{more}. Remove or change those first."


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """Translate domain/database exceptions, then defer to DRF's handler."""
    if isinstance(exc, DjangoValidationError):
        exc = exceptions.ValidationError(detail=as_serializer_error(exc))
    elif isinstance(exc, ConflictError):
        exc = Conflict(str(exc))
    elif isinstance(exc, ProtectedError | RestrictedError):
        exc = Conflict(_protected_message(exc))
    elif isinstance(exc, IntegrityError):
        exc = Conflict(f"The change violates a uniqueness or reference constraint: {str(exc).strip()}")
    elif isinstance(exc, RequestDataTooBig):
        exc = BodyTooLarge(f"The request body is larger than {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes.")
    elif isinstance(exc, DataError):
        exc = exceptions.ValidationError({"non_field_errors": [f"A value cannot be stored: {str(exc).strip()}"]})
    elif isinstance(exc, OperationalError) and isinstance(exc.__cause__, PoolTimeout):
        response = drf_exception_handler(Busy(), context)
        response["Retry-After"] = str(RETRY_AFTER_S)
        return response
    return drf_exception_handler(exc, context)
