"""Translation between ``ModelConfig`` and HF ``config.json`` dicts (torch-free).

RoPE parameters come in two HF spellings: transformers 5 ``rope_parameters`` (per layer type for Gemma 3)
and transformers 4 ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``. Both are read; the
transformers 5 form is written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from inference_worker.config.architecture import (
    FULL_ATTENTION,
    GEMMA3_DEFAULT_ROPE_LOCAL_BASE_FREQ,
    SLIDING_ATTENTION,
)

if TYPE_CHECKING:
    from inference_worker.config.model_config import ModelConfig

_HF_MODEL_TYPE_OUT = {"gemma3": "gemma3_text", "llama": "llama"}
_HF_ARCH_CLASS = {"gemma3": "Gemma3ForCausalLM", "llama": "LlamaForCausalLM"}


def model_config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """An HF ``config.json`` dict (transformers 5 names) that ``ModelConfig.from_hf_config`` parses back."""
    gemma = config.architecture == "gemma3"
    full = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling_factor != 1.0:
        full = {"rope_type": "linear", "rope_theta": config.rope_theta, "factor": config.rope_scaling_factor}
    out: dict[str, Any] = {
        "architectures": [_HF_ARCH_CLASS[config.architecture]],
        "model_type": _HF_MODEL_TYPE_OUT[config.architecture],
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "layer_types": list(config.layer_types),
        "sliding_window": config.sliding_window,
        "rms_norm_eps": config.rms_norm_eps,
        "dtype": config.dtype,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids) if len(config.eos_token_ids) != 1 else config.eos_token_ids[0],
        "pad_token_id": config.pad_token_id,
    }
    if gemma:
        local = {"rope_type": "default", "rope_theta": config.rope_local_base_freq or config.rope_theta}
        out["rope_parameters"] = {FULL_ATTENTION: full, SLIDING_ATTENTION: local}
        out.update(hidden_activation=config.hidden_activation, query_pre_attn_scalar=config.query_pre_attn_scalar,
                   attn_logit_softcapping=config.attn_logit_softcapping,
                   final_logit_softcapping=config.final_logit_softcapping)
    else:
        out["rope_parameters"] = full
        out["hidden_act"] = config.hidden_activation
    return out


def hf_rope_parameters(data: dict[str, Any], gemma: bool) -> tuple[float, float | None, float]:
    """(rope_theta of full layers, rope base of sliding layers or None, linear scaling factor of full layers)."""
    params = data.get("rope_parameters")
    if isinstance(params, dict) and FULL_ATTENTION in params:
        full, local = params[FULL_ATTENTION], params.get(SLIDING_ATTENTION)
    elif isinstance(params, dict) and params:
        full, local = params, None
    else:
        full = {"rope_theta": data.get("rope_theta", 10_000.0), **(data.get("rope_scaling") or {})}
        local = {"rope_theta": data["rope_local_base_freq"]} if "rope_local_base_freq" in data else None
    if local is not None and local.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported rope_type {local.get('rope_type')!r} for sliding layers")
    rope_type = full.get("rope_type") or full.get("type") or "default"
    if rope_type not in ("default", "linear"):
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear")
    factor = float(full.get("factor", 1.0)) if rope_type == "linear" else 1.0
    theta = float(full.get("rope_theta", data.get("rope_theta", 10_000.0)))
    if local is not None:
        local_base: float | None = float(local["rope_theta"])
    elif gemma:
        local_base = float(data.get("rope_local_base_freq", GEMMA3_DEFAULT_ROPE_LOCAL_BASE_FREQ))
    else:
        local_base = None
    return theta, local_base, factor
