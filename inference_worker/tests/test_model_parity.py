"""Exact parity with transformers on the real models, both loaded from the same GGUF file (fp32, SDPA).

For Gemma 3 270M (hybrid: 15 sliding layers with W=512, 3 full) and SmolLM2-135M (Llama, all full) and 12
prompts each - including prompts of exactly 511, 512, 513 and 1500 tokens around Gemma's window - we compare:

* the last-position logits after prefill: max |diff| <= 1e-2;
* 32 greedy tokens: identical, except that a divergence is accepted at a step where the reference's top-2
  logit gap is below 1e-2 (a near-tie that float reduction order may flip); every such case is reported.

Our side runs the prepared artifact (safetensors written by ``models prepare`` from the GGUF) twice: through
the contiguous runner with the SDPA kernel (all 12 prompts prefilled into their own slots, then decoded
together in ragged batches), and through the paged engine (``LLMEngine``: continuous batching, chunked prefill
in 512-token steps mixed with decodes over the paged KV cache). Both are held to the same rule against one
reference run: transformers' own model class with a DynamicCache greedy loop (loaded once per model). The
reference (prefill logits, greedy tokens, top-2 gap at each step) is computed once per GGUF sha256, prompt
set, reference code and torch/transformers versions, and read back from ``~/.cache/ferry/test-references``
on later runs (``inference_worker.tests.support.models.cached_reference``).
"""

import inspect
import warnings

import pytest
import torch

from inference_worker.engine.llm_engine import LLMEngine, PagedLLMEngine
from inference_worker.engine.sampling_params import SamplingParams
from inference_worker.reference.contiguous_runner import ContiguousModelRunner
from inference_worker.registry import gguf_path
from inference_worker.tests.support.models import GEMMA, SMOLLM2, cached_reference, file_sha256, load_prepared

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # transformers loads the GGUF once per model
torch.set_num_threads(1)

NUM_NEW_TOKENS = 32
LOGIT_TOLERANCE = 1e-2
NEAR_TIE_GAP = 1e-2
EXACT_LENGTHS = (511, 512, 513, 1500)
SHORT_PROMPTS = (
    "The capital of France is",
    "def quicksort(items):\n",
    "Translate to German: The weather is nice today.",
    "1, 1, 2, 3, 5, 8, 13,",
    "Q: Why is the sky blue?\nA:",
    "In 1969, the Apollo 11 mission",
    "The three primary colors are",
)
CORPUS = (
    "Disaggregated inference splits the prefill of a prompt from the decoding of its answer. Prefill is "
    "compute-bound: every prompt token passes through every layer at once. Decode is memory-bound: each new "
    "token reads the whole key-value cache. Sliding-window attention layers keep only the most recent tokens, "
    "so a hybrid model's cache grows slowly, and shipping it between datacenters becomes practical. "
    "Operators roll new model versions out gradually, watching time to first token and error rates. "
)


def _prompts(tokenizer, chat_prompt):
    prompts = [tokenizer.encode(text).ids for text in SHORT_PROMPTS]
    prompts.append(tokenizer.encode(chat_prompt).ids)
    corpus_ids = tokenizer.encode(CORPUS * 60).ids
    prompts += [corpus_ids[:n] for n in EXACT_LENGTHS]
    return prompts


