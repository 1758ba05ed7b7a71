"""Incremental detokenizer and chat templates on the real Gemma 3 tokenizer."""

from __future__ import annotations

import pytest

from inference_worker.tests.support.worker import gemma_tokenizer_dir
from inference_worker.tokenization import (
    GEMMA_CHAT_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    IncrementalDetokenizer,
    end_of_turn_token_ids,
    load_tokenizer,
)

MIXED_TEXT = "Hello 世界! 🎉🚀 naïve café — 日本語のテキスト 𓀀𝔘 ꙮ 龘 done."


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(gemma_tokenizer_dir())


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    pieces = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*pieces, detok.finish()]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_streamed_pieces_join_to_the_full_decode_without_replacement_chars(tokenizer, chunk):
    ids = tokenizer.encode(MIXED_TEXT, add_special_tokens=False).ids
    pieces = stream(IncrementalDetokenizer(tokenizer), ids, chunk)
    assert "".join(pieces) == MIXED_TEXT == tokenizer.decode(ids)
    assert all("\ufffd" not in piece for piece in pieces)


def test_byte_fallback_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("a𓀀", add_special_tokens=False).ids
    # 'a' then the four UTF-8 bytes of U+13000 as byte-fallback tokens <0xF0> <0x93> <0x80> <0x80>
    assert tokenizer.id_to_token(ids[1]) == "<0xF0>" and len(ids) == 5
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push([i]) for i in ids] == ["a", "", "", "", "𓀀"]


def test_special_tokens_are_left_out_of_the_text(tokenizer):
    eos = tokenizer.token_to_id("<eos>")
    ids = [*tokenizer.encode("Hi there", add_special_tokens=False).ids, eos]
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(stream(detok, ids)) == "Hi there"


def test_stop_string_spanning_tokens_is_never_released_and_text_ends_before_it(tokenizer):
    text = "The answer is forty two. THE END of story"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    stop = "THE END"
    # the stop string spans several tokens
    covering = [t for t in tokenizer.encode(stop, add_special_tokens=False).tokens]
    assert len(covering) >= 2
    detok = IncrementalDetokenizer(tokenizer, stop=[stop, "never appears"])
    released = ""
    for token_id in ids:
        released += detok.push([token_id])
        assert "THE" not in released  # even the first part of the stop string is held back
        if detok.stopped:
            break
    released += detok.finish()
    assert released == "The answer is forty two. "
    assert detok.stop_string == stop
    assert detok.push([ids[-1]]) == ""


def test_held_back_prefix_is_released_when_the_stop_string_does_not_follow(tokenizer):
    text = "THE ENDING was THE ENTRY"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, stop=["THE END!"])
    pieces = stream(detok, ids)
    assert "".join(pieces) == text
    assert not detok.stopped


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, stop=["four", "two"])
    assert "".join(stream(detok, ids)) == "one "
    assert detok.stop_string == "two"


def test_stop_string_inside_a_multibyte_run_cuts_right_before_it(tokenizer):
    text = "数据中心之间传输 KV 缓存"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, stop=["传输"])
    assert "".join(stream(detok, ids)) == "数据中心之间"


def test_empty_stop_string_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tokenizer, stop=[""])


def test_gemma_fallback_template_renders_the_documented_turn_format(tokenizer):
    template = ChatTemplate.for_tokenizer_dir(gemma_tokenizer_dir())
    assert template.is_builtin_fallback and template.source == GEMMA_CHAT_TEMPLATE
    prompt = template.render([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
    ])
    assert prompt == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\n2+2?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    assert ids[0] == tokenizer.token_to_id("<bos>")
    assert ids.count(tokenizer.token_to_id("<start_of_turn>")) == 4
    assert end_of_turn_token_ids(tokenizer) == [tokenizer.token_to_id("<end_of_turn>")]


def test_model_template_from_tokenizer_config_is_used(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": {"content": "</s>"}, '
        '"chat_template": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}'
        '{% if add_generation_prompt %}<|assistant|>{% endif %}"}'
    )
    template = ChatTemplate.for_tokenizer_dir(tmp_path)
    assert not template.is_builtin_fallback
    assert template.render([{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}]) == (
        "<|system|>x</s><|user|>y</s><|assistant|>"
    )


def test_a_non_gemma_model_without_a_template_has_no_chat_format(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
    assert ChatTemplate.for_tokenizer_dir(tmp_path) is None


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "at least one message"),
        ([{"role": "robot", "content": "x"}], "messages\\[0\\].role must be one of"),
        (["hello"], "messages\\[0\\] must be an object"),
        ([{"role": "user", "content": 5}], "content must be a string"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "only text content"),
    ],
)
def test_malformed_messages_raise_clear_errors(messages, message):
    template = ChatTemplate(GEMMA_CHAT_TEMPLATE, "<bos>", "<eos>", is_builtin_fallback=True)
    with pytest.raises(ChatTemplateError, match=message):
        template.render(messages)
