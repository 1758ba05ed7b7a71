"""Block tables of one KV-cache group: the full-attention and sliding-window managers; torch-free.

``FullAttentionManager`` keeps every block of a request; ``SlidingWindowManager`` replaces blocks
lying wholly before the window with the pool's null block and frees them (window convention in
:mod:`~inference_worker.engine.kv_cache_manager`). ``HybridKVCacheManager`` there is the facade over
one of these per group.
"""

from __future__ import annotations

from inference_worker.engine.block_pool import BlockPool, KVCacheBlock


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


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

    def get_num_blocks_to_allocate(self, request_id: str, num_computed_tokens: int, num_tokens: int,
                                   computed_blocks: list[KVCacheBlock] | None = None) -> int:
        """Real blocks needed so the table covers positions ``[0, num_tokens)``.

        New table entries lying wholly before the window of position ``num_computed_tokens``
        are filled with the null block and cost nothing. ``computed_blocks`` (a prefix-cache hit
        for a request without a table) become the table's head; those now free count as needed
        too, since taking them back removes them from the free queue.
        """
        blocks = self.req_to_blocks.get(request_id, []) if computed_blocks is None else computed_blocks
        num_required = cdiv(num_tokens, self.block_size)
        first_real = max(len(blocks), self.num_skipped_blocks(num_computed_tokens))
        num_revived = 0 if computed_blocks is None else sum(
            1 for b in computed_blocks if not b.is_null and b.ref_cnt == 0)
        return max(0, num_required - first_real) + num_revived

    def adopt_computed_blocks(self, request_id: str, computed_blocks: list[KVCacheBlock]) -> None:
        """Start the request's table with the blocks of a prefix-cache hit (adds a reference to each).

        Raises:
            ValueError: if the request already has a table.
        """
        if self.req_to_blocks.get(request_id):
            raise ValueError(f"request {request_id!r} already holds blocks; a hit applies only at admission")
        self.block_pool.touch(computed_blocks)
        self.req_to_blocks[request_id] = list(computed_blocks)

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
