"""Paged engine on real Gemma 3 270M: same greedy tokens as the contiguous runner, alone, in a batch
of 16 mixed lengths, and under a KV budget small enough to force preemption.

Divergence rule (the model issue's): a token may differ from the reference only at a step where
the reference's top-2 logit gap is below 1e-2; from there on the sequences are not compared.
Each accepted case is reported on stdout.
"""

import pytest
import torch

from inference_worker.engine.paged_engine import PagedEngineCore
from inference_worker.reference.contiguous_runner import ContiguousModelRunner
from inference_worker.tests.support.models import GEMMA, load_prepared
from inference_worker.tests.support.models import assert_same_under_divergence_rule as check_divergence

pytestmark = pytest.mark.slow
torch.set_num_threads(1)

MAX_TOKENS = 6
GAP = 1e-2
# 16 prompt lengths around the window (W = 512) and beyond it
LENGTHS = [1, 7, 33, 100, 255, 300, 511, 512, 513, 64, 17, 700, 129, 2, 450, 1030]


@pytest.fixture(scope="module")
def model():
    """The prepared fp32 artifact of the GGUF, loaded once per test process (shared with other modules)."""
    return load_prepared(GEMMA).model


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(1234)
    return [[2] + torch.randint(300, 200_000, (n - 1,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(model, prompts):
    """Greedy tokens and per-step top-2 gaps from the contiguous runner, one prompt at a time."""
    runner = ContiguousModelRunner(model, max_num_seqs=1, max_model_len=2048)
    results = []
    for prompt in prompts:
        slot = runner.allocate_slot()
        logits = runner.prefill(slot, prompt)
        tokens, gaps = [], []
        for step in range(MAX_TOKENS):
            top2 = logits.topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            tokens.append(int(logits.argmax()))
            if step + 1 < MAX_TOKENS:
                logits = runner.decode([slot], [tokens[-1]], [len(prompt) + step])[0]
        runner.free_slot(slot)
        results.append((tokens, gaps))
    return results


def run_paged(model, prompts, **engine_kwargs):
    engine = PagedEngineCore(model, **engine_kwargs)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, max_tokens=MAX_TOKENS, arrival_time=float(i))
    outputs = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for update in engine.step():
            outputs[update.request_id] += update.new_token_ids
    assert engine.kv_cache_manager.get_num_free_blocks() == engine.kv_cache_manager.get_num_usable_blocks()
    return [outputs[f"r{i}"] for i in range(len(prompts))], engine


def assert_same_under_divergence_rule(label, got, reference):
    check_divergence(label, got, reference, num_tokens=MAX_TOKENS, gap=GAP)


def test_each_prompt_alone_matches_contiguous_reference(model, prompts, reference):
    got = []
    for prompt in prompts:
        tokens, _ = run_paged(model, [prompt], kv_cache_memory="64MiB", max_num_seqs=1, max_num_batched_tokens=512)
        got += tokens
    assert_same_under_divergence_rule("alone", got, reference)


def test_batch_of_16_mixed_lengths_matches_contiguous_reference(model, prompts, reference):
    got, engine = run_paged(model, prompts, kv_cache_memory="256MiB", max_num_seqs=16, max_num_batched_tokens=1024)
    assert engine.num_preemptions == 0
    assert_same_under_divergence_rule("batch16", got, reference)


def test_kv_budget_forcing_preemption_gives_same_tokens(model, prompts, reference):
    # fp32 Gemma: 98304 B per full block (3 layers), 491520 B per sliding block (15 layers): 100 blocks each
    got, engine = run_paged(model, prompts, kv_cache_memory=101 * (98304 + 491520), max_num_seqs=16,
                            max_num_batched_tokens=512)
    assert engine.kv_cache_report["groups"]["full_attention"]["num_blocks"] == 101  # 100 usable + the null block
    assert engine.num_preemptions > 0
    print(f"preemptions under a 100-block budget: {engine.num_preemptions}")
    assert_same_under_divergence_rule("preemption", got, reference)


def test_paged_reference_attention_gives_the_same_tokens(model, prompts, reference):
    subset = [0, 8, 11]  # 1, 513 and 700 tokens
    got, _ = run_paged(model, [prompts[i] for i in subset], kv_cache_memory="64MiB", attention="reference",
                       max_num_seqs=8, max_num_batched_tokens=512)
    assert_same_under_divergence_rule("reference-kernel", got, [reference[i] for i in subset])
