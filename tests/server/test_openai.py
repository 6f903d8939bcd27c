"""server/openai.py: the OpenAI routes through the `openai` package and Hugging Face's InferenceClient:
chat, completions, n choices, best_of, logprobs, stop, penalties, seeds, errors, the served-model rule, and
tool calling (also through LangChain's bind_tools and /invocations' chat schema).
"""
from __future__ import annotations

import base64
import io
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from huggingface_hub import InferenceClient
from PIL import Image

from tests.helpers import NAMED_WEATHER, TIME_PARAMETERS, TOOL_PARAMETERS, TOOLS, WEATHER_QUESTION, serve
from tests.server.helpers import PROMPT, generated_text, solo_text

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def strict_server(model_dir, tmp_path_factory):
    """option.strict_model_name=true: a `model` that is not a served name is a 404, as vLLM answers."""
    yield from serve(tmp_path_factory, "strict", strict_model_name="true", num_threads="1")


@pytest.fixture(scope="module")
def sdk(rolling_server):
    return openai.OpenAI(base_url=rolling_server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_completion_with_the_sdk(sdk):
    reply = sdk.chat.completions.create(model="model", messages=[{"role": "user", "content": "Say hi."}],
                                        temperature=0, max_tokens=16)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens <= 16 and reply.usage.prompt_tokens > 0
    assert reply.choices[0].finish_reason == ("length" if reply.usage.completion_tokens == 16 else "stop")


def test_streamed_chat_deltas_join_to_the_non_streamed_content(sdk):
    messages = [{"role": "user", "content": "Name three colors."}]
    full = sdk.chat.completions.create(model="model", messages=messages, temperature=0, max_tokens=20)
    stream = sdk.chat.completions.create(model="model", messages=messages, temperature=0, max_tokens=20, stream=True)
    parts, reasons = [], []
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
    assert "".join(parts) == full.choices[0].message.content
    assert reasons[-1] == full.choices[0].finish_reason and all(r is None for r in reasons[:-1])


def test_completion_with_the_sdk_and_logprobs(sdk):
    reply = sdk.completions.create(model="model", prompt="The sky is", max_tokens=4, temperature=0, logprobs=2)
    assert reply.choices[0].text
    assert len(reply.choices[0].logprobs.tokens) == reply.usage.completion_tokens


def test_bad_parameter_raises_bad_request_naming_it(sdk):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="model", messages=[{"role": "user", "content": "Hi"}], top_p=1.5)
    assert "top_p" in str(err.value)


MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]


SAMPLED = {"model": "model", "temperature": 1.0, "max_tokens": 6, "seed": 1234}


def joined_by_index(stream, chat: bool) -> tuple[dict[int, str], dict[int, list], list]:
    """A stream's text and finish_reasons per choice index, and the chunks that carried usage."""
    texts: dict[int, str] = {}
    reasons: dict[int, list] = {}
    usage_chunks = []
    for chunk in stream:
        if chunk.usage is not None:
            usage_chunks.append(chunk)
        for choice in chunk.choices:
            piece = (choice.delta.content or "") if chat else choice.text
            texts[choice.index] = texts.get(choice.index, "") + piece
            reasons.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, reasons, usage_chunks


def test_chat_n_two_is_two_seeded_choices_the_prompt_counted_once(sdk):
    reply = sdk.chat.completions.create(messages=MESSAGES, n=2, logprobs=True, **SAMPLED)
    again = sdk.chat.completions.create(messages=MESSAGES, n=2, logprobs=True, **SAMPLED)
    single = sdk.chat.completions.create(messages=MESSAGES, **SAMPLED)
    assert [c.index for c in reply.choices] == [0, 1]
    assert {c.finish_reason for c in reply.choices} <= {"stop", "length"}     # sampled: each ends its own way
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens            # once, not n times
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices)
    # choice j samples with seed + j: choice 0 is the n=1 answer, choice 1 the n=1 answer at seed + 1
    assert reply.choices[0].message.content == single.choices[0].message.content
    next_seed = sdk.chat.completions.create(messages=MESSAGES, **{**SAMPLED, "seed": SAMPLED["seed"] + 1})
    assert reply.choices[1].message.content == next_seed.choices[0].message.content


