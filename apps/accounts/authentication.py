"""API token authentication: django-rest-knox's, without its per-request scan of the user's other tokens.

knox's ``TokenAuthentication._cleanup_token`` reads every token of the authenticated user on each request to
delete the expired ones. Ferry's tokens never expire (``REST_KNOX["TOKEN_TTL"]`` is None: a token works until it
is rotated), so that scan finds nothing and only costs a query per API request (issue 21: per-request cost). The
request's own token is still refused and deleted if it carries an expiry in the past.
"""

from __future__ import annotations

from django.utils import timezone
from knox.auth import TokenAuthentication as KnoxTokenAuthentication
from knox.signals import token_expired


class TokenAuthentication(KnoxTokenAuthentication):
    """``Authorization: Token <key>``; one query per request (the token with its user)."""

    def _cleanup_token(self, auth_token) -> bool:  # noqa: ANN001 - knox's AuthToken
        if auth_token.expiry is not None and auth_token.expiry < timezone.now():
            username = auth_token.user.get_username()
            auth_token.delete()
            token_expired.send(sender=self.__class__, username=username, source="auth_token")
            return True
        return False
