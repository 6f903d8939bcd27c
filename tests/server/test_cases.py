"""The handed request cases of ../shared/cases (real bug reports against similar servers), as tests.

Each test follows its case's `expect` list against the running server on the demo model.
"""
from __future__ import annotations

import json
import threading
import time
import unicodedata

import httpx
import pytest

from tests.conftest import load_case
from tests.server.helpers import generated_text, invoke, stream_lines, streamed_text

pytestmark = pytest.mark.slow


def expand(inputs: str) -> str:
    """REPEAT('hello ', N) -> the text repeated N times (cases/README.md)."""
    if inputs.startswith("REPEAT("):
        text, count = inputs[len("REPEAT("):-1].rsplit(",", 1)
        return json.loads(text.strip().replace("'", '"')) * int(count)
    return inputs


def is_cjk_or_emoji(ch: str) -> bool:
    return ord(ch) > 0x2E80 and unicodedata.category(ch) in ("Lo", "So")


def test_c01_streaming_keeps_multibyte_characters_whole(client):
    case = load_case("C01")
    body = case["request"]
    lines = stream_lines(client, body)
    assert all("token" in line for line in lines)
    text = streamed_text(lines)
    assert text == lines[-1]["generated_text"]
    plain = client.post("/invocations", json={**body, "stream": False}).json()
    assert plain["generated_text"] == lines[-1]["generated_text"]
    assert text.count("\ufffd") == plain["generated_text"].count("\ufffd")
    for line in lines:
        token_text = line["token"]["text"]
        assert not any(0xD800 <= ord(ch) <= 0xDFFF for ch in token_text)
        token_text.encode("utf-8")  # a lone surrogate would raise here
    for ch in plain["generated_text"]:
        if is_cjk_or_emoji(ch):
            assert ch in text
    assert all("generated_text" not in line and "details" not in line for line in lines[:-1])
    details = lines[-1]["details"]
    assert details["generated_tokens"] == len(lines)
    if details["generated_tokens"] == 24:
        assert details["finish_reason"] == "length"


def test_c01_kind_every_streamed_prefix_is_valid_text_for_other_scripts(client):
    for prompt in ["Привет, как дела? Ответь по-русски:", "日本語で答えてください：こんにちは", "Emoji story: 🐶🐱🐭🐹 then",
                   "한국어로 대답해 주세요:"]:
        lines = stream_lines(client, {"inputs": prompt, "parameters": {"max_new_tokens": 20}})
        assert streamed_text(lines) == lines[-1]["generated_text"]
        assert "\ufffd" not in streamed_text(lines) or "\ufffd" in generated_text(client, prompt, max_new_tokens=20)


def test_c04_no_fragment_of_a_stop_sequence_is_streamed(client):
    case = load_case("C04")
    request = case["request"]
    plain = client.post("/invocations", json={**request, "stream": False}).json()
    text, tokens = plain["generated_text"], plain["details"]["tokens"]
    assert len(tokens) >= 8
    stop = "".join(t["text"] for t in tokens[3:7])
    prefix_len = len("".join(t["text"] for t in tokens[:3]))
    assert text.find(stop) == prefix_len
    params = {**request["parameters"], "stop_sequences": [stop], "include_stop_str_in_output": False}
    started = time.monotonic()
    lines = stream_lines(client, {**request, "parameters": params})
    assert time.monotonic() - started < 120
    assert streamed_text(lines) == text[:text.find(stop)]
    assert lines[-1]["generated_text"] == text[:text.find(stop)]
    assert lines[-1]["details"]["finish_reason"] == "stop_sequence"
    assert all("details" not in line for line in lines[:-1])


@pytest.mark.parametrize("start, length", [(1, 2), (2, 3), (0, 5)])
def test_c04_kind_stop_strings_starting_mid_token_are_held_back(client, start, length):
    request = {"inputs": "Here is the English alphabet: A B C", "parameters": {"max_new_tokens": 30, "details": True}}
    plain = client.post("/invocations", json=request).json()
    text = plain["generated_text"]
    first_len = len(plain["details"]["tokens"][0]["text"])
    begin = max(first_len - 1, 0) + start  # starts inside or right after the first token
    stop = text[begin:begin + length]
    assert stop, text
    cut = text[:text.find(stop)]
    lines = stream_lines(client, {**request, "parameters": {**request["parameters"], "stop_sequences": [stop]}})
    assert streamed_text(lines) == cut == lines[-1]["generated_text"]
    assert lines[-1]["details"]["finish_reason"] == "stop_sequence"
    lines = stream_lines(client, {**request, "parameters": {**request["parameters"], "stop_sequences": [stop],
                                                            "include_stop_str_in_output": True}})
    assert streamed_text(lines) == cut + stop == lines[-1]["generated_text"]


def test_c16_finish_reason_is_length_eos_or_stop_exactly(client):
    case = load_case("C16")
    request = case["request"]
    plain = client.post("/invocations", json=request).json()
    assert plain["details"]["finish_reason"] == "length" and plain["details"]["generated_tokens"] == 4
    lines = stream_lines(client, request)
    assert lines[-1]["details"]["finish_reason"] == "length"
    assert all("details" not in line and "finish_reason" not in json.dumps(line) for line in lines[:-1])
    longer = invoke(client, request["inputs"], do_sample=False, max_new_tokens=16, details=True).json()
    second = longer["details"]["tokens"][1]["text"]
    stopped = invoke(client, request["inputs"], do_sample=False, max_new_tokens=16, details=True,
                     stop_sequences=[second]).json()["details"]
    assert stopped["finish_reason"] == "stop_sequence" and stopped["generated_tokens"] < 16
    chat = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    details = invoke(client, chat, do_sample=False, max_new_tokens=200, details=True).json()["details"]
    if details["generated_tokens"] < 200:
        assert details["finish_reason"] == "eos_token"
    if details["finish_reason"] == "length":
        assert details["generated_tokens"] == 200
