"""OpenAPI (drf-spectacular) description of Ferry's token authentication: the scheme knox's own extension
gives ``knox.auth.TokenAuthentication`` (``Authorization: Token <key>``), for its subclass
:class:`apps.accounts.authentication.TokenAuthentication` (spectacular matches extensions by exact class)."""

from drf_spectacular.contrib.knox_auth_token import KnoxTokenScheme


class FerryTokenScheme(KnoxTokenScheme):
    target_class = "apps.accounts.authentication.TokenAuthentication"
