"""Prefix caching on real models (issue 16, acceptance 1): greedy tokens with caching on equal caching off.

Models: Gemma 3 270M (hybrid, W = 512) in fp32 and bf16, SmolLM2-135M (dense). A primer request
computes a 530-token prompt P; then requests that share P's first r tokens and continue differently
resume from the cache at r = W-2, W-1, W, W+1 (rounded down to the block size: the hit is
block-aligned) and at the prompt end (P again: all but its last token); SmolLM2 has no window, so
its prompt is 130 tokens resumed at 126..129. Block sizes 1, 2, 7 and 16 on every model; on fp32
Gemma also chunked prefill after a hit across the window boundary, a KV budget that forces
preemption while requests share a prefix (preempted requests hit blocks again), and a hit inside a
PD-imported window (acceptance 2).

Divergence rule (``test_paged_engine``'s): a token may differ from the caching-off reference only at
a step where the reference's top-2 logit gap is below 1e-2; from there on the sequences are not
compared. Each model is loaded once per test process (``load_prepared``).
"""

import functools

import pytest
import torch

from inference_worker.engine.paged_engine import PagedEngineCore
from inference_worker.tests.support.models import GEMMA, SMOLLM2, load_prepared
from inference_worker.tests.support.models import assert_same_under_divergence_rule as check_divergence

pytestmark = pytest.mark.slow
torch.set_num_threads(1)

W = 512
MAX_TOKENS = 4
GAP = 1e-2
GAP_BF16 = 5e-2
"""The near-tie bound for the bf16 model. bf16 keeps 8 significant bits, and a different chunking of the same
prompt (cached prefix vs computed) changes the accumulation order through 18 layers: on a CPU with AMX-BF16
(oneDNN picks AMX tiles for some matmul shapes and AVX-512 for others) caching on and off differed on greedy
steps whose reference top-2 gaps were 0.0156 and 0.0273, a tie at bf16's resolution, not a caching defect (fp32
keeps the 1e-2 bound)."""
SHA = "ab" * 32
RESUME_POINTS = [W - 2, W - 1, W, W + 1]
L = 530
# fp32 Gemma: 98304 B per full block (3 layers), 491520 B per sliding block (15 layers), block size 16
GEMMA_FP32_BLOCK_BYTES = 98304 + 491520


def make_prompts(vocab_low, vocab_high, length=L, resume_points=tuple(RESUME_POINTS)):
    gen = torch.Generator().manual_seed(16)
    primer = [2] + torch.randint(vocab_low, vocab_high, (length - 1,), generator=gen).tolist()
    resumed = []
    for r in resume_points:  # continue differently from primer[r] on
        tail = torch.randint(vocab_low, vocab_high, (3,), generator=gen).tolist()
        tail[0] = primer[r] + 1
        resumed.append(primer[:r] + tail)
    chunked = primer[: W + 1] + torch.randint(vocab_low, vocab_high, (60,), generator=gen).tolist()
    shared = [primer[:200] + torch.randint(vocab_low, vocab_high, (200,), generator=gen).tolist() for _ in range(3)]
    return {"primer": primer, "resumed": resumed, "end": primer, "chunked": chunked, "shared": shared,
            "resume_points": list(resume_points)}


def run(engine, prompts, *, first_id=0):
    """Greedy tokens, per-step top-2 gaps and prefix-cache hits of ``prompts`` run together on ``engine``."""
    requests = [engine.add_request(f"r{first_id + i}", p, max_tokens=MAX_TOKENS, arrival_time=float(first_id + i))
                for i, p in enumerate(prompts)]
    tokens = {r.request_id: [] for r in requests}
    gaps = {r.request_id: [] for r in requests}
    while engine.has_unfinished_requests():
        for update in engine.step():
            tokens[update.request_id] += update.new_token_ids
            top2 = engine.last_logits(update.request_id).topk(2).values
            gaps[update.request_id].append(float(top2[0] - top2[1]))
    kv = engine.kv_cache_manager
    assert kv.get_num_free_blocks() == kv.get_num_usable_blocks()
    return [(tokens[r.request_id], gaps[r.request_id]) for r in requests], [r.num_cached_tokens for r in requests]


def assert_same_under_divergence_rule(label, got, reference):
    gap = GAP_BF16 if label.startswith("gemma-bf16") else GAP
    check_divergence(label, [tokens for tokens, _ in got], reference, num_tokens=MAX_TOKENS, gap=gap)


def engine(model, caching, **kwargs):
    kwargs = {"kv_cache_memory": "256MiB", "max_num_seqs": 8, "max_num_batched_tokens": 4096} | kwargs
    return PagedEngineCore(model, enable_prefix_caching=caching, weights_sha256=SHA, **kwargs)


def reference_of(model, prompts):
    """Caching-off results of every prompt of ``make_prompts`` (one batched run per list)."""
    eng = engine(model, False)
    results = {}
    for key in ("resumed", "chunked", "shared"):
        batch = prompts[key] if isinstance(prompts[key][0], list) else [prompts[key]]
        results[key], hits = run(eng, batch, first_id=len(results) * 10)
        assert set(hits) == {0}
    results["end"] = run(eng, [prompts["end"]], first_id=100)[0]
    return results


