"""The model issue's parity prompts through the paged engine (LLMEngine) against transformers.

Same prompts (12 per model, including 511, 512, 513 and 1500 tokens), same reference (transformers
loading the same GGUF, fp32, SDPA, DynamicCache greedy loop) and same rule as ``test_model_parity``:
32 greedy tokens identical, except a divergence accepted at a step where the reference's top-2 logit
gap is below 1e-2 (reported). Here all 12 prompts go through the paged engine together: continuous
batching with chunked prefill (512-token steps) mixed with decodes over the paged KV cache.
"""

import warnings

import pytest
import torch
from test_model_parity import NEAR_TIE_GAP, NUM_NEW_TOKENS, _prompts, _reference, _top2_gap

from inference_worker.engine.llm_engine import LLMEngine
from inference_worker.engine.paged_engine import PagedLLMEngine
from inference_worker.engine.sampling_params import SamplingParams
from inference_worker.registry import gguf_path
from inference_worker.testing import GEMMA, SMOLLM2, load_prepared

pytestmark = pytest.mark.slow
torch.set_num_threads(1)

CHAT = {
    GEMMA: "<start_of_turn>user\nWrite a haiku about ferries.<end_of_turn>\n<start_of_turn>model\n",
    SMOLLM2: "<|im_start|>user\nWrite a haiku about ferries.<|im_end|>\n<|im_start|>assistant\n",
}


@pytest.mark.timeout(2400)  # transformers' greedy loop over 12 prompts is slow on a shared 2-core machine
@pytest.mark.parametrize("name", [GEMMA, SMOLLM2])
def test_parity_prompts_through_the_paged_engine_match_transformers(name):
    from transformers import AutoModelForCausalLM

    assert LLMEngine is PagedLLMEngine
    loaded = load_prepared(name)
    prompts = _prompts(loaded.tokenizer, CHAT[name])
    engine = LLMEngine(loaded, max_num_seqs=12, max_model_len=2048, kv_cache_memory="256MiB",
                       max_num_batched_tokens=512)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True))
    ours = [o.output.token_ids for o in outputs]
    assert engine.kv_cache_usage == 0.0

    path = gguf_path(name)
    hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                    attn_implementation="sdpa").eval()
    accepted = []
    for i, prompt in enumerate(prompts):
        _, ref_tokens, ref_logits = _reference(hf_model, prompt)
        assert len(ours[i]) == len(ref_tokens) == NUM_NEW_TOKENS
        mismatch = next((s for s in range(NUM_NEW_TOKENS) if ours[i][s] != ref_tokens[s]), None)
        if mismatch is None:
            continue
        gap = _top2_gap(ref_logits[mismatch])
        case = (f"{name} prompt {i} ({len(prompt)} tokens): diverged at step {mismatch} "
                f"(paged {ours[i][mismatch]}, reference {ref_tokens[mismatch]}, reference top-2 gap {gap:.2e})")
        assert gap < NEAR_TIE_GAP, case
        accepted.append(case)
    for case in accepted:
        warnings.warn(f"accepted near-tie divergence: {case}", stacklevel=1)
    print(f"\n{name} (paged): {len(prompts) - len(accepted)}/{len(prompts)} prompts identical over "
          f"{NUM_NEW_TOKENS} tokens; accepted near-tie divergences: {accepted or 'none'}")
