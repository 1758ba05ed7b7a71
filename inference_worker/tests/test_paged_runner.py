"""Paged model runner on a tiny random hybrid model (fast, no weights): every sampled step's logits equal
the contiguous runner's for the same tokens, with chunked prefill, a batch and forced preemption."""

import pytest
import torch

from inference_worker.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from inference_worker.engine.paged_engine import PagedEngineCore
from inference_worker.model.transformer import CausalLM
from inference_worker.reference.contiguous_runner import ContiguousModelRunner

torch.set_num_threads(1)
W = 8
MAX_TOKENS = 10
LENGTHS = [W - 1, W, W + 1, 5 * W, 3, 2 * W + 3]


@pytest.fixture(scope="module")
def model():
    config = ModelConfig(
        architecture="gemma3", num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=97, max_position_embeddings=256,
        layer_types=(SLIDING_ATTENTION, SLIDING_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION), sliding_window=W,
        rope_theta=10_000.0, rope_local_base_freq=10_000.0, rms_norm_eps=1e-6, dtype="float32",
        tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16.0,
    )
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 97, (n,), generator=gen).tolist() for n in LENGTHS]


def contiguous_logits(model, prompt, tokens):
    """Logits [len(tokens), vocab] the contiguous runner gives before each of ``tokens``."""
    runner = ContiguousModelRunner(model, max_num_seqs=1, max_model_len=256, kernel="reference")
    rows = [runner.prefill(0, prompt)]
    for i, token in enumerate(tokens[:-1]):
        rows.append(runner.decode([0], [token], [len(prompt) + i])[0])
    return torch.stack(rows)


@pytest.mark.parametrize(
    ("budget_blocks", "max_num_seqs", "max_num_batched_tokens", "expect_preemption"),
    [(200, 6, 64, False), (200, 6, 5, False), (16, 6, 8, True)],
    ids=["batch", "small-chunks", "preemption"],
)
def test_paged_logits_equal_contiguous(model, prompts, budget_blocks, max_num_seqs, max_num_batched_tokens,
                                       expect_preemption):
    # block = 4 tokens * 2 KV heads * 16 dims * 2 (K, V) * 4 bytes = 1024 B per layer
    engine = PagedEngineCore(model, kv_cache_memory=(budget_blocks + 1) * 1024 * 4, block_size=4,
                             max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, max_tokens=MAX_TOKENS, arrival_time=float(i))
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    logits = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for update in engine.step():
            tokens[update.request_id] += update.new_token_ids
            logits[update.request_id].append(engine.last_logits(update.request_id).clone())
    assert (engine.num_preemptions > 0) == expect_preemption
    assert engine.kv_cache_manager.get_num_free_blocks() == engine.kv_cache_manager.get_num_usable_blocks()
    for i, prompt in enumerate(prompts):
        got = torch.stack(logits[f"r{i}"])  # [MAX_TOKENS, vocab]
        expected = contiguous_logits(model, prompt, tokens[f"r{i}"])
        assert len(tokens[f"r{i}"]) == MAX_TOKENS
        assert (got - expected).abs().max().item() <= 1e-4, f"prompt {i} ({len(prompt)} tokens)"
        assert tokens[f"r{i}"] == expected.argmax(dim=-1).tolist()
