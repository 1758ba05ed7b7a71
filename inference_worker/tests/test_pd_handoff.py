"""KV hand-off between two paged engines on a tiny random hybrid model (fast, no weights, no processes).

A prefill engine exports a request's KV after its first token, a separate decode engine (its own
cache) imports it and decodes: the tokens equal a colocated engine's, the exported rows are N for
the full layer and min(N, W-1) for sliding ones, and every block is free afterwards on both sides.
"""

from pathlib import Path

import pytest
import torch

from inference_worker.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from inference_worker.engine.kv_handoff import (
    NoCapacity,
    export_prefill_kv,
    import_prefilled_request,
    kv_layout,
)
from inference_worker.engine.paged_engine import PagedLLMEngine
from inference_worker.engine.sampling_params import SamplingParams
from inference_worker.model.loader import LoadedModel
from inference_worker.model.transformer import CausalLM

torch.set_num_threads(1)
W = 8
BLOCK = 4
LENGTHS = [3, W - 1, W, W + 1, 2 * W + 3, 5 * W]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
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
    return LoadedModel("tiny", Path("tiny"), config, model, None, None, (), torch.float32, torch.device("cpu"))


def engine(loaded, **kwargs):
    # block = 4 tokens * 2 KV heads * 16 dims * 2 (K, V) * 4 bytes = 1024 B per layer; 4 layers
    return PagedLLMEngine(loaded, kv_cache_memory=kwargs.pop("blocks", 64) * 1024 * 4, block_size=BLOCK, **kwargs)


def all_free(eng) -> bool:
    manager = eng.core.kv_cache_manager
    return manager.get_num_free_blocks() == manager.get_num_usable_blocks()


def prefill_and_export(eng, rid, prompt):
    eng.add_request(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while True:
        outputs = eng.step()
        if outputs and outputs[0].outputs[0].token_ids:
            break
    first = outputs[0].outputs[0].token_ids[0]
    num_tokens, kv = export_prefill_kv(eng, rid)
    eng.abort_request(rid)
    eng.step()
    return first, num_tokens, kv


def run_to_end(eng, first_output):
    tokens = list(first_output.outputs[0].token_ids)
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens = list(out.outputs[0].token_ids)
    return tokens


@pytest.mark.parametrize("n", LENGTHS)
def test_imported_kv_decodes_like_colocated(loaded, n):
    prompt = torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    colocated = engine(loaded).generate([prompt], GREEDY)[0].outputs[0].token_ids
    prefill, decode = engine(loaded), engine(loaded)
    first, num_tokens, kv = prefill_and_export(prefill, "r", prompt)
    assert num_tokens == n and first == colocated[0]
    assert [k.shape[0] for k, _ in kv] == [min(n, W - 1)] * 3 + [n]
    assert all(tuple(k.shape[1:]) == (2, 16) and v.shape == k.shape for k, v in kv)
    assert all_free(prefill)
    first_positions = [n - k.shape[0] for k, _ in kv]
    output = import_prefilled_request(decode, "r", prompt, GREEDY, first, kv, first_positions)
    assert output.outputs[0].token_ids == [first] and not output.finished
    tables = decode.core.kv_cache_manager.get_block_ids("r")
    sliding = kv_layout(decode).layer_windows.index(W)
    num_null = max(0, (n - W + 1) // BLOCK)  # blocks wholly before the window of position n
    assert tables[decode.core.runner.kv_cache.layer_to_group[sliding]][:num_null] == [0] * num_null
    assert run_to_end(decode, output) == colocated
    assert all_free(decode)


def test_first_token_that_ends_the_request_allocates_nothing(loaded):
    prompt = list(range(1, 20))
    prefill, decode = engine(loaded), engine(loaded)
    first, _, kv = prefill_and_export(prefill, "r", prompt)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    output = import_prefilled_request(decode, "r", prompt, params, first, kv, [len(prompt) - k.shape[0] for k, _ in kv])
    assert output.finished and output.outputs[0].finish_reason == "length" and output.outputs[0].token_ids == [first]
    assert all_free(decode) and not decode.has_unfinished_requests()


def test_no_capacity_changes_nothing_and_bad_kv_is_refused(loaded):
    prompt = list(range(1, 12))
    prefill, decode = engine(loaded), engine(loaded, max_num_seqs=1)
    first, _, kv = prefill_and_export(prefill, "r", prompt)
    firsts = [len(prompt) - k.shape[0] for k, _ in kv]
    decode.add_request("busy", [5, 6, 7], GREEDY)
    decode.step()
    free = decode.core.kv_cache_manager.get_num_free_blocks()
    with pytest.raises(NoCapacity):
        import_prefilled_request(decode, "r", prompt, GREEDY, first, kv, firsts)
    assert decode.core.kv_cache_manager.get_num_free_blocks() == free and "r" not in decode.core.scheduler.requests
    with pytest.raises(ValueError, match="does not fit a prefill of 12 tokens"):
        import_prefilled_request(decode, "x", prompt + [1], GREEDY, first, kv, firsts)
    with pytest.raises(ValueError, match="KV for 3 layers"):
        import_prefilled_request(decode, "x", prompt, GREEDY, first, kv[:3], firsts[:3])
    assert decode.core.kv_cache_manager.get_num_free_blocks() == free


def test_export_refuses_a_request_not_at_the_end_of_its_prefill(loaded):
    eng = engine(loaded, max_num_batched_tokens=4)
    eng.add_request("r", list(range(1, 20)), SamplingParams(max_tokens=2, temperature=0.0))
    eng.step()  # first chunk of 4 tokens only
    with pytest.raises(ValueError, match="not at the end of its prefill"):
        export_prefill_kv(eng, "r")
    with pytest.raises(ValueError, match="not running"):
        export_prefill_kv(eng, "missing")
