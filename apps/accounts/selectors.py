"""Reads for accounts."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from knox.models import AuthToken


def user_has_api_token(*, username: str) -> bool:
    """True when ``username`` exists and holds an API token (tokens are stored hashed: never readable)."""
    return AuthToken.objects.filter(user__username=username).exists()


def user_exists(*, username: str) -> bool:
    return get_user_model().objects.filter(username=username).exists()
