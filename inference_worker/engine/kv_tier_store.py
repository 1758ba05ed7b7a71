"""KV tier stores: one byte-budgeted key -> bytes interface for every tier beyond the engine; torch-free.

Tiers (DESIGN "KV reuse"; issue 17): engine blocks -> host memory (:class:`MemoryKVStore`, off by
default on CPU, where the engine cache already is host memory) -> local disk and a shared store
(:class:`DirectoryKVStore`: a local directory, or a directory every worker of the same weights, dtype
and block size mounts — any networked filesystem). An object store implements the same
:class:`KVStore` methods (put/get/contains/delete/entries); nothing else in the worker knows which
store it talks to.

Budget and expiry: a put that would take usage past ``budget_bytes`` first evicts the entries idle the
longest. An entry's idle time counts from its last read or write (``get`` refreshes it; on a directory
store the file's mtime is that time, so every worker sharing the directory sees one clock), and
:meth:`KVStore.expire` removes entries idle longer than the TTL (``--kv-entry-ttl``, default 30 min,
``003_*.txt`` 六: idle contexts expire after 30 minutes).
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from inference_worker.engine.kv_cache_sizing import parse_kv_cache_memory
from inference_worker.engine.kv_tier_record import RecordError

_KEY_RE = re.compile(r"^[0-9a-f]{16,128}$")
SUFFIX = ".kvt"


def check_key(key: str) -> str:
    """An entry key is lower-case hex (a block digest), so it is a safe file or object name.

    Raises:
        ValueError: any other key.
    """
    if not _KEY_RE.match(key):
        raise ValueError(f"KV tier keys are 16..128 lower-case hex characters, got {key!r}")
    return key


@dataclass(frozen=True)
class StoreEntry:
    """One stored entry: its key, size in bytes and last access (seconds since the epoch)."""

    key: str
    num_bytes: int
    last_access_s: float


class KVStore:
    """A byte-budgeted key -> bytes store (the interface every tier implements).

    Args:
        tier: the tier's name in KV events and metrics (``host``, ``disk``, ``shared``).
        budget_bytes: most bytes held (> 0).

    Raises:
        ValueError: a budget <= 0.
    """

    def __init__(self, tier: str, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"the {tier} KV tier needs a positive byte budget, got {budget_bytes}")
        self.tier = tier
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()

    # ---- what a backend implements ---------------------------------------------------------
    def _write(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def _read(self, key: str) -> bytes | None:
        raise NotImplementedError

    def _remove(self, key: str) -> bool:
        raise NotImplementedError

    def _touch(self, key: str, now: float) -> None:
        raise NotImplementedError

    def entries(self) -> list[StoreEntry]:
        """Every entry now (for a shared store: written by any worker)."""
        raise NotImplementedError

    def contains(self, key: str) -> bool:
        """True when ``key`` is stored (a cheap probe: no read)."""
        raise NotImplementedError

    # ---- the interface -------------------------------------------------------------------------
    @property
    def usage_bytes(self) -> int:
        """Bytes held now."""
        return sum(e.num_bytes for e in self.entries())

    def put(self, key: str, data: bytes) -> list[str]:
        """Store ``data`` under ``key`` (replacing it), evicting the longest-idle entries to stay in budget.

        Returns:
            the keys evicted to make room.

        Raises:
            ValueError: a bad key, or ``data`` larger than the whole budget.
        """
        check_key(key)
        if len(data) > self.budget_bytes:
            raise ValueError(f"a {len(data)}-byte entry does not fit the {self.tier} tier's budget of "
                             f"{self.budget_bytes} bytes")
        with self._lock:
            entries = sorted((e for e in self.entries() if e.key != key), key=lambda e: e.last_access_s)
            used = sum(e.num_bytes for e in entries)
            evicted = []
            for entry in entries:
                if used + len(data) <= self.budget_bytes:
                    break
                if self._remove(entry.key):
                    evicted.append(entry.key)
                used -= entry.num_bytes
            self._write(key, data)
        return evicted

    def get(self, key: str) -> bytes | None:
        """The bytes under ``key`` (None when absent); a read restarts the entry's idle time."""
        check_key(key)
        data = self._read(key)
        if data is not None:
            self._touch(key, time.time())
        return data

    def touch(self, key: str, now_s: float | None = None) -> None:
        """Set the entry's last access to ``now_s`` (seconds since the epoch; default: now)."""
        self._touch(check_key(key), time.time() if now_s is None else now_s)

    def delete(self, key: str) -> bool:
        """Remove ``key``; False when it was not there."""
        check_key(key)
        with self._lock:
            return self._remove(key)

    def expire(self, ttl_s: float, now: float | None = None) -> list[str]:
        """Remove every entry idle (no read or write) for more than ``ttl_s`` seconds; returns their keys."""
        now = time.time() if now is None else now
        with self._lock:
            return [e.key for e in self.entries() if now - e.last_access_s > ttl_s and self._remove(e.key)]


