"""KV cache managers: one per attention type, behind one facade with one KV-cache group each.

A *KV-cache group* is the set of layers sharing an attention type (all ``full_attention``
layers, all ``sliding_attention`` layers). Every group has its own ``BlockPool`` sized from
its own budget, and a request has one block table per group; the block ids of a group index
the KV tensors of every layer in that group. ``FullAttentionManager`` keeps every block of a
request; ``SlidingWindowManager`` replaces blocks lying wholly before the window with the
pool's null block and frees them. ``HybridKVCacheManager`` is the facade the scheduler uses:
an allocation succeeds in every group or in none.

Window convention (Hugging Face's): with window W the query at position i sees keys j with
``i - W < j <= i``. This module never imports torch.

Prefix caching (``enable_prefix_caching``): a request's full blocks are registered in their
group's cached-block map under their chained digests (:mod:`~inference_worker.engine.block_hash`)
once every slot holds KV computed or received for exactly those tokens — prompt and generated
tokens alike; the scheduler calls :meth:`HybridKVCacheManager.cache_blocks` after each step.
Blocks whose KV is only partly known (a PD import's first sliding block) are never registered.
At admission :meth:`HybridKVCacheManager.get_computed_blocks` finds the longest hit under the
hybrid rule, stated with its source in ``block_hash``: full layers need every block of the
prefix, sliding layers the blocks covering the last W-1 positions before it; the last prompt
token is always computed. Freed blocks keep their digests in the pool's LRU until their memory
is reused (``BlockPool``).
"""

from __future__ import annotations

from dataclasses import dataclass

from inference_worker.config import FULL_ATTENTION, SLIDING_ATTENTION
from inference_worker.engine.block_hash import block_digests, first_needed_block, longest_hit_blocks
from inference_worker.engine.block_pool import BlockPool, KVCacheBlock
from inference_worker.engine.kv_events import AllCleared, BlockStored, KVEvent, KVEventQueue
from inference_worker.engine.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    cdiv,
)

