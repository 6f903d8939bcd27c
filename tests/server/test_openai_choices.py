"""The OpenAI routes, completed, driven by the official `openai` client: n > 1 choices (streamed and not),
stream_options.include_usage, logprobs in OpenAI's shapes, seeds, stop, penalties, best_of and 400s."""
from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]
SAMPLED = {"model": "model", "temperature": 1.0, "max_tokens": 6, "seed": 1234}


@pytest.fixture(scope="module")
def sdk(rolling_server):
    return openai.OpenAI(base_url=rolling_server.url + "/v1", api_key="unused", max_retries=0)


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
    assert all(c.finish_reason in ("stop", "length") for c in reply.choices)
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
def test_a_bad_parameter_raises_bad_request_naming_it(sdk, route, field, extra):
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