@torch.inference_mode()
def _reference(hf_model, prompt):
    """(prefill last logits [vocab], greedy tokens, reference top-2 logit gap at each step) from transformers."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf_model.config)
    out = hf_model(torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1)
    step_logits = [out.logits[0, -1].float()]
    tokens = []
    for _ in range(NUM_NEW_TOKENS):
        token = int(step_logits[-1].argmax())
        tokens.append(token)
        if len(tokens) == NUM_NEW_TOKENS:
            break
        out = hf_model(torch.tensor([[token]]), cache=cache, use_cache=True, logits_to_keep=1)
        step_logits.append(out.logits[0, -1].float())
    return step_logits[0].clone(), tokens, [_top2_gap(logits) for logits in step_logits]


def _reference_run(name, prompts):
    """:func:`_reference` for every prompt, transformers loading the GGUF once (fp32, SDPA)."""
    from transformers import AutoModelForCausalLM

    path = gguf_path(name)
    hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                    attn_implementation="sdpa").eval()
    return [_reference(hf_model, p) for p in prompts]


def _cached_reference_run(name, prompts):
    key = {"gguf_sha256": file_sha256(gguf_path(name)), "prompts": prompts, "num_new_tokens": NUM_NEW_TOKENS,
           "code": inspect.getsource(_reference) + inspect.getsource(_reference_run) + inspect.getsource(_top2_gap)}
    return cached_reference(f"parity-{name}", key, lambda: _reference_run(name, prompts))


@torch.inference_mode()
def _ours(loaded, prompts):
    runner = ContiguousModelRunner(loaded.model, max_num_seqs=len(prompts), max_model_len=2048)
    prefill_logits, tokens = [], []
    for slot, prompt in enumerate(prompts):
        logits = runner.prefill(slot, prompt)
        prefill_logits.append(logits)
        tokens.append([int(logits.argmax())])
    slots = list(range(len(prompts)))
    for _ in range(NUM_NEW_TOKENS - 1):  # every sequence decodes in one ragged batch
        lens = [len(p) + len(t) - 1 for p, t in zip(prompts, tokens, strict=True)]
        logits = runner.decode(slots, [t[-1] for t in tokens], lens)
        for seq, row in zip(tokens, logits, strict=True):
            seq.append(int(row.argmax()))
    return prefill_logits, tokens


def _paged(loaded, prompts):
    """Greedy tokens for every prompt, all 12 batched through the paged engine; KV fully freed after."""
    engine = LLMEngine(loaded, max_num_seqs=len(prompts), max_model_len=2048, kv_cache_memory="256MiB",
                       max_num_batched_tokens=512)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True))
    assert engine.kv_cache_usage == 0.0
    return [list(o.output.token_ids) for o in outputs]


def _top2_gap(logits):
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


@pytest.fixture(scope="module", params=[GEMMA, SMOLLM2])
def parity_run(request):
    name = request.param
    loaded = load_prepared(name)
    chat = {
        GEMMA: "<start_of_turn>user\nWrite a haiku about ferries.<end_of_turn>\n<start_of_turn>model\n",
        SMOLLM2: "<|im_start|>user\nWrite a haiku about ferries.<|im_end|>\n<|im_start|>assistant\n",
    }[name]
    prompts = _prompts(loaded.tokenizer, chat)
    ours = _ours(loaded, prompts)
    paged = _paged(loaded, prompts)
    reference = _cached_reference_run(name, prompts)
    return name, prompts, ours, reference, paged


def test_twelve_prompts_including_the_window_edges(parity_run):
    name, prompts, _, _, _ = parity_run
    lengths = [len(p) for p in prompts]
    assert len(prompts) == 12
    assert lengths[-4:] == [511, 512, 513, 1500]
    if name == GEMMA:
        assert all(p[0] == 2 for p in prompts)  # <bos> added by the prepared tokenizer


def test_last_position_logits_match_transformers(parity_run):
    name, prompts, (our_logits, _), reference, _ = parity_run
    diffs = [float((ours - ref[0]).abs().max()) for ours, ref in zip(our_logits, reference, strict=True)]
    print(f"\n{name}: max |logit diff| per prompt (lengths {[len(p) for p in prompts]}): "
          + ", ".join(f"{d:.2e}" for d in diffs))
    assert max(diffs) <= LOGIT_TOLERANCE


def _assert_greedy_tokens_match(label, prompts, our_tokens, reference):
    accepted = []
    for i, (ours, (_, ref_tokens, ref_gaps)) in enumerate(zip(our_tokens, reference, strict=True)):
        assert len(ours) == len(ref_tokens) == len(ref_gaps) == NUM_NEW_TOKENS
        mismatch = next((s for s in range(NUM_NEW_TOKENS) if ours[s] != ref_tokens[s]), None)
        if mismatch is None:
            continue
        gap = ref_gaps[mismatch]
        case = (f"{label} prompt {i} ({len(prompts[i])} tokens): diverged at step {mismatch} "
                f"(ours {ours[mismatch]}, reference {ref_tokens[mismatch]}, reference top-2 gap {gap:.2e})")
        assert gap < NEAR_TIE_GAP, case
        accepted.append(case)
    for case in accepted:
        warnings.warn(f"accepted near-tie divergence: {case}", stacklevel=1)
    print(f"\n{label}: {len(prompts) - len(accepted)}/{len(prompts)} prompts identical over {NUM_NEW_TOKENS} "
          f"tokens; accepted near-tie divergences: {accepted or 'none'}")


def test_32_greedy_tokens_match_transformers(parity_run):
    name, prompts, (_, our_tokens), reference, _ = parity_run
    _assert_greedy_tokens_match(name, prompts, our_tokens, reference)


def test_parity_prompts_through_the_paged_engine_match_transformers(parity_run):
    name, prompts, _, reference, paged_tokens = parity_run
    assert LLMEngine is PagedLLMEngine
    _assert_greedy_tokens_match(f"{name} (paged engine)", prompts, paged_tokens, reference)
