"""API token authentication: django-rest-knox's hashed tokens, with the user and the user's role in one query.

knox's ``TokenAuthentication`` reads the candidate tokens with their users (one query), then on each request
scans every token of the user to delete expired ones (``_cleanup_token``, a second query), and
:class:`~apps.accounts.permissions.RolePermission` reads the user's groups (a third). Ferry's tokens never
expire (``REST_KNOX["TOKEN_TTL"]`` is None: a token works until it is rotated), so the scan finds nothing;
:class:`TokenAuthentication` skips it (the request's own token is still refused and deleted if it carries an
expiry in the past) and aggregates the user's role group names into the token query (PostgreSQL
``array_agg``), caching the role on the user (:func:`apps.accounts.roles.user_role` reads it). An API request
authenticates with one query (issue 21: per-request cost), which the ORM builds and compiles once per process
(:class:`apps.core.queries.PreparedQuery`; building and compiling it was half of the authentication's CPU): each
request runs it with its token's key and builds the token and user from the row as ``select_related`` does.
"""

from __future__ import annotations

import binascii
from hmac import compare_digest

from django.contrib.postgres.aggregates import ArrayAgg
from django.db.models import Model, Q, QuerySet
from django.utils import timezone
from django.utils.translation import gettext_lazy as _
from knox.auth import TokenAuthentication as KnoxTokenAuthentication
from knox.crypto import hash_token
from knox.models import get_token_model
from knox.settings import CONSTANTS
from knox.signals import token_expired
from rest_framework.exceptions import AuthenticationFailed

from apps.accounts.roles import ROLES, role_of
from apps.core.queries import PreparedQuery


def _token_candidates(*, token_key: str) -> QuerySet:
    """The tokens whose key (the first ``TOKEN_KEY_LENGTH`` characters) is ``token_key``: every column of the token
    and of its user, and the user's role group names (``role_names``), as ``values()``."""
    token_model = get_token_model()
    user_model = token_model._meta.get_field("user").related_model
    return (token_model.objects.filter(token_key=token_key)
            .values(*(field.attname for field in token_model._meta.concrete_fields),
                    *(f"user__{field.attname}" for field in user_model._meta.concrete_fields))
            .annotate(role_names=ArrayAgg("user__groups__name", filter=Q(user__groups__name__in=ROLES), default=[])))


TOKEN_CANDIDATES = PreparedQuery(_token_candidates)
"""Built and compiled once per process (:class:`apps.core.queries.PreparedQuery`)."""


def _token_and_user(row: dict) -> tuple[Model, Model]:
    """The token and its user (cached on it, as ``select_related`` does) from a :data:`TOKEN_CANDIDATES` row."""
    token_model = get_token_model()
    user_field = token_model._meta.get_field("user")
    user_model = user_field.related_model
    token_names = [field.attname for field in token_model._meta.concrete_fields]
    user_names = [field.attname for field in user_model._meta.concrete_fields]
    token = token_model.from_db(TOKEN_CANDIDATES.using, token_names, [row[name] for name in token_names])
    user = user_model.from_db(TOKEN_CANDIDATES.using, user_names, [row[f"user__{name}"] for name in user_names])
    user_field.set_cached_value(token, user)
    return token, user


class TokenAuthentication(KnoxTokenAuthentication):
    """``Authorization: Token <key>``: the token, its user and the user's role in one query."""

    def authenticate_credentials(self, token: bytes):  # noqa: ANN201 - knox's signature
        """The (user, token) of ``token`` (the header's raw bytes).

        Raises:
            AuthenticationFailed: no such token, an expired one, or its user is inactive (knox's messages; 401).
        """
        msg = _("Invalid token.")
        try:
            text = token.decode("utf-8")
            digest = hash_token(text)
        except (UnicodeDecodeError, TypeError, binascii.Error):
            raise AuthenticationFailed(msg) from None
        for row in TOKEN_CANDIDATES.rows(token_key=text[:CONSTANTS.TOKEN_KEY_LENGTH]):
            auth_token, user = _token_and_user(row)
            if self._cleanup_token(auth_token):
                continue
            if compare_digest(digest, auth_token.digest):
                user._ferry_role = role_of(row["role_names"], is_superuser=user.is_superuser)
                return self.validate_user(auth_token)
        raise AuthenticationFailed(msg)

    def _cleanup_token(self, auth_token) -> bool:  # noqa: ANN001 - knox's AuthToken
        """True (and the token deleted) when the request's own token has expired; other tokens are not read."""
        if auth_token.expiry is not None and auth_token.expiry < timezone.now():
            username = auth_token.user.get_username()
            auth_token.delete()
            token_expired.send(sender=self.__class__, username=username, source="auth_token")
            return True
        return False
