"""ModelConfig fields from GGUF metadata (torch-free; used by ``ModelConfig.from_gguf``).

GGUF keys are ``<arch>.<key>`` (``gemma3.block_count``, ``llama.rope.freq_base`` ...), per the GGUF spec
(https://github.com/ggml-org/ggml/blob/master/docs/gguf.md). GGUF carries no ``layer_types``; they are derived
by the architecture's rule. Gemma 3 GGUF lacks the sliding-layer RoPE base, so the architecture default is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inference_worker.config.architecture import (
    GEMMA3_DEFAULT_ROPE_LOCAL_BASE_FREQ,
    SUPPORTED_ARCHITECTURES,
    derive_layer_types,
)
from inference_worker.config.gguf_header import read_gguf_header


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Scalar/string metadata of a GGUF file as a dict, without reading tensor data (milliseconds).

    Adds ``tokenizer.ggml.tokens_count`` (vocabulary size) and ``_has_output_weight`` (an untied
    ``output.weight`` tensor exists).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is not a readable GGUF file.
    """
    header = read_gguf_header(path)
    meta = dict(header.metadata)
    meta["tokenizer.ggml.tokens_count"] = header.array_lengths.get("tokenizer.ggml.tokens", 0)
    meta["_has_output_weight"] = any(t.name == "output.weight" for t in header.tensors)
    return meta


def gguf_config_kwargs(path: str | Path) -> dict[str, Any]:
    """Keyword arguments of ``ModelConfig`` read from the GGUF file at ``path`` (weights: dequantized float32).

    Raises:
        ValueError: not a GGUF file, or an unsupported ``general.architecture`` (named in the message).
        FileNotFoundError: no file at ``path``.
    """
    meta = read_gguf_metadata(path)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {path}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    num_layers = int(get("block_count"))
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads)
    vocab = int(get("vocab_size") or meta.get("tokenizer.ggml.tokens_count") or 0)
    gemma = arch == "gemma3"
    sliding_window = get("attention.sliding_window") if gemma else None
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return dict(
        architecture=arch,
        num_hidden_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv") or heads),
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=int(get("context_length")),
        layer_types=derive_layer_types(arch, num_layers, sliding_window),
        sliding_window=int(sliding_window) if sliding_window is not None else None,
        rope_theta=float(get("rope.freq_base", 10_000.0)),
        rope_local_base_freq=GEMMA3_DEFAULT_ROPE_LOCAL_BASE_FREQ if gemma else None,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        dtype="float32",
        tie_word_embeddings=not meta.get("_has_output_weight", False),
        hidden_activation="gelu_pytorch_tanh" if gemma else "silu",
        query_pre_attn_scalar=float(head_dim) if gemma else None,
        rope_scaling_factor=float(get("rope.scaling.factor", 1.0) or 1.0),
        final_logit_softcapping=get("final_logit_softcapping") if gemma else None,
        attn_logit_softcapping=get("attn_logit_softcapping") if gemma else None,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )

