"""Block pool: the free list and reference counts of one KV-cache group's physical blocks.

A KV cache is split into fixed-size blocks of ``block_size`` token slots. The pool hands out
block ids, counts how many requests hold each block, and owns one shared *null block*
(block id 0): a placeholder that sliding-window managers put in a block table where a block
has fallen out of the window. The null block is never allocated, never freed and never
counted as free. This module never imports torch; the model runner maps block ids to tensor
rows.

Prefix caching: a block whose KV is complete for a known prefix carries its digest
(:mod:`~inference_worker.engine.block_hash`) and sits in the pool's cached-block map
(digest -> block). When its last reference goes it joins the free queue *with* its digest, so a
later request can take it back (``touch``) while its memory has not been reused; ``allocate``
evicts a cached block (drops its digest, emits ``BlockRemoved``) only when it hands the block out
for new KV. The free queue is therefore also the LRU of reusable blocks: least recently freed
first, O(1) per operation.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from inference_worker.engine.kv_events import BlockRemoved, BlockStored, KVEventQueue

NULL_BLOCK_ID = 0


@dataclass(eq=False)
class KVCacheBlock:
    """One physical block of ``block_size`` token slots.

    Attributes:
        block_id: row of the group's KV tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        ref_cnt: number of requests whose block table holds this block (0 = free).
        is_null: True only for the pool's shared null block.
        block_hash: the block's prefix digest while it is in the cached-block map, else None.
        parent_hash: the digest of the block before it in the prefix (the root for block 0).
    """

    block_id: int
    ref_cnt: int = 0
    is_null: bool = False
    block_hash: bytes | None = None
    parent_hash: bytes | None = None


class BlockPool:
    """Free queue and reference counts for ``num_blocks`` blocks, block 0 being the null block.

    Args:
        num_blocks: total blocks including the null block; must be >= 2 so at least one block
            is usable.
        group: the KV-cache group's name in events (its attention type).
        events: where ``BlockStored``/``BlockRemoved``/``AllCleared`` go (None: not recorded).

    Raises:
        ValueError: if ``num_blocks`` < 2.

    The free queue is ordered (least recently freed first), so a freed block is reused as late
    as possible; each operation is O(1) per block.
    """

    def __init__(self, num_blocks: int, *, group: str = "", events: KVEventQueue | None = None) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (one null block plus at least one usable block), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.is_null = True
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks[1:]
        )
        self.group = group
        self.events = events
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be allocated: ``num_blocks - 1`` (the null block is excluded)."""
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Number of blocks that ``allocate`` can hand out now."""
        return len(self._free)

    def get_usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, each with ``ref_cnt`` 1.

        Raises:
            ValueError: if ``num_blocks`` is negative or more than the free blocks; the pool is
                left unchanged (callers check ``get_num_free_blocks`` first).
        """
        if num_blocks < 0 or num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks: {len(self._free)} free")
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:  # a reusable block's memory is needed: evict it
                self._uncache(block)
                self.num_evictions += 1
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def get_cached_block(self, digest: bytes) -> KVCacheBlock | None:
        """The block holding KV for ``digest``, whether in use or free (still reusable), else None."""
        return self.cached_blocks.get(digest)

    def cache_block(self, block: KVCacheBlock, digest: bytes, parent_digest: bytes) -> bool:
        """Register ``block`` (held by a request, every slot computed) under ``digest``.

        Returns False and changes nothing when the digest is already cached (another request
        computed the same prefix into another block: the first one stays the cached copy), or the
        block is the null block or already registered.
        """
        if block.is_null or block.block_hash is not None or digest in self.cached_blocks:
            return False
        block.block_hash, block.parent_hash = digest, parent_digest
        self.cached_blocks[digest] = block
        if self.events is not None:
            self.events.put(BlockStored(digest, parent_digest, self.group))
        return True

    def _uncache(self, block: KVCacheBlock) -> None:
        digest, block.block_hash, block.parent_hash = block.block_hash, None, None
        del self.cached_blocks[digest]
        if self.events is not None:
            self.events.put(BlockRemoved(digest, self.group))

    def reset_prefix_cache(self) -> int:
        """Forget every digest (blocks in use keep their KV but stop being reusable); returns how many.

        Emits no per-block events: ``HybridKVCacheManager.reset_prefix_cache`` emits one
        ``AllCleared`` for all groups.
        """
        num = len(self.cached_blocks)
        for block in self.cached_blocks.values():
            block.block_hash = block.parent_hash = None
        self.cached_blocks.clear()
        return num

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Add one reference to each block (sharing), taking free ones out of the free queue.

        The null block is skipped: it is shared by everyone and never counted. Touching a free
        cached block is a prefix-cache hit: it leaves the free queue without losing its KV.
        """
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the tail of the free queue.

        The null block is skipped. Pass blocks in eviction order (the ones to reuse first
        first); managers pass a request's blocks in reverse so its tail blocks are reused first.

        Raises:
            ValueError: if a block is already free (a double free is a bookkeeping bug).
        """
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
