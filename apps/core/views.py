"""``GET /healthz``: 200 when the database and Redis answer, 503 naming what is down; ``GET /api/v1/``: the API's root.

Unauthenticated on purpose (load balancers and Kubernetes probes call it); it reveals only
which dependency failed and the error class.
"""

from __future__ import annotations

import redis
from django.conf import settings
from django.db import DatabaseError, connection
from django.http import HttpRequest, JsonResponse
from django.urls import NoReverseMatch, get_resolver
from django.views.decorators.http import require_GET
from drf_spectacular.utils import extend_schema, extend_schema_view, inline_serializer
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.reverse import reverse
from rest_framework.views import APIView

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


@extend_schema_view(get=extend_schema(responses=inline_serializer(name="ApiRoot", fields={
    "schema": serializers.URLField(), "docs": serializers.URLField(),
    "collections": serializers.DictField(child=serializers.URLField(), help_text="Collection name -> its URL.")})))
class ApiRootView(APIView):
    """``GET /api/v1/``: where the API is described (the OpenAPI schema, Swagger UI) and its collections, by name.

    The ready banner of ``make run`` points here. Same authentication and roles as the rest of the API (a viewer
    may read it).
    """

    def get(self, request: Request) -> Response:
        names = sorted(name for name in get_resolver().reverse_dict if isinstance(name, str) and name.endswith("-list"))
        collections = {}
        for name in names:
            try:
                url = reverse(name, request=request)
            except NoReverseMatch:  # a list route that needs arguments (nested): not a top-level collection
                continue
            if "/api/v1/" in url:
                collections[name.removesuffix("-list")] = url
        return Response({"schema": reverse("schema", request=request), "docs": reverse("docs", request=request),
                         "collections": collections})
