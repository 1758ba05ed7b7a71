"""The decode worker's reading of a prefill worker's ``/internal/prefill`` answer (no model, fast)."""

import httpx
import pytest

from inference_worker.server.pd import (
    KVHandoffFailed,
    PrefillRefused,
    prefill_answer_failure,
    prefill_cached_tokens,
)


def test_cached_tokens_of_a_prefill_answer_default_to_0_for_an_older_prefill_worker():
    assert prefill_cached_tokens({"first_token_id": 7, "num_tokens": 462}, 462) == 0
    assert prefill_cached_tokens({"first_token_id": 7, "num_cached_tokens": 448}, 462) == 448
    assert prefill_cached_tokens({"num_cached_tokens": 461}, 462) == 461


@pytest.mark.parametrize("value", [-1, 462, 448.0, "448", True, None])
def test_cached_tokens_outside_the_prompt_or_not_an_integer_are_a_protocol_failure(value):
    with pytest.raises(KVHandoffFailed, match=r"num_cached_tokens .* is not an integer in \[0, 462\)") as caught:
        prefill_cached_tokens({"num_cached_tokens": value}, 462)
    assert caught.value.reason == "protocol"


def _error(status, code, message="m", param=None):
    return httpx.Response(status, json={"error": {"message": message, "type": "t", "param": param, "code": code}})


@pytest.mark.parametrize(("response", "status", "code"), [
    (_error(400, "context_length_exceeded", "prompt over 128"), 400, "context_length_exceeded"),
    (_error(400, "invalid_prompt"), 400, "invalid_prompt"),
    (_error(400, "invalid_value"), 400, "context_length_exceeded"),  # not a prompt-limit code: the prompt's length
    (httpx.Response(413, text="request body too large"), 413, "context_length_exceeded"),
])
def test_a_prefill_workers_400_or_413_is_a_refusal_of_the_prompt_not_a_transfer_failure(response, status, code):
    failure = prefill_answer_failure(response)
    assert isinstance(failure, PrefillRefused) and (failure.status, failure.code, failure.reason) == (status, code,
                                                                                                       "capacity")
    assert str(failure).startswith(f"the prefill worker refused the prompt ({status}): ")


@pytest.mark.parametrize(("response", "reason"), [
    (_error(502, "kv_transfer_failed", param="checksum"), "checksum"),
    (_error(401, "invalid_signature"), "protocol"),
    (_error(409, "version_mismatch"), "protocol"),
    (httpx.Response(500, text="boom"), "protocol"),
])
def test_other_prefill_answers_are_transfer_failures(response, reason):
    failure = prefill_answer_failure(response)
    assert type(failure) is KVHandoffFailed and failure.reason == reason
    assert prefill_answer_failure(httpx.Response(200, json={})) is None
