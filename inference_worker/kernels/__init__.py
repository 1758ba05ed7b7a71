"""Attention kernels over a contiguous KV cache: a pure-torch reference and a fast CPU/GPU path (SDPA).

Both take the same arguments and obey HF's sliding-window convention: with window ``W`` the query at
absolute position ``i`` sees the keys at positions ``j`` with ``i - W < j <= i``.
"""

from inference_worker.kernels.reference import decode_attention_reference, prefill_attention_reference
from inference_worker.kernels.sdpa import decode_attention_sdpa, prefill_attention_sdpa

__all__ = [
    "decode_attention_reference",
    "decode_attention_sdpa",
    "prefill_attention_reference",
    "prefill_attention_sdpa",
]
