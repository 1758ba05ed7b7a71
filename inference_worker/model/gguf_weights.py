"""Read a GGUF file's tensors into an HF-named, dequantized state dict.

Tensor data is memory-mapped and dequantized by the ``gguf`` package (``gguf.quants.dequantize``).
Two llama.cpp conventions are undone here, as transformers' GGUF integration also does
(``transformers/modeling_gguf_pytorch_utils.py``), and as the parity tests confirm:

* Llama q/k projections are stored with each head's rows interleaved for llama.cpp's RoPE
  (``convert_hf_to_gguf.py`` ``permute``); we reverse that permutation to HF's rotate-half layout.
* Gemma norm weights are stored as ``1 + w`` (llama.cpp multiplies by the stored weight); HF's Gemma
  RMSNorm multiplies by ``1 + w``, so 1 is subtracted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from inference_worker.config import ModelConfig
from inference_worker.config.gguf_header import GGUFTensorInfo, read_gguf_header

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# ffn_norm is the norm before the MLP: Llama calls it post_attention_layernorm, Gemma pre_feedforward_layernorm
# (Gemma's post_attention_norm is the norm applied to the attention output).
_ARCH_LAYER_NAMES = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm"},
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_name(gguf_name: str, architecture: str) -> str:
    """HF parameter name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``).

    Raises:
        ValueError: a tensor name this loader does not know.
    """
    match = _BLOCK_RE.match(gguf_name)
    if match:
        layer, base, kind = match.groups()
        mapped = _ARCH_LAYER_NAMES.get(architecture, {}).get(base) or _LAYER_NAMES.get(base)
        if mapped is not None:
            return f"model.layers.{layer}.{mapped}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r} for architecture {architecture!r}")


def unpermute_llama_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, rows ``(d/2, 2)`` -> ``(2, d/2)``.

    ``weight`` is ``[num_heads * head_dim, hidden]`` (``num_heads`` = KV heads for k). Source: the
    inverse of ``permute`` in llama.cpp ``convert_hf_to_gguf.py``.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])  # [H, d/2, 2, hidden]
    return w.swapaxes(1, 2).reshape(weight.shape)  # [H*d, hidden]


def dequantize_tensor(mm: np.memmap, info: GGUFTensorInfo) -> np.ndarray:
    """Dequantize one tensor to float32 with numpy shape (reversed GGUF shape)."""
    import gguf

    qtype = gguf.GGMLQuantizationType(info.ggml_type)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    shape = tuple(reversed(info.shape))  # numpy order: [rows, cols]
    num_elements = int(np.prod(shape))
    num_bytes = num_elements // block_size * type_size
    raw = mm[info.offset : info.offset + num_bytes]
    row_bytes = shape[-1] // block_size * type_size
    data = raw.reshape(*shape[:-1], row_bytes)
    out = gguf.quants.dequantize(data, qtype)
    out = np.ascontiguousarray(out.reshape(shape), dtype=np.float32)
    return out if out.flags.writeable else out.copy()  # F32 tensors are views of the read-only memmap


def iter_gguf_state_dict(path: str | Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every tensor of the GGUF file, conventions undone.

    Raises:
        ValueError: unknown tensor names, or a tensor whose shape does not fit ``config``.
    """
    header = read_gguf_header(path)
    mm = np.memmap(header.path, dtype=np.uint8, mode="r")
    arch = config.architecture
    for info in header.tensors:
        name = hf_name(info.name, arch)
        array = dequantize_tensor(mm, info)
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            array = unpermute_llama_qk(array, config.num_attention_heads)
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            array = unpermute_llama_qk(array, config.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array - 1.0
        yield name, torch.from_numpy(array)


def load_gguf_state_dict(path: str | Path, config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All tensors of a GGUF file as an HF-named state dict in ``dtype`` (see :func:`iter_gguf_state_dict`)."""
    return {name: tensor.to(dtype) for name, tensor in iter_gguf_state_dict(path, config)}
