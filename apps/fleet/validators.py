"""Validators for fleet JSON fields, following Kubernetes' own syntax rules.

Sources: Kubernetes API conventions for label keys/values (``[prefix/]name``, name <= 63 chars,
alphanumeric with ``-_.`` inside), resource quantities (``500m``, ``4``, ``16Gi``) and
tolerations (``key``, ``operator`` Equal|Exists, ``value``, ``effect``, ``tolerationSeconds``).
"""

from __future__ import annotations

import ipaddress
import re
from datetime import time
from typing import Any
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django.core.exceptions import ValidationError
from django.core.validators import URLValidator

_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
TOLERATION_OPERATORS = ("Equal", "Exists")
TOLERATION_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_HHMM = re.compile(r"^([01][0-9]|2[0-3]):[0-5][0-9]$")


def _label_key_ok(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    return bool(_LABEL_NAME.match(name)) and (not prefix or bool(_DNS_SUBDOMAIN.match(prefix)))


def validate_labels(value: Any) -> None:
    """A ``{key: value}`` object of Kubernetes-style labels (values may be empty)."""
    if not isinstance(value, dict):
        raise ValidationError("Must be a JSON object of label key to string value.")
    for key, val in value.items():
        if not _label_key_ok(key):
            raise ValidationError(f"Label key {key!r} is invalid: use [prefix/]name, name <= 63 chars, alphanumeric "
                                  "with '-', '_' or '.' inside.")
        if not isinstance(val, str) or (val and not _LABEL_NAME.match(val)):
            raise ValidationError(f"Label value for {key!r} must be a string of <= 63 alphanumeric, '-', '_', '.'.")


def validate_quantity(value: str) -> None:
    """A Kubernetes resource quantity such as ``500m``, ``4`` or ``16Gi`` (empty allowed)."""
    if value and not QUANTITY.match(value):
        raise ValidationError(f"{value!r} is not a Kubernetes quantity (examples: 500m, 4, 16Gi).")


def validate_tolerations(value: Any) -> None:
    """A list of Kubernetes tolerations."""
    if not isinstance(value, list):
        raise ValidationError("Must be a JSON list of tolerations.")
    allowed = {"key", "operator", "value", "effect", "tolerationSeconds"}
    for i, tol in enumerate(value):
        if not isinstance(tol, dict):
            raise ValidationError(f"Toleration {i} must be an object.")
        unknown = sorted(set(tol) - allowed)
        if unknown:
            raise ValidationError(f"Toleration {i} has unknown keys {unknown}; allowed: {sorted(allowed)}.")
        operator = tol.get("operator", "Equal")
        if operator not in TOLERATION_OPERATORS:
            raise ValidationError(f"Toleration {i}: operator must be Equal or Exists.")
        key = tol.get("key", "")
        if not isinstance(key, str) or (key and not _label_key_ok(key)):
            raise ValidationError(f"Toleration {i}: key must be a label key.")
        if not key and operator != "Exists":
            raise ValidationError(f"Toleration {i}: an empty key needs operator Exists.")
        val = tol.get("value", "")
        if not isinstance(val, str) or (val and not _LABEL_NAME.match(val)):
            raise ValidationError(f"Toleration {i}: value must be a label value string.")
        if operator == "Exists" and val:
            raise ValidationError(f"Toleration {i}: operator Exists takes no value.")
        if tol.get("effect", "") not in TOLERATION_EFFECTS:
            raise ValidationError(f"Toleration {i}: effect must be one of {TOLERATION_EFFECTS[1:]} or empty.")
        seconds = tol.get("tolerationSeconds")
        if seconds is not None and (not isinstance(seconds, int) or isinstance(seconds, bool) or seconds < 0):
            raise ValidationError(f"Toleration {i}: tolerationSeconds must be an integer >= 0.")


def validate_time_zone(value: str) -> None:
    """An IANA time zone name known to ``zoneinfo`` (e.g. UTC, Europe/Paris)."""
    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ValidationError(f"Unknown time zone {value!r}; use an IANA name such as UTC or Europe/Paris.") from exc


def parse_hhmm(value: Any) -> time:
    """``"HH:MM"`` (24 h) as a ``time``. Raises ValidationError otherwise."""
    if not isinstance(value, str) or not _HHMM.match(value):
        raise ValidationError(f"{value!r} is not a time of day HH:MM (00:00..23:59).")
    return time(int(value[:2]), int(value[3:]))


def validate_schedule_overrides(value: Any) -> None:
    """A list of windows ``{"start": "HH:MM", "end": "HH:MM", "replicas": N, "days": ["mon", ...]}``.

    Times are in the pool's ``schedule_time_zone``; ``end`` before ``start`` wraps past midnight;
    ``days`` is optional (default every day); ``replicas`` is the total desired while the window is open.
    """
    if not isinstance(value, list):
        raise ValidationError("Must be a JSON list of windows.")
    allowed = {"start", "end", "replicas", "days"}
    for i, window in enumerate(value):
        if not isinstance(window, dict):
            raise ValidationError(f"Window {i} must be an object.")
        unknown = sorted(set(window) - allowed)
        missing = sorted({"start", "end", "replicas"} - set(window))
        if unknown or missing:
            raise ValidationError(f"Window {i}: unknown keys {unknown}, missing keys {missing}.")
        if parse_hhmm(window["start"]) == parse_hhmm(window["end"]):
            raise ValidationError(f"Window {i}: start and end must differ.")
        replicas = window["replicas"]
        if not isinstance(replicas, int) or isinstance(replicas, bool) or not 0 <= replicas <= 10_000:
            raise ValidationError(f"Window {i}: replicas must be an integer in 0..10000.")
        days = window.get("days", list(WEEKDAYS))
        if not isinstance(days, list) or not days or any(d not in WEEKDAYS for d in days):
            raise ValidationError(f"Window {i}: days must be a non-empty list of {', '.join(WEEKDAYS)}.")


def validate_cidr_list(value: Any) -> None:
    """A JSON list of IPv4/IPv6 networks in CIDR notation without host bits (``["10.8.0.0/16"]``)."""
    if not isinstance(value, list):
        raise ValidationError('Must be a JSON list of CIDRs, e.g. ["10.8.0.0/16"].')
    for item in value:
        if not isinstance(item, str):
            raise ValidationError(f"{item!r} is not a string; give CIDRs such as 10.8.0.0/16.")
        try:
            ipaddress.ip_network(item, strict=True)
        except ValueError as exc:
            raise ValidationError(f"{item!r} is not a CIDR such as 10.8.0.0/16: {exc}.") from exc


def validate_router_url(value: str) -> None:
    """A router's base URL: ``http(s)://host[:port]`` and nothing else.

    Raises ValidationError for another scheme (``file:``, ``gopher:``...), user info, a path other than
    ``/``, a query or fragment (an empty ``?`` or ``#`` included), a port outside 1..65535, or a URL Django's
    ``URLValidator`` refuses.
    """
    URLValidator(schemes=["http", "https"])(value)
    parts = urlsplit(value)
    if (parts.username or parts.password or parts.path not in ("", "/") or parts.query or parts.fragment
            or "?" in value or "#" in value):
        raise ValidationError(f"{value!r} must be a router's base URL: http(s)://host[:port], nothing after it.")
    try:
        port = parts.port
    except ValueError:  # urlsplit: out of 0..65535
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValidationError(f"{value!r}: the port must be within 1..65535.")
