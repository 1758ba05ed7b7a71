"""Service-token authentication for machine clients (the router) of ``GET /api/v1/routing-table/``.

``Authorization: Bearer <token>`` is accepted when the token is ``settings.FERRY_SERVICE_TOKEN``
(compared in constant time; authenticates a ``ServicePrincipal``) or the API token of a user in
the ``service`` group. :class:`IsServiceOrViewer` then admits service principals, ``service``
users and anyone with the viewer role or higher.
"""

from __future__ import annotations

import hmac

from django.conf import settings
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.permissions import BasePermission

from apps.accounts.authentication import TokenAuthentication
from apps.accounts.roles import VIEWER, role_at_least

SERVICE_GROUP = "service"


class ServicePrincipal:
    """The caller holding ``FERRY_SERVICE_TOKEN`` (not a database user)."""

    is_authenticated = True
    is_active = True
    is_superuser = False
    is_staff = False
    username = "service"
    pk = None

    def __str__(self) -> str:
        return "service"


def is_service(user) -> bool:  # noqa: ANN001 - any request.user
    if isinstance(user, ServicePrincipal):
        return True
    return bool(user and user.is_authenticated and user.groups.filter(name=SERVICE_GROUP).exists())


class ServiceTokenAuthentication(BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):  # noqa: ANN001, ANN201 - DRF signature
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != self.keyword.lower().encode():
            return None
        if len(parts) != 2:
            raise AuthenticationFailed("Use 'Authorization: Bearer <service token>'.")
        token = parts[1].decode(errors="replace")
        expected = getattr(settings, "FERRY_SERVICE_TOKEN", "")
        if expected and hmac.compare_digest(token.encode(), expected.encode()):
            return ServicePrincipal(), token
        try:
            return TokenAuthentication().authenticate_credentials(parts[1])  # a service user's (hashed) API token
        except AuthenticationFailed as exc:
            raise AuthenticationFailed("Invalid service token.") from exc

    def authenticate_header(self, request) -> str:  # noqa: ANN001 - DRF signature
        return self.keyword


class IsServiceOrViewer(BasePermission):
    message = "Reading the routing table needs the service token, a service account or the viewer role."

    def has_permission(self, request, view) -> bool:  # noqa: ANN001 - DRF signature
        user = request.user
        return is_service(user) or (not isinstance(user, ServicePrincipal) and role_at_least(user, VIEWER))


class ServiceTokenScheme(OpenApiAuthenticationExtension):
    """OpenAPI security scheme of :class:`ServiceTokenAuthentication` (HTTP bearer)."""

    target_class = "apps.fleet.api.auth.ServiceTokenAuthentication"
    name = "serviceToken"

    def get_security_definition(self, auto_schema):  # noqa: ANN001, ANN201 - drf-spectacular signature
        return {"type": "http", "scheme": "bearer", "description": "FERRY_SERVICE_TOKEN or a service user's token"}
