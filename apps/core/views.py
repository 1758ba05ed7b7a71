"""``GET /healthz``: 200 when the database and Redis answer, 503 naming what is down.

Unauthenticated on purpose (load balancers and Kubernetes probes call it); it reveals only
which dependency failed and the error class.
"""

from __future__ import annotations

import redis
from django.conf import settings
from django.db import DatabaseError, connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

PROBE_TIMEOUT_S = 1.0


def check_database() -> str:
    """'ok', or 'down: <error class>' when a trivial query fails."""
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except DatabaseError as exc:
        return f"down: {type(exc).__name__}"
    return "ok"


def check_redis() -> str:
    """'ok', or 'down: <error class>' when ``REDIS_URL`` does not answer PING within 1 s."""
    client = redis.Redis.from_url(
        settings.REDIS_URL, socket_connect_timeout=PROBE_TIMEOUT_S, socket_timeout=PROBE_TIMEOUT_S
    )
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        return f"down: {type(exc).__name__}"
    finally:
        client.close()
    return "ok"


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    body = {"database": check_database(), "redis": check_redis()}
    healthy = all(value == "ok" for value in body.values())
    return JsonResponse(body, status=200 if healthy else 503)
