"""The router's prefix index: which replica holds which KV blocks, built from the workers' KV events (torch-free).

Input is each replica's ``GET /v1/kv-events`` stream (format: :mod:`inference_worker.server.kv_events`).
Per replica the index keeps the worker id, the last applied sequence number and, per KV-cache group
(``full_attention``, ``sliding_attention``), digest -> tier. Blocks in the ``shared`` tier are kept per
model version instead: any replica of that version can load them (the shared store), so they count for
all of them.

Sync rules (:meth:`PrefixIndex.apply`):

- a snapshot batch replaces the replica's blocks and sets its worker id and sequence number;
- a batch from another worker id than the one applied (a restart, or a restart we missed) or whose
  first event is not ``seq + 1`` (a gap: lines lost) is *not* applied: the replica's entries are
  dropped and :meth:`apply` returns False, so the subscriber reconnects without ``after`` and the worker
  answers with a snapshot (re-sync);
- replicas that leave the routing table are dropped (:meth:`retain`).

A lookup (:meth:`PrefixIndex.hit_tokens`) applies the hybrid hit rule of
:mod:`inference_worker.engine.block_hash` (a block whose full-attention KV is present but whose sliding
window KV was evicted is not a hit), so the prediction equals the worker's own ``cached_tokens`` when the
index is current. Tier weights (:data:`TIER_WEIGHTS`) discount blocks that must first be loaded from a
slower tier.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from inference_worker.engine.block_hash import longest_hit_blocks
from inference_worker.kv_transfer.layout import KVLayout

log = logging.getLogger(__name__)

FULL, SLIDING = "full_attention", "sliding_attention"
SHARED_TIER = "shared"
_NONE: dict[bytes, str] = {}
TIER_WEIGHTS = {"device": 1.0, "host": 0.9, "disk": 0.6, SHARED_TIER: 0.4}
"""Expected-value weight of a cached token per tier: 1 for blocks already on the accelerator; less for
tiers that are loaded first (host memory over PCIe is nearly free next to prefill, local disk and the
shared store cost a read of the hybrid-sized KV); unknown tiers count 0.5."""


def group_windows(layout: KVLayout) -> dict[str, int | None]:
    """KV-cache groups of a model as the events name them, with their window (None = full attention).

    Raises:
        ValueError: sliding layers with different windows (one ``sliding_attention`` group cannot hold them).
    """
    groups: dict[str, int | None] = {}
    windows = {w for w in layout.layer_windows if w is not None}
    if any(w is None for w in layout.layer_windows):
        groups[FULL] = None
    if len(windows) > 1:
        raise ValueError(f"one sliding_attention group per model is supported, got windows {sorted(windows)}")
    if windows:
        groups[SLIDING] = windows.pop()
    return groups


@dataclass
class ReplicaBlocks:
    """What the index knows about one replica."""

    model_version: str
    worker_id: str | None = None
    seq: int | None = None
    """Last applied event number; None: not in sync (the next stream starts with a snapshot)."""
    blocks: dict[str, dict[bytes, str]] = field(default_factory=dict)
    """group -> digest -> tier."""
    num_resyncs: int = 0


class PrefixIndex:
    """Digest -> replicas, per group and tier, from KV event batches (see the module docstring)."""

    def __init__(self) -> None:
        self.replicas: dict[str, ReplicaBlocks] = {}
        self.shared: dict[str, dict[str, dict[bytes, str]]] = {}
        """model version -> group -> digest -> tier (the shared store)."""

    def after(self, replica: str) -> int | None:
        """The ``after`` to ask ``replica``'s stream for (None: ask for a snapshot)."""
        state = self.replicas.get(replica)
        return None if state is None else state.seq

    def retain(self, replicas: dict[str, str]) -> None:
        """Keep only ``replicas`` (name -> model version); a replica whose version changed starts over."""
        for name in list(self.replicas):
            if replicas.get(name) != self.replicas[name].model_version:
                del self.replicas[name]
        for name, version in replicas.items():
            self.replicas.setdefault(name, ReplicaBlocks(version))

    def apply(self, replica: str, batch: dict) -> bool:
        """Apply one NDJSON batch of ``replica``'s stream.

        Returns:
            True if applied; False if the batch shows a gap or a restart (the replica's entries are
            dropped and the caller must reconnect for a snapshot).

        Raises:
            KeyError: ``replica`` is not in the index (call :meth:`retain` first).
            ValueError: a malformed batch or event.
        """
        state = self.replicas[replica]
        try:
            seq, events, worker_id = int(batch["seq"]), list(batch["events"]), str(batch["worker_id"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed KV event batch: {exc!r}") from None
        if batch.get("snapshot"):
            state.blocks = {}
            state.worker_id = worker_id
        elif worker_id != state.worker_id or state.seq is None or seq - len(events) != state.seq:
            self._desync(state)
            return False
        for event in events:
            self._apply_event(state, event)
        state.seq = seq
        return True

    def _desync(self, state: ReplicaBlocks) -> None:
        state.blocks, state.seq, state.worker_id = {}, None, None
        state.num_resyncs += 1

    def _apply_event(self, state: ReplicaBlocks, event: dict) -> None:
        kind = event.get("type")
        if kind == "cleared":
            state.blocks = {}
            return
        try:
            digest, group, tier = bytes.fromhex(event["digest"]), str(event["group"]), str(event.get("tier", "device"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed KV event {event!r}: {exc!r}") from None
        target = self.shared.setdefault(state.model_version, {}) if tier == SHARED_TIER else state.blocks
        blocks = target.setdefault(group, {})
        if kind == "stored":
            blocks[digest] = tier
        elif kind == "removed":
            if blocks.get(digest) == tier:
                del blocks[digest]
        else:
            raise ValueError(f"unknown KV event type {kind!r}")

    def hit_tokens(self, replica: str, digests: Sequence[bytes], num_tokens: int, groups: dict[str, int | None],
                   block_size: int) -> tuple[int, float]:
        """Cached prefix of a prompt on ``replica`` under the hybrid hit rule.

        Args:
            digests: the prompt's block digests (``block_hash.block_digests`` with the version's root).
            num_tokens: prompt tokens (the last one is always computed: at most ``(num_tokens-1)//bs`` blocks).
            groups: :func:`group_windows` of the model version.

        Returns:
            (hit tokens, tier-weighted expected cached tokens); (0, 0.0) for a replica not in sync.
        """
        state = self.replicas.get(replica)
        if state is None or state.seq is None or num_tokens <= 0:
            return 0, 0.0
        names = list(groups)
        # per group: the replica's own blocks, then the shared store's (any replica of the version can load them)
        own = [state.blocks.get(g) or _NONE for g in names]
        shared_version = self.shared.get(state.model_version) or {}
        shared = [shared_version.get(g) or _NONE for g in names]

        def is_cached(g: int, k: int) -> bool:
            digest = digests[k]
            return digest in own[g] or digest in shared[g]

        num_blocks = min(len(digests), (num_tokens - 1) // block_size)
        hit = longest_hit_blocks(num_blocks, [groups[g] for g in names], block_size, is_cached)
        expected = 0.0
        pairs = list(zip(own, shared, strict=True))
        for k in range(hit):
            digest = digests[k]
            weight = 1.0
            for blocks, common in pairs:
                tier = blocks.get(digest)
                if tier is None:
                    tier = common.get(digest)
                w = TIER_WEIGHTS.get(tier, 0.5) if tier else 1.0
                if w < weight:
                    weight = w
            expected += block_size * weight
        return hit * block_size, expected


class KVEventSubscriber:
    """Follows one replica's ``/v1/kv-events`` stream into a :class:`PrefixIndex`, re-syncing on gaps."""

    def __init__(self, index: PrefixIndex, replica: str, url: str, *, client: httpx.AsyncClient,
                 retry_s: float = 1.0, tokens: tuple[str, ...] = ()) -> None:
        self.index, self.replica, self.url, self.client, self.retry_s = index, replica, url, client, retry_s
        self.tokens = tuple(t for t in tokens if t)
        """The pool's worker tokens (current, then previous): sent as ``Authorization: Bearer``; a 401 moves to the
        next one (a replica not yet rolled to a rotated token)."""
        self._token_index = 0
        self.on_resync = None
        """Called with the replica name after a gap or restart (metrics)."""

    async def run(self) -> None:
        """Stream, apply, reconnect (after ``retry_s`` on errors) until cancelled or the replica is dropped."""
        while self.replica in self.index.replicas:
            try:
                await self._stream_once()
            except (httpx.HTTPError, ValueError) as exc:
                log.info("KV events of %s: %s; reconnecting", self.replica, exc)
                await asyncio.sleep(self.retry_s)

    async def _stream_once(self) -> None:
        after = self.index.after(self.replica)
        params = {} if after is None else {"after": str(after)}
        timeout = httpx.Timeout(60.0, connect=2.0)  # heartbeats come every 15 s
        headers = {"Authorization": f"Bearer {self.tokens[self._token_index]}"} if self.tokens else {}
        async with self.client.stream("GET", self.url + "/v1/kv-events", params=params, timeout=timeout,
                                      headers=headers) as response:
            if response.status_code == 401 and self.tokens:
                self._token_index = (self._token_index + 1) % len(self.tokens)
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                if self.replica not in self.index.replicas:
                    return
                if not self.index.apply(self.replica, json.loads(line)):
                    log.info("KV events of %s: gap or restart, re-syncing from a snapshot", self.replica)
                    if self.on_resync is not None:
                        self.on_resync(self.replica)
                    return


class KVIndexFeed:
    """Keeps one :class:`KVEventSubscriber` per replica of the current routing table (decode, colocated and
    prefill), starting new ones and cancelling those of replicas that left (their entries are dropped)."""

    def __init__(self, index: PrefixIndex, table_source, *, client: httpx.AsyncClient, interval_s: float = 1.0,
                 on_resync=None) -> None:  # noqa: ANN001 - a source.TableSource; on_resync(replica) -> None
        self.index, self.source, self.client, self.interval_s = index, table_source, client, interval_s
        self.on_resync = on_resync
        self.tasks: dict[str, tuple[str, asyncio.Task]] = {}

    def sync(self) -> None:
        """Match subscribers to the table now."""
        table = self.source.table
        wanted = {} if table is None else {
            r.name: ((r.url, r.worker_token, r.worker_token_previous), r.model_version) for r in table.replicas}
        for name, (where, task) in list(self.tasks.items()):  # a new URL or token restarts the subscriber
            if wanted.get(name, (None,))[0] != where or task.done():
                task.cancel()
                del self.tasks[name]
        self.index.retain({name: version for name, (_, version) in wanted.items()})
        for name, (where, _) in wanted.items():
            if name not in self.tasks:
                subscriber = KVEventSubscriber(self.index, name, where[0], client=self.client, tokens=where[1:])
                subscriber.on_resync = self.on_resync
                self.tasks[name] = (where, asyncio.create_task(subscriber.run()))

    async def run(self) -> None:
        """Sync every ``interval_s`` until cancelled (then cancel the subscribers)."""
        try:
            while True:
                self.sync()
                await asyncio.sleep(self.interval_s)
        finally:
            for _, task in self.tasks.values():
                task.cancel()
            await asyncio.gather(*(task for _, task in self.tasks.values()), return_exceptions=True)