def test_streamed_chat_n_two_joins_to_the_whole_answer_with_a_usage_chunk_only_when_asked(sdk):
    whole = sdk.chat.completions.create(messages=MESSAGES, n=2, **SAMPLED)
    texts, reasons, usage_chunks = joined_by_index(sdk.chat.completions.create(
        messages=MESSAGES, n=2, stream=True, stream_options={"include_usage": True}, **SAMPLED), chat=True)
    assert texts == {c.index: c.message.content for c in whole.choices}
    for choice in whole.choices:          # one finish_reason per choice index, on its last chunk
        assert reasons[choice.index][-1] == choice.finish_reason
        assert all(r is None for r in reasons[choice.index][:-1])
    (last,) = usage_chunks
    assert last.choices == [] and last.usage == whole.usage
    _, _, unasked = joined_by_index(sdk.chat.completions.create(messages=MESSAGES, n=2, stream=True, **SAMPLED),
                                    chat=True)
    assert unasked == []


def test_completions_n_two_streamed_and_not_agree(sdk):
    body = {"prompt": "The ocean is", "n": 2, "logprobs": 0, **SAMPLED}
    whole = sdk.completions.create(**body)
    texts, reasons, usage_chunks = joined_by_index(sdk.completions.create(
        stream=True, stream_options={"include_usage": True}, **body), chat=False)
    assert [c.index for c in whole.choices] == [0, 1]
    assert texts == {c.index: c.text for c in whole.choices}
    assert {i: r[-1] for i, r in reasons.items()} == {c.index: c.finish_reason for c in whole.choices}
    (last,) = usage_chunks
    assert last.usage == whole.usage
    assert whole.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in whole.choices)


def test_completions_best_of_returns_the_n_best_of_the_sequences_it_ran(sdk):
    body = {"prompt": "The ocean is", **SAMPLED}
    best = sdk.completions.create(best_of=3, n=2, logprobs=0, **body)
    candidates = sdk.completions.create(n=3, logprobs=0, **body)       # the same seeds: the same three sequences
    scored = sorted(candidates.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [c.text for c in scored[:2]]
    assert [c.index for c in best.choices] == [0, 1]


def test_chat_logprobs_and_top_logprobs_take_openais_shape(sdk):
    reply = sdk.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=3, **SAMPLED)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8")) and entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)


def test_completion_logprobs_take_openais_legacy_shape(sdk):
    reply = sdk.completions.create(prompt="The ocean is", logprobs=2, echo=False, **SAMPLED)
    logprobs = reply.choices[0].logprobs
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert len(logprobs.token_logprobs) == len(logprobs.tokens) == reply.usage.completion_tokens
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert 2 <= len(top) <= 3 and top.get(token, logprob) == logprob   # the 2 best, plus the sampled one


def test_stop_ends_the_text_before_the_stop_string(sdk):
    greedy = {"model": "model", "temperature": 0, "max_tokens": 12}
    free = sdk.completions.create(prompt="One, two, three,", **greedy).choices[0].text
    stop_word = free.split()[2]
    stopped = sdk.completions.create(prompt="One, two, three,", stop=[stop_word], **greedy).choices[0]
    assert stopped.finish_reason == "stop" and stop_word not in stopped.text
    assert free.startswith(stopped.text)


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
def test_penalties_reshape_the_distribution_over_generated_tokens_only(sdk, penalty):
    """Log probs are reported under the processed distribution: the first token (nothing generated yet)
    is untouched, and once tokens exist the penalty moves every later token's log prob."""
    greedy = {"model": "model", "temperature": 0, "max_tokens": 5, "logprobs": 0, "prompt": "cat cat cat cat"}
    plain = sdk.completions.create(**greedy).choices[0].logprobs.token_logprobs
    penalized = sdk.completions.create(**{penalty: 2.0}, **greedy).choices[0].logprobs.token_logprobs
    assert penalized[0] == pytest.approx(plain[0], abs=1e-5)
    assert all(abs(a - b) > 1e-4 for a, b in zip(plain[1:], penalized[1:]))


