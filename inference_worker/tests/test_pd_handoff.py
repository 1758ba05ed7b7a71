"""KV hand-off between two paged engines on a tiny random hybrid model (fast, no weights, no processes).

A prefill engine exports a request's KV when it finishes with its first token, a separate decode
engine (its own cache) imports it through its KV connector and decodes: the tokens equal a colocated
engine's, the exported rows are N for the full layer and min(N, W-1) for sliding ones, and every
block is free afterwards on both sides. With prefix caching, a request that hits inside the imported
window gives the colocated tokens too (the partly written sliding block is never registered).
"""

from pathlib import Path

import pytest
import torch

from inference_worker.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from inference_worker.engine.kv_handoff import kv_layout
from inference_worker.engine.llm_engine import PagedLLMEngine
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
    # block = 4 tokens * 2 KV heads * 16 dims * 2 (K, V) * 4 bytes = 128 B per layer... per group: see the plan
    return PagedLLMEngine(loaded, kv_cache_memory=kwargs.pop("blocks", 64) * 1024 * 4, block_size=BLOCK,
                          weights_sha256="0" * 64, **kwargs)


def all_free(eng) -> bool:
    manager = eng.core.kv_cache_manager
    return manager.get_num_free_blocks() == manager.get_num_usable_blocks()


def prefill_and_export(eng, rid, prompt):
    eng.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), kv_export=True)
    first = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                first = out.outputs[0].token_ids[0]
    num_tokens, kv = eng.pop_exported_kv(rid)
    assert eng.pop_exported_kv(rid) is None  # handed out once
    return first, num_tokens, kv


