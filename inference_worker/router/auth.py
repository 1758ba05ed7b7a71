"""Client API keys and per-key rate limits for the router.

Keys come from two places, and a router uses both when both are configured:

* the routing table's ``client_keys`` (keys managed in the control plane, hashes only; see
  :mod:`inference_worker.router.table`): they replace the previous table's keys at every table refresh, so
  a key revoked in the control plane is refused from the router's next poll;
* a keys file (``--api-keys``, for routers without a control plane) or one key in ``FERRY_ROUTER_API_KEY``.

Keys file (JSON)::

    {"keys": [{"name": "team-a", "key_sha256": "<hex sha256 of the key>", "rate_per_s": 5, "burst": 10},
              {"name": "dev", "key": "plaintext-key-for-development"}]}

A table entry has the file's hashed form, ``{"name", "key_sha256", "rate_per_s", "burst"}`` (null rate:
unlimited), plus ``"models"`` (the model names the key may use) when it is restricted.

Clients send ``Authorization: Bearer <key>``. A missing or unknown key is refused (401); a key over
its rate gets 429 with ``Retry-After`` in whole seconds (each key *name* has a
:class:`~inference_worker.kv_transfer.bucket.TokenBucket` of ``rate_per_s`` requests/s, ``burst``
deep (default ``max(1, rate_per_s)``); no ``rate_per_s`` means unlimited). Entries sharing a name (a key's old
and new secret during a rotation's grace period) share its bucket, and a table refresh keeps a bucket whose
limits did not change. Keys are compared by sha256 digest in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from inference_worker.kv_transfer.bucket import TokenBucket

_SHA256_HEX = re.compile(r"^[0-9a-fA-F]{64}$")


@dataclass(frozen=True)
class KeySpec:
    """One key as configured (file or routing table), before the router gives it a bucket."""

    name: str
    digest: bytes
    """sha256 of the key (32 bytes)."""
    rate_per_s: float | None = None
    """Requests per second; None: unlimited."""
    burst: float | None = None
    """Bucket depth, requests; None: ``max(1, rate_per_s)``."""
    models: frozenset[str] | None = None
    """Model names the key may use; None: every model."""

    @classmethod
    def from_entry(cls, entry: dict) -> KeySpec:
        """Parse a file or table entry (module docstring). Raises ValueError, KeyError or TypeError."""
        name = entry["name"]
        if not isinstance(name, str) or not name:
            raise ValueError(f"key name must be a non-empty string, got {name!r}")
        if "key_sha256" in entry:
            if not isinstance(entry["key_sha256"], str) or not _SHA256_HEX.match(entry["key_sha256"]):
                raise ValueError(f"key {name!r}: key_sha256 must be 64 hex digits")
            digest = bytes.fromhex(entry["key_sha256"])
        else:
            digest = hashlib.sha256(str(entry["key"]).encode()).digest()
        rate, burst = entry.get("rate_per_s"), entry.get("burst")
        if rate is not None and (not math.isfinite(float(rate)) or float(rate) <= 0):
            raise ValueError(f"key {name!r}: rate_per_s must be a positive number, got {rate!r}")
        if burst is not None and (not math.isfinite(float(burst)) or float(burst) < 1):
            raise ValueError(f"key {name!r}: burst must be >= 1, got {burst!r}")
        models = entry.get("models")
        if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
            raise ValueError(f"key {name!r}: models must be a list of model names")
        return cls(name, digest, None if rate is None else float(rate), None if burst is None else float(burst),
                   frozenset(models) if models else None)

    def new_bucket(self) -> TokenBucket | None:
        if self.rate_per_s is None:
            return None
        return TokenBucket(self.rate_per_s, self.burst if self.burst is not None else max(1.0, self.rate_per_s))


@dataclass
class ApiKey:
    """One client key."""

    name: str
    digest: bytes
    bucket: TokenBucket | None
    models: frozenset[str] | None = None
    """Model names the key may use; None: every model."""

    def allows(self, model: str | None) -> bool:
        """Whether the key may use ``model`` (a restricted key must name one of its models)."""
        return self.models is None or (model is not None and model in self.models)


class ApiKeys:
    """The router's key set. Raises ValueError on a malformed file."""

    def __init__(self, keys: list[ApiKey]):
        self.keys = keys

    @classmethod
    def from_specs(cls, specs: Iterable[KeySpec], *, previous: ApiKeys | None = None) -> ApiKeys:
        """Keys with buckets: one bucket per name (its first spec's limits), taken over from ``previous`` when a
        key of that name had the same limits there (a table refresh does not refill a key's bucket)."""
        old = {} if previous is None else {k.name: k.bucket for k in previous.keys}
        buckets: dict[str, TokenBucket | None] = {}
        keys = []
        for spec in specs:
            if spec.name not in buckets:
                kept = old.get(spec.name)
                same = (kept is not None and spec.rate_per_s == kept.rate_per_s
                        and (spec.burst if spec.burst is not None else max(1.0, spec.rate_per_s)) == kept.burst)
                buckets[spec.name] = kept if same else spec.new_bucket()
            keys.append(ApiKey(spec.name, spec.digest, buckets[spec.name], spec.models))
        return cls(keys)

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        """Load the keys file described in the module docstring."""
        try:
            data = json.loads(Path(path).read_text())
            specs = [KeySpec.from_entry(entry) for entry in data["keys"]]
        except (OSError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"invalid API keys file {path}: {exc!r}") from exc
        return cls.from_specs(specs)

    def with_table_keys(self, specs: Iterable[KeySpec], *, previous: ApiKeys | None = None) -> ApiKeys:
        """These keys (the file's or the environment's) plus the routing table's ``specs``; buckets of table keys
        carry over from ``previous`` (the last merged set) as in :meth:`from_specs`."""
        return ApiKeys(list(self.keys) + ApiKeys.from_specs(specs, previous=previous).keys)

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The key named by an ``Authorization: Bearer`` header value, or None."""
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        digest = hashlib.sha256(authorization[7:].strip().encode()).digest()
        found = None
        for key in self.keys:
            if hmac.compare_digest(key.digest, digest):
                found = key
        return found

    @staticmethod
    def retry_after_s(key: ApiKey) -> int:
        """0 if the key may send a request now (and takes its token), else whole seconds to wait."""
        if key.bucket is None:
            return 0
        wait = key.bucket.try_acquire(1.0)
        return 0 if wait == 0 else max(1, math.ceil(wait))