def test_a_seed_reproduces_a_sampled_answer(sdk):
    first = sdk.chat.completions.create(messages=MESSAGES, **{**SAMPLED, "max_tokens": 12})
    second = sdk.chat.completions.create(messages=MESSAGES, **{**SAMPLED, "max_tokens": 12})
    assert first.choices[0].message.content == second.choices[0].message.content


@pytest.mark.parametrize("route, field, extra", [
    ("chat", "n", {"n": 0}), ("chat", "top_logprobs", {"logprobs": True, "top_logprobs": 21}),
    ("chat", "temperature", {"temperature": 3}), ("completions", "logprobs", {"logprobs": 6}),
    ("completions", "best_of", {"n": 2, "best_of": 1}), ("chat", "n", {"n": 17}),
    ("completions", "best_of", {"best_of": 2, "stream": True}),
])
def test_a_bad_parameter_of_any_route_raises_bad_request_naming_it(sdk, route, field, extra):
    with pytest.raises(openai.BadRequestError) as err:
        if route == "chat":
            sdk.chat.completions.create(model="model", messages=MESSAGES, max_tokens=2, **extra)
        else:
            sdk.completions.create(model="model", prompt="Hi", max_tokens=2, **extra)
    assert f"`{field}`" in str(err.value) and err.value.body["param"] == field


def test_dynamic_batch_answers_n_choices_too(dynamic_server):
    client = openai.OpenAI(base_url=dynamic_server.url + "/v1", api_key="unused", max_retries=0)
    reply = client.completions.create(prompt="The ocean is", n=2, **SAMPLED)
    assert [c.index for c in reply.choices] == [0, 1] and all(c.finish_reason for c in reply.choices)
    seeded = client.completions.create(prompt="The ocean is", n=2, **SAMPLED)
    assert [c.text for c in seeded.choices] == [c.text for c in reply.choices]


