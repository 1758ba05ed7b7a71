"""Writes for accounts: create a user with a role and an API token; client API keys' secrets and use counts
(their audited create/rotate/revoke are operations': :mod:`apps.operations.client_keys`)."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractUser
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Case, F, Value, When
from knox.models import AuthToken

from apps.accounts.models import ClientApiKey
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


CLIENT_KEY_PREFIX = "fck_"
"""Every client key starts with this ("Ferry client key"), so a leaked one is recognisable (secret scanners)."""
CLIENT_KEY_DISPLAY_CHARS = 12


@dataclass(frozen=True)
class ClientKeySecret:
    """A new client key: ``key`` is shown once; ``key_sha256`` (hex) and ``prefix`` are what is stored."""

    key: str
    key_sha256: str
    prefix: str


def client_key_sha256(key: str) -> str:
    """The stored and routed form of a client key: SHA-256 of its UTF-8 bytes, lowercase hex (64 characters)."""
    return hashlib.sha256(key.encode()).hexdigest()


def client_key_secret_new() -> ClientKeySecret:
    """A new client key: ``fck_`` + 43 URL-safe characters of 32 random bytes (256 bits, :mod:`secrets`)."""
    key = CLIENT_KEY_PREFIX + secrets.token_urlsafe(32)
    return ClientKeySecret(key=key, key_sha256=client_key_sha256(key), prefix=key[:CLIENT_KEY_DISPLAY_CHARS])


def client_key_uses_record(*, uses: Mapping[str, int], at: datetime) -> int:
    """Add ``uses`` (key name -> requests since the last call, > 0) to each key's ``use_count`` and set its
    ``last_used_at`` to ``at`` (never backwards). One UPDATE per key that was used; names without a row (a
    key of a router's own file) are ignored. Returns the rows updated.

    The telemetry poller calls this once per poll with the increase of the routers'
    ``ferry_router_requests_by_key_total`` counters, so a busy key costs one write per poll, not per request.
    """
    updated = 0
    with transaction.atomic():
        for name, count in sorted(uses.items()):
            if count <= 0:
                continue
            updated += ClientApiKey.objects.filter(name=name).update(
                use_count=F("use_count") + int(count),
                last_used_at=Case(When(last_used_at__gt=at, then=F("last_used_at")), default=Value(at)))
    return updated
