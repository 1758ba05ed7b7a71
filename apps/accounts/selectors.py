"""Reads for accounts."""

from __future__ import annotations

from datetime import datetime

from django.contrib.auth import get_user_model
from django.db.models import QuerySet
from knox.models import AuthToken

from apps.accounts.models import ClientApiKey


def user_has_api_token(*, username: str) -> bool:
    """True when ``username`` exists and holds an API token (tokens are stored hashed: never readable)."""
    return AuthToken.objects.filter(user__username=username).exists()


def user_exists(*, username: str) -> bool:
    return get_user_model().objects.filter(username=username).exists()


def client_key_list() -> QuerySet[ClientApiKey]:
    """Every client API key, revoked ones included (by name)."""
    return ClientApiKey.objects.order_by("name")


def client_keys_routed(*, now: datetime) -> list[dict]:
    """The routing table's ``client_keys`` entries at ``now``: for every active key
    ``{"name", "key_sha256", "rate_per_s", "burst"}`` (plus ``"models"`` when the key is limited to some models),
    and a second entry with the same name for its pre-rotation hash while that is in its grace period. Sorted
    by (name, hash) so the table's digest changes only when a key does. Hashes only, never a key."""
    entries = []
    for key in ClientApiKey.objects.filter(revoked_at__isnull=True).order_by("name"):
        hashes = [key.key_sha256] + ([key.previous_sha256] if key.previous_valid(now) else [])
        for digest in sorted(hashes):
            entry = {"name": key.name, "key_sha256": digest, "rate_per_s": key.rate_per_s, "burst": key.burst}
            if key.allowed_models:
                entry["models"] = sorted(key.allowed_models)
            entries.append(entry)
    return entries