def test_inference_client_chat_completion_against_the_base_url_is_answered_by_the_loaded_model(rolling_server):
    """huggingface_hub's InferenceClient sends `model: "tgi"` against a base URL: the served-model rule answers it
    with the loaded model (as TGI and LMI do), no tgi_compat needed."""
    client = InferenceClient(base_url=rolling_server.url, timeout=300)
    messages = [{"role": "user", "content": "Name three colors."}]
    reply = client.chat_completion(messages, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content and reply.model == "model"
    chunks = list(client.chat_completion(messages, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content


def test_inference_client_chat_completion_under_tgi_compat(tgi_server):
    client = InferenceClient(base_url=tgi_server.url, timeout=300)     # sends model="dummy", as TGI accepts
    messages = [{"role": "user", "content": "Name three colors."}]
    reply = client.chat_completion(messages, max_tokens=12, temperature=0)
    content = reply.choices[0].message.content
    assert content and reply.system_fingerprint and reply.usage.completion_tokens <= 12
    # OpenAI's finish reasons, not TGI's eos_token: "stop" when the answer ended by itself (an EOS drawn as the
    # 12th token included, as vLLM counts it), which a 13-token budget shows by giving the same answer
    longer = client.chat_completion(messages, max_tokens=13, temperature=0)
    ended = longer.usage.completion_tokens == reply.usage.completion_tokens
    assert reply.choices[0].finish_reason == ("stop" if ended else "length")
    short = client.chat_completion(messages, max_tokens=4, temperature=0)     # the answer above is longer
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 4
    assert content.startswith(short.choices[0].message.content)
    chunks = list(client.chat_completion(messages, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content


def test_the_openai_package_chats_and_completes_and_sees_our_errors(rolling_server, strict_server):
    sdk = openai.OpenAI(base_url=rolling_server.url + "/v1", api_key="unused", max_retries=0)
    reply = sdk.chat.completions.create(model="model", messages=[{"role": "user", "content": "Say hi."}],
                                        temperature=0, max_tokens=8)
    assert reply.choices[0].message.content and reply.system_fingerprint
    stream = sdk.completions.create(model="model", prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == solo_text(rolling_server)
    strict = openai.OpenAI(base_url=strict_server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        strict.chat.completions.create(model="tgi", messages=[{"role": "user", "content": "Hi"}])
    assert "tgi" in missing.value.body["message"]
    with pytest.raises(openai.NotFoundError) as no_route:
        sdk.embeddings.create(model="model", input="hi")
    assert no_route.value.body["message"].startswith("no route POST /v1/embeddings")


def test_openai_completions_route_answers_text_completion(client):
    response = client.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 5, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] <= 5
    assert body["choices"][0]["text"] == generated_text(client, "The sky is", max_new_tokens=5)


def test_with_strict_model_name_the_openai_routes_refuse_a_model_they_do_not_serve(strict_server, client):
    body = {"model": "gpt-4", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    response = httpx.post(strict_server.url + "/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 404 and "gpt-4" in response.json()["error"]["message"]
    served = httpx.post(strict_server.url + "/v1/chat/completions", json={**body, "model": "model"}, timeout=300)
    assert served.status_code == 200 and served.json()["model"] == "model"
    # by default (option.strict_model_name unset) the same body is answered, naming the served model
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200 and response.json()["model"] == "model"


# ---- decoding controls through the SDK ------------------------------------------------------------------

def test_response_format_json_schema_outputs_validate_when_they_stop(sdk):
    """8 prompts over the nested / array / enum / required schemas of tests/helpers.py, sent at once (the
    engine test runs 32); every answer that stopped parses and validates, and most stop within 160 tokens."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    from tests.helpers import JSON_SCHEMAS, SCHEMA_SUBJECTS

    def ask(i: int):
        schema = JSON_SCHEMAS[i % len(JSON_SCHEMAS)]
        return schema, sdk.chat.completions.create(
            model="model", max_tokens=160, temperature=0 if i % 2 == 0 else 0.7, seed=i,
            messages=[{"role": "user", "content": f"Describe {SCHEMA_SUBJECTS[i]} as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    stopped = 0
    for schema, answer in answers:
        choice = answer.choices[0]
        if choice.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(choice.message.content), schema)
        else:
            assert choice.finish_reason == "length"
    assert stopped >= 6


def test_regex_choice_and_json_object_through_extra_body_on_completions(sdk):
    import json
    import re

    date = sdk.completions.create(model="model", prompt="Apollo 11 landed on (YYYY-MM-DD): ", max_tokens=16,
                                  temperature=0, extra_body={"structured_outputs": {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}})
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.choices[0].text)
    label = sdk.completions.create(model="model", prompt="The sentiment of 'I love it' is", max_tokens=8,
                                   temperature=0.9, seed=3, extra_body={"guided_choice": ["positive", "negative"]})
    assert label.choices[0].text in ("positive", "negative")
    anything = sdk.chat.completions.create(model="model", max_tokens=60, temperature=0,
                                           messages=[{"role": "user", "content": "A JSON object about a cat."}],
                                           response_format={"type": "json_object"})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].message.content), dict)


@pytest.mark.parametrize(("extra", "field"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs"),
    ({"extra_body": {"guided_grammar": "start: ((("}}, "guided_grammar"),
    ({"extra_body": {"guided_json": "{oops"}}, "guided_json"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
    ({"extra_body": {"allowed_token_ids": [10 ** 9]}}, "allowed_token_ids"),
])
def test_an_invalid_constraint_or_control_raises_bad_request_naming_it(sdk, extra, field):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="model", max_tokens=8, messages=[{"role": "user", "content": "hi"}], **extra)
    assert info.value.status_code == 400 and f"`{field}`" in info.value.message


def test_logits_controls_change_the_answer_as_asked(sdk, tokenizer):
    base = dict(model="model", prompt="The capital of France is", max_tokens=6, temperature=0)
    plain = sdk.completions.create(**base).choices[0].text
    first = tokenizer.encode(plain, add_special_tokens=False)[0]
    banned = sdk.completions.create(**base, logit_bias={str(first): -100}).choices[0].text
    assert tokenizer.encode(banned, add_special_tokens=False)[0] != first
    forced = sdk.completions.create(**base, logit_bias={"28": 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens == [tokenizer.decode([28])] * 6
    word = plain.split()[0]
    without = sdk.completions.create(**base, extra_body={"bad_words": [word]}).choices[0].text
    assert word not in without
    allowed = sdk.completions.create(**base, extra_body={"allowed_token_ids": [28, 29, 30]}, logprobs=0)
    assert set(allowed.choices[0].logprobs.tokens) <= {tokenizer.decode([t]) for t in (28, 29, 30)}
    ask = dict(model="model", max_tokens=20, temperature=0,
               messages=[{"role": "user", "content": "Is the sky blue? Answer yes or no."}])
    short = sdk.chat.completions.create(**ask, extra_body={"guided_choice": ["yes", "no"]})
    assert short.usage.completion_tokens < 10 and short.choices[0].finish_reason == "stop"
    longer = sdk.chat.completions.create(**ask, extra_body={"min_tokens": 10})
    assert longer.usage.completion_tokens >= 10


def test_prompt_logprobs_take_vllms_shape(sdk, tokenizer):
    answer = sdk.completions.create(model="model", prompt="The capital of France is", max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    entries = answer.choices[0].model_extra["prompt_logprobs"]
    ids = tokenizer.encode("The capital of France is")
    assert entries[0] is None and len(entries) == len(ids)
    for token, entry in zip(ids[1:], entries[1:]):
        assert str(token) in entry and 2 <= len(entry) <= 3
        ranked = sorted(entry.values(), key=lambda v: v["rank"])   # the 2 best, and the token itself with its rank
        assert [v["rank"] for v in ranked[:2]] == [1, 2] and ranked[0]["logprob"] >= ranked[1]["logprob"]
        assert entry[str(token)]["rank"] >= 1
    chat = sdk.chat.completions.create(model="model", max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1},
                                       messages=[{"role": "user", "content": "hi"}])
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3


def test_a_prompt_tokens_rank_is_its_place_in_the_whole_vocabulary_even_outside_the_top_k(sdk, tokenizer, model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = "The capital of France is Paris, and the zebra quietly ate purple spaghetti."
    ask = dict(model="model", prompt=prompt, max_tokens=1, temperature=0)
    one = sdk.completions.create(**ask, extra_body={"prompt_logprobs": 1}).choices[0].model_extra["prompt_logprobs"]
    many = sdk.completions.create(**ask, extra_body={"prompt_logprobs": 20}).choices[0].model_extra["prompt_logprobs"]
    ids = tokenizer.encode(prompt)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    outside = 0
    for pos, (token, small, large) in enumerate(zip(ids[1:], one[1:], many[1:]), 1):
        rank = small[str(token)]["rank"]
        assert isinstance(rank, int) and rank >= 1 and large[str(token)]["rank"] == rank   # the same whatever k
        if rank <= 20:   # among the 20 best alternatives, its place there
            assert sorted(v["rank"] for v in large.values()) == list(range(1, 21))
        outside += rank > 1
        target = logp[pos - 1, token]   # transformers on the same weights, within float32 noise of ours
        above_surely = int((logp[pos - 1] > target + 1e-4).sum())
        above_maybe = int((logp[pos - 1] > target - 1e-4).sum())
        assert above_surely <= rank - 1 <= above_maybe
    assert outside >= 3   # the odd words are not the model's first choice: ranks past k=1 were computed


def test_use_beam_search_through_extra_body_answers_n_choices_on_chat(sdk):
    answer = sdk.chat.completions.create(model="model", max_tokens=10, n=2, temperature=0,
                                         messages=[{"role": "user", "content": "Name a colour."}],
                                         extra_body={"use_beam_search": True, "length_penalty": 1.0})
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.choices[0].message.content != answer.choices[1].message.content
    assert answer.usage.completion_tokens <= 20


# ---- tool calling (protocol/tools.py, chat_output.py; docs/tools.md) ------------------------------------

def ask_tools(sdk, **fields):
    return sdk.chat.completions.create(model="model", messages=WEATHER_QUESTION, tools=TOOLS, temperature=0,
                                       max_tokens=40, **fields)


def check_tool_calls(calls) -> list:
    """Every call names a tool and its arguments parse and validate against that tool's schema."""
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), TOOL_PARAMETERS[call.function.name])
    return calls


def joined_tool_calls(stream) -> tuple[dict[int, dict], str | None, str]:
    """The streamed tool-call deltas joined per index (id, name, arguments), the finish_reason, the content."""
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or delta.id
            call["name"] += (delta.function.name or "") if delta.function else ""
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
        reason = choice.finish_reason or reason
    return calls, reason, content


@pytest.mark.parametrize("tool_choice", ["required", NAMED_WEATHER])
def test_required_and_named_tool_choice_return_calls_whose_arguments_validate(sdk, tool_choice):
    reply = ask_tools(sdk, tool_choice=tool_choice)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = check_tool_calls(choice.message.tool_calls)
    if tool_choice == NAMED_WEATHER:
        assert [c.function.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize("tool_choice", ["required", NAMED_WEATHER])
def test_streamed_tool_call_deltas_join_to_calls_whose_arguments_validate(sdk, tool_choice):
    whole = ask_tools(sdk, tool_choice=tool_choice).choices[0].message.tool_calls
    calls, reason, content = joined_tool_calls(ask_tools(sdk, tool_choice=tool_choice, stream=True))
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.function.name, c.function.arguments)
                                                                     for c in whole]      # greedy: the same calls
    for call in calls.values():
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), TOOL_PARAMETERS[call["name"]])


def test_the_follow_up_turn_with_the_tool_result_answers(sdk):
    call = ask_tools(sdk, tool_choice=NAMED_WEATHER).choices[0].message.tool_calls[0]
    messages = [*WEATHER_QUESTION, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "unit": "celsius"}'}]
    reply = sdk.chat.completions.create(model="model", messages=messages, tools=TOOLS, tool_choice="none",
                                        temperature=0, max_tokens=12)
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason == ("length" if reply.usage.completion_tokens == 12 else "stop")
    assert reply.choices[0].message.tool_calls is None


def test_langchain_bind_tools_round_trips(rolling_server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "London", "Tokyo"]) -> str:
        """The weather in a city."""
        return f"Sunny in {city}"

    llm = ChatOpenAI(base_url=rolling_server.url + "/v1", api_key="unused", model="model", temperature=0,
                     max_tokens=30, max_retries=0)
    # strict: additionalProperties false, so the demo model's arguments end after `city` (it would add others)
    bound = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True)
    history = [HumanMessage("What is the weather in Paris?")]
    reply = bound.invoke(history)
    assert [c["name"] for c in reply.tool_calls] == ["get_weather"]
    assert reply.tool_calls[0]["args"]["city"] in ("Paris", "London", "Tokyo") and reply.tool_calls[0]["id"].startswith("call_")
    result = get_weather.invoke(reply.tool_calls[0])                  # a ToolMessage for the call's id
    assert isinstance(result, ToolMessage)
    answer = llm.bind_tools([get_weather]).invoke([*history, reply, result], tool_choice="none")
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls


def test_invocations_chat_schema_and_legacy_functions_call_tools(client):
    body = {"messages": WEATHER_QUESTION, "tools": TOOLS, "tool_choice": "required", "max_tokens": 40, "temperature": 0}
    reply = client.post("/invocations", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] == "tool_calls"
    legacy = {"messages": WEATHER_QUESTION, "functions": [t["function"] for t in TOOLS], "function_call": {"name": "get_time"},
              "max_tokens": 40, "temperature": 0}
    message = client.post("/v1/chat/completions", json=legacy).json()["choices"][0]["message"]
    jsonschema.validate(json.loads(message["function_call"]["arguments"]), TIME_PARAMETERS)
    assert message["tool_calls"][0]["function"] == message["function_call"]


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS}, "tool_choice"),        # auto (the default) without option.enable_auto_tool_choice
])
def test_bad_tools_answer_400_naming_the_field(sdk, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="model", messages=WEATHER_QUESTION, max_tokens=4, **fields)
    assert info.value.status_code == 400 and info.value.body["param"] == param
    if fields == {"tools": TOOLS}:
        assert "option.enable_auto_tool_choice" in info.value.body["message"]


