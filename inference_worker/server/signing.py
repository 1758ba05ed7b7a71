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

from starlette.requests import Request

from inference_worker import http_headers
from inference_worker.server.errors import OpenAIError

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


def too_large(max_bytes: int) -> OpenAIError:
    """A 413 for a body over ``max_bytes``."""
    return OpenAIError(413, f"request body too large: this route accepts at most {max_bytes} bytes",
                       code="request_too_large")


async def read_body_capped(request: Request, max_bytes: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``max_bytes``.

    A ``Content-Length`` over the cap is refused before any of the body is read; a chunked (or lying)
    body is read chunk by chunk and refused as soon as the bytes received pass the cap, so at most
    ``max_bytes`` plus one ASGI chunk is ever buffered.

    Raises:
        OpenAIError: 413 ``request_too_large``; 400 for a malformed ``Content-Length``.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isascii() or not declared.isdigit() or len(declared) > 19:
            raise OpenAIError(400, "invalid Content-Length header", code="invalid_value")
        if int(declared) > max_bytes:
            raise too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)
