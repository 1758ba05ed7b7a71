"""Token sampling from logits: greedy, temperature, top-k, top-p, with a per-request seeded generator.

Filtering order follows the common convention (HF ``generate``/vLLM): temperature, then top-k, then top-p
(nucleus; Holtzman et al. 2019: keep the smallest prefix of the sorted distribution whose mass reaches p).
"""

from __future__ import annotations

import torch

from inference_worker.engine.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits ``[vocab]`` outside top-k / the top-p nucleus with ``-inf`` (at least one token survives)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    """Samples one token per row of a logits batch."""

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> list[int]:
        """Pick a token id for each row of ``logits`` ``[num_seqs, vocab]`` (float32).

        Greedy rows use argmax (ties -> lowest id). Other rows sample with their own ``torch.Generator``
        (seeded per request) so results do not depend on batch composition.

        Raises:
            ValueError: ``params``/``generators`` length differs from the batch.
        """
        if not (len(params) == len(generators) == logits.shape[0]):
            raise ValueError(f"{logits.shape[0]} logits rows but {len(params)} params and {len(generators)} generators")
        greedy = torch.argmax(logits, dim=-1).tolist()
        tokens = []
        for i, p in enumerate(params):
            if p.greedy:
                tokens.append(int(greedy[i]))
                continue
            row = apply_top_k_top_p(logits[i].float() / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(row, dim=-1)
            tokens.append(int(torch.multinomial(probs.cpu(), 1, generator=generators[i]).item()))
        return tokens