# ---- images (docs/images.md) on a tiny random SmolVLM, the real app in this process ------------------------------

IMAGE_QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def vlm_app(tiny_vlm):
    """The app on the tiny vision-language checkpoint in float32: at most 2 images a prompt, http images only from
    example.com, 10000 pixels an image."""
    from tests.server.helpers import InProcessServer

    server = InProcessServer(model_id=str(tiny_vlm[0]), dtype="fp32", limit_mm_per_prompt="2",
                             allowed_media_domains="example.com", max_image_pixels="10000", num_threads="1",
                             kv_cache_bytes=str(16 << 20))
    yield server
    server.close()


def _image_chat(*urls: str, role: str = "user") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": role, "content": [*parts, {"type": "text", "text": IMAGE_QUESTION}]}]


def test_the_openai_clients_image_message_is_answered_as_transformers_generates_it(vlm_app, tiny_vlm):
    import torch

    from tests.engine.vision_models import data_url, picture

    _, model, processor = tiny_vlm
    image = picture(50, 30, seed=11)
    sdk = openai.AsyncOpenAI(base_url="http://app/v1", api_key="unused", max_retries=0,
                             http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=vlm_app.app)))
    reply = vlm_app.loop.run_until_complete(sdk.chat.completions.create(
        model="vlm", messages=_image_chat(data_url(image, "JPEG")), temperature=0, max_tokens=6, logprobs=True))
    decoded = Image.open(io.BytesIO(base64.b64decode(data_url(image, "JPEG").split(",", 1)[1]))).convert("RGB")
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {
        "type": "text", "text": IMAGE_QUESTION}]}], add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[[decoded]], add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    expected = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    expected_lp = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.scores, expected)]
    assert reply.usage.prompt_tokens == inputs["input_ids"].shape[1] and reply.usage.completion_tokens == 6
    assert [t.logprob for t in reply.choices[0].logprobs.content] == pytest.approx(expected_lp, abs=1e-4)


