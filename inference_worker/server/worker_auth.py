"""The worker credential: ``Authorization: Bearer <pool token>`` on every route but the probes.

Each pool has one worker token (the control plane generates it with the pool and hands it to the pool's
workers through their environment and to routers in the routing table). A worker started with
``FERRY_WORKER_TOKEN`` set refuses, with a 401 OpenAI error (``code: invalid_worker_token``) and a
``WWW-Authenticate: Bearer`` header, any request without that token, except:

* ``GET /health``, ``/ready``, ``/metrics`` and ``/debug/slow-requests`` (:data:`OPEN_PATHS`): probes,
  Prometheus scrapes and the telemetry poller's read of the slow-request timeline (timings, ids and counts,
  never prompt text; the poller sends no worker token);
* ``POST /internal/prefill``: a decode worker's hand-off, authenticated by its HMAC-SHA256 body signature
  under the KV link secret (:mod:`.signing`), which every worker of a prefill/decode link holds.

During a rotation a worker also accepts ``FERRY_WORKER_TOKEN_PREVIOUS`` (the token before the rotation), so
a router still sending the old token keeps working while the replicas roll. Tokens come only from the
environment, never from the command line (``ps`` shows every user the arguments). The comparison is
``hmac.compare_digest`` over every accepted token (no early exit on the first match), so its time does not
tell an attacker how much of a guess was right. Without ``FERRY_WORKER_TOKEN`` the worker is open, as before
(tests and a bare ``serve``).

The check is a pure ASGI middleware, so it runs before a body is read and leaves streaming responses and
client-disconnect handling untouched.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from inference_worker.server.errors import OpenAIError
from inference_worker.tracing import SLOW_REQUESTS_PATH

TOKEN_ENV = "FERRY_WORKER_TOKEN"
PREVIOUS_TOKEN_ENV = "FERRY_WORKER_TOKEN_PREVIOUS"
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", SLOW_REQUESTS_PATH})
"""Routes any client may call: liveness and readiness probes, Prometheus scrapes, the slow-request timeline."""
SIGNED_PATHS = frozenset({"/internal/prefill"})
"""Routes with their own authentication (the KV link secret's body signature), exempt from the bearer check."""
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True)
class WorkerTokens:
    """The bearer tokens a worker accepts: the pool's current token and, during a rotation, the previous one."""

    current: str
    previous: str = ""

    def __post_init__(self) -> None:
        for name, value in ((TOKEN_ENV, self.current), (PREVIOUS_TOKEN_ENV, self.previous)):
            if value and (len(value) < MIN_TOKEN_CHARS or not value.isascii() or not value.isprintable()
                          or " " in value):
                raise ValueError(f"{name} must be at least {MIN_TOKEN_CHARS} printable ASCII characters without "
                                 "spaces")
        if not self.current:
            raise ValueError(f"{TOKEN_ENV} is empty")

    def __repr__(self) -> str:  # never the secrets, e.g. in a logged ServerState
        return f"WorkerTokens(current=<{len(self.current)} chars>, previous={'<set>' if self.previous else '<none>'})"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> WorkerTokens | None:
        """The tokens of ``FERRY_WORKER_TOKEN`` / ``FERRY_WORKER_TOKEN_PREVIOUS``; None when the first is unset or
        empty (the worker is then open). Raises ValueError for a token shorter than 16 characters or with spaces."""
        current = environ.get(TOKEN_ENV, "")
        return cls(current, environ.get(PREVIOUS_TOKEN_ENV, "")) if current else None

    def accepts(self, authorization: str | None) -> bool:
        """True when ``authorization`` is ``Bearer <current or previous token>`` (scheme case-insensitive)."""
        scheme, _, given = (authorization or "").partition(" ")
        raw = given.strip().encode("utf-8", "surrogateescape")
        ok = False
        for token in (self.current, self.previous):
            if token:
                ok |= hmac.compare_digest(raw, token.encode("ascii"))
        return ok and scheme.lower() == "bearer"


def unauthorized_body(present: bool) -> bytes:
    """The 401 OpenAI error body: a missing or a wrong token (the message never echoes what was sent)."""
    message = ("invalid worker token" if present else "missing worker token") + (
        ": send 'Authorization: Bearer <the pool's worker token>' (routers take it from the routing table)")
    return json.dumps(OpenAIError(401, message, type="authentication_error", code="invalid_worker_token").body()
                      ).encode()


class WorkerAuthMiddleware:
    """ASGI middleware: HTTP requests outside :data:`OPEN_PATHS` and :data:`SIGNED_PATHS` need a token of
    ``tokens``; others get a 401 before the app (or its body reading) runs."""

    def __init__(self, app, tokens: WorkerTokens) -> None:  # noqa: ANN001 - an ASGI app
        self.app, self.tokens = app, tokens

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI signature
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["path"] in SIGNED_PATHS:
            await self.app(scope, receive, send)
            return
        header = None
        for key, value in scope.get("headers", ()):
            if key == b"authorization":
                header = value.decode("latin-1")
                break
        if self.tokens.accepts(header):
            await self.app(scope, receive, send)
            return
        body = unauthorized_body(header is not None)
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b'Bearer realm="ferry-worker"')]})
        await send({"type": "http.response.body", "body": body})
