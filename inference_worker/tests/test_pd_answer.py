"""The decode worker's reading of a prefill worker's ``/internal/prefill`` answer (no model, fast)."""

import pytest

from inference_worker.server.pd import KVHandoffFailed, prefill_cached_tokens


def test_cached_tokens_of_a_prefill_answer_default_to_0_for_an_older_prefill_worker():
    assert prefill_cached_tokens({"first_token_id": 7, "num_tokens": 462}, 462) == 0
    assert prefill_cached_tokens({"first_token_id": 7, "num_cached_tokens": 448}, 462) == 448
    assert prefill_cached_tokens({"num_cached_tokens": 461}, 462) == 461


@pytest.mark.parametrize("value", [-1, 462, 448.0, "448", True, None])
def test_cached_tokens_outside_the_prompt_or_not_an_integer_are_a_protocol_failure(value):
    with pytest.raises(KVHandoffFailed, match=r"num_cached_tokens .* is not an integer in \[0, 462\)") as caught:
        prefill_cached_tokens({"num_cached_tokens": value}, 462)
    assert caught.value.reason == "protocol"
