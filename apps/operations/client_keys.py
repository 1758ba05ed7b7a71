"""Verbs on client API keys (admin): create, update limits, rotate, revoke, and the setup's import.

Each verb is one transaction that writes the key row (:class:`apps.accounts.models.ClientApiKey`: the SHA-256
only), records a finished Action as the audit log entry (``client_key.create`` | ``.update`` | ``.rotate`` |
``.revoke`` | ``.import``; target ``client_key:<id>``; params name the key, its prefix and limits, never a
secret or a hash) and republishes the routing table, so the new version (and its Redis cache entry, written
after commit) carries the change to every router at its next poll. No backend is called: the Action is
``succeeded`` when recorded.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from apps.accounts.models import SHA256_HEX, ClientApiKey
from apps.accounts.services import client_key_secret_new
from apps.core.errors import ConflictError
from apps.fleet.services import routing_table_publish
from apps.operations.models import Action

CLIENT_KEY_CREATE = "client_key.create"
CLIENT_KEY_UPDATE = "client_key.update"
CLIENT_KEY_ROTATE = "client_key.rotate"
CLIENT_KEY_REVOKE = "client_key.revoke"
CLIENT_KEY_IMPORT = "client_key.import"
MAX_GRACE_S = 7 * 24 * 3600
LIMIT_FIELDS = ("rate_per_s", "burst", "allowed_models")


@dataclass(frozen=True)
class IssuedKey:
    """A key row and its clear-text key, which the caller shows once (it is not stored)."""

    client_key: ClientApiKey
    key: str


def _audit(*, kind: str, client_key: ClientApiKey, params: dict[str, Any], requested_by: AbstractBaseUser | None,
           requester: str, message: str) -> Action:
    now = timezone.now()
    who = requested_by.get_username() if requested_by is not None else requester or "system"
    params = {"name": client_key.name, "prefix": client_key.prefix, **params}
    if requester:
        params["requester"] = requester
    return Action.objects.create(
        kind=kind, target_type="client_key", target_id=str(client_key.pk), target_repr=client_key.name[:200],
        params=params, requested_by=requested_by, status=Action.Status.SUCCEEDED, attempts=0, started_at=now,
        finished_at=now, log=[{"at": now.isoformat(), "message": f"requested by {who}"},
                              {"at": now.isoformat(), "message": message}])


def _limits(client_key: ClientApiKey) -> dict[str, Any]:
    return {"rate_per_s": client_key.rate_per_s, "burst": client_key.burst,
            "allowed_models": list(client_key.allowed_models)}


def _save(client_key: ClientApiKey) -> None:
    client_key.full_clean()
    try:
        with transaction.atomic():
            client_key.save()
    except IntegrityError as exc:  # a concurrent create of the same name (full_clean saw none)
        raise ValidationError({"name": [f"A client key named {client_key.name!r} already exists."]}) from exc


def client_key_create(*, name: str, rate_per_s: float | None = None, burst: int | None = None,
                      allowed_models: list[str] | None = None, requested_by: AbstractBaseUser | None = None,
                      requester: str = "") -> IssuedKey:
    """Create a client key with a new random secret; returns the row and the key (shown once).

    ``rate_per_s``: requests/s (None: unlimited); ``burst``: bucket depth in requests (needs ``rate_per_s``);
    ``allowed_models``: model names the key may use (empty: every model).

    Raises:
        ValidationError: a bad or taken name, a non-finite or non-positive rate, a burst without a rate or
            below 1, a malformed model list.
    """
    secret = client_key_secret_new()
    client_key = ClientApiKey(name=name, prefix=secret.prefix, key_sha256=secret.key_sha256, rate_per_s=rate_per_s,
                              burst=burst, allowed_models=list(allowed_models or []))
    with transaction.atomic():
        _save(client_key)
        _audit(kind=CLIENT_KEY_CREATE, client_key=client_key, params=_limits(client_key), requested_by=requested_by,
               requester=requester, message="key created; routing table republished")
        routing_table_publish()
    return IssuedKey(client_key, secret.key)


def client_key_update(*, client_key: ClientApiKey, requested_by: AbstractBaseUser | None = None,
                      requester: str = "", **changes: Any) -> ClientApiKey:
    """Change a key's limits (``rate_per_s``, ``burst``, ``allowed_models``); the secret stays. Records an
    Action only when something changed.

    Raises:
        ValidationError: an unknown field or a value as in :func:`client_key_create`.
        ConflictError: the key is revoked.
    """
    unknown = sorted(set(changes) - set(LIMIT_FIELDS))
    if unknown:
        raise ValidationError({f: ["Only rate_per_s, burst and allowed_models can change; rotate to change the "
                                   "secret, revoke and create to rename."] for f in unknown})
    with transaction.atomic():
        client_key = ClientApiKey.objects.select_for_update().get(pk=client_key.pk)
        if client_key.revoked_at is not None:
            raise ConflictError(f"Client key {client_key.name!r} is revoked; create a new key instead.")
        changed = {f: v for f, v in changes.items() if getattr(client_key, f) != v}
        if not changed:
            return client_key
        for field, value in changed.items():
            setattr(client_key, field, value)
        _save(client_key)
        _audit(kind=CLIENT_KEY_UPDATE, client_key=client_key, params={"changes": sorted(changed), **_limits(client_key)},
               requested_by=requested_by, requester=requester, message="limits changed; routing table republished")
        routing_table_publish()
    return client_key


def client_key_rotate(*, client_key: ClientApiKey, grace_s: float = 0, requested_by: AbstractBaseUser | None = None,
                      requester: str = "") -> IssuedKey:
    """Give the key a new random secret; returns the row and the new key (shown once).

    The old secret stops working at once (``grace_s`` 0) or after ``grace_s`` seconds (0..7 days), during which
    routers accept both; a grace that is still running from an earlier rotation ends now (two secrets at most).
    The end of a grace reaches the routers with the next reconcile tick's table (``FERRY_RECONCILE_INTERVAL_S``)
    plus one router poll.

    Raises:
        ValidationError: ``grace_s`` not a number in 0..604800.
        ConflictError: the key is revoked.
    """
    if isinstance(grace_s, bool) or not isinstance(grace_s, int | float) or not math.isfinite(grace_s) \
            or not 0 <= grace_s <= MAX_GRACE_S:
        raise ValidationError({"grace_s": [f"grace_s must be a number of seconds in 0..{MAX_GRACE_S} (7 days)."]})
    secret = client_key_secret_new()
    with transaction.atomic():
        client_key = ClientApiKey.objects.select_for_update().get(pk=client_key.pk)
        if client_key.revoked_at is not None:
            raise ConflictError(f"Client key {client_key.name!r} is revoked; create a new key instead.")
        now = timezone.now()
        client_key.previous_sha256 = client_key.key_sha256 if grace_s > 0 else ""
        client_key.previous_valid_until = now + timedelta(seconds=grace_s) if grace_s > 0 else None
        client_key.key_sha256, client_key.prefix, client_key.rotated_at = secret.key_sha256, secret.prefix, now
        _save(client_key)
        until = client_key.previous_valid_until
        _audit(kind=CLIENT_KEY_ROTATE, client_key=client_key,
               params={"grace_s": grace_s, "previous_valid_until": until.isoformat() if until else None},
               requested_by=requested_by, requester=requester,
               message=(f"new secret; the old one is accepted until {until.isoformat()}" if until
                        else "new secret; the old one is refused") + "; routing table republished")
        routing_table_publish()
    return IssuedKey(client_key, secret.key)


def client_key_revoke(*, client_key: ClientApiKey, requested_by: AbstractBaseUser | None = None,
                      requester: str = "") -> ClientApiKey:
    """Revoke the key (and any rotation grace): it leaves the routing table, so routers refuse it at their next
    table poll (1 s by default). The row stays for its history (use count, last use).

    Raises:
        ConflictError: already revoked.
    """
    with transaction.atomic():
        client_key = ClientApiKey.objects.select_for_update().get(pk=client_key.pk)
        if client_key.revoked_at is not None:
            raise ConflictError(f"Client key {client_key.name!r} was already revoked at "
                                f"{client_key.revoked_at.isoformat()}.")
        client_key.revoked_at = timezone.now()
        client_key.previous_valid_until = None
        client_key.save(update_fields=["revoked_at", "previous_valid_until"])
        _audit(kind=CLIENT_KEY_REVOKE, client_key=client_key, params={}, requested_by=requested_by,
               requester=requester, message="revoked; routing table republished")
        routing_table_publish()
    return client_key


def client_key_import(*, name: str, key_sha256: str, requester: str) -> tuple[ClientApiKey, bool]:
    """Make ``name`` an active key whose secret hashes to ``key_sha256`` (hex), for a key generated elsewhere
    (``make run``'s launcher keeps its key in ``var/launcher_tokens.json`` and gives setup only the hash).
    Idempotent: nothing happens when the key already has that hash; a different hash replaces the old one
    at once, and a revoked key of that name is reactivated with the new hash. Returns ``(row, changed)``.

    Raises:
        ValidationError: ``key_sha256`` is not 64 lowercase hex digits, or a bad name.
    """
    if not isinstance(key_sha256, str) or not re.fullmatch(SHA256_HEX, key_sha256):
        raise ValidationError({"key_sha256": ["A SHA-256 digest: 64 lowercase hex digits."]})
    with transaction.atomic():
        client_key = ClientApiKey.objects.select_for_update().filter(name=name).first()
        if client_key is not None and client_key.key_sha256 == key_sha256 and client_key.revoked_at is None:
            return client_key, False
        created = client_key is None
        client_key = client_key or ClientApiKey(name=name)
        client_key.key_sha256, client_key.prefix = key_sha256, "(imported)"
        client_key.previous_sha256, client_key.previous_valid_until, client_key.revoked_at = "", None, None
        _save(client_key)
        _audit(kind=CLIENT_KEY_IMPORT, client_key=client_key, params={"created": created}, requested_by=None,
               requester=requester, message="hash imported; routing table republished")
        routing_table_publish()
    return client_key, True
