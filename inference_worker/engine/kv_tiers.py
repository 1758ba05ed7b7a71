"""KV tiers on the connector seam: save a finished context's KV to host/disk/shared stores, load it back (DualPath).

**What is written, when.** When a request finishes normally (``request_finished``, engine thread, blocks
still allocated) the KV needed to resume its context of E computed tokens is copied out of the cache
(the only engine-thread work) and a writer thread encodes the signed record
(:mod:`~inference_worker.engine.kv_tier_record`) and puts it in every configured store, fastest first.
With ``Eb = floor(E/bs)*bs`` an entry resumes at the block boundaries ``L0 .. Eb`` (``L0 = max(bs,
Eb - 2*bs)``: the last 2 blocks) and at E itself. Full layers store positions ``0 .. E-1``; a sliding
layer of window W stores the blocks covering ``[floor(E/bs)*bs - 2*bs - W + 1, E - 1]`` (issue 17),
i.e. from ``floor(max(0, L0 - W + 1)/bs)*bs``: what the first query after each resume point reads
(window convention in :mod:`~inference_worker.engine.block_hash`). Sliding blocks already nulled in
the request's table are taken from the prefix cache while still cached there; if one is gone, L0 moves
up to the first boundary whose window is all present. The entry's key is the digest of the block
ending at L0, so any request sharing the context's first L0 tokens finds it.

**DualPath loading** (``002_*.txt``: the cold path loads stored KV while the hot path keeps
computing). At admission, a request (not preempted, no PD import) whose longest stored prefix beats its
device prefix-cache hit is parked (``ExternalKV.load_async``; scheduler state ``WAITING_FOR_KV``) while
a loader thread reads, authenticates and parses the entry into CPU tensors; the running requests keep
decoding. When the load is done the request rejoins the waiting queue; at its admission the resume
point r is ``E`` if its tokens continue the whole context, else the last block boundary of the common
prefix, and the bytes are copied into its blocks on the engine thread (``start_load_kv``, the PD
import's path) before the step that computes token r. A load that fails its checks is counted by
reason, the entry is deleted and the request computes its prompt (from its device hit) as if nothing
was stored.

**Events.** Each tier publishes the blocks its entries cover as ``BlockStored`` / ``BlockRemoved``
with ``tier`` ``host``/``disk``/``shared`` (a block stays announced while any entry covers it). A disk
tier found non-empty at start is indexed from its records' headers and is in the snapshot. The shared
store is announced per model version by its writers only: a worker's events carry ``tier: shared`` for
the entries it wrote; the router keys shared blocks by model version, not by replica.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from inference_worker.engine.block_hash import block_digests
from inference_worker.engine.kv_connector import ExternalKV
from inference_worker.engine.kv_events import BlockRemoved, BlockStored, KVEvent, KVEventQueue
from inference_worker.engine.kv_handoff import PDConnector, _slots
from inference_worker.engine.kv_tier_record import (
    PREFIX_BYTES,
    RecordError,
    RecordHeader,
    decode_record,
    encode_record,
    header_prefix_len,
    read_header_unverified,
    tier_key,
)
from inference_worker.engine.kv_tier_store import DirectoryKVStore, KVStore
from inference_worker.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from inference_worker.engine.kv_cache_manager import HybridKVCacheManager
    from inference_worker.engine.model_runner import PagedKVCache

logger = logging.getLogger(__name__)

DEFAULT_ENTRY_TTL_S = 1800.0
"""Idle TTL of a tier entry: 30 minutes (``003_*.txt`` 六: idle contexts expire after 30 minutes)."""


@dataclass
class KVTierOptions:
    """The tiers a worker writes to and reads from.

    Attributes:
        stores: fastest first (host, disk, shared); each store's ``tier`` names it in events and metrics.
        secret: the tier secret (>= 16 bytes) that keys the records' tags; every worker sharing a store
            needs the same one.
        model_id: recorded in each entry (informational; validity is decided by the weights hash).
        entry_ttl_s: idle TTL of an entry (since its last read or write).
        sweep_interval_s: how often expired entries are removed (None: ``min(ttl/4, 30)``; 0: only by
            calling :meth:`TieredConnector.sweep`).
    """

    stores: list[KVStore]
    secret: bytes
    model_id: str = ""
    entry_ttl_s: float = DEFAULT_ENTRY_TTL_S
    sweep_interval_s: float | None = None

    def __post_init__(self) -> None:
        tier_key(self.secret)
        if self.entry_ttl_s <= 0:
            raise ValueError(f"--kv-entry-ttl must be > 0 seconds, got {self.entry_ttl_s}")
        names = [s.tier for s in self.stores]
        if len(set(names)) != len(names):
            raise ValueError(f"one store per tier, got {names}")


@dataclass
class TierStats:
    """Counters of one tier since start (bytes, tokens, seconds)."""

    hit_tokens: int = 0
    read_bytes: int = 0
    written_bytes: int = 0
    load_seconds: float = 0.0
    expiries: int = 0
    io_errors: int = 0
    integrity_failures: Counter = field(default_factory=Counter)


@dataclass
class _Loaded:
    num_tokens: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    firsts: list[int]
    tier: str


def _block_start(position: int, block_size: int) -> int:
    return (max(0, position) // block_size) * block_size


class TieredConnector(PDConnector):
    """The PD hand-off plus KV tiers (module docstring), one connector on the engine's seam.

    Args:
        kv_cache: the runner's paged KV tensors.
        layer_windows: per layer, W or None.
        kv_manager: the engine's KV cache manager (digests, device hits, the event queue).
        options: the tiers.
        weights_sha256, kv_dtype: what entries must match to be loaded.
    """

    def __init__(self, kv_cache: PagedKVCache, layer_windows: list[int | None], *, kv_manager: HybridKVCacheManager,
                 options: KVTierOptions, weights_sha256: str, kv_dtype: str) -> None:
        super().__init__(kv_cache, layer_windows)
        if not kv_manager.enable_prefix_caching:
            raise ValueError("KV tiers need prefix caching (block digests name the entries)")
        self.kv_manager = kv_manager
        self.options = options
        self.stores = list(options.stores)
        self.weights_sha256 = weights_sha256.lower()
        self.kv_dtype = kv_dtype
        self.block_size = kv_cache.block_size
        self.group_names = [g.attention_type for g in kv_manager.groups]
        self._key = tier_key(options.secret)
        self._events: KVEventQueue = kv_manager.events
        self.stats = {s.tier: TierStats() for s in self.stores}
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, list[tuple[int, bytes, bytes]]]] = {s.tier: {} for s in self.stores}
        self._refs: dict[str, Counter] = {s.tier: Counter() for s in self.stores}
        self._looked_up: set[str] = set()
        self._pending: set[str] = set()
        self._ready: dict[str, _Loaded | None] = {}
        self._load_done = threading.Event()
        self._tier_hits: dict[str, tuple[str, int]] = {}
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-load")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-write")
        for store in self.stores:
            if store.tier != "shared" and isinstance(store, DirectoryKVStore):
                self._index_existing(store)
        interval = options.sweep_interval_s
        if interval is None:
            interval = min(options.entry_ttl_s / 4, 30.0)
        self._stop = threading.Event()
        if interval > 0:
            threading.Thread(target=self._sweep_loop, args=(interval,), name="kv-tier-expiry", daemon=True).start()

    # ---- index and events -------------------------------------------------------------------------
    def _entry_blocks(self, header: RecordHeader) -> list[tuple[int, bytes, bytes]]:
        """``(group, digest, parent)`` of every whole block an entry holds for every layer of the group."""
        bs = self.block_size
        num_blocks = header.num_tokens // bs
        digests = block_digests(self.kv_manager.prefix_root, header.token_ids[: num_blocks * bs], bs)
        first_block = [0] * len(self.group_names)
        for layer, first in enumerate(header.firsts):
            g = self.kv_cache.layer_to_group[layer]
            first_block[g] = max(first_block[g], -(-first // bs))
        blocks = []
        for g in range(len(self.group_names)):
            for k in range(first_block[g], num_blocks):
                blocks.append((g, digests[k], digests[k - 1] if k else self.kv_manager.prefix_root))
        return blocks

    def _index_add(self, tier: str, key: str, blocks: list[tuple[int, bytes, bytes]]) -> None:
        with self._lock:
            if key in self._entries[tier]:
                self._index_remove_locked(tier, key)
            self._entries[tier][key] = blocks
            refs = self._refs[tier]
            for g, digest, parent in blocks:
                refs[(g, digest)] += 1
                if refs[(g, digest)] == 1:
                    self._events.put(BlockStored(digest, parent, self.group_names[g], tier))

    def _index_remove(self, tier: str, key: str) -> None:
        with self._lock:
            self._index_remove_locked(tier, key)

    def _index_remove_locked(self, tier: str, key: str) -> None:
        blocks = self._entries[tier].pop(key, None)
        refs = self._refs[tier]
        for g, digest, _ in blocks or ():
            refs[(g, digest)] -= 1
            if refs[(g, digest)] <= 0:
                del refs[(g, digest)]
                self._events.put(BlockRemoved(digest, self.group_names[g], tier))

    def _index_existing(self, store: DirectoryKVStore) -> None:
        """Index a directory store's entries from their headers (a restarted worker's disk tier)."""
        try:
            for entry in store.entries():
                header = read_header_unverified(_read_head(store, entry.key) or b"")
                if header is not None and self._matches(header) is None:
                    self._index_add(store.tier, entry.key, self._entry_blocks(header))
        except OSError as exc:
            self._io_error(store, "indexing its entries", exc)

    def _io_error(self, store: KVStore, doing: str, exc: OSError) -> None:
        """Count a store's I/O failure (the tier is a miss, never an engine failure); logs the first and every 100th."""
        stats = self.stats[store.tier]
        stats.io_errors += 1
        if stats.io_errors == 1 or stats.io_errors % 100 == 0:
            logger.warning("KV %s tier: %s failed (%d I/O errors so far; treated as a miss): %s: %s", store.tier,
                           doing, stats.io_errors, type(exc).__name__, exc)

    def snapshot_events(self) -> list[KVEvent]:
        """A ``BlockStored`` per block announced by each tier now (after the device snapshot)."""
        with self._lock:
            found = {}
            for tier, entries in self._entries.items():
                for blocks in entries.values():
                    for g, digest, parent in blocks:
                        found[(tier, g, digest)] = BlockStored(digest, parent, self.group_names[g], tier)
        return list(found.values())

    # ---- scheduler side -----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> ExternalKV | None:
        """A PD import; else a finished tier load (if it beats the device hit); else start a load (park)."""
        external = super().get_num_new_matched_tokens(request, num_computed_tokens)
        rid = request.request_id
        if external is not None or num_computed_tokens != 0:
            return external
        if rid in self._ready:
            loaded = self._ready.pop(rid)
            if loaded is None:
                return None
            hit, _ = self.kv_manager.get_computed_blocks(rid, request.prompt_token_ids, request.output_token_ids)
            if loaded.num_tokens <= hit:
                return None
            self.expect_import(rid, loaded.num_tokens, loaded.kv, loaded.firsts)
            self._tier_hits[rid] = (loaded.tier, loaded.num_tokens)
            return replace(super().get_num_new_matched_tokens(request, 0), num_cached_tokens=loaded.num_tokens)
        if rid in self._looked_up or request.num_preemptions or not self.stores:
            return None
        self._looked_up.add(rid)
        found = self._find(request)
        if found is None:
            return None
        store, key, min_tokens = found
        hit, _ = self.kv_manager.get_computed_blocks(rid, request.prompt_token_ids, request.output_token_ids)
        if min_tokens <= hit:
            return None
        self._pending.add(rid)
        tokens = list(request.prompt_token_ids) + list(request.output_token_ids)
        self._loader.submit(self._load, rid, store, key, tokens)
        return ExternalKV(0, (), load_async=True)

    def update_state_after_alloc(self, request: Request, block_ids: tuple[list[int], ...],
                                 external: ExternalKV) -> None:
        """Blocks are allocated: load the KV (PD import or tier entry) before this step's forward."""
        super().update_state_after_alloc(request, block_ids, external)
        hit = self._tier_hits.pop(request.request_id, None)
        if hit is not None:
            self.stats[hit[0]].hit_tokens += hit[1]

    def _find(self, request: Request) -> tuple[KVStore, str, int] | None:
        """The store and key of the entry covering the longest block-aligned prefix of the request."""
        n = request.num_tokens
        digests = self.kv_manager.request_block_digests(request.request_id, request.prompt_token_ids,
                                                        request.output_token_ids, n - 1)
        failed: set[str] = set()  # stores that failed this lookup are not asked again for shorter prefixes
        for k in range(len(digests) - 1, -1, -1):
            key = digests[k].hex()
            for store in self.stores:
                if store.tier in failed:
                    continue
                try:
                    if store.contains(key):
                        return store, key, (k + 1) * self.block_size
                except OSError as exc:
                    failed.add(store.tier)
                    self._io_error(store, "looking up an entry", exc)
        return None

    def get_finished_loads(self) -> set[str]:
        """Parked requests whose load finished (loaded, or failed and to be computed)."""
        with self._lock:
            done = {rid for rid in self._ready if rid in self._pending}
            self._pending -= done
            self._load_done.clear()
        return done

    def wait_for_any_load(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for a load to finish."""
        self._load_done.wait(timeout_s)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> None:
        """PD export/import bookkeeping, then save the context to the tiers (not after an abort)."""
        super().request_finished(request, block_ids)
        rid = request.request_id
        self._looked_up.discard(rid)
        self._tier_hits.pop(rid, None)
        with self._lock:
            self._pending.discard(rid)
            self._ready.pop(rid, None)
        if self.stores and request.status != RequestStatus.FINISHED_ABORTED:
            self._save(request)

    # ---- loading (loader thread) ----------------------------------------------------------------
    def _matches(self, header: RecordHeader) -> str | None:
        """Why an authenticated header's KV cannot be used by this engine, or None."""
        config = (self.weights_sha256, self.kv_dtype, self.block_size, self.kv_cache.k_caches[0].shape[2],
                  self.kv_cache.k_caches[0].shape[3], tuple(self.layer_windows))
        theirs = (header.weights_sha256.lower(), header.kv_dtype, header.block_size, header.num_kv_heads,
                  header.head_dim, tuple(header.windows))
        if config != theirs:
            return f"entry for {theirs[:3]}, this engine is {config[:3]}"
        return None

    def _load(self, rid: str, store: KVStore, key: str, tokens: list[int]) -> None:
        started = time.monotonic()
        loaded = None
        try:
            data = store.get(key)
            if data is not None:
                self.stats[store.tier].read_bytes += len(data)
                loaded = self._parse(data, tokens)
                loaded.tier = store.tier
        except RecordError as exc:
            self.stats[store.tier].integrity_failures[exc.reason] += 1
            try:
                store.delete(key)
            except OSError as io_exc:
                self._io_error(store, "deleting a refused entry", io_exc)
            self._index_remove(store.tier, key)
        except OSError as exc:  # unreadable: computed instead
            self._io_error(store, "reading an entry", exc)
        finally:
            self.stats[store.tier].load_seconds += time.monotonic() - started
            with self._lock:
                if rid in self._pending:
                    self._ready[rid] = loaded
                self._load_done.set()

    def _parse(self, data: bytes, tokens: list[int]) -> _Loaded:
        """The KV of the longest resume point an entry offers ``tokens``, as CPU tensors per layer.

        Raises:
            RecordError: the record fails its checks (module docstring of ``kv_tier_record``).
        """
        header, body = decode_record(data, self._key)
        why = self._matches(header)
        if why is not None:
            raise RecordError("weights", why)
        bs, e = self.block_size, header.num_tokens
        common = 0
        limit = min(e, len(tokens) - 1)
        while common < limit and header.token_ids[common] == tokens[common]:
            common += 1
        r = e if common == e else (common // bs) * bs
        dtype = self.kv_cache.k_caches[0].dtype
        heads, dim = header.num_kv_heads, header.head_dim
        row_bytes = heads * dim * torch.empty((), dtype=dtype).element_size()
        expected = sum(2 * rows * row_bytes for rows in header.layer_rows())
        if len(body) != expected:
            raise RecordError("format", f"body of {len(body)} bytes, the header describes {expected}")
        flat = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        kv, firsts, offset = [], [], 0
        for first, window, rows in zip(header.firsts, header.windows, header.layer_rows(), strict=True):
            need = 0 if window is None else _block_start(r - window + 1, bs)
            if need < first:
                raise RecordError("format", f"resume at {r} needs position {need}, the entry starts at {first}")
            size = rows * row_bytes
            k = flat[offset : offset + size].view(dtype).view(rows, heads, dim)[need - first : r - first]
            v = flat[offset + size : offset + 2 * size].view(dtype).view(rows, heads, dim)[need - first : r - first]
            kv.append((k, v))
            firsts.append(need)
            offset += 2 * size
        return _Loaded(r, kv, firsts, "")

    # ---- saving --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _save(self, request: Request) -> None:
        """Copy the context's KV out of the cache (engine thread); the writer thread encodes and stores it."""
        bs = self.block_size
        e = request.num_computed_tokens
        eb = (e // bs) * bs
        if eb < bs:
            return
        tokens = (list(request.prompt_token_ids) + list(request.output_token_ids))[:e]
        digests = self.kv_manager.request_block_digests(request.request_id, request.prompt_token_ids,
                                                        request.output_token_ids, e)
        tables = self.kv_manager.readable_block_ids(request.request_id, digests)
        last_block = -(-e // bs)

        def firsts_for(l0: int) -> list[int] | None:
            firsts = []
            for layer, window in enumerate(self.layer_windows):
                first = 0 if window is None else _block_start(l0 - window + 1, bs)
                table = tables[self.kv_cache.layer_to_group[layer]]
                if len(table) < last_block or any(b == 0 for b in table[first // bs : last_block]):
                    return None
                firsts.append(first)
            return firsts

        for l0 in range(max(bs, eb - 2 * bs), eb + 1, bs):
            firsts = firsts_for(l0)
            if firsts is not None:
                break
        else:
            return
        cache, layers = self.kv_cache, []
        for layer, first in enumerate(firsts):
            g = cache.layer_to_group[layer]
            k_cache, v_cache = cache.k_caches[layer], cache.v_caches[layer]
            slots = _slots(tables[g], range(first, e), bs).to(k_cache.device)
            flat_k = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, Hkv, D]
            flat_v = v_cache.view(-1, *v_cache.shape[2:])
            layers.append((flat_k.index_select(0, slots).cpu(), flat_v.index_select(0, slots).cpu()))
        header = RecordHeader(self.options.model_id, self.weights_sha256, self.kv_dtype, bs,
                              int(k_cache.shape[2]), int(k_cache.shape[3]), e, tuple(tokens),
                              tuple(self.layer_windows), tuple(firsts))
        self._writer.submit(self._write, digests[l0 // bs - 1].hex(), header, layers)

    def _write(self, key: str, header: RecordHeader, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        raw = [(k.contiguous().view(torch.uint8).numpy().tobytes(), v.contiguous().view(torch.uint8).numpy().tobytes())
               for k, v in layers]
        data = encode_record(header, raw, self._key)
        blocks = self._entry_blocks(header)
        for store in self.stores:
            try:
                evicted = store.put(key, data)
            except ValueError:
                continue
            except OSError as exc:
                self._io_error(store, "writing an entry", exc)
                continue
            self.stats[store.tier].written_bytes += len(data)
            for old in evicted:
                self._index_remove(store.tier, old)
            self._index_add(store.tier, key, blocks)

    def flush(self) -> None:
        """Wait until every write submitted so far is stored (tests, shutdown)."""
        self._writer.submit(lambda: None).result()

    # ---- expiry, reset, stats ------------------------------------------------------------------------
    def sweep(self, now: float | None = None) -> int:
        """Remove entries idle past the TTL from every store and the events; returns how many."""
        removed = 0
        for store in self.stores:
            try:
                expired = store.expire(self.options.entry_ttl_s, now)
                self.stats[store.tier].expiries += len(expired)
                removed += len(expired)
                present = {e.key for e in store.entries()}
            except OSError as exc:
                self._io_error(store, "expiring idle entries", exc)
                continue
            with self._lock:
                gone = [key for key in self._entries[store.tier] if key not in present]
            for key in gone:
                self._index_remove(store.tier, key)
        return removed

    def _sweep_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self._writer.submit(self.sweep)

    def reset(self) -> None:
        """Prefix-cache reset: delete this worker's host and disk entries and forget its shared ones."""
        self.flush()
        for store in self.stores:
            if store.tier != "shared":
                try:
                    for entry in store.entries():
                        store.delete(entry.key)
                except OSError as exc:
                    self._io_error(store, "deleting its entries on reset", exc)
            with self._lock:
                self._entries[store.tier].clear()
                self._refs[store.tier].clear()

    def tier_stats(self) -> dict[str, dict]:
        """Per tier: ``hit_tokens``, ``read_bytes``, ``written_bytes``, ``load_seconds``, ``expiries``,
        ``io_errors`` (store operations that failed with an OSError, each treated as a miss), ``integrity_failures``
        (by reason), ``usage_bytes`` (now) and ``entries`` (now; 0 when the store cannot be listed)."""
        out = {}
        for store in self.stores:
            try:
                entries = store.entries()
            except OSError as exc:
                self._io_error(store, "listing its entries", exc)
                entries = []
            s = self.stats[store.tier]
            out[store.tier] = {"hit_tokens": s.hit_tokens, "read_bytes": s.read_bytes,
                               "written_bytes": s.written_bytes, "load_seconds": s.load_seconds,
                               "expiries": s.expiries, "io_errors": s.io_errors,
                               "integrity_failures": dict(s.integrity_failures),
                               "usage_bytes": sum(e.num_bytes for e in entries), "entries": len(entries)}
        return out

    def close(self) -> None:
        """Finish pending writes and stop the threads."""
        self._stop.set()
        self._writer.shutdown(wait=True)
        self._loader.shutdown(wait=True)


def _read_head(store: DirectoryKVStore, key: str) -> bytes | None:
    """The prefix and header of a stored record (not its KV)."""
    try:
        with open(store.path(key), "rb") as f:
            head = f.read(PREFIX_BYTES)
            need = header_prefix_len(head)
            return None if need is None else head + f.read(need - len(head))
    except FileNotFoundError:
        return None


def tier_windows(model_config: object) -> list[int | None]:
    """Per layer W or None, from ``layer_types`` / ``sliding_window``."""
    return [model_config.sliding_window if t == "sliding_attention" else None  # type: ignore[attr-defined]
            for t in model_config.layer_types]  # type: ignore[attr-defined]


__all__ = ["DEFAULT_ENTRY_TTL_S", "KVTierOptions", "TieredConnector", "tier_windows"]
