"""Request cases (tests/cases/, from real bug reports against similar servers) on generation: multibyte
streaming (C01), stop strings (C04), chat specials (C05), boundary values (C06), over-long prompts (C09),
temperature and do_sample (C12), finish reasons (C16).
"""
from __future__ import annotations

import json
import threading
import time
import unicodedata

import httpx
import pytest

from tests.helpers import load_case
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
        # no replacement character the whole (non-streamed) answer does not have itself
        assert streamed_text(lines).count("\ufffd") == generated_text(client, prompt, max_new_tokens=20).count("\ufffd")


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


def chat(client: httpx.Client, **body) -> httpx.Response:
    return client.post("/v1/chat/completions", json=body)


def sse_chunks(client: httpx.Client, body: dict) -> tuple[list[dict], list[str]]:
    """Stream /v1/chat/completions; returns the parsed chunks and the raw data lines."""
    raw = []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                raw.append(line[len("data: "):])
    return [json.loads(r) for r in raw if r != "[DONE]"], raw


def test_c05_chat_content_never_carries_special_tokens_and_stops_cleanly(client):
    case = load_case("C05")
    body = case["request"]
    content = chat(client, **body).json()["choices"][0]["message"]["content"]
    assert len(content) >= 12
    for marker in ("<|im_end|>", "<|im_start|>", "<|endoftext|>"):
        assert marker not in content
    stop = content[6:10]
    assert content.find(stop) == 6
    stopped = chat(client, **body, stop=[stop]).json()["choices"][0]
    assert stopped["message"]["content"] == content[:6] and stopped["finish_reason"] == "stop"
    im_end = chat(client, **body, stop=["<|im_end|>"])
    assert im_end.status_code == 200
    choice, used = im_end.json()["choices"][0], im_end.json()["usage"]["completion_tokens"]
    assert "<|im_end|>" not in choice["message"]["content"]
    assert choice["finish_reason"] == ("length" if used == body["max_tokens"] else "stop")
    chunks, raw = sse_chunks(client, {**body, "stop": [stop]})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == content[:6]
    assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "stop"
    assert raw[-1] == "[DONE]"


def test_c06_boundary_values_accepted_and_invalid_ones_rejected_by_name(client):
    case = load_case("C06")
    request = case["request"]
    params = request["parameters"]
    ok = client.post("/invocations", json=request)
    assert ok.status_code == 200 and ok.json()["generated_text"]
    text = ok.json()["generated_text"]
    without_top_p = {k: v for k, v in params.items() if k != "top_p"}
    assert generated_text(client, request["inputs"], **without_top_p) == text
    without_top_k = {k: v for k, v in params.items() if k != "top_k"}
    assert generated_text(client, request["inputs"], **without_top_k) == text
    for name, value in [("top_p", 1.5), ("top_p", 0), ("repetition_penalty", 0)]:
        bad = client.post("/invocations", json={**request, "parameters": {**params, name: value}})
        assert bad.status_code == 400 and name in bad.json()["error"]
    response = chat(client, messages=[{"role": "user", "content": "Hi"}], top_p=1.0, temperature=0, max_tokens=8)
    assert response.status_code == 200


def test_c09_over_long_prompt_is_rejected_without_disturbing_the_batch(client, rolling_server):
    case = load_case("C09")
    long_text = expand(case["request"]["inputs"])
    normal = {"inputs": "The sky is", "parameters": {"do_sample": False, "max_new_tokens": 16}}
    solo = client.post("/invocations", json=normal).json()["generated_text"]
    results: dict[str, httpx.Response] = {}

    def send(name: str, body: dict) -> None:
        with httpx.Client(base_url=rolling_server.url, timeout=300) as http:
            results[name] = http.post("/invocations", json=body)

    threads = [threading.Thread(target=send, args=("long", case["request"] | {"inputs": long_text}))]
    threads += [threading.Thread(target=send, args=(f"n{i}", normal)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    long = results["long"]
    assert long.status_code == 400          # the case allows 413/422 too; ours is the validation 400
    assert "token" in long.json()["error"]
    for i in range(3):
        assert results[f"n{i}"].status_code == 200
        assert results[f"n{i}"].json()["generated_text"] == solo
    time.sleep(2)
    assert client.post("/invocations", json=normal).status_code == 200
    truncated = client.post("/invocations", json={"inputs": long_text,
                                                  "parameters": {"max_new_tokens": 8, "truncate": 256}})
    assert truncated.status_code == 200 and truncated.json()["generated_text"]
    chat_long = chat(client, messages=[{"role": "user", "content": long_text}])
    assert chat_long.status_code == 400 and "error" in chat_long.json()


def test_c12_temperature_is_honoured_exactly_as_do_sample_says(client):
    case = load_case("C12")
    request = case["request"]
    greedy20 = generated_text(client, request["inputs"], do_sample=False, max_new_tokens=20)
    for _ in range(2):
        assert generated_text(client, request["inputs"], **request["parameters"]) == greedy20
    greedy8 = generated_text(client, request["inputs"], do_sample=False, max_new_tokens=8)
    for seed in (1, 2):
        assert generated_text(client, request["inputs"], do_sample=True, temperature=0.01, max_new_tokens=8,
                              seed=seed) == greedy8
    assert generated_text(client, request["inputs"], do_sample=True, temperature=0, max_new_tokens=8) == greedy8
    hot = [generated_text(client, request["inputs"], do_sample=True, temperature=1.5, max_new_tokens=20, seed=s)
           for s in (1, 2)]
    assert hot[0] != hot[1]
    implied = [generated_text(client, request["inputs"], temperature=1.5, max_new_tokens=20, seed=s) for s in (1, 2)]
    assert implied[0] != implied[1]
    messages = [{"role": "user", "content": "Name a fruit and describe it."}]
    contents = [chat(client, messages=messages, temperature=1.5, seed=s, max_tokens=20).json()
                ["choices"][0]["message"]["content"] for s in (1, 2)]
    assert contents[0] != contents[1]
    cold = [chat(client, messages=messages, temperature=0, max_tokens=20).json()["choices"][0]["message"]["content"]
            for _ in range(2)]
    assert cold[0] == cold[1]


def test_c16_chat_finish_reasons_use_openai_words(client):
    short = chat(client, messages=[{"role": "user", "content": "Count from 1 to 20."}], max_tokens=3,
                 temperature=0).json()
    assert short["choices"][0]["finish_reason"] == "length" and short["usage"]["completion_tokens"] == 3
    natural = chat(client, messages=[{"role": "user", "content": "Say hi."}], temperature=0, max_tokens=300).json()
    assert natural["choices"][0]["finish_reason"] == "stop"
