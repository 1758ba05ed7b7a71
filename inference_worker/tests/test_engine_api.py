"""Engine API on the real SmolLM2 (and Gemma 3 for batching over the window): greedy equivalence across
batching, stop strings/tokens, abort, seeds, validation, incremental outputs.

Every test runs on both implementations of the API: ``ContiguousLLMEngine`` (the contiguous-cache reference)
and ``LLMEngine`` (the paged engine the worker serves with)."""

import pytest
import torch

from inference_worker.engine.llm_engine import LLMEngine
from inference_worker.engine.sampler import Sampler, apply_top_k_top_p
from inference_worker.engine.sampling_params import SamplingParams
from inference_worker.reference.contiguous_engine import ContiguousLLMEngine
from inference_worker.tests.support.models import GEMMA, SMOLLM2, load_prepared

torch.set_num_threads(1)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


ENGINES = [ContiguousLLMEngine, LLMEngine]


@pytest.fixture(scope="module", params=ENGINES, ids=lambda cls: cls.__name__)
def engine(request):
    return request.param(load_prepared(SMOLLM2), max_num_seqs=2, max_model_len=256)


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0)


def test_batched_greedy_equals_one_at_a_time(engine):
    alone = [engine.generate([p], _greedy(8))[0].output.token_ids for p in PROMPTS]
    together = [o.output.token_ids for o in engine.generate(PROMPTS, _greedy(8))]  # 3 prompts, 2 slots
    assert together == alone
    assert all(len(t) == 8 for t in alone)


def test_greedy_text_is_the_decoded_tokens_and_finish_reason_length(engine):
    out = engine.generate(["The capital of France is"], _greedy(6))[0]
    assert out.finished and out.output.finish_reason == "length" and out.output.stop_reason is None
    assert out.output.text == engine.tokenizer.decode(out.output.token_ids, skip_special_tokens=True)
    assert out.prompt_token_ids == engine.tokenizer.encode("The capital of France is").ids
    assert out.metrics.first_token_time >= out.metrics.arrival_time
    assert out.metrics.finished_time >= out.metrics.first_token_time


def test_stop_string_trims_text_and_reports_the_string(engine):
    full = engine.generate(["The capital of France is"], _greedy(8))[0].output.text
    word = full.split()[1]  # a word the greedy continuation is known to contain
    out = engine.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0, stop=[word]))[0]
    assert out.output.finish_reason == "stop" and out.output.stop_reason == word
    assert out.output.text == full[: full.index(word)]


def test_stop_token_id_ends_the_request(engine):
    tokens = engine.generate(["Once upon a time"], _greedy(5))[0].output.token_ids
    out = engine.generate(["Once upon a time"], SamplingParams(max_tokens=5, temperature=0,
                                                                stop_token_ids=[tokens[2]]))[0]
    assert out.output.token_ids == tokens[:3]
    assert (out.output.finish_reason, out.output.stop_reason) == ("stop", tokens[2])


def test_eos_finishes_unless_ignored(engine):
    chat = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    out = engine.generate([chat], _greedy(60))[0]
    assert out.output.finish_reason == "stop" and out.output.token_ids[-1] == 2  # <|im_end|>
    n = len(out.output.token_ids)
    ignored = engine.generate([chat], SamplingParams(max_tokens=n + 2, temperature=0, ignore_eos=True))[0]
    assert ignored.output.finish_reason == "length" and len(ignored.output.token_ids) == n + 2
    assert ignored.output.token_ids[:n] == out.output.token_ids


def test_step_returns_incremental_tokens_and_abort(engine):
    engine.add_request("a", "Once upon a time", _greedy(10))
    engine.add_request("b", [1, 504, 3458], _greedy(10))
    first = {o.request_id: o for o in engine.step()}
    assert set(first) == {"a", "b"}
    assert all(len(o.output.new_token_ids) == 1 and o.output.token_ids == o.output.new_token_ids
               for o in first.values())
    second = {o.request_id: o for o in engine.step()}
    assert second["a"].output.token_ids[:1] == first["a"].output.token_ids
    assert second["a"].output.new_token_ids == second["a"].output.token_ids[1:]
    assert engine.abort_request("a") is True
    assert engine.abort_request("a") is False
    third = {o.request_id: o for o in engine.step()}
    assert third["a"].finished and third["a"].output.finish_reason == "abort"
    assert third["a"].output.new_token_ids == []
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_running == 0 and engine.num_waiting == 0


def test_seeded_sampling_is_reproducible_and_independent_of_batch(engine):
    params = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = engine.generate(["Once upon a time"], params)[0].output.token_ids
    batched = engine.generate(["Once upon a time", "def fibonacci(n):"],
                              [params, SamplingParams(max_tokens=6, temperature=1.0, seed=7)])[0].output.token_ids
    assert alone == batched


def test_request_validation(engine):
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        engine.add_request("x", "hi", SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="top_p must be in"):
        engine.add_request("x", "hi", SamplingParams(top_p=0))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1).validate()
    with pytest.raises(ValueError, match="stop must be a list of non-empty strings"):
        SamplingParams(stop=[""]).validate()
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.add_request("x", [], _greedy(1))
    with pytest.raises(ValueError, match="leaves no room"):
        engine.add_request("x", [1] * 256, _greedy(1))
    engine.add_request("dup", "hi", _greedy(1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "hi", _greedy(1))
    while engine.has_unfinished_requests():
        engine.step()


def test_top_k_top_p_filtering_exact():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isinf(apply_top_k_top_p(logits, 2, 1.0)).tolist() == [False, False, True, True]
    # nucleus 0.8: 0.5 + 0.3 reaches 0.8, so the last two are dropped
    assert torch.isinf(apply_top_k_top_p(logits, 0, 0.8)).tolist() == [False, False, True, True]
    assert torch.isinf(apply_top_k_top_p(logits, 0, 0.81)).tolist() == [False, False, False, True]
    assert torch.isinf(apply_top_k_top_p(logits, 0, 0.01)).tolist() == [False, True, True, True]
    greedy = Sampler().sample(torch.tensor([[0.0, 2.0, 1.0]]), [SamplingParams(temperature=0)], [None])
    assert greedy == [1]


@pytest.mark.parametrize("engine_cls", ENGINES, ids=lambda cls: cls.__name__)
def test_gemma_batched_decode_across_the_window_matches_single(engine_cls):
    engine = engine_cls(load_prepared(GEMMA), max_num_seqs=2, max_model_len=1024)
    gen = torch.Generator().manual_seed(0)
    long_prompt = [2] + torch.randint(10, 5000, (520,), generator=gen).tolist()  # crosses W=512 while decoding
    short_prompt = [2] + torch.randint(10, 5000, (30,), generator=gen).tolist()
    alone = [engine.generate([p], _greedy(4))[0].output.token_ids for p in (long_prompt, short_prompt)]
    together = [o.output.token_ids for o in engine.generate([long_prompt, short_prompt], _greedy(4))]
    assert together == alone
