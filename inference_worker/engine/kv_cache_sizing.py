"""KV cache sizing: turn ``--kv-cache-memory`` into blocks and tokens per attention-type group.

``--kv-cache-memory`` is bytes (an int, or a string such as ``"2GiB"``/``"512MB"``) or a
fraction ``0 < f <= 1`` of free accelerator memory (on CPU: of available RAM, via psutil).

Split between groups (hybrid models): a sliding-window layer never needs more than the
tokens inside its window, so the sliding group's need is bounded no matter how long
sequences grow. With block size ``bs``, window W, chunk sizes ``c_i`` summing to at most
``max_num_batched_tokens`` B per step, a running sequence holds at most
``cdiv(W - 1 + c_i, bs) + 1`` sliding blocks, so the whole batch needs at most
``max_num_seqs * (cdiv(W - 1, bs) + 2) + cdiv(B, bs)`` sliding blocks. The budget is first
split so both groups hold the same number of blocks (a sequence never holds more sliding
blocks than full ones, so the full group then runs out first); if that gives the sliding
group more than its bound, the sliding group gets exactly the bound and the full group gets
the rest. Each group also pays for its null block.

With prefix caching (the policy that keeps cached contexts' windows): the freed blocks of
finished contexts stay reusable, and a cached context is only a hit if its sliding window
survives too (the hybrid hit rule reads the last W-1 positions), i.e. ``cdiv(W - 1, bs) + 1``
sliding blocks for a context that holds ``cdiv(L, bs)`` full blocks. That is never fewer sliding
than full blocks for ``L <= W`` and, for ``L = W``, ``cdiv(W - 1, bs) + 1 >= cdiv(W, bs)``: so that
every context the full group can hold keeps its window, both groups get the same number of
blocks (the equal split, without the running-bound cap). Contexts longer than W then leave
sliding blocks to spare; the LRU evicts in each group independently and a context whose window
was evicted simply stops hitting (a shorter or no hit, never a wrong one).
This module never imports torch.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from inference_worker.engine.kv_cache_manager import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    KVCacheGroupSpec,
    cdiv,
)

logger = logging.getLogger(__name__)

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_kv_cache_memory(value: int | float | str) -> tuple[str, float]:
    """Parse ``--kv-cache-memory`` into ``("bytes", n)`` or ``("fraction", f)``.

    Ints and strings with a unit (``"2GiB"``, ``"512MB"``, ``"1000000"``) are bytes; floats and
    unitless strings with a decimal point (``0.5``, ``"0.9"``) are fractions in (0, 1].

    Raises:
        ValueError: on an unparsable string, an unknown unit, a non-positive size or a fraction
            outside (0, 1].
    """
    if isinstance(value, bool):
        raise ValueError(f"--kv-cache-memory must be bytes or a fraction, got {value!r}")
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match is None:
            raise ValueError(f"cannot parse --kv-cache-memory {value!r}; use e.g. 2GiB, 512MB, 1000000 or 0.8")
        number, unit = match.group(1), match.group(2).lower()
        if unit not in _UNITS:
            raise ValueError(f"unknown unit {match.group(2)!r} in --kv-cache-memory; use B, KB, MB, GB, KiB, MiB, GiB")
        if unit == "" and "." in number:
            value = float(number)
        else:
            value = int(float(number) * _UNITS[unit])
            if value <= 0:
                raise ValueError(f"--kv-cache-memory must be positive, got {match.group(0)!r}")
            return ("bytes", value)
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"--kv-cache-memory must be positive, got {value}")
        return ("bytes", value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"a --kv-cache-memory fraction must be in (0, 1], got {value}")
    return ("fraction", float(value))


def resolve_kv_cache_bytes(value: int | float | str, *, free_accelerator_bytes: int | None = None) -> int:
    """The KV cache budget in bytes.

    Args:
        value: ``--kv-cache-memory`` (see ``parse_kv_cache_memory``).
        free_accelerator_bytes: free device memory (the runner reads it, e.g. from
            ``torch.cuda.mem_get_info``); ``None`` on CPU, where a fraction applies to
            ``psutil.virtual_memory().available``.

    Raises:
        ValueError: as ``parse_kv_cache_memory``.
    """
    kind, number = parse_kv_cache_memory(value)
    if kind == "bytes":
        return int(number)
    if free_accelerator_bytes is None:
        import psutil

        free_accelerator_bytes = psutil.virtual_memory().available
    return int(free_accelerator_bytes * number)


@dataclass(frozen=True)
class KVCacheGroupPlan:
    """Size of one attention-type group's pool.

    Attributes:
        attention_type: ``full_attention`` or ``sliding_attention``.
        layer_indices: the group's layers.
        sliding_window: W, or None for full attention.
        num_blocks: pool size including the null block.
        num_tokens: usable token slots, ``(num_blocks - 1) * block_size``.
        bytes_per_block: K and V bytes of one block over all the group's layers.
    """

    attention_type: str
    layer_indices: tuple[int, ...]
    sliding_window: int | None
    num_blocks: int
    num_tokens: int
    bytes_per_block: int

    @property
    def total_bytes(self) -> int:
        """Bytes the group's tensors take, null block included."""
        return self.num_blocks * self.bytes_per_block


