"""Request validation, error JSON, metrics registry and serve options, without a model (fast)."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from inference_worker.cli.serve import add_arguments, validate
from inference_worker.metrics import WorkerMetrics
from inference_worker.server.errors import OpenAIError
from inference_worker.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_sampling,
    completion_prompts,
    completion_sampling,
    parse_body,
)


def error_of(raw: bytes, cls=CompletionRequest) -> dict:
    with pytest.raises(OpenAIError) as info:
        body = parse_body(raw, cls)
        completion_prompts(body.prompt) if cls is CompletionRequest else None
        completion_sampling(body) if cls is CompletionRequest else chat_sampling(body)
    assert info.value.status_code == 400
    return info.value.body()["error"]


def test_defaults_follow_openai():
    body = parse_body(b'{"model": "m", "prompt": "hi"}', CompletionRequest)
    sampling = completion_sampling(body)
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.n, sampling.stop) == (16, 1.0, 1.0, 1, ())
    chat = chat_sampling(parse_body(b'{"model": "m", "messages": [], "max_completion_tokens": 7}', ChatCompletionRequest))
    assert chat.max_tokens == 7
    assert chat_sampling(parse_body(b'{"model": "m", "messages": []}', ChatCompletionRequest)).max_tokens is None


def test_stop_string_and_include_usage_are_normalized():
    body = parse_body(b'{"model": "m", "prompt": "x", "stop": "END", "stream": true, '
                      b'"stream_options": {"include_usage": true}, "top_k": 0}', CompletionRequest)
    sampling = completion_sampling(body)
    assert (sampling.stop, sampling.stream, sampling.include_usage, sampling.top_k) == (("END",), True, True, -1)


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        (b"", None, "invalid_json"),
        (b'{"model": "m", "prompt": "x", "max_tokens": 0}', "max_tokens", "invalid_value"),
        (b'{"model": "m", "prompt": "x", "n": 17}', "n", "invalid_value"),
        (b'{"model": "m", "prompt": "x", "stop": ["a", ""]}', "stop", "invalid_value"),
        (b'{"model": "m", "prompt": "x", "logprobs": 2}', "logprobs", "unsupported_parameter"),
        (b'{"model": "m", "prompt": "x", "echo": true}', "echo", "unsupported_parameter"),
        (b'{"model": "m", "prompt": "x", "presence_penalty": 0.5}', "presence_penalty", "unsupported_parameter"),
        (b'{"model": "m", "prompt": "x", "stream_options": {"include_usage": "yes"}}',
         "stream_options.include_usage", "invalid_type"),
        (b'{"model": "m", "prompt": [[1, 2], [-4]]}', "prompt", "invalid_type"),
        (b'{"model": 5, "prompt": "x"}', "model", "invalid_type"),
        (b'{"model": "m", "prompt": "x", "return_token_ids": "yes"}', "return_token_ids", "invalid_type"),
        (b'{"model": "m", "prompt": "x", "return_token_ids": 1}', "return_token_ids", "invalid_type"),
    ],
)
def test_invalid_completion_bodies_name_the_field(raw, param, code):
    error = error_of(raw)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert error["message"]


def test_return_token_ids_defaults_to_false_and_is_read_for_both_routes():
    assert completion_sampling(parse_body(b'{"model": "m", "prompt": "x"}', CompletionRequest)).return_token_ids is False
    on = parse_body(b'{"model": "m", "prompt": "x", "return_token_ids": true}', CompletionRequest)
    assert completion_sampling(on).return_token_ids is True
    off = parse_body(b'{"model": "m", "prompt": "x", "return_token_ids": null}', CompletionRequest)
    assert completion_sampling(off).return_token_ids is False
    chat = parse_body(b'{"model": "m", "messages": [], "return_token_ids": true}', ChatCompletionRequest)
    assert chat_sampling(chat).return_token_ids is True
    error = error_of(b'{"model": "m", "messages": [], "return_token_ids": "true"}', ChatCompletionRequest)
    assert (error["param"], error["code"]) == ("return_token_ids", "invalid_type")
    assert error["message"] == "'return_token_ids' must be a boolean; got 'true'"


def test_batched_prompts_are_split():
    assert completion_prompts(["a", "b"]) == ["a", "b"]
    assert completion_prompts([[1, 2], [3]]) == [[1, 2], [3]]
    assert completion_prompts([5, 6]) == [[5, 6]]


def test_metrics_registry_is_per_server_and_labels_are_checked():
    first = WorkerMetrics({"model": "a", "role": "prefill"})
    second = WorkerMetrics({"model": "b"})
    first.request_finished("server_error")
    first.tokens(num_prompt_tokens=7, num_generation_tokens=3)
    first.observe_latency(ttft_s=0.5, e2e_s=1.5, num_output_tokens=3)  # TPOT (1.5 - 0.5) / 2 = 0.5
    samples = {(s.name, s.labels.get("outcome")): s.value
               for f in text_string_to_metric_families(generate_latest(first.registry).decode()) for s in f.samples}
    assert samples[("ferry_requests_total", "server_error")] == 1
    assert samples[("ferry_prompt_tokens_total", None)] == 7
    assert samples[("ferry_generation_tokens_total", None)] == 3
    assert samples[("ferry_time_per_output_token_seconds_sum", None)] == 0.5
    assert "ferry_requests_total" in generate_latest(second.registry).decode()
    assert 'model="a"' not in generate_latest(second.registry).decode()
    with pytest.raises(ValueError, match="unknown metric labels"):
        WorkerMetrics({"zone": "x"})
    with pytest.raises(ValueError, match="unknown request outcome"):
        first.request_finished("weird")


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", "gemma-3-270m", "--port", "8000", *argv])


def test_serve_options_are_validated():
    validate(serve_args("--role", "decode", "--fault-error-rate", "0.3", "--kv-cache-memory", "512MiB"))
    validate(serve_args("--kv-cache-memory", "0.5"))
    for argv, message in [(("--fault-error-rate", "1.5"), "--fault-error-rate"),
                          (("--drain-timeout", "-1"), "--drain-timeout"),
                          (("--max-num-seqs", "0"), "--max-num-seqs"),
                          (("--kv-cache-memory", "0"), "--kv-cache-memory"),
                          (("--kv-cache-memory", "2 parsecs"), "--kv-cache-memory")]:
        with pytest.raises(ValueError, match=message):
            validate(serve_args(*argv))
    with pytest.raises(SystemExit):
        serve_args("--role", "router")
