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
"""

from __future__ import annotations

from dataclasses import dataclass

from inference_worker.config import FULL_ATTENTION, SLIDING_ATTENTION
from inference_worker.engine.block_pool import BlockPool, KVCacheBlock

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


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


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


class SingleTypeKVCacheManager:
    """Block tables of one KV-cache group, keyed by request id. Subclasses set the freeing rule."""

    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no query from position ``num_computed_tokens`` on can read (0 here)."""
        return 0

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replace unreadable leading blocks with the null block and free them (no-op here)."""

    def get_num_blocks_to_allocate(self, request_id: str, num_computed_tokens: int, num_tokens: int) -> int:
        """Real blocks needed so the table covers positions ``[0, num_tokens)``.

        New table entries lying wholly before the window of position ``num_computed_tokens``
        are filled with the null block and cost nothing.
        """
        blocks = self.req_to_blocks.get(request_id, [])
        num_required = cdiv(num_tokens, self.block_size)
        first_real = max(len(blocks), self.num_skipped_blocks(num_computed_tokens))
        return max(0, num_required - first_real)

    def allocate_new_blocks(
        self, request_id: str, num_computed_tokens: int, num_tokens: int
    ) -> list[KVCacheBlock]:
        """Extend the request's table to cover ``[0, num_tokens)``; returns the appended entries.

        Raises:
            ValueError: from the pool if not enough blocks are free (check first).
        """
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_required = cdiv(num_tokens, self.block_size)
        if num_required <= len(blocks):
            return []
        num_null = max(0, min(num_required, self.num_skipped_blocks(num_computed_tokens)) - len(blocks))
        new_blocks = [self.block_pool.null_block] * num_null
        new_blocks += self.block_pool.allocate(num_required - len(blocks) - num_null)
        blocks.extend(new_blocks)
        return new_blocks

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks to the pool, tail first so the tail is reused first."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (null entries are block 0)."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def num_held_blocks(self, request_id: str) -> int:
        """Real (non-null) blocks the request holds in this group."""
        return sum(1 for block in self.req_to_blocks.get(request_id, []) if not block.is_null)


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every position is read by every later query, so no block is freed early."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window W: blocks whose last position is <= p - W are unreadable from position p on."""

    def __init__(self, block_pool: BlockPool, block_size: int, sliding_window: int) -> None:
        super().__init__(block_pool, block_size)
        self.sliding_window = sliding_window

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Number of leading blocks wholly before the window of position ``num_computed_tokens``.

        The next query is at position p = ``num_computed_tokens`` and sees keys j > p - W; block k
        holds positions ``[k*bs, (k+1)*bs)``, so it is unreadable iff ``(k+1)*bs - 1 <= p - W``,
        i.e. ``k < (p - W + 1) // bs``.
        """
        return max(0, (num_computed_tokens - self.sliding_window + 1) // self.block_size)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Null out and free the blocks the next query can no longer see.

        Algorithm: the next query is at position p = ``num_computed_tokens``; the first
        ``(p - W + 1) // block_size`` blocks hold only positions <= p - W, outside every future
        window. Walk those entries from the last one backwards, stop at the first entry that is
        already the null block (everything before it was nulled on an earlier step), replace
        each real block with the null block and return it to the pool. The table keeps its
        length, so block index k still maps to positions ``[k*bs, (k+1)*bs)``.
        """
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_skipped = min(self.num_skipped_blocks(num_computed_tokens), len(blocks))
        removed = []
        null_block = self.block_pool.null_block
        for k in range(num_skipped - 1, -1, -1):
            if blocks[k].is_null:
                break
            removed.append(blocks[k])
            blocks[k] = null_block
        self.block_pool.free(removed)


class HybridKVCacheManager:
    """Facade over one manager per KV-cache group; allocations are all-or-nothing across groups.

    Args:
        groups: one spec per attention type; all must share ``block_size``.

    Raises:
        ValueError: if ``groups`` is empty or block sizes differ.
    """

    def __init__(self, groups: list[KVCacheGroupSpec]) -> None:
        if not groups:
            raise ValueError("at least one KV-cache group is required")
        block_sizes = {group.block_size for group in groups}
        if len(block_sizes) != 1:
            raise ValueError(f"all KV-cache groups must share one block_size, got {sorted(block_sizes)}")
        self.groups = list(groups)
        self.block_size = groups[0].block_size
        self.block_pools = [BlockPool(group.num_blocks) for group in groups]
        self.managers: list[SingleTypeKVCacheManager] = []
        for group, pool in zip(groups, self.block_pools, strict=True):
            if group.sliding_window is None:
                self.managers.append(FullAttentionManager(pool, group.block_size))
            else:
                self.managers.append(SlidingWindowManager(pool, group.block_size, group.sliding_window))

    def allocate_slots(
        self, request_id: str, num_computed_tokens: int, num_new_tokens: int
    ) -> tuple[list[int], ...] | None:
        """Make room for ``num_new_tokens`` more tokens after ``num_computed_tokens``.

        Algorithm: first every group drops the blocks the next query (at position
        ``num_computed_tokens``) cannot see — always safe, whatever happens next. Then each group
        counts the real blocks it needs for its table to cover ``num_computed_tokens +
        num_new_tokens`` positions; if any group lacks free blocks nothing is allocated and
        ``None`` is returned (the scheduler preempts or waits). Otherwise each group appends its
        blocks and the appended block ids are returned, one list per group.

        Raises:
            ValueError: if either count is negative.
        """
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError("token counts must be >= 0")
        num_tokens = num_computed_tokens + num_new_tokens
        for manager in self.managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)
        for manager, pool in zip(self.managers, self.block_pools, strict=True):
            needed = manager.get_num_blocks_to_allocate(request_id, num_computed_tokens, num_tokens)
            if needed > pool.get_num_free_blocks():
                return None
        return tuple(
            [block.block_id for block in manager.allocate_new_blocks(request_id, num_computed_tokens, num_tokens)]
            for manager in self.managers
        )

    def free(self, request_id: str) -> None:
        """Free every block of the request in every group (finish, abort or preemption)."""
        for manager in self.managers:
            manager.free(request_id)

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