@dataclass(frozen=True)
class KVCachePlan:
    """The KV cache layout chosen at start-up: budget, block size and one plan per group."""

    budget_bytes: int
    block_size: int
    dtype_bytes: int
    groups: tuple[KVCacheGroupPlan, ...]

    def group_specs(self) -> list[KVCacheGroupSpec]:
        """Specs for ``HybridKVCacheManager``, in the plan's group order."""
        return [
            KVCacheGroupSpec(g.attention_type, g.layer_indices, g.sliding_window, g.num_blocks, self.block_size)
            for g in self.groups
        ]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready report: budget, block size and blocks/tokens/bytes per attention type."""
        return {
            "budget_bytes": self.budget_bytes,
            "block_size": self.block_size,
            "dtype_bytes": self.dtype_bytes,
            "groups": {
                g.attention_type: {
                    "num_layers": len(g.layer_indices),
                    "sliding_window": g.sliding_window,
                    "num_blocks": g.num_blocks,
                    "num_tokens": g.num_tokens,
                    "bytes": g.total_bytes,
                }
                for g in self.groups
            },
        }

    def log_line(self) -> str:
        """One start-up line, e.g. ``KV cache 1.00 GiB, block_size 16: full_attention 3 layers ...``."""
        parts = [
            f"{g.attention_type} {len(g.layer_indices)} layers {g.num_blocks - 1} blocks "
            f"{g.num_tokens} tokens {g.total_bytes / 2**20:.1f} MiB"
            for g in self.groups
        ]
        return f"KV cache {self.budget_bytes / 2**30:.2f} GiB, block_size {self.block_size}: " + "; ".join(parts)


def plan_kv_cache(
    model_config: Any,
    *,
    budget_bytes: int,
    block_size: int,
    dtype_bytes: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    enable_prefix_caching: bool = False,
) -> KVCachePlan:
    """Split ``budget_bytes`` into per-group block pools (rule in the module docstring).

    Args:
        model_config: ``inference_worker.config.ModelConfig`` (reads ``layer_types``,
            ``sliding_window`` and ``kv_bytes_per_token(layer_type, dtype_bytes)``, the bytes of K
            and V per token per layer, DESIGN's ``b``).
        budget_bytes: total KV bytes allowed.
        block_size: tokens per block.
        dtype_bytes: bytes per KV element (4 fp32, 2 bf16/fp16).
        max_num_seqs: scheduler's running-request limit (bounds the sliding group).
        max_num_batched_tokens: scheduler's per-step token budget (bounds the sliding group).
        enable_prefix_caching: size the sliding group so cached contexts keep their windows
            (policy in the module docstring).

    Raises:
        ValueError: if a group would get fewer than one usable block, or an unknown layer type.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    layer_types = list(model_config.layer_types)
    layers: dict[str, list[int]] = {}
    for index, layer_type in enumerate(layer_types):
        if layer_type not in (FULL_ATTENTION, SLIDING_ATTENTION):
            raise ValueError(f"layer {index} has unsupported layer type {layer_type!r}")
        layers.setdefault(layer_type, []).append(index)
    order = [t for t in (FULL_ATTENTION, SLIDING_ATTENTION) if t in layers]
    block_bytes = {
        t: int(model_config.kv_bytes_per_token(t, dtype_bytes)) * block_size * len(layers[t]) for t in order
    }
    num_usable: dict[str, int] = {}
    # Every group pays for its null block first.
    remaining = budget_bytes - sum(block_bytes.values())
    equal = max(0, remaining // sum(block_bytes.values()))
    if len(order) == 1:
        num_usable[order[0]] = equal
    else:
        window = model_config.sliding_window
        bound = max_num_seqs * (cdiv(window - 1, block_size) + 2) + cdiv(max_num_batched_tokens, block_size)
        num_usable[SLIDING_ATTENTION] = min(equal, bound)
        if enable_prefix_caching:  # cached contexts keep their windows: the equal split (module docstring)
            num_usable[SLIDING_ATTENTION] = equal
        rest = remaining - num_usable[SLIDING_ATTENTION] * block_bytes[SLIDING_ATTENTION]
        num_usable[FULL_ATTENTION] = rest // block_bytes[FULL_ATTENTION]
    for t in order:
        if num_usable[t] < 1:
            raise ValueError(
                f"--kv-cache-memory of {budget_bytes} bytes leaves no usable {t} block "
                f"({block_bytes[t]} bytes per block); raise it"
            )
    groups = tuple(
        KVCacheGroupPlan(
            attention_type=t,
            layer_indices=tuple(layers[t]),
            sliding_window=model_config.sliding_window if t == SLIDING_ATTENTION else None,
            num_blocks=num_usable[t] + 1,
            num_tokens=num_usable[t] * block_size,
            bytes_per_block=block_bytes[t],
        )
        for t in order
    )
    plan = KVCachePlan(budget_bytes=budget_bytes, block_size=block_size, dtype_bytes=dtype_bytes, groups=groups)
    logger.info(plan.log_line())
    return plan
