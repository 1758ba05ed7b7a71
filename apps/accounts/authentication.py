"""API token authentication that reads the user's role in the same query as the token.

DRF's ``TokenAuthentication`` reads the token and its user (one query), then :class:`RolePermission` reads
the user's groups (a second query) on every request. :class:`RoleTokenAuthentication` aggregates the user's
role group names into the token query (PostgreSQL ``array_agg``) and caches the role on the user
(:func:`apps.accounts.roles.user_role` reads it), so an API request authenticates with one query.
"""

from __future__ import annotations

from django.contrib.postgres.aggregates import ArrayAgg
from django.db.models import Q
from django.utils.translation import gettext_lazy as _
from rest_framework.authentication import TokenAuthentication
from rest_framework.exceptions import AuthenticationFailed

from apps.accounts.roles import ROLES, role_of


class RoleTokenAuthentication(TokenAuthentication):
    """``Authorization: Token <key>``, as DRF's, with the user's role read in the same query."""

    def authenticate_credentials(self, key: str):  # noqa: ANN201 - DRF signature
        """The (user, token) of ``key``.

        Raises:
            AuthenticationFailed: no such token, or its user is inactive (DRF's messages; 401).
        """
        model = self.get_model()
        try:
            token = (model.objects.select_related("user")
                     .annotate(role_names=ArrayAgg("user__groups__name", filter=Q(user__groups__name__in=ROLES),
                                                   default=[]))
                     .get(key=key))
        except model.DoesNotExist:
            raise AuthenticationFailed(_("Invalid token.")) from None
        if not token.user.is_active:
            raise AuthenticationFailed(_("User inactive or deleted."))
        token.user._ferry_role = role_of(token.role_names, is_superuser=token.user.is_superuser)
        return token.user, token
