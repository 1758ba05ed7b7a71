"""Writes for accounts: create a user with a role and an API token."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractUser
from django.core.exceptions import ValidationError
from django.db import transaction
from knox.models import AuthToken

from apps.accounts.roles import ADMIN, ROLES, roles_ensure


@dataclass(frozen=True)
class CreatedUser:
    user: AbstractUser
    password: str
    token: str


def user_create_with_role(*, username: str, role: str, password: str | None = None) -> CreatedUser:
    """Create ``username`` in the ``role`` group with a password (random when None) and a token.

    Admins are Django staff. Returns the user, the clear-text password (shown once) and the token.

    Raises:
        ValidationError: unknown role, or the username exists or is invalid.
    """
    if role not in ROLES:
        raise ValidationError({"role": [f"Unknown role {role!r}; choose one of {', '.join(ROLES)}."]})
    user_model = get_user_model()
    with transaction.atomic():
        if user_model.objects.filter(username=username).exists():
            raise ValidationError({"username": [f"User {username!r} already exists."]})
        password = password or secrets.token_urlsafe(18)
        user = user_model(username=username, is_staff=(role == ADMIN))
        user.set_password(password)
        user.full_clean()
        user.save()
        user.groups.add(roles_ensure()[role])
        token = api_token_create(user=user)
    return CreatedUser(user=user, password=password, token=token)


def api_token_create(*, user: AbstractUser) -> str:
    """A new API token for ``user``; returns the clear text, which is shown once and stored only as a digest.

    django-rest-knox keeps the SHA-512 of the token and its first 15 characters (the lookup key); the token
    never expires (``REST_KNOX["TOKEN_TTL"] = None``).
    """
    _instance, token = AuthToken.objects.create(user=user, expiry=None)
    return token


def api_token_rotate(*, user: AbstractUser) -> str:
    """Revoke every API token of ``user`` and create one; returns the new clear-text token."""
    with transaction.atomic():
        AuthToken.objects.filter(user=user).delete()
        return api_token_create(user=user)