def test_lmi_chat_tgi_markdown_images_and_batch_lines_carry_their_images(vlm_app):
    from tests.engine.vision_models import data_url, picture

    url = data_url(picture(40, 40, seed=12))
    for path in ("/generate", "/invocations"):
        reply = vlm_app.post(path, json={"inputs": f"![]({url}){IMAGE_QUESTION}", "parameters": {"max_new_tokens": 3}})
        assert reply.status_code == 200, reply.text
    chat = vlm_app.post("/invocations", json={"messages": _image_chat(url), "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] > 20, chat.text     # 5 tiles x 4
    body = {"model": "vlm", "messages": _image_chat(url, url), "max_tokens": 2}
    plan = vlm_app.service.plan_openai_body(body, "/v1/chat/completions", "line-1")
    assert len(plan.prompts[0].params.multimodal.images) == 2


@pytest.mark.parametrize(("urls", "role", "field", "why"), [
    (["data:image/png;base64,@@"], "user", "messages[0].content[0]", "base64 does not decode"),
    (["data:image/png;base64,aGVsbG8="], "user", "messages[0].content[0]", "no image this server decodes"),
    (["https://elsewhere.org/a.png"], "user", "messages[0].content[0]", "not in option.allowed_media_domains"),
    (["/etc/hostname"], "user", "messages[0].content[0]", "allowed_local_media_path is unset"),
    (["big"], "user", "messages[0].content[0]", "more than option.max_image_pixels=10000"),
    (["small"] * 3, "user", "messages[0].content[2]", "at most 2 images (option.limit_mm_per_prompt)"),
    (["small"], "assistant", "messages[0].content[0]", "user messages only"),
])
def test_every_bad_image_answers_400_naming_the_part_and_why(vlm_app, urls, role, field, why):
    from tests.engine.vision_models import data_url, picture

    drawn = {"big": data_url(picture(120, 120)), "small": data_url(picture(20, 20))}
    messages = _image_chat(*[drawn.get(u, u) for u in urls], role=role)
    reply = vlm_app.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == field and why in error["message"], reply.text
    markdown = vlm_app.post("/generate", json={"inputs": f"![]({drawn.get(urls[0], urls[0])})Hi"})
    if role == "user" and len(urls) == 1:
        assert markdown.status_code == 400 and why in markdown.json()["error"], markdown.text


def test_a_seeded_sampled_image_chat_streams_the_text_it_answers_whole_with_the_same_log_probs(vlm_app):
    """Sampling, seeds, logprobs and streaming on a prompt with an image, as for text: the streamed deltas join to
    the whole answer's text, token by token with the same log-probs, and the same seed draws the same tokens."""
    import json

    from tests.engine.vision_models import data_url, picture

    body = {"messages": _image_chat(data_url(picture(48, 40, seed=15))), "max_tokens": 6, "temperature": 1.5,
            "seed": 7, "logprobs": True}
    whole = vlm_app.post("/v1/chat/completions", json=body)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    streamed = vlm_app.post("/v1/chat/completions", json={**body, "stream": True})
    assert streamed.status_code == 200, streamed.text
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == choice["message"]["content"]
    streamed_logprobs = [t for d in deltas if d.get("logprobs") for t in d["logprobs"]["content"]]
    assert streamed_logprobs and [(t["token"], t["logprob"]) for t in streamed_logprobs] == \
        [(t["token"], t["logprob"]) for t in choice["logprobs"]["content"]]
    again = vlm_app.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert again["logprobs"] == choice["logprobs"]


def test_an_images_tokens_count_against_the_context(vlm_app):
    from tests.engine.vision_models import data_url, picture

    messages = _image_chat(data_url(picture(64, 64, seed=13)), data_url(picture(64, 64, seed=14)))
    fits = vlm_app.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    prompt_tokens = fits.json()["usage"]["prompt_tokens"]
    assert fits.status_code == 200 and prompt_tokens > 40          # 2 images of 5 tiles x 4 tokens, and the text
    too_long = vlm_app.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 513 - prompt_tokens})
    assert too_long.status_code == 400
    assert f"({prompt_tokens} in the messages, {513 - prompt_tokens} for the completion)" in too_long.json()["error"]["message"]


