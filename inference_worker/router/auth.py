"""Client API keys and per-key rate limits for the router.

Keys file (JSON)::

    {"keys": [{"name": "team-a", "key_sha256": "<hex sha256 of the key>", "rate_per_s": 5, "burst": 10},
              {"name": "dev", "key": "plaintext-key-for-development"}]}

Clients send ``Authorization: Bearer <key>``. A missing or unknown key is refused (401); a key over
its rate gets 429 with ``Retry-After`` in whole seconds (each key has a
:class:`~inference_worker.kv_transfer.bucket.TokenBucket` of ``rate_per_s`` requests/s, ``burst``
deep; no ``rate_per_s`` means unlimited). Keys are compared by sha256 digest in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from dataclasses import dataclass
from pathlib import Path

from inference_worker.kv_transfer.bucket import TokenBucket


@dataclass
class ApiKey:
    """One client key."""

    name: str
    digest: bytes
    bucket: TokenBucket | None


class ApiKeys:
    """The router's key set. Raises ValueError on a malformed file."""

    def __init__(self, keys: list[ApiKey]):
        self.keys = keys

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        """Load the keys file described in the module docstring."""
        try:
            data = json.loads(Path(path).read_text())
            keys = []
            for entry in data["keys"]:
                if "key_sha256" in entry:
                    digest = bytes.fromhex(entry["key_sha256"])
                else:
                    digest = hashlib.sha256(str(entry["key"]).encode()).digest()
                rate = entry.get("rate_per_s")
                bucket = None if rate is None else TokenBucket(float(rate), float(entry.get("burst", max(1, rate))))
                keys.append(ApiKey(str(entry["name"]), digest, bucket))
        except (OSError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"invalid API keys file {path}: {exc!r}") from exc
        return cls(keys)

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
