"""OpenAI API of a real worker process on Gemma 3 270M: greedy parity, usage, n, errors, stop, UTF-8."""

from __future__ import annotations

import json

import httpx
import pytest

from inference_worker.tests.support.worker import WorkerProcess, gemma_tokenizer_dir
from inference_worker.tokenization import ChatTemplate, load_tokenizer

pytestmark = pytest.mark.slow

MODEL = "gemma-3-270m"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def worker():
    with WorkerProcess() as proc:
        yield proc


@pytest.fixture(scope="module")
def api(worker):
    with httpx.Client(base_url=worker.base_url, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(gemma_tokenizer_dir())


def complete(api, **body):
    response = api.post("/v1/completions", json={"model": MODEL, "temperature": 0.0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def chat(api, **body):
    response = api.post("/v1/chat/completions", json={"model": MODEL, "temperature": 0.0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream(api, path, **body):
    """POST with stream=true; returns (chunks, text per choice index)."""
    chunks, texts = [], {}
    with api.stream("POST", path, json={"model": MODEL, "temperature": 0.0, "stream": True, **body}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        chunk = json.loads(line[len("data: "):])
        chunks.append(chunk)
        for choice in chunk["choices"]:
            piece = choice["text"] if "text" in choice else choice["delta"].get("content", "")
            texts.setdefault(choice["index"], []).append(piece)
    return chunks, texts


@pytest.fixture(scope="module")
def greedy(api):
    """Non-streamed greedy completion of PROMPT, 12 tokens (ignore_eos so the length is exact)."""
    return complete(api, prompt=PROMPT, max_tokens=12, ignore_eos=True)


def test_models_lists_the_served_model(api):
    data = api.get("/v1/models").json()
    assert [m["id"] for m in data["data"]] == [MODEL]
    assert data["data"][0]["max_model_len"] > 0


def test_health_and_ready(api):
    assert api.get("/health").json()["status"] == "ok"
    assert api.get("/ready").json() == {"ready": True, "reason": "ready"}


def test_streamed_completion_equals_non_streamed_and_usage_is_exact(api, tokenizer, greedy):
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=True).ids
    assert greedy["object"] == "text_completion"
    assert greedy["choices"][0]["finish_reason"] == "length"
    assert greedy["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 12,
                               "total_tokens": len(prompt_ids) + 12,
                               "prompt_tokens_details": {"cached_tokens": 0}}  # shorter than one block
    text = greedy["choices"][0]["text"]
    assert text.strip()
    chunks, texts = stream(api, "/v1/completions", prompt=PROMPT, max_tokens=12, ignore_eos=True,
                           stream_options={"include_usage": True})
    assert "".join(texts[0]) == text
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == greedy["usage"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    # a token-id prompt gives the same greedy text
    by_ids = complete(api, prompt=prompt_ids, max_tokens=12, ignore_eos=True)
    assert by_ids["choices"][0]["text"] == text and by_ids["usage"] == greedy["usage"]


def test_streamed_chat_equals_non_streamed_and_usage_is_exact(api, tokenizer):
    result = chat(api, messages=CHAT, max_tokens=10, ignore_eos=True)
    rendered = ChatTemplate.for_tokenizer_dir(gemma_tokenizer_dir()).render(CHAT)
    num_prompt = len(tokenizer.encode(rendered, add_special_tokens=False).ids)
    assert result["object"] == "chat.completion"
    assert result["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": 10, "total_tokens": num_prompt + 10,
                               "prompt_tokens_details": {"cached_tokens": 0}}
    message = result["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].strip()
    chunks, texts = stream(api, "/v1/chat/completions", messages=CHAT, max_tokens=10, ignore_eos=True)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(texts[0]) == message["content"]


def test_n_returns_three_choices_indexed_0_to_2(api, greedy):
    result = complete(api, prompt=PROMPT, max_tokens=12, ignore_eos=True, n=3)
    assert [c["index"] for c in result["choices"]] == [0, 1, 2]
    assert [c["text"] for c in result["choices"]] == [greedy["choices"][0]["text"]] * 3
    assert result["usage"]["completion_tokens"] == 36
    _, texts = stream(api, "/v1/completions", prompt=PROMPT, max_tokens=12, ignore_eos=True, n=3)
    assert sorted(texts) == [0, 1, 2]


def test_return_token_ids_gives_the_prompt_and_every_generated_id_streamed_or_not(api, tokenizer, greedy):
    """vLLM's placement for completions: each choice carries prompt_token_ids and token_ids; streamed, the
    prompt ids come in a choice's first chunk only and the token_ids deltas join to the same ids."""
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=True).ids
    result = complete(api, prompt=PROMPT, max_tokens=12, ignore_eos=True, return_token_ids=True)
    choice = result["choices"][0]
    ids = choice["token_ids"]
    assert "prompt_token_ids" not in result and choice["prompt_token_ids"] == prompt_ids
    assert len(ids) == 12 and choice["text"] == greedy["choices"][0]["text"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == choice["text"]
    # They are the generated ids: sent back after the prompt, greedy decoding continues with the rest.
    resumed = complete(api, prompt=prompt_ids + ids[:6], max_tokens=6, ignore_eos=True, return_token_ids=True)
    assert resumed["choices"][0]["prompt_token_ids"] == prompt_ids + ids[:6]
    assert resumed["choices"][0]["token_ids"] == ids[6:]
    chunks, _ = stream(api, "/v1/completions", prompt=PROMPT, max_tokens=12, ignore_eos=True, n=2,
                       return_token_ids=True)
    for index in (0, 1):
        mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == index]
        assert mine[0]["prompt_token_ids"] == prompt_ids
        assert all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == ids


def test_chat_return_token_ids_puts_the_prompt_ids_on_the_response_and_the_first_chunk(api, tokenizer):
    rendered = ChatTemplate.for_tokenizer_dir(gemma_tokenizer_dir()).render(CHAT)
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    result = chat(api, messages=CHAT, max_tokens=10, ignore_eos=True, return_token_ids=True)
    ids = result["choices"][0]["token_ids"]
    assert result["prompt_token_ids"] == prompt_ids and "prompt_token_ids" not in result["choices"][0]
    assert len(ids) == 10
    assert tokenizer.decode(ids, skip_special_tokens=True) == result["choices"][0]["message"]["content"]
    chunks, _ = stream(api, "/v1/chat/completions", messages=CHAT, max_tokens=10, ignore_eos=True,
                       return_token_ids=True)
    assert chunks[0]["prompt_token_ids"] == prompt_ids and chunks[0]["choices"][0]["token_ids"] == []
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ids


M = {"model": MODEL}
BAD_REQUESTS = [
    ("malformed JSON", b'{"model": "gemma-3-270m", "prompt": ', None, "invalid_json"),
    ("body not an object", [1, 2], None, "invalid_type"),
    ("unknown model", {"model": "gpt-17", "prompt": "x"}, "model", "model_not_found"),
    ("missing model", {"prompt": "x"}, "model", "missing_required_parameter"),
    ("empty prompt", {**M, "prompt": ""}, "prompt", "invalid_value"),
    ("empty token list", {**M, "prompt": []}, "prompt", "invalid_value"),
    ("prompt of wrong type", {**M, "prompt": 42}, "prompt", "invalid_type"),
    ("token id out of vocab", {**M, "prompt": [2, 10_000_000]}, "prompt", "invalid_value"),
    ("over the context", {**M, "prompt": "hi", "max_tokens": 10_000_000}, "max_tokens", "context_length_exceeded"),
    ("negative max_tokens", {**M, "prompt": "hi", "max_tokens": -1}, "max_tokens", "invalid_value"),
    ("zero max_tokens", {**M, "prompt": "hi", "max_tokens": 0}, "max_tokens", "invalid_value"),
    ("fractional max_tokens", {**M, "prompt": "hi", "max_tokens": 2.5}, "max_tokens", "invalid_type"),
    ("string max_tokens", {**M, "prompt": "hi", "max_tokens": "8"}, "max_tokens", "invalid_type"),
    ("negative temperature", {**M, "prompt": "hi", "temperature": -0.5}, "temperature", "invalid_value"),
    ("top_p zero", {**M, "prompt": "hi", "top_p": 0}, "top_p", "invalid_value"),
    ("top_p above one", {**M, "prompt": "hi", "top_p": 1.01}, "top_p", "invalid_value"),
    ("n zero", {**M, "prompt": "hi", "n": 0}, "n", "invalid_value"),
    ("stop of wrong type", {**M, "prompt": "hi", "stop": 7}, "stop", "invalid_type"),
    ("stream of wrong type", {**M, "prompt": "hi", "stream": "yes"}, "stream", "invalid_type"),
    ("return_token_ids of wrong type", {**M, "prompt": "hi", "return_token_ids": "yes"}, "return_token_ids",
     "invalid_type"),
]


def test_every_bad_request_gets_a_4xx_openai_error_and_the_worker_keeps_serving(api, greedy):
    for name, body, param, code in BAD_REQUESTS:
        if isinstance(body, bytes):
            response = api.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        else:
            response = api.post("/v1/completions", json=body)
        expected_status = 404 if code == "model_not_found" else 400
        assert response.status_code == expected_status, (name, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code), name
        assert error["message"], name
    bad_chat = api.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "x", "content": "y"}]})
    assert bad_chat.status_code == 400 and bad_chat.json()["error"]["param"] == "messages"
    assert complete(api, prompt=PROMPT, max_tokens=12, ignore_eos=True)["choices"] == greedy["choices"]


def test_multi_token_stop_string_is_never_streamed_and_text_ends_right_before_it(api, tokenizer, greedy):
    text = greedy["choices"][0]["text"]
    words = text.split()
    stop = " ".join(words[1:3])  # two words in the middle of the greedy text
    assert len(tokenizer.encode(stop, add_special_tokens=False).ids) >= 2
    expected = text[: text.index(stop)]
    result = complete(api, prompt=PROMPT, max_tokens=12, stop=[stop, "zzzz-never"])
    assert result["choices"][0] == {"index": 0, "text": expected, "logprobs": None, "finish_reason": "stop"}
    chunks, texts = stream(api, "/v1/completions", prompt=PROMPT, max_tokens=12, stop=stop)
    assert "".join(texts[0]) == expected
    assert all(stop not in piece for piece in texts[0])
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_streamed_cjk_and_emoji_text_equals_non_streamed_without_replacement_chars(api):
    messages = [{"role": "user", "content": "用中文写一句关于春天的话，并加上表情符号 🌸"}]
    result = chat(api, messages=messages, max_tokens=24, ignore_eos=True)
    content = result["choices"][0]["message"]["content"]
    assert any("\u4e00" <= ch <= "\u9fff" for ch in content), content  # the greedy reply is Chinese
    assert "\ufffd" not in content
    _, texts = stream(api, "/v1/chat/completions", messages=messages, max_tokens=24, ignore_eos=True)
    assert "".join(texts[0]) == content
    assert all("\ufffd" not in piece for piece in texts[0])