# ---- images on a tiny random Qwen2.5-VL (M-RoPE, its own processor) ---------------------------------------------

@pytest.fixture(scope="module")
def qwen_app(qwen2_5_vl_checkpoint):
    """The app on the tiny Qwen2.5-VL (tests/engine/qwen2_vl_models.py) in float32: its own processor and chat
    template, M-RoPE in the engine."""
    from tests.server.helpers import InProcessServer

    server = InProcessServer(model_id=str(qwen2_5_vl_checkpoint[0]), dtype="fp32", num_threads="1",
                             kv_cache_bytes=str(16 << 20))
    yield server
    server.close()


@pytest.mark.slow          # the app starts (about 5 s on a quiet host)
def test_the_openai_clients_two_image_message_to_qwen2_5_vl_is_answered_as_transformers_generates_it(
        qwen_app, qwen2_5_vl_checkpoint):
    import torch
    from jinja2 import Template

    from lmi_handler.engine.model.vision.qwen2_vl import QWEN2_VL
    from tests.engine.qwen2_vl_models import IMAGE_TOKEN_ID, draw_image
    from tests.engine.vision_models import data_url

    path, hf = qwen2_5_vl_checkpoint
    images = [draw_image(40, 24, 5), draw_image(24, 32, 6)]
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in images]
    sdk = openai.AsyncOpenAI(base_url="http://app/v1", api_key="unused", max_retries=0,
                             http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=qwen_app.app)))
    reply = qwen_app.loop.run_until_complete(sdk.chat.completions.create(
        model="qwen", messages=[{"role": "user", "content": [*content, {"type": "text", "text": IMAGE_QUESTION}]}],
        temperature=0, max_tokens=6, logprobs=True))
    processor = QWEN2_VL.load_processor(path)
    text = Template(processor.chat_template).render(messages=[{"role": "user", "content": [
        {"type": "image"}, {"type": "image"}, {"type": "text", "text": IMAGE_QUESTION}]}], add_generation_prompt=True)
    prompt = QWEN2_VL.prepare(processor, text, images, add_special_tokens=False)
    ids = torch.tensor([prompt.token_ids])
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == IMAGE_TOKEN_ID).int(),
            pixel_values=torch.cat([image.pixel_inputs["pixel_values"] for image in prompt.images]),
            image_grid_thw=torch.cat([image.pixel_inputs["image_grid_thw"] for image in prompt.images]),
            max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
            return_dict_in_generate=True)
    expected = out.sequences[0, ids.shape[1]:].tolist()
    expected_lp = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, expected)]
    assert reply.usage.prompt_tokens == ids.shape[1] and reply.usage.completion_tokens == 6
    assert [t.logprob for t in reply.choices[0].logprobs.content] == pytest.approx(expected_lp, abs=1e-4)
