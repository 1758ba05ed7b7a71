"""Reads for accounts."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token


def user_token_get(*, username: str) -> str | None:
    """The API token key of ``username``, or None if the user or token does not exist."""
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        return None
    token = Token.objects.filter(user=user).first()
    return token.key if token else None
