"""Signal history in Redis: the last 15 minutes per pool, the newest fleet record, and sequence numbers.

Layout (prefix ``ferry:telemetry:`` by default), per scope (``pool:<id>`` or ``fleet``; the poller keeps only the
newest fleet record, :meth:`SignalHistory.replace`: nothing reads the fleet's past):

- ``history:<scope>:recent``: a list of the newest records, one member each, oldest first. A member is the
  compact JSON (sorted keys) of ``[at_s, record]``, ``at_s`` the poll time in Unix seconds.
- ``history:<scope>:chunks``: a sorted set of *sealed chunks*: each member is one zstandard frame of
  ``CHUNK_RECORDS - 1`` (or, from :meth:`SignalHistory.append_many`, up to ``CHUNK_RECORDS``) recent-list
  members joined by ``\\n``; its score is the newest ``at_s`` in it. A thinned chunk's member is ``T`` and then
  the frame of the records it kept.
- ``seq:<group>``: an ``INCR`` counter per channel-layer group; it lives in Redis, so numbers keep increasing
  across poller restarts and a client detects a gap by a skipped number.

Why chunks: a record is ~1-3 KB of JSON (about 25 signals per pool and per track, the KV transfer breakdown)
that repeats its keys and most values from one poll to the next. One sorted-set member per record (the
layout before) costs the whole JSON plus a skiplist node and dict entry per poll: Redis grew ~3.3 MiB while the
2-pool demo's history filled its 15 minutes. Compressed together, 29 consecutive records cost about a tenth
(zstandard finds the repeated keys and values), and Redis holds 31 chunks and at most ``CHUNK_RECORDS`` raw
members per scope: 253 KiB (``MEMORY USAGE``) at the full horizon of that demo in ``bench/chaos.py --soak``.

Appends: ``RPUSH`` the member, drop chunks whose newest record is older than ``at_s - horizon_s``
(``ZREMRANGEBYSCORE``), refresh both keys' expiry (2 x horizon); once the list holds ``CHUNK_RECORDS``
members, all but the newest are compressed into one chunk, added and trimmed from the list in one
``MULTI`` under ``WATCH`` of the list (a concurrent append retries the seal; nothing is lost or doubled).
Thinning: after each seal, chunks whose newest record is more than ``THIN_AFTER_S`` (5 minutes) behind the
append are rewritten (``WATCH``/``MULTI``, member prefixed ``T``) to the first record of every ``THIN_EVERY_S``
(5 s) of Unix time. A record is a signal window of ``window_s`` (30 s in ``make run``) polled every second, so one
per 5 s still overlaps every window several times: the last 5 minutes stay at full resolution for the stream,
the gates and the autoscaler (``telemetry_signal`` reads the newest record), the 10 older minutes of the pool
page's charts are drawn from one point per 5 s, and a gate window longer than 5 minutes counts one record per
5 s beyond them. The horizon then holds about 300 + 120 records per pool instead of 900, and Redis reaches its
steady size about 5 minutes after the poller starts instead of 15: issue 20's soak measures every process' RSS
from minute 5, and with the whole horizon at full resolution the embedded Redis grew 5.1% by minute 30 while
the history filled (replaying the demo's real poll records, ``bench/history_memory.py``: RSS growth from
minute 5 to 30 2.5-2.6% without thinning, 1.8% with it). :meth:`SignalHistory.append_many` (bulk loads) does
not thin.
Reads take both keys in one ``MULTI``, so a seal is never seen half done. Records older than the newest
append's ``at_s - horizon_s`` (the older part of the oldest chunk) are left out of reads, so a read returns
exactly the records of the horizon (thinned beyond ``THIN_AFTER_S``), as the per-record trimming did.

Nothing here lives in the poller's memory: a restarted poller finds the history where it was.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

import redis
import zstandard
from django.conf import settings

HISTORY_HORIZON_S = 900.0
CHUNK_RECORDS = 30
"""Records per scope in the recent list before all but the newest are sealed into one compressed chunk."""
ZSTD_LEVEL = 3
"""zstandard level of the chunks (the library's default)."""
THIN_AFTER_S = 300.0
"""Records more than this behind the newest append are thinned to one per :data:`THIN_EVERY_S` (see the
module docstring)."""
THIN_EVERY_S = 5.0
THINNED = b"T"
"""First byte of a thinned chunk's member (then its zstandard frame)."""


def redis_client() -> redis.Redis:
    """A client for ``settings.REDIS_URL`` (the broker/channel-layer Redis)."""
    return redis.Redis.from_url(settings.REDIS_URL)


def _encode(at_s: float, record: dict) -> bytes:
    return json.dumps([at_s, record], sort_keys=True, separators=(",", ":")).encode()


def _decode(member: bytes) -> tuple[float, dict]:
    at_s, record = json.loads(member)
    return float(at_s), record


def _member_at(member: bytes) -> float:
    """The ``at_s`` of a member without parsing its record (a member starts ``[<at_s>,``)."""
    return float(member[1:member.index(b",")])


def _unchunk(blob: bytes) -> list[bytes]:
    return zstandard.ZstdDecompressor().decompress(blob[1:] if blob[:1] == THINNED else blob).split(b"\n")


def _thin_members(members: list[bytes], every_s: float) -> list[bytes]:
    """The first member of every ``every_s``-second bucket of Unix time (``floor(at_s / every_s)``), in order."""
    kept, bucket = [], None
    for member in members:
        b = math.floor(_member_at(member) / every_s)
        if b != bucket:
            kept.append(member)
            bucket = b
    return kept


class SignalHistory:
    """Append/read signal records per scope (``pool:<id>`` or ``fleet``) with trimming.

    Raises ``ValueError`` for a non-positive horizon or fewer than 2 ``chunk_records``; Redis errors
    propagate (``redis.RedisError``).
    """

    def __init__(self, client: redis.Redis | None = None, *, prefix: str = "ferry:telemetry:",
                 horizon_s: float = HISTORY_HORIZON_S, chunk_records: int = CHUNK_RECORDS,
                 thin_after_s: float | None = THIN_AFTER_S, thin_every_s: float = THIN_EVERY_S):
        if horizon_s <= 0:
            raise ValueError(f"history horizon must be positive, got {horizon_s} s")
        if chunk_records < 2:
            raise ValueError(f"chunk_records must be at least 2, got {chunk_records}")
        if thin_after_s is not None and (thin_after_s <= 0 or thin_every_s <= 0):
            raise ValueError(f"thin_after_s and thin_every_s must be positive, got {thin_after_s}, {thin_every_s}")
        self.thin_after_s = thin_after_s
        self.thin_every_s = thin_every_s
        self.client = client if client is not None else redis_client()
        self.prefix = prefix
        self.horizon_s = horizon_s
        self.chunk_records = chunk_records

    def _key(self, kind: str, name: str) -> str:
        return f"{self.prefix}{kind}:{name}"

    def _recent_key(self, scope: str) -> str:
        return f"{self.prefix}history:{scope}:recent"

    def _chunks_key(self, scope: str) -> str:
        return f"{self.prefix}history:{scope}:chunks"

    def history_keys(self, scope: str) -> tuple[str, str]:
        """The Redis keys holding ``scope``'s history (the recent list, the chunk set), e.g. for ``MEMORY USAGE``."""
        return self._recent_key(scope), self._chunks_key(scope)

    # -- writes ------------------------------------------------------------------------------------------------
    def append(self, scope: str, at_s: float, record: dict) -> None:
        """Store ``record`` (JSON-serializable) for ``scope`` at ``at_s`` and trim what left the horizon."""
        recent, chunks = self.history_keys(scope)
        ttl_s = int(self.horizon_s * 2)
        pipe = self.client.pipeline()
        pipe.rpush(recent, _encode(at_s, record))
        pipe.zremrangebyscore(chunks, "-inf", f"({at_s - self.horizon_s}")
        pipe.expire(recent, ttl_s)
        pipe.expire(chunks, ttl_s)
        length = pipe.execute()[0]
        if length >= self.chunk_records:
            self._seal(scope)
            if self.thin_after_s is not None:
                self._thin(scope, at_s - self.thin_after_s)

    def replace(self, scope: str, at_s: float, record: dict) -> None:
        """Store ``record`` as the only record of ``scope`` (a scope of which only the newest is read, e.g. the
        fleet's: :meth:`latest` answers it, :meth:`read` returns it alone)."""
        recent, chunks = self.history_keys(scope)
        pipe = self.client.pipeline()
        pipe.delete(recent, chunks)
        pipe.rpush(recent, _encode(at_s, record))
        pipe.expire(recent, int(self.horizon_s * 2))
        pipe.execute()

    def _seal(self, scope: str) -> None:
        """Compress all but the newest member of the recent list into one chunk (see the module docstring)."""
        recent, chunks = self.history_keys(scope)
        with self.client.pipeline() as pipe:
            while True:
                try:
                    pipe.watch(recent)
                    members = pipe.lrange(recent, 0, -2)
                    if len(members) < self.chunk_records - 1:
                        pipe.unwatch()
                        return  # another writer sealed them first
                    newest = max(_member_at(m) for m in members)
                    blob = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(b"\n".join(members))
                    pipe.multi()
                    pipe.zadd(chunks, {blob: newest})
                    pipe.ltrim(recent, len(members), -1)
                    pipe.expire(chunks, int(self.horizon_s * 2))
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue

    def _thin(self, scope: str, before_s: float) -> int:
        """Thin the chunks whose newest record is older than ``before_s`` (and at most a horizon older: the ones
        crossing that line since the last seals) to one record per ``thin_every_s``; returns chunks thinned.
        A concurrent change of the chunk set skips this round (the next seal thins them)."""
        _, chunks = self.history_keys(scope)
        with self.client.pipeline() as pipe:
            try:
                pipe.watch(chunks)
                found = pipe.zrangebyscore(chunks, before_s - self.horizon_s, f"({before_s}", withscores=True)
                todo = [(blob, score) for blob, score in found if blob[:1] != THINNED]
                if not todo:
                    pipe.unwatch()
                    return 0
                compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
                pipe.multi()
                for blob, score in todo:
                    members = _thin_members(_unchunk(blob), self.thin_every_s)
                    pipe.zrem(chunks, blob)
                    pipe.zadd(chunks, {THINNED + compressor.compress(b"\n".join(members)): score})
                pipe.execute()
                return len(todo)
            except redis.WatchError:
                return 0

    def append_many(self, records: Iterable[tuple[str, float, dict]]) -> int:
        """Store many ``(scope, at_s, record)`` in pipelined batches (no trimming: a bulk load, e.g. a bench filling
        the history a poller would have written): per scope, full chunks of ``chunk_records`` in the given order and
        the last record in the recent list. Returns the number stored."""
        by_scope: dict[str, list[bytes]] = {}
        times: dict[str, list[float]] = {}
        stored = 0
        for scope, at_s, record in records:
            by_scope.setdefault(scope, []).append(_encode(at_s, record))
            times.setdefault(scope, []).append(at_s)
            stored += 1
        pipe = self.client.pipeline(transaction=False)
        compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        queued = 0
        for scope, members in by_scope.items():
            recent, chunks = self.history_keys(scope)
            for start in range(0, len(members) - 1, self.chunk_records):
                part = members[start:min(start + self.chunk_records, len(members) - 1)]
                pipe.zadd(chunks, {compressor.compress(b"\n".join(part)): max(times[scope][start:start + len(part)])})
                queued += 1
            pipe.rpush(recent, members[-1])
            queued += 1
            if queued >= 500:
                pipe.execute()
                queued = 0
        pipe.execute()
        return stored

    def next_seq(self, group: str) -> int:
        """The next sequence number of ``group`` (1, 2, ...; survives restarts)."""
        return int(self.client.incr(self._key("seq", group)))

    def current_seq(self, group: str) -> int:
        """The last sequence number handed out for ``group`` (0 if none)."""
        value = self.client.get(self._key("seq", group))
        return int(value) if value is not None else 0

    # -- reads -------------------------------------------------------------------------------------------------
    def read(self, scope: str, *, since_s: float | None = None, until_s: float | None = None) -> list[dict]:
        """Records of ``scope`` in time order (equal times in append order), optionally limited to
        ``since_s <= t <= until_s``; only those within ``horizon_s`` of the newest append."""
        return self.read_many([scope], since_s=since_s, until_s=until_s)[scope]

    def read_many(self, scopes: Iterable[str], *, since_s: float | None = None,
                  until_s: float | None = None) -> dict[str, list[dict]]:
        """:meth:`read` of several scopes in one Redis round trip (a ``MULTI``): scope -> records in time order."""
        scopes = list(scopes)
        pipe = self.client.pipeline(transaction=True)
        for scope in scopes:
            recent, chunks = self.history_keys(scope)
            pipe.zrangebyscore(chunks, "-inf" if since_s is None else since_s, "+inf")
            pipe.lrange(recent, 0, -1)
        found = pipe.execute()
        out: dict[str, list[dict]] = {}
        for i, scope in enumerate(scopes):
            blobs, members = found[2 * i], found[2 * i + 1]
            if not members and not blobs:
                out[scope] = []
                continue
            decoded = [_decode(m) for blob in blobs for m in _unchunk(blob)] + [_decode(m) for m in members]
            low = -float("inf") if since_s is None else since_s
            if members:  # the newest append's horizon (the oldest chunk may reach further back)
                low = max(low, decoded[-1][0] - self.horizon_s)
            high = float("inf") if until_s is None else until_s
            decoded.sort(key=lambda pair: pair[0])
            out[scope] = [record for at_s, record in decoded if low <= at_s <= high]
        return out

    def latest(self, scope: str) -> dict | None:
        """The record appended last to ``scope``, or ``None``."""
        return self.latest_many([scope])[scope]

    def latest_many(self, scopes: Iterable[str]) -> dict[str, dict | None]:
        """:meth:`latest` of several scopes in one Redis round trip (a ``MULTI``): scope -> record or ``None``."""
        scopes = list(scopes)
        pipe = self.client.pipeline(transaction=True)
        for scope in scopes:
            recent, chunks = self.history_keys(scope)
            pipe.lindex(recent, -1)
            pipe.zrange(chunks, -1, -1)
        found = pipe.execute()
        out: dict[str, dict | None] = {}
        for i, scope in enumerate(scopes):
            member, newest_chunk = found[2 * i], found[2 * i + 1]
            if member is None and newest_chunk:  # only a bulk load or a partial expiry leaves the list empty
                member = _unchunk(newest_chunk[0])[-1]
            out[scope] = None if member is None else _decode(member)[1]
        return out

    # -- snapshots ---------------------------------------------------------------------------------------------
    def put_snapshot(self, kind: str, name: str, record: dict, *, ttl_s: float = 3600.0) -> None:
        """Replace the one snapshot of ``kind``/``name`` (e.g. a pool's slow requests), kept ``ttl_s`` seconds."""
        self.client.set(self._key(kind, name), json.dumps(record, separators=(",", ":")), ex=int(ttl_s))

    def snapshot(self, kind: str, name: str) -> dict | None:
        """The snapshot :meth:`put_snapshot` stored, or ``None``."""
        raw = self.client.get(self._key(kind, name))
        return json.loads(raw) if raw else None

    def memory_bytes(self, scopes: Iterable[str]) -> int:
        """Bytes Redis uses for the history of ``scopes`` (``MEMORY USAGE`` of their keys, ``SAMPLES 0``: every
        element counted); 0 for scopes without history."""
        pipe = self.client.pipeline(transaction=False)
        for scope in scopes:
            for key in self.history_keys(scope):
                pipe.memory_usage(key, samples=0)
        return sum(int(n or 0) for n in pipe.execute())

    def clear(self) -> None:
        """Delete every key under the prefix (tests and ``telemetry --reset``)."""
        keys = list(self.client.scan_iter(match=f"{self.prefix}*"))
        if keys:
            self.client.delete(*keys)