__all__ = [
    "FULL_ATTENTION",
    "SLIDING_ATTENTION",
    "FullAttentionManager",
    "HybridKVCacheManager",
    "KVCacheGroupSpec",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "cdiv",
]


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group: the layers of one attention type and the size of their pool.

    Attributes:
        attention_type: ``"full_attention"`` or ``"sliding_attention"`` (HF ``layer_types`` values).
        layer_indices: model layers whose KV lives in this group's blocks.
        sliding_window: W in tokens for sliding attention; ``None`` for full attention.
        num_blocks: blocks in this group's pool, including the null block (block 0).
        block_size: token slots per block (same for every group).
    """

    attention_type: str
    layer_indices: tuple[int, ...]
    sliding_window: int | None
    num_blocks: int
    block_size: int

    def __post_init__(self) -> None:
        if self.attention_type not in (FULL_ATTENTION, SLIDING_ATTENTION):
            raise ValueError(f"unknown attention_type {self.attention_type!r}")
        if (self.attention_type == SLIDING_ATTENTION) != (self.sliding_window is not None):
            raise ValueError("sliding_window must be set for sliding_attention and None for full_attention")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


class HybridKVCacheManager:
    """Facade over one manager per KV-cache group; allocations are all-or-nothing across groups.

    Args:
        groups: one spec per attention type; all must share ``block_size``.
        enable_prefix_caching: register computed blocks and reuse them (see module docstring).
        prefix_root: the root digest (``block_hash.prefix_root``: weights sha256, KV dtype, block
            size); required when prefix caching is on.
        max_events: bound of the KV event queue (oldest events dropped past it).

    Raises:
        ValueError: if ``groups`` is empty, block sizes differ, or prefix caching is on without a root.
    """

    def __init__(self, groups: list[KVCacheGroupSpec], *, enable_prefix_caching: bool = False,
                 prefix_root: bytes | None = None, max_events: int = 100_000) -> None:
        if not groups:
            raise ValueError("at least one KV-cache group is required")
        block_sizes = {group.block_size for group in groups}
        if len(block_sizes) != 1:
            raise ValueError(f"all KV-cache groups must share one block_size, got {sorted(block_sizes)}")
        if enable_prefix_caching and prefix_root is None:
            raise ValueError("prefix caching needs a prefix_root (weights sha256, KV dtype, block size)")
        self.groups = list(groups)
        self.block_size = groups[0].block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_root = prefix_root
        self.events = KVEventQueue(max_events)
        self.block_pools = [BlockPool(group.num_blocks, group=group.attention_type, events=self.events)
                            for group in groups]
        self.windows = [group.sliding_window for group in groups]
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self._digests: dict[str, list[bytes]] = {}
        self._next_to_register: dict[str, list[int]] = {}
        self.managers: list[SingleTypeKVCacheManager] = []
        for group, pool in zip(groups, self.block_pools, strict=True):
            if group.sliding_window is None:
                self.managers.append(FullAttentionManager(pool, group.block_size))
            else:
                self.managers.append(SlidingWindowManager(pool, group.block_size, group.sliding_window))

    def get_computed_blocks(
        self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int] = ()
    ) -> tuple[int, list[list[KVCacheBlock]] | None]:
        """The longest prefix-cache hit for a request about to be admitted (nothing is changed).

        Returns:
            ``(num_hit_tokens, blocks)``: a multiple of ``block_size``, at most ``num_tokens - 1``;
            ``blocks`` per group is the table head to adopt (null entries for sliding blocks
            before the window), or None when prefix caching is off or there is no hit.
        """
        if not self.enable_prefix_caching:
            return 0, None
        num_tokens = len(prompt_token_ids) + len(output_token_ids)
        digests = self._digests_for(request_id, prompt_token_ids, output_token_ids, num_tokens - 1)
        pools = self.block_pools
        num_blocks = min(len(digests), (num_tokens - 1) // self.block_size)
        hit = longest_hit_blocks(num_blocks, self.windows, self.block_size,
                                 lambda g, k: digests[k] in pools[g].cached_blocks)
        if hit == 0:
            return 0, None
        tables = []
        for pool, window in zip(pools, self.windows, strict=True):
            first = first_needed_block(hit * self.block_size, window, self.block_size)
            tables.append([pool.null_block] * first + [pool.cached_blocks[d] for d in digests[first:hit]])
        return hit * self.block_size, tables

    def _digests_for(self, request_id: str, prompt: list[int], output: list[int], num_tokens: int) -> list[bytes]:
        """Digests of the full blocks of the request's first ``num_tokens`` tokens (cached per request)."""
        known = self._digests.get(request_id, [])
        if len(known) < num_tokens // self.block_size:
            tokens = list(prompt[:num_tokens]) + list(output[: max(0, num_tokens - len(prompt))])
            known = block_digests(self.prefix_root, tokens, self.block_size, start=known)
            self._digests[request_id] = known
        return known

    def request_block_digests(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                              num_tokens: int) -> list[bytes]:
        """Digests of the full blocks of the request's first ``num_tokens`` tokens (computed once per request).

        Raises:
            ValueError: prefix caching is off (there is no root to chain from).
        """
        if self.prefix_root is None:
            raise ValueError("block digests need prefix caching (a prefix root)")
        return self._digests_for(request_id, prompt_token_ids, output_token_ids, num_tokens)[: num_tokens // self.block_size]

    def readable_block_ids(self, request_id: str, digests: list[bytes]) -> tuple[list[int], ...]:
        """Per group, the blocks holding the request's KV that can be trusted, for saving it elsewhere.

        Entry k below ``len(digests)`` (a full block) is the block registered under ``digests[k]`` — registered
        blocks hold KV computed or received for exactly those tokens, including sliding blocks already nulled
        in the table but still cached — or 0 when there is none (evicted, or only partly written such as a PD
        import's first sliding block, which is never registered). Later entries (the partial last block,
        written by this request's own steps) are the table's.
        """
        tables = []
        for manager, pool in zip(self.managers, self.block_pools, strict=True):
            table = []
            for k, block in enumerate(manager.req_to_blocks.get(request_id, [])):
                if k < len(digests):
                    cached = pool.cached_blocks.get(digests[k])
                    table.append(0 if cached is None else cached.block_id)
                else:
                    table.append(block.block_id)
            tables.append(table)
        return tuple(tables)

    def allocate_slots(
        self, request_id: str, num_computed_tokens: int, num_new_tokens: int,
        computed_blocks: list[list[KVCacheBlock]] | None = None,
    ) -> tuple[list[int], ...] | None:
        """Make room for ``num_new_tokens`` more tokens after ``num_computed_tokens``.

        Algorithm: first every group drops the blocks the next query (at position
        ``num_computed_tokens``) cannot see — always safe, whatever happens next. Then each group
        counts the real blocks it needs for its table to cover ``num_computed_tokens +
        num_new_tokens`` positions; if any group lacks free blocks nothing is allocated and
        ``None`` is returned (the scheduler preempts or waits). Otherwise each group appends its
        blocks and the appended block ids are returned, one list per group.

        ``computed_blocks`` (from ``get_computed_blocks``, admission only, with
        ``num_computed_tokens`` the hit) are adopted as the head of each table in the same
        all-or-nothing check, and count as a prefix-cache query of the request's tokens.

        Raises:
            ValueError: if either count is negative.
        """
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError("token counts must be >= 0")
        num_tokens = num_computed_tokens + num_new_tokens
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)
        for g, (manager, pool) in enumerate(zip(self.managers, self.block_pools, strict=True)):
            head = None if computed_blocks is None else computed_blocks[g]
            needed = manager.get_num_blocks_to_allocate(request_id, num_computed_tokens, num_tokens, head)
            if needed > pool.get_num_free_blocks():
                return None
        if computed_blocks is not None:
            for manager, head in zip(self.managers, computed_blocks, strict=True):
                manager.adopt_computed_blocks(request_id, head)
            self._next_to_register[request_id] = [len(head) for head in computed_blocks]
        return tuple(
            [block.block_id for block in manager.allocate_new_blocks(request_id, num_computed_tokens, num_tokens)]
            for manager in self.managers
        )

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup (tokens looked up, tokens hit)."""
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    def cache_blocks(self, request_id: str, num_computed_tokens: int, prompt_token_ids: list[int],
                     output_token_ids: list[int] = ()) -> int:
        """Register the request's blocks that are now full of computed KV; returns how many were new.

        Block k is registered in a group when positions ``k*bs .. (k+1)*bs - 1`` are all below
        ``num_computed_tokens``, its table entry is a real block, and the group's registration
        point (see ``set_first_registrable_blocks``) has reached it. A digest already cached in
        the group keeps its first block. No-op when prefix caching is off.
        """
        if not self.enable_prefix_caching:
            return 0
        num_full = num_computed_tokens // self.block_size
        nexts = self._next_to_register.setdefault(request_id, [0] * len(self.managers))
        if min(nexts) >= num_full:
            return 0
        digests = self._digests_for(request_id, prompt_token_ids, output_token_ids, num_computed_tokens)
        num_new = 0
        for g, (manager, pool) in enumerate(zip(self.managers, self.block_pools, strict=True)):
            table = manager.req_to_blocks.get(request_id, [])
            for k in range(nexts[g], min(num_full, len(table))):
                parent = digests[k - 1] if k else self.prefix_root
                num_new += pool.cache_block(table[k], digests[k], parent)
            nexts[g] = max(nexts[g], min(num_full, len(table)))
        return num_new

    def set_first_registrable_blocks(self, request_id: str, first_positions: list[int]) -> None:
        """KV received from elsewhere: per group, only positions from ``first_positions[g]`` on hold KV.

        Blocks containing an earlier position (null, or partly written such as a PD import's first
        sliding block) are never registered: the group's registration point starts at
        ``cdiv(first_positions[g], block_size)``.
        """
        self._next_to_register[request_id] = [cdiv(p, self.block_size) for p in first_positions]

    def reset_prefix_cache(self) -> int:
        """Forget every cached digest in every group; emits one ``AllCleared``. Returns blocks forgotten.

        Blocks in use keep their KV; requests running now will not register their earlier blocks again.
        """
        num = sum(pool.reset_prefix_cache() for pool in self.block_pools)
        self.events.put(AllCleared())
        return num

    def take_events(self) -> list[KVEvent]:
        """KV events since the previous call, oldest first."""
        return self.events.take()

    def snapshot_events(self) -> list[KVEvent]:
        """The cache as it is now, as events: one ``AllCleared`` then a ``BlockStored`` per cached block."""
        events: list[KVEvent] = [AllCleared()]
        for pool in self.block_pools:
            events += [BlockStored(d, b.parent_hash, pool.group) for d, b in pool.cached_blocks.items()]
        return events

    def get_num_cached_blocks(self) -> tuple[int, ...]:
        """Registered (reusable) blocks per group, in use or free."""
        return tuple(len(pool.cached_blocks) for pool in self.block_pools)

    def get_num_evictions(self) -> tuple[int, ...]:
        """Cached blocks evicted (memory reused) per group since start."""
        return tuple(pool.num_evictions for pool in self.block_pools)

    def free(self, request_id: str) -> None:
        """Free every block of the request in every group (finish, abort or preemption).

        Registered blocks stay reusable in the pools' LRU until their memory is needed.
        """
        for manager in self.managers:
            manager.free(request_id)
        self._digests.pop(request_id, None)
        self._next_to_register.pop(request_id, None)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block tables, one per group (null entries are block 0)."""
        return tuple(manager.get_block_ids(request_id) for manager in self.managers)

    def num_held_blocks(self, request_id: str) -> tuple[int, ...]:
        """Real blocks the request holds, one count per group."""
        return tuple(manager.num_held_blocks(request_id) for manager in self.managers)

    def get_num_free_blocks(self) -> tuple[int, ...]:
        """Free blocks per group."""
        return tuple(pool.get_num_free_blocks() for pool in self.block_pools)

    def get_num_usable_blocks(self) -> tuple[int, ...]:
        """Allocatable blocks per group (pool size minus the null block)."""
        return tuple(pool.num_usable_blocks for pool in self.block_pools)

    def get_usage(self) -> float:
        """KV cache usage in [0, 1]: the fullest group's fraction of used blocks."""
        return max(pool.get_usage() for pool in self.block_pools)
