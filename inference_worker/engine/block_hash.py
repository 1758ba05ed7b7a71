"""Prefix-cache block identity and the hybrid hit rule; torch-free, shared by the worker and the router.

**Block digest.** A full block of ``block_size`` token slots is identified by a 32-byte BLAKE3
digest over a canonical byte encoding of (parent digest, the block's token ids)::

    digest(k) = BLAKE3(b"ferry-kv-block\\x00" || digest(k-1) || uint32_le(token ids of block k))
    digest(-1) = root = BLAKE3(b"ferry-kv-root-v1\\x00" || weights_sha256 (64 hex chars, ascii)
                               || b"\\x00" || kv_dtype (ascii) || b"\\x00" || uint32_le(block_size))

so a digest names the whole prefix up to the end of its block, is the same in every process
and on every host, and is only valid for the weights, KV dtype and block size in its root (KV
computed by other weights, in another dtype or with another block layout never matches).
Chaining with a cryptographic hash makes accidental collisions negligible (vLLM's automatic
prefix caching chains the parent hash the same way; its default Python ``hash`` was replaced by
SHA-256 for the same collision reason). Only full blocks have digests: a partial last block is
never cached.

**Hybrid hit rule** (DESIGN "KV reuse"; the window convention is Hugging Face's: with window W
the query at position i sees keys j with ``i - W < j <= i``). A hit of ``h`` tokens (a multiple
of ``block_size``) means the request skips computing positions ``0..h-1``; the first computed
query is at position h and it reads, for each KV-cache group:

- full attention: every position ``0..h-1``, i.e. blocks ``0 .. h/bs - 1``;
- sliding window W: positions ``max(0, h - W + 1) .. h - 1`` (the last W-1 positions), i.e.
  blocks ``max(0, h - W + 1) // bs .. h/bs - 1``; earlier blocks may be gone (null).

Later queries of the request read no older positions than the first one, so the hit is valid
iff every group has every block it reads. The hit is the longest such block-aligned prefix, and
never the whole prompt: the last prompt token is always computed (its logits give the first
output token), so ``h <= num_tokens - 1``. vLLM v1's hybrid KV cache manager uses the same
rule (``SlidingWindowManager.find_longest_cache_hit``: a run of cached blocks covering the
window, searched from the right).

Worked example, W = 4, bs = 2: a hit of 6 needs full blocks 0, 1, 2 and sliding blocks
``(6-4+1)//2 = 1`` and 2 (positions 3..5); sliding block 0 may have been evicted.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

from blake3 import blake3

DIGEST_BYTES = 32
_BLOCK_TAG = b"ferry-kv-block\x00"
_ROOT_TAG = b"ferry-kv-root-v1\x00"


def prefix_root(weights_sha256: str, kv_dtype: str, block_size: int) -> bytes:
    """The root digest (the parent of block 0) for one model's KV layout.

    Args:
        weights_sha256: hex sha256 of the weights (64 characters).
        kv_dtype: the KV cache dtype name, e.g. ``"float32"``, ``"bfloat16"``.
        block_size: tokens per block (>= 1).

    Raises:
        ValueError: on an empty hash or dtype, or ``block_size`` < 1.
    """
    if not weights_sha256 or not kv_dtype:
        raise ValueError("weights_sha256 and kv_dtype must be non-empty")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    data = _ROOT_TAG + weights_sha256.lower().encode("ascii") + b"\x00" + kv_dtype.encode("ascii") + b"\x00"
    return blake3(data + struct.pack("<I", block_size)).digest()


def block_digest(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Digest of one block: BLAKE3 over the tag, the parent digest and the token ids as uint32 LE.

    Raises:
        ValueError: if ``parent`` is not 32 bytes or a token id is outside [0, 2**32).
    """
    if len(parent) != DIGEST_BYTES:
        raise ValueError(f"parent digest must be {DIGEST_BYTES} bytes, got {len(parent)}")
    try:
        packed = struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be in [0, 2**32): {exc}") from None
    return blake3(_BLOCK_TAG + parent + packed).digest()


def block_digests(root: bytes, token_ids: Sequence[int], block_size: int, *, start: Sequence[bytes] = ()) -> list[bytes]:
    """Digests of every full block of ``token_ids`` (``len(token_ids) // block_size`` of them).

    Args:
        root: ``prefix_root(...)``.
        start: digests already known for the leading blocks (extended, not recomputed).
    """
    digests = list(start)
    parent = digests[-1] if digests else root
    first, end = len(digests), len(token_ids) // block_size
    if first >= end:
        return digests
    if len(parent) != DIGEST_BYTES:
        raise ValueError(f"parent digest must be {DIGEST_BYTES} bytes, got {len(parent)}")
    # the same bytes as block_digest per block, packed in one call (a 4K-token prompt: 256 blocks)
    ids = token_ids[first * block_size : end * block_size]
    try:
        packed = struct.pack(f"<{len(ids)}I", *ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be in [0, 2**32): {exc}") from None
    step = 4 * block_size
    for offset in range(0, len(packed), step):
        parent = blake3(_BLOCK_TAG + parent + packed[offset : offset + step]).digest()
        digests.append(parent)
    return digests


def first_needed_block(num_tokens: int, sliding_window: int | None, block_size: int) -> int:
    """First block the query at position ``num_tokens`` reads: 0 for full attention, else ``max(0, p-W+1)//bs``."""
    if sliding_window is None:
        return 0
    return max(0, num_tokens - sliding_window + 1) // block_size


def longest_hit_blocks(
    num_blocks: int, windows: Sequence[int | None], block_size: int, is_cached: Callable[[int, int], bool]
) -> int:
    """The longest hit, in blocks, under the hybrid rule (module docstring).

    Args:
        num_blocks: most blocks the hit may have (``(num_tokens - 1) // block_size`` for a request
            of ``num_tokens`` tokens, so the last token is computed; also bounded by the number of
            digests known).
        windows: per KV-cache group, W for sliding attention or None for full attention.
        block_size: tokens per block.
        is_cached: ``(group index, block index) -> bool``.

    Returns:
        h_blocks in ``[0, num_blocks]``: every group has every block the query at position
        ``h_blocks * block_size`` reads. O(num_blocks) ``is_cached`` calls per group per pass;
        passes repeat only while a group lowers the candidate.
    """
    h = num_blocks
    for g, window in enumerate(windows):  # full groups: the longest run of cached blocks from block 0
        if window is None:
            k = 0
            while k < h and is_cached(g, k):
                k += 1
            h = k
    sliding = [(g, w) for g, w in enumerate(windows) if w is not None]
    changed = True
    while changed and h > 0:
        changed = False
        for g, window in sliding:
            k = h - 1
            while h > 0 and k >= first_needed_block(h * block_size, window, block_size):
                if is_cached(g, k):
                    k -= 1
                    continue
                h, changed = k, True  # block k is missing: no hit that reads it; try ending before it
                k = h - 1
    return h