def resume_and_end(model, prompts, reference, block_size, label):
    """Primer, then the resumed prompts and the primer again in one batch; checks hits and tokens."""
    eng = engine(model, True, block_size=block_size)
    run(eng, [prompts["primer"]])
    got, hits = run(eng, prompts["resumed"] + [prompts["end"]], first_id=1)
    num_end = len(prompts["end"]) - 1
    assert hits == [(r // block_size) * block_size for r in prompts["resume_points"]] + [
        (num_end // block_size) * block_size]
    assert_same_under_divergence_rule(label, got, reference["resumed"] + reference["end"])


@pytest.fixture(scope="module")
def gemma():
    return load_prepared(GEMMA).model


@pytest.fixture(scope="module")
def gemma_prompts():
    return make_prompts(300, 200_000)


@pytest.fixture(scope="module")
def gemma_reference(gemma, gemma_prompts):
    return reference_of(gemma, gemma_prompts)


@pytest.mark.parametrize("block_size", [1, 2, 7, 16])
def test_gemma_fp32_resume_at_the_window_edges_and_prompt_end(gemma, gemma_prompts, gemma_reference, block_size):
    resume_and_end(gemma, gemma_prompts, gemma_reference, block_size, f"gemma-fp32-bs{block_size}")


def test_gemma_fp32_chunked_prefill_after_a_hit_across_the_window(gemma, gemma_prompts, gemma_reference):
    eng = engine(gemma, True, block_size=16, max_num_batched_tokens=24)
    run(eng, [gemma_prompts["primer"]])
    got, hits = run(eng, [gemma_prompts["chunked"]], first_id=1)
    assert hits == [512]  # W + 1 shared tokens: the hit is 512, then 61 tokens in chunks of at most 24
    assert_same_under_divergence_rule("gemma-chunked", got, gemma_reference["chunked"])


def test_gemma_fp32_preemption_with_shared_prefixes(gemma, gemma_prompts, gemma_reference):
    # 30 usable blocks per group (25 per 400-token request): three requests sharing 200 tokens must preempt
    eng = engine(gemma, True, block_size=16, kv_cache_memory=31 * GEMMA_FP32_BLOCK_BYTES, max_num_seqs=3,
                 max_num_batched_tokens=64)
    assert eng.kv_cache_report["groups"]["full_attention"]["num_blocks"] == 31
    got, _ = run(eng, gemma_prompts["shared"])
    assert eng.num_preemptions > 0 and eng.kv_cache_manager.num_hit_tokens > 0
    print(f"preemptions {eng.num_preemptions}, prefix-cache hit tokens {eng.kv_cache_manager.num_hit_tokens}")
    assert_same_under_divergence_rule("gemma-preemption", got, gemma_reference["shared"])


# SmolLM2 is dense (no window): a 130-token prompt resumed around a block boundary (126..129) is enough
OTHER_MODELS = {"gemma-bf16": (GEMMA, "bfloat16", (300, 200_000, L, tuple(RESUME_POINTS))),
                "smollm2": (SMOLLM2, "float32", (100, 49_000, 130, (126, 127, 128, 129)))}


@functools.cache
def other_model(key):
    """(model, prompts, caching-off reference) of bf16 Gemma or dense SmolLM2, once per test process."""
    name, dtype, prompt_args = OTHER_MODELS[key]
    model = load_prepared(name, dtype=dtype).model
    prompts = make_prompts(*prompt_args)
    results, _ = run(engine(model, False), prompts["resumed"] + [prompts["end"]])
    return model, prompts, {"resumed": results[:-1], "end": results[-1:]}


@pytest.mark.parametrize("block_size", [1, 2, 7, 16])
@pytest.mark.parametrize("key", list(OTHER_MODELS))
def test_bf16_gemma_and_dense_smollm2_resume_and_prompt_end(key, block_size):
    model, prompts, reference = other_model(key)
    resume_and_end(model, prompts, reference, block_size, f"{key}-bs{block_size}")


def test_gemma_fp32_hit_inside_a_pd_imported_window_equals_colocated(gemma, gemma_prompts):
    """Acceptance 2: the decode engine imports a 530-token prefill (sliding layers receive positions 19..529,
    so sliding block 1, positions 16..31, is only partly written), decodes 20 tokens, then requests extending
    the prompt hit inside the imported window: same greedy tokens as colocated.

    Decode computed positions 0..548: whole blocks 0..33 are registered in the full group and 2..33 in the
    sliding group. A request extending prompt + all 20 answer tokens hits 544 (the query at 544 reads
    33..543: blocks 2..33); one extending prompt + 2 answer tokens could only hit 528, which reads
    17..527 (the partly written block 1), so it gets no hit at all.
    """
    from inference_worker.engine.llm_engine import PagedLLMEngine
    from inference_worker.engine.sampling_params import SamplingParams

    loaded = load_prepared(GEMMA)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    def new_engine():
        return PagedLLMEngine(loaded, kv_cache_memory="128MiB", weights_sha256=SHA)

    prompt = gemma_prompts["primer"]
    prefill, decode, colocated = new_engine(), new_engine(), new_engine()
    prefill.add_request("p", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), kv_export=True)
    first = None
    while prefill.has_unfinished_requests():
        first = next((out.outputs[0].token_ids[0] for out in prefill.step() if out.finished), first)
    num_tokens, kv = prefill.pop_exported_kv("p")
    assert num_tokens == L and [k.shape[0] for k, _ in kv][:2] == [W - 1, W - 1]
    output = decode.add_prefilled_request("p", prompt, long, first, kv, [L - k.shape[0] for k, _ in kv])
    answer = list(output.outputs[0].token_ids)
    while decode.has_unfinished_requests():
        answer = next((out.outputs[0].token_ids for out in decode.step()), answer)
    assert answer == colocated.generate([prompt], long)[0].outputs[0].token_ids
    follows = [prompt + answer + [5, 6, 7], prompt + answer[:2] + [5, 6, 7]]
    expected = [out.outputs[0].token_ids for out in colocated.generate(follows, greedy)]
    got = [decode.generate([follow], greedy)[0] for follow in follows]
    assert [g.num_cached_tokens for g in got] == [544, 0]
    assert [g.outputs[0].token_ids for g in got] == expected
