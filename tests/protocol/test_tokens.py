"""protocol/tokens.py: the token routes' bodies (vLLM's /tokenize and /detokenize, TGI's /tokenize) and answers."""
from __future__ import annotations

import json

import pytest

from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.tokens import (
    is_tgi_tokenize,
    parse_detokenize,
    parse_tgi_tokenize,
    parse_tokenize,
    tgi_tokens,
    tokenize_answer,
)


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_a_prompt_adds_special_tokens_by_default_and_messages_do_not_as_in_vllm():
    prompt = parse_tokenize(body(prompt="Hi", return_token_strs=True))
    assert (prompt.text, prompt.messages, prompt.add_special_tokens, prompt.return_token_strs) == ("Hi", None, True, True)
    chat = parse_tokenize(body(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]))
    assert chat.messages == [{"role": "user", "content": "Hi"}] and not chat.add_special_tokens
    assert parse_tokenize(body(prompt="Hi", add_special_tokens=False)).add_special_tokens is False


def test_tgi_bodies_are_told_apart_by_inputs():
    assert is_tgi_tokenize(body(inputs="Hi", parameters={})) and parse_tgi_tokenize(body(inputs="Hi")) == "Hi"
    assert not is_tgi_tokenize(body(prompt="Hi")) and not is_tgi_tokenize(b"not json")


@pytest.mark.parametrize("fields, field", [
    ({}, "prompt"), ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ({"prompt": 3}, "prompt"), ({"messages": []}, "messages"), ({"prompt": "a", "add_special_tokens": 1},
                                                               "add_special_tokens")])
def test_bad_vllm_tokenize_bodies_name_the_field(fields, field):
    with pytest.raises(RequestValidationError) as info:
        parse_tokenize(body(**fields))
    assert info.value.field == field


@pytest.mark.parametrize("tokens", [[-1], "12", [1.5], [True]])
def test_detokenize_takes_token_ids_only(tokens):
    assert parse_detokenize(body(tokens=[0, 5])) == [0, 5]
    with pytest.raises(RequestValidationError) as info:
        parse_detokenize(body(tokens=tokens))
    assert info.value.field == "tokens"


def test_answers_take_vllms_and_tgis_shapes():
    assert tokenize_answer([1, 2], 8192, None) == {"count": 2, "max_model_len": 8192, "tokens": [1, 2],
                                                   "token_strs": None}
    assert tgi_tokens("<s>Hé", [1, 56, 2756], [(0, 0), (3, 4), (4, 5)]) == [
        {"id": 1, "text": "", "start": 0, "stop": 0}, {"id": 56, "text": "H", "start": 3, "stop": 4},
        {"id": 2756, "text": "é", "start": 4, "stop": 5}]