def run_to_end(eng, first_output):
    tokens = {first_output.request_id: list(first_output.outputs[0].token_ids)}
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
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
    output = decode.add_prefilled_request("r", prompt, GREEDY, first, kv, first_positions)
    assert output.outputs[0].token_ids == [first] and not output.finished and output.num_cached_tokens == 0
    decode.step()  # admission: the KV is loaded into the blocks, then the first token is decoded
    tables = decode.core.kv_cache_manager.get_block_ids("r")
    sliding = kv_layout(decode).layer_windows.index(W)
    num_null = max(0, (n - W + 1) // BLOCK)  # blocks wholly before the window of position n
    assert tables[decode.core.runner.kv_cache.layer_to_group[sliding]][:num_null] == [0] * num_null
    assert run_to_end(decode, output)["r"] == colocated
    assert all_free(decode)


def test_first_token_that_ends_the_request_allocates_nothing(loaded):
    prompt = list(range(1, 20))
    prefill, decode = engine(loaded), engine(loaded)
    first, _, kv = prefill_and_export(prefill, "r", prompt)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    output = decode.add_prefilled_request("r", prompt, params, first, kv, [len(prompt) - k.shape[0] for k, _ in kv])
    assert output.finished and output.outputs[0].finish_reason == "length" and output.outputs[0].token_ids == [first]
    assert all_free(decode) and not decode.has_unfinished_requests()


def test_an_import_reports_the_prefill_engines_cache_hit_as_its_own(loaded):
    # regression: an import reported num_cached_tokens 0 although its prefill reused the prefill engine's cache
    prompt, export = list(range(1, 20)), SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefill, decode = engine(loaded), engine(loaded)
    prefill_and_export(prefill, "a", prompt)
    prefill.add_request("b", prompt, export, kv_export=True)
    finished = [out for _ in range(4) for out in prefill.step() if out.finished]
    assert [(out.request_id, out.num_cached_tokens) for out in finished] == [("b", 16)]  # 4 whole blocks of 19
    first, kv = finished[0].outputs[0].token_ids[0], prefill.pop_exported_kv("b")[1]
    firsts = [len(prompt) - k.shape[0] for k, _ in kv]
    for bad in (-1, 19):
        with pytest.raises(ValueError, match=rf"num_cached_tokens must be in \[0, 19\) .* got {bad}"):
            decode.add_prefilled_request("x", prompt, GREEDY, first, kv, firsts, num_cached_tokens=bad)
    admitted = {}
    decode.set_admission_listener(admitted.update)
    output = decode.add_prefilled_request("b", prompt, GREEDY, first, kv, firsts, num_cached_tokens=16)
    assert output.num_cached_tokens == 16
    decode.step()  # admission: the decode engine's own lookup adds nothing to what the prefill spared
    assert admitted == {"b": 16}
    assert run_to_end(decode, output)["b"] == engine(loaded).generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert all_free(decode)


def test_an_import_without_room_waits_its_turn_and_bad_kv_is_refused(loaded):
    prompt = list(range(1, 12))
    prefill, decode = engine(loaded), engine(loaded, max_num_seqs=1)
    first, _, kv = prefill_and_export(prefill, "r", prompt)
    firsts = [len(prompt) - k.shape[0] for k, _ in kv]
    decode.add_request("busy", [5, 6, 7], GREEDY)
    decode.step()
    free = decode.core.kv_cache_manager.get_num_free_blocks()
    with pytest.raises(ValueError, match="does not fit a prefill of 12 tokens"):
        decode.add_prefilled_request("x", prompt + [1], GREEDY, first, kv, firsts)
    with pytest.raises(ValueError, match="KV for 3 layers"):
        decode.add_prefilled_request("x", prompt, GREEDY, first, kv[:3], firsts[:3])
    assert decode.core.kv_cache_manager.get_num_free_blocks() == free
    output = decode.add_prefilled_request("r", prompt, GREEDY, first, kv, firsts)
    decode.step()
    assert decode.num_running == 1 and decode.num_waiting == 1  # "busy" holds the only seat
    tokens = run_to_end(decode, output)
    assert tokens["r"] == engine(loaded).generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert all_free(decode)


def test_an_aborted_export_saves_nothing(loaded):
    eng = engine(loaded, max_num_batched_tokens=4)
    eng.add_request("r", list(range(1, 20)), SamplingParams(max_tokens=1, temperature=0.0), kv_export=True)
    eng.step()  # first chunk of 4 tokens only
    eng.abort_request("r")
    eng.step()
    assert eng.pop_exported_kv("r") is None and eng.pop_exported_kv("missing") is None
    assert all_free(eng)


@pytest.mark.parametrize(("n", "num_reused_outputs", "expected_hit"),
                         [(W + 1, 10, 16), (2 * W + 1, 10, 24), (2 * W + 2, 10, 24), (2 * W + 1, 1, 0), (5 * W, 3, 0), (5 * W, 8, 48)])
def test_a_hit_inside_the_imported_window_gives_the_colocated_tokens(loaded, n, num_reused_outputs, expected_hit):
    """Acceptance 2 on the tiny model: import N tokens, decode, then a request extending the prompt and
    the first ``num_reused_outputs`` output tokens hits inside the imported window.

    Sliding layers received positions n-W+1..n-1 only; the block holding n-W+1 is partly written
    unless it starts there, so it is not registered, and a hit of h tokens (which reads positions
    h-W+1..h-1) must start its window at or after the first whole received block. E.g. n = 17:
    received 10..16, block 2 (8..11) is partial, blocks 3.. are whole; a hit of 24 reads 17..23.
    """
    prompt = torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(100 + n)).tolist()
    prefill, decode, colocated = engine(loaded), engine(loaded), engine(loaded)
    first, _, kv = prefill_and_export(prefill, "r", prompt)
    output = decode.add_prefilled_request("r", prompt, GREEDY, first, kv, [n - k.shape[0] for k, _ in kv])
    outputs = run_to_end(decode, output)["r"]
    follow = prompt + outputs[:num_reused_outputs] + [3, 1, 4, 1, 5, 9]
    expected = [out.outputs[0].token_ids for out in colocated.generate([prompt, follow], GREEDY)]
    assert outputs == expected[0]
    got = decode.generate([follow], GREEDY)[0]
    assert got.outputs[0].token_ids == expected[1]
    assert got.num_cached_tokens == expected_hit
    assert all_free(decode)
