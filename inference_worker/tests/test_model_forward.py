"""The model's forward on tiny random configs: KV-storage independence, chunked prefill, decode vs prefill."""

import pytest
import torch

from inference_worker.config import ModelConfig
from inference_worker.model.layers import RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq
from inference_worker.model.transformer import CausalLM
from inference_worker.reference.contiguous_runner import ContiguousModelRunner

torch.set_num_threads(1)


def _tiny(architecture):
    gemma = architecture == "gemma3"
    return ModelConfig(
        architecture=architecture, num_hidden_layers=3, hidden_size=32, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=50, max_position_embeddings=64,
        layer_types=("sliding_attention", "full_attention", "sliding_attention") if gemma else ("full_attention",) * 3,
        sliding_window=4 if gemma else None, rope_theta=10000.0, rope_local_base_freq=100.0 if gemma else None,
        rms_norm_eps=1e-6, dtype="float32", tie_word_embeddings=gemma,
        hidden_activation="gelu_pytorch_tanh" if gemma else "silu", query_pre_attn_scalar=8.0 if gemma else None,
    )


def _model(architecture, seed=0):
    torch.manual_seed(seed)
    model = CausalLM(_tiny(architecture)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("architecture", ["gemma3", "llama"])
def test_sdpa_and_reference_kernels_give_the_same_logits(architecture):
    model = _model(architecture)
    prompt = list(range(1, 12))  # longer than the window
    a = ContiguousModelRunner(model, max_num_seqs=1, kernel="sdpa")
    b = ContiguousModelRunner(model, max_num_seqs=1, kernel="reference")
    assert (a.prefill(0, prompt) - b.prefill(0, prompt)).abs().max().item() <= 1e-5
    assert (a.decode([0], [7], [11]) - b.decode([0], [7], [11])).abs().max().item() <= 1e-5


@pytest.mark.parametrize("architecture", ["gemma3", "llama"])
def test_chunked_prefill_and_decode_equal_one_shot_prefill(architecture):
    model = _model(architecture, seed=1)
    prompt = [3, 9, 4, 17, 22, 5, 8, 31, 2, 6, 11, 40]
    one_shot = ContiguousModelRunner(model, max_num_seqs=1).prefill(0, prompt)
    chunked = ContiguousModelRunner(model, max_num_seqs=1)
    chunked.prefill(0, prompt[:5])
    chunked.prefill(0, prompt[5:9], context_len=5)
    assert (chunked.prefill(0, prompt[9:], context_len=9) - one_shot).abs().max().item() <= 1e-5
    stepwise = ContiguousModelRunner(model, max_num_seqs=1)
    stepwise.prefill(0, prompt[:1])
    for i in range(1, len(prompt)):
        last = stepwise.decode([0], [prompt[i]], [i])[0]
    assert (last - one_shot).abs().max().item() <= 1e-5


def test_sliding_window_limits_what_a_sliding_layer_sees():
    """With one sliding layer of W=4, tokens more than 3 positions back cannot change the last logits."""
    config = ModelConfig(
        architecture="gemma3", num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=50, max_position_embeddings=64,
        layer_types=("sliding_attention",), sliding_window=4, rope_theta=1e4, rope_local_base_freq=100.0,
        rms_norm_eps=1e-6, dtype="float32", tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=8.0,
    )
    torch.manual_seed(2)
    model = CausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    base = [5, 6, 7, 8, 9, 10, 11, 12]
    changed_far = [40, 41, 42, 43, 9, 10, 11, 12]  # differs only outside the last 4 positions
    changed_near = [5, 6, 7, 8, 44, 10, 11, 12]
    run = lambda p: ContiguousModelRunner(model, max_num_seqs=1).prefill(0, p)  # noqa: E731
    assert torch.equal(run(base), run(changed_far))
    assert (run(base) - run(changed_near)).abs().max().item() > 1e-3


def test_gemma_rmsnorm_uses_one_plus_weight_and_llama_uses_weight():
    x = torch.tensor([[3.0, 4.0]])  # rms = sqrt(12.5)
    gemma = RMSNorm(2, 0.0, unit_offset=True)
    llama = RMSNorm(2, 0.0, unit_offset=False)
    with torch.no_grad():
        gemma.weight.fill_(0.5)
        llama.weight.fill_(0.5)
    expected = x / 12.5**0.5
    assert torch.allclose(gemma(x), expected * 1.5, atol=0, rtol=1e-6)
    assert torch.allclose(llama(x), expected * 0.5, atol=0, rtol=1e-6)


def test_rope_rotates_pairs_half_a_head_apart_by_position_times_frequency():
    inv = rope_inv_freq(4, base=100.0)
    assert inv.tolist() == [1.0, 0.10000000149011612]  # 1 / 100^(2/4), float32
    cos, sin = rope_cos_sin(torch.tensor([2]), inv, torch.float32)
    x = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])  # [tokens, heads, head_dim]
    out = apply_rope(x, cos, sin)[0, 0]
    angle = torch.tensor(2.0)
    assert torch.allclose(out, torch.stack([angle.cos(), torch.tensor(0.0), angle.sin(), torch.tensor(0.0)]))


def test_forward_rejects_mismatched_positions():
    model = _model("llama")
    with pytest.raises(ValueError, match="equal length"):
        model(torch.tensor([1, 2]), torch.tensor([0]), None, None)
