"""Signal history in Redis: the last 15 minutes per pool and for the fleet, and sequence numbers.

Layout (prefix ``ferry:telemetry:`` by default):

- ``history:<scope>``: a sorted set, score = poll time (Unix seconds), member = the JSON
  record (which includes its sequence number, so members are unique). Each append trims
  entries older than ``horizon_s`` (900 s) with ``ZREMRANGEBYSCORE``.
- ``seq:<group>``: an ``INCR`` counter per channel-layer group; it lives in Redis, so numbers
  keep increasing across poller restarts and a client detects a gap by a skipped number.

Nothing here lives in the poller's memory: a restarted poller finds the history where it was.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import redis
from django.conf import settings

HISTORY_HORIZON_S = 900.0


def redis_client() -> redis.Redis:
    """A client for ``settings.REDIS_URL`` (the broker/channel-layer Redis)."""
    return redis.Redis.from_url(settings.REDIS_URL)


class SignalHistory:
    """Append/read signal records per scope (``pool:<id>`` or ``fleet``) with trimming.

    Raises ``ValueError`` for a non-positive horizon; Redis errors propagate
    (``redis.RedisError``).
    """

    def __init__(self, client: redis.Redis | None = None, *, prefix: str = "ferry:telemetry:",
                 horizon_s: float = HISTORY_HORIZON_S):
        if horizon_s <= 0:
            raise ValueError(f"history horizon must be positive, got {horizon_s} s")
        self.client = client if client is not None else redis_client()
        self.prefix = prefix
        self.horizon_s = horizon_s

    def _key(self, kind: str, name: str) -> str:
        return f"{self.prefix}{kind}:{name}"

    def append_many(self, records: Iterable[tuple[str, float, dict]]) -> int:
        """Store many ``(scope, at_s, record)`` in pipelined batches (no trimming: a bulk load, e.g. a bench filling
        the history a poller would have written). Returns the number stored."""
        pipe = self.client.pipeline(transaction=False)
        stored = 0
        for scope, at_s, record in records:
            pipe.zadd(self._key("history", scope), {json.dumps(record, sort_keys=True, separators=(",", ":")): at_s})
            stored += 1
            if stored % 5000 == 0:
                pipe.execute()
        pipe.execute()
        return stored

    def next_seq(self, group: str) -> int:
        """The next sequence number of ``group`` (1, 2, ...; survives restarts)."""
        return int(self.client.incr(self._key("seq", group)))

    def current_seq(self, group: str) -> int:
        """The last sequence number handed out for ``group`` (0 if none)."""
        value = self.client.get(self._key("seq", group))
        return int(value) if value is not None else 0

    def append(self, scope: str, at_s: float, record: dict) -> None:
        """Store ``record`` (JSON-serializable) for ``scope`` at ``at_s`` and trim old entries."""
        key = self._key("history", scope)
        pipe = self.client.pipeline()
        pipe.zadd(key, {json.dumps(record, sort_keys=True, separators=(",", ":")): at_s})
        pipe.zremrangebyscore(key, "-inf", f"({at_s - self.horizon_s}")
        pipe.expire(key, int(self.horizon_s * 2))
        pipe.execute()

    def read(self, scope: str, *, since_s: float | None = None, until_s: float | None = None) -> list[dict]:
        """Records of ``scope`` in time order, optionally limited to ``since_s <= t <= until_s``."""
        low = "-inf" if since_s is None else since_s
        high = "+inf" if until_s is None else until_s
        return [json.loads(raw) for raw in self.client.zrangebyscore(self._key("history", scope), low, high)]

    def read_many(self, scopes: Iterable[str], *, since_s: float | None = None,
                  until_s: float | None = None) -> dict[str, list[dict]]:
        """:meth:`read` of several scopes in one Redis round trip (a pipeline): scope -> records in time order."""
        scopes = list(scopes)
        low = "-inf" if since_s is None else since_s
        high = "+inf" if until_s is None else until_s
        pipe = self.client.pipeline(transaction=False)
        for scope in scopes:
            pipe.zrangebyscore(self._key("history", scope), low, high)
        return {scope: [json.loads(raw) for raw in found] for scope, found in zip(scopes, pipe.execute(), strict=True)}

    def latest(self, scope: str) -> dict | None:
        """The newest record of ``scope``, or ``None``."""
        raw = self.client.zrange(self._key("history", scope), -1, -1)
        return json.loads(raw[0]) if raw else None

    def put_snapshot(self, kind: str, name: str, record: dict, *, ttl_s: float = 3600.0) -> None:
        """Replace the one snapshot of ``kind``/``name`` (e.g. a pool's slow requests), kept ``ttl_s`` seconds."""
        self.client.set(self._key(kind, name), json.dumps(record, separators=(",", ":")), ex=int(ttl_s))

    def snapshot(self, kind: str, name: str) -> dict | None:
        """The snapshot :meth:`put_snapshot` stored, or ``None``."""
        raw = self.client.get(self._key(kind, name))
        return json.loads(raw) if raw else None
    def latest_many(self, scopes: Iterable[str]) -> dict[str, dict | None]:
        """:meth:`latest` of several scopes in one Redis round trip (a pipeline): scope -> record or ``None``."""
        scopes = list(scopes)
        pipe = self.client.pipeline(transaction=False)
        for scope in scopes:
            pipe.zrange(self._key("history", scope), -1, -1)
        return {scope: json.loads(found[0]) if found else None
                for scope, found in zip(scopes, pipe.execute(), strict=True)}

    def clear(self) -> None:
        """Delete every key under the prefix (tests and ``telemetry --reset``)."""
        keys = list(self.client.scan_iter(match=f"{self.prefix}*"))
        if keys:
            self.client.delete(*keys)
