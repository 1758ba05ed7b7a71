"""``ClientApiKey``: a client's key for the router (``Authorization: Bearer <key>``), managed in the control plane.

Only the SHA-256 of a key is stored, never the key. The keys are 256-bit random strings
(:func:`apps.accounts.services.client_key_secret_new`), so a preimage search is out of reach and a slow
password hasher (PBKDF2, Argon2) would only cost the router a KDF per request; a fast, unsalted hash is what
lets the router verify each request with one SHA-256 and a constant-time compare, and what the routing table
can carry to every router (``client_keys``: hashes only).

A key keeps its ``name`` (its identity in the router's per-key metrics and rate limits) across rotations: a
rotation replaces ``key_sha256`` and may keep the old hash valid until ``previous_valid_until`` (a grace period
for clients to switch). A key is *active* while ``revoked_at`` is empty; a revoked key leaves the routing table
(routers refuse it within one table poll). ``use_count`` and ``last_used_at`` are written by the telemetry
poller from the routers' ``ferry_router_requests_by_key_total`` counters, not per request.
"""

from __future__ import annotations

import math

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.db.models import Q
from django.utils import timezone

KEY_NAME = r"^[a-z0-9][a-z0-9_.-]{0,62}$"
SHA256_HEX = r"^[0-9a-f]{64}$"
MAX_RATE_PER_S = 1_000_000.0
MAX_BURST = 1_000_000
MAX_MODELS = 64


def validate_rate_per_s(value: float) -> None:
    """Requests per second: finite, > 0 and at most ``MAX_RATE_PER_S``; raises ValidationError."""
    if not math.isfinite(value) or not 0 < value <= MAX_RATE_PER_S:
        raise ValidationError(f"rate_per_s must be a finite number in (0, {MAX_RATE_PER_S:g}] requests/s.")


def validate_model_names(value: object) -> None:
    """A list of distinct, non-empty OpenAI model names (at most ``MAX_MODELS``); raises ValidationError."""
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() and len(v) <= 200 for v in value):
        raise ValidationError('allowed_models must be a list of model names, e.g. ["gemma-3-270m"] (empty: every model).')
    if len(set(value)) != len(value) or len(value) > MAX_MODELS:
        raise ValidationError(f"allowed_models must name each model once, at most {MAX_MODELS}.")


class ClientApiKey(models.Model):
    """One client API key (see the module docstring)."""

    name = models.CharField(max_length=63, unique=True,
                            validators=[RegexValidator(KEY_NAME, "Use lowercase letters, digits, '_', '.' and '-' "
                                                                 "(1-63, starting with a letter or digit).")],
                            help_text="Who holds the key; the label of its router metrics.")
    prefix = models.CharField(max_length=16, editable=False, help_text="The key's first characters, for display.")
    key_sha256 = models.CharField(max_length=64, unique=True, editable=False,
                                  validators=[RegexValidator(SHA256_HEX, "A SHA-256 digest: 64 lowercase hex.")],
                                  help_text="SHA-256 (hex) of the key; the key itself is never stored.")
    previous_sha256 = models.CharField(max_length=64, blank=True, editable=False,
                                       help_text="The hash before the last rotation, valid until previous_valid_until.")
    previous_valid_until = models.DateTimeField(null=True, blank=True, editable=False)
    rate_per_s = models.FloatField(null=True, blank=True, validators=[validate_rate_per_s],
                                   help_text="Requests per second (token bucket); empty: unlimited.")
    burst = models.PositiveIntegerField(null=True, blank=True,
                                        validators=[MinValueValidator(1), MaxValueValidator(MAX_BURST)],
                                        help_text="Bucket depth, requests (default: max(1, rate_per_s)).")
    allowed_models = models.JSONField(default=list, blank=True, validators=[validate_model_names],
                              help_text="Model names the key may use; empty: every model.")
    created_at = models.DateTimeField(auto_now_add=True)
    rotated_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    use_count = models.PositiveBigIntegerField(default=0, editable=False)

    class Meta:
        ordering = ["name"]
        constraints = [models.CheckConstraint(condition=Q(burst__isnull=True) | Q(rate_per_s__isnull=False),
                                              name="accounts_clientapikey_burst_needs_rate",
                                              violation_error_message="burst needs rate_per_s.")]

    def __str__(self) -> str:
        return self.name

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    def previous_valid(self, now=None) -> bool:  # noqa: ANN001 - a datetime
        """True while the pre-rotation hash is still accepted (grace period)."""
        now = now or timezone.now()
        return bool(self.previous_sha256) and self.previous_valid_until is not None and self.previous_valid_until > now
