"""Authentication and body bounds of the worker's signed internal routes.

``POST /internal/prefill`` and ``POST /admin/kv-cache/reset`` carry an HMAC-SHA256 of the raw body under
the KV link secret, hex-encoded, in ``X-Ferry-KV-Signature``. This module is the one place that checks it
(:func:`verify_signature`) and that reads such a body with a size cap before anything is authenticated
(:func:`read_body_capped`), so an unsigned client can neither crash the check nor make the worker buffer
an arbitrary body.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from inference_worker import http_headers
from inference_worker.request_limits import read_body_capped, too_large
from inference_worker.server.errors import OpenAIError

__all__ = ["read_body_capped", "sign", "too_large", "verify_signature"]

_HEX64 = re.compile(rb"[0-9a-fA-F]{64}")


def sign(secret: bytes, body: bytes) -> str:
    """Hex (lower-case, 64 chars) HMAC-SHA256 of ``body`` under ``secret``."""
    return hmac.new(secret, body, hashlib.sha256).hexdigest()


def verify_signature(secret: bytes, body: bytes, header: str | None, *, message: str | None = None) -> None:
    """Check a request's ``X-Ferry-KV-Signature`` against ``body``.

    The header must be exactly 64 hex digits; upper-case hex is accepted (hex is case-insensitive and the
    digest is the same bytes: RFC 4648 section 8 lists base16 case-insensitively). It is compared as bytes
    in constant time (``hmac.compare_digest``), so non-ASCII input is just a wrong signature.

    Raises:
        OpenAIError: 401 ``invalid_signature`` when the header is missing, not 64 hex chars, or wrong.
    """
    raw = (header or "").encode("utf-8", "surrogateescape")
    expected = sign(secret, body).encode("ascii")
    if _HEX64.fullmatch(raw) is None or not hmac.compare_digest(raw.lower(), expected):
        raise OpenAIError(401, message or f"invalid or missing {http_headers.KV_SIGNATURE} (64 hex chars: HMAC-SHA256 "
                          "of the body under the KV link secret)", type="authentication_error",
                          code="invalid_signature")
