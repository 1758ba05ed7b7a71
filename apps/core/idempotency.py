"""The ``Idempotency-Key`` request header: read and validate it for services that create Actions."""

from __future__ import annotations

import re

from django.core.exceptions import ValidationError
from django.http import HttpRequest

HEADER = "Idempotency-Key"
MAX_LENGTH = 255
_VALID = re.compile(r"^[\x21-\x7e]{1,255}$")  # visible ASCII, no spaces


def idempotency_key_from_request(request: HttpRequest) -> str | None:
    """Return the request's ``Idempotency-Key`` header, or None when absent.

    Raises:
        ValidationError: the header is empty, longer than 255 characters or not visible ASCII.
    """
    raw = request.headers.get(HEADER)
    if raw is None:
        return None
    if not _VALID.match(raw):
        raise ValidationError(
            {"idempotency_key": [f"{HEADER} must be 1..{MAX_LENGTH} visible ASCII characters (e.g. a UUID)."]}
        )
    return raw