class MemoryKVStore(KVStore):
    """Entries in this process's memory (the host tier): gone when the worker stops."""

    def __init__(self, budget_bytes: int, tier: str = "host") -> None:
        super().__init__(tier, budget_bytes)
        self._data: dict[str, tuple[bytes, float]] = {}

    def _write(self, key: str, data: bytes) -> None:
        self._data[key] = (bytes(data), time.time())

    def _read(self, key: str) -> bytes | None:
        item = self._data.get(key)
        return None if item is None else item[0]

    def _remove(self, key: str) -> bool:
        return self._data.pop(key, None) is not None

    def _touch(self, key: str, now: float) -> None:
        item = self._data.get(key)
        if item is not None:
            self._data[key] = (item[0], now)

    def entries(self) -> list[StoreEntry]:
        """Every entry now."""
        return [StoreEntry(k, len(d), t) for k, (d, t) in list(self._data.items())]

    def contains(self, key: str) -> bool:
        """True when ``key`` is stored."""
        return key in self._data


class DirectoryKVStore(KVStore):
    """Entries as files ``<key>.kvt`` in one directory (the disk tier, or the shared tier on a shared mount).

    Writes go to a temporary file in the same directory and are renamed into place, so a reader never
    sees a half-written entry (a truncated one is still detected by the record's length and tag). The
    file's mtime is the entry's last access.
    """

    def __init__(self, root: str | Path, budget_bytes: int, tier: str = "disk") -> None:
        super().__init__(tier, budget_bytes)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        """The file holding ``key``."""
        return self.root / (check_key(key) + SUFFIX)

    def _write(self, key: str, data: bytes) -> None:
        try:
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        except FileNotFoundError:  # the directory was removed while the worker runs: the tier starts again empty
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _read(self, key: str) -> bytes | None:
        """The file's bytes; a file larger than the budget (never written by a store: :meth:`KVStore.put` refuses
        it; e.g. a foreign or runaway file in a shared directory) is refused before it is read into memory.

        Raises:
            RecordError: ``format``, for a file larger than ``budget_bytes``.
        """
        try:
            with open(self.path(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > self.budget_bytes:
                    raise RecordError("format", f"a {size}-byte {self.tier} tier file is larger than the tier's "
                                      f"budget of {self.budget_bytes} bytes: not an entry")
                return f.read()
        except FileNotFoundError:
            return None

    def _remove(self, key: str) -> bool:
        try:
            self.path(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def _touch(self, key: str, now: float) -> None:
        try:
            os.utime(self.path(key), (now, now))
        except FileNotFoundError:
            pass

    def entries(self) -> list[StoreEntry]:
        """Every ``*.kvt`` file now (written by any worker sharing the directory); none when the directory is gone.

        Raises:
            OSError: the directory cannot be listed (unreadable, an I/O error of its filesystem).
        """
        found = []
        try:
            it = os.scandir(self.root)
        except FileNotFoundError:
            return found
        with it:
            for item in it:
                key = item.name.removesuffix(SUFFIX)
                if item.name.endswith(SUFFIX) and _KEY_RE.match(key):
                    try:
                        st = item.stat()
                    except FileNotFoundError:
                        continue
                    found.append(StoreEntry(key, st.st_size, st.st_mtime))
        return found

    def contains(self, key: str) -> bool:
        """True when the file exists (one ``stat``)."""
        return self.path(key).exists()


def parse_tier_size(option: str, size: str) -> int:
    """A tier's byte budget: a positive byte count with an optional unit (``2GiB``, ``500MB``, ``1000000``).

    Raises:
        ValueError: anything else (a fraction, zero, a negative or unparsable size); the message names ``option``.
    """
    try:
        kind, num_bytes = parse_kv_cache_memory(size)
    except ValueError as exc:
        raise ValueError(f"{option}: the size must be a positive byte count (e.g. 20GiB), got {size!r}") from exc
    if kind != "bytes":
        raise ValueError(f"{option}: the size must be bytes with a unit (e.g. 20GiB), got {size!r}")
    return int(num_bytes)


def open_directory_store(option: str, path: str, budget_bytes: int, tier: str) -> DirectoryKVStore:
    """A :class:`DirectoryKVStore` at ``path`` (created if missing), checked to be a writable directory.

    Raises:
        ValueError: ``path`` cannot be created, is not a directory or is not writable; the message names ``option``.
    """
    try:
        store = DirectoryKVStore(path, budget_bytes, tier)
    except OSError as exc:
        raise ValueError(f"{option}: cannot use {path!r} as the {tier} tier's directory: "
                         f"{exc.strerror or exc}") from exc
    if not os.access(store.root, os.W_OK | os.X_OK):
        raise ValueError(f"{option}: the {tier} tier's directory {path!r} is not writable by this process")
    return store


def parse_store_spec(option: str, value: str) -> tuple[str, int]:
    """Split ``PATH:SIZE`` (``--kv-offload-disk``) or ``URI:SIZE`` (``--kv-shared``) into location and bytes.

    The size is the last ``:``-separated part (``2GiB``, ``500MB``, ``1000000``); a ``file://`` URI gives
    its path.

    Raises:
        ValueError: no ``:SIZE``, an unknown URI scheme, or a size that is not a positive byte count.
    """
    location, sep, size = value.rpartition(":")
    if not sep or not location:
        raise ValueError(f"{option} takes PATH:SIZE (e.g. /var/cache/ferry-kv:20GiB), got {value!r}")
    num_bytes = parse_tier_size(option, size)
    if "://" in location:
        scheme, _, path = location.partition("://")
        if scheme != "file":
            raise ValueError(f"{option}: only file:// (a shared directory) is supported, got {scheme}://")
        location = path
    return location, num_bytes
