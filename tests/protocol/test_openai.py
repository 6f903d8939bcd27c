"""OpenAI chat/completions requests -> GenerationParameters, finish_reason mapping, error bodies."""
from __future__ import annotations

import json

import pytest

from lmi_handler.engine.sequence import FinishReason, RequestOutput, SamplingParams, TokenOutput
from lmi_handler.protocol.dialects import Dialect
from lmi_handler.protocol.encoder import Wire
from lmi_handler.protocol.errors import RequestValidationError, error_body
from lmi_handler.protocol.formatters import response_body
from lmi_handler.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_choice,
    chat_completion_response,
    completion_logprobs,
    to_openai_finish_reason,
)
from lmi_handler.protocol.plan import Kind, Prompt
from lmi_handler.protocol.sequences import Combine, SequencePlan, members
from tests.protocol.helpers import PROMPT, lines_of, make_plan, run, steps, tok

MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.parse({"model": "smol", "messages": MESSAGES, **kw})


@pytest.mark.parametrize(("reason", "word"), [
    (FinishReason.EOS_TOKEN, "stop"), (FinishReason.STOP_SEQUENCE, "stop"), (FinishReason.LENGTH, "length"),
    (FinishReason.ERROR, "error"), (None, None), ("eos_token", "stop"),
])
def test_finish_reason_mapping(reason, word):
    assert to_openai_finish_reason(reason) == word


def test_live_chat_without_temperature_samples_at_one_like_vllm():
    p = chat().to_generation_parameters()
    assert not p.is_greedy() and p.temperature == 1.0


def test_batch_chat_without_temperature_is_greedy():
    assert chat(top_p=0.9).to_generation_parameters(greedy_when_unset=True).is_greedy()


@pytest.mark.parametrize(("temperature", "greedy"), [(0, True), (0.0, True), (1.5, False), (0.01, False)])
def test_chat_temperature_decides(temperature, greedy):
    assert chat(temperature=temperature).to_generation_parameters().is_greedy() is greedy


def test_generation_config_defaults_fill_missing_fields():
    p = chat(top_p=0.5).to_generation_parameters(defaults={"temperature": 0.6, "top_p": 0.9, "top_k": 20})
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.5, 20) and not p.is_greedy()


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_completion_tokens=5, max_tokens=50).to_generation_parameters().max_new_tokens == 5
    assert chat(max_tokens=50).to_generation_parameters().max_new_tokens == 50
    assert chat().to_generation_parameters(default_max_new_tokens=900).max_new_tokens == 900
    assert chat().to_generation_parameters().max_new_tokens == 30


def test_chat_fields_map_to_parameters():
    p = chat(stop="END", seed=-4, presence_penalty=0.5, frequency_penalty=-0.5, logprobs=True, top_logprobs=3,
             top_k=-1, min_p=0.1, repetition_penalty=1.1, ignore_eos=True, stop_token_ids=[2],
             include_stop_str_in_output=True, skip_special_tokens=False).to_generation_parameters()
    assert p.stop_sequences == ["END"] and p.seed == -4 and p.top_n_tokens == 3 and p.top_k == 0
    assert (p.presence_penalty, p.frequency_penalty, p.min_p, p.repetition_penalty) == (0.5, -0.5, 0.1, 1.1)
    assert p.ignore_eos and p.stop_token_ids == [2] and p.include_stop_str_in_output and not p.skip_special_tokens


def test_priority_of_chat_and_completion_bodies_reaches_the_engine():
    assert chat(priority=-2).to_generation_parameters().to_sampling_params().priority == -2
    assert chat().to_generation_parameters().to_sampling_params().priority == 0
    completion = CompletionRequest.parse({"prompt": "Hi", "max_tokens": 2, "priority": 7})
    assert completion.to_generation_parameters().to_sampling_params().priority == 7


def test_c06_chat_top_p_one_with_temperature_zero_is_accepted():
    p = chat(top_p=1.0, temperature=0).to_generation_parameters()
    assert p.to_sampling_params().greedy


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -1), ("temperature", 3), ("temperature", "hot"), ("top_p", 0), ("top_p", 1.5), ("max_tokens", 0),
    ("max_tokens", 2.5), ("max_completion_tokens", 0), ("n", 0), ("stop", 5), ("stop", [""]), ("seed", 1.5),
    ("presence_penalty", 3), ("frequency_penalty", -3), ("top_logprobs", 21), ("logprobs", 1), ("stream", "yes"),
    ("messages", []), ("messages", [{"role": "user", "content": 5}]),
    ("priority", "high"), ("priority", 1.5), ("priority", True), ("priority", -(1 << 63) - 1),
])
def test_chat_bad_field_is_named_in_openai_error(field, value):
    with pytest.raises(RequestValidationError) as info:
        chat(**{field: value}).to_generation_parameters()
    err = info.value
    assert err.field == field and f"`{field}`" in err.message
    body = error_body(Dialect.OPENAI, err.message, err.status_code, param=err.field)
    assert body == {"error": {"message": err.message, "type": "invalid_request_error", "param": field, "code": 400}}


def test_missing_messages_is_rejected():
    with pytest.raises(RequestValidationError) as info:
        ChatCompletionRequest.parse({"model": "m"})
    assert info.value.field == "messages"


def test_top_logprobs_needs_logprobs():
    with pytest.raises(RequestValidationError) as info:
        chat(top_logprobs=2).to_generation_parameters()
    assert info.value.field == "top_logprobs"


def test_text_parts_are_joined_for_the_chat_template():
    req = ChatCompletionRequest.parse({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]})
    assert req.text_messages() == [{"role": "user", "content": "Hello there"}]


def test_stream_options_include_usage():
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert not chat(stream=True).include_usage


def test_completion_defaults_and_echo():
    req = CompletionRequest.parse({"prompt": "The sky is"})
    p = req.to_generation_parameters()
    assert p.max_new_tokens == 16 and not p.return_full_text and req.prompts == ["The sky is"]
    p = CompletionRequest.parse({"prompt": ["a", "b"], "max_tokens": 6, "echo": True, "logprobs": 2,
                                 "temperature": 0}).to_generation_parameters()
    assert p.max_new_tokens == 6 and p.return_full_text and p.top_n_tokens == 2 and p.is_greedy()


@pytest.mark.parametrize("prompt", ["", [], 5, [1, -2], [1, True], [[1], []], [[1], "a"], ["a", ""], [[]], [1.0]])
def test_completion_bad_prompt(prompt):
    with pytest.raises(RequestValidationError) as info:
        CompletionRequest.parse({"prompt": prompt})
    assert info.value.field == "prompt" and "token ids (integers >= 0)" in info.value.message


@pytest.mark.parametrize("prompt, prompts", [("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]),
                                             ([[1, 2], [3]], [[1, 2], [3]]), ([0], [[0]])])
def test_completion_prompt_takes_openais_four_forms_one_prompt_each(prompt, prompts):
    assert CompletionRequest.parse({"prompt": prompt}).prompts == prompts


def test_max_tokens_zero_is_echo_only_and_runs_one_token_else_it_is_refused_naming_the_field():
    request = CompletionRequest.parse({"prompt": [1, 2], "max_tokens": 0, "echo": True, "logprobs": 1})
    assert request.echo_only and request.to_generation_parameters().max_new_tokens == 1
    assert not CompletionRequest.parse({"prompt": "a", "max_tokens": 1, "echo": True}).echo_only
    with pytest.raises(RequestValidationError) as info:
        CompletionRequest.parse({"prompt": "a", "max_tokens": 0}).to_generation_parameters()
    assert info.value.field == "max_tokens" and "only with echo=true" in info.value.message
    with pytest.raises(RequestValidationError) as info:
        CompletionRequest.parse({"prompt": "a", "max_tokens": -1, "echo": True})
    assert info.value.field == "max_tokens" and "integer >= 0" in info.value.message


def test_chat_completion_response_shape():
    doc = chat_completion_response(request_id="r", created=1, model="m", prompt_tokens=5, completion_tokens=3,
                                   choices=[chat_choice(0, "ok", FinishReason.LENGTH)])
    assert doc["choices"][0]["finish_reason"] == "length"
    assert doc["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


@pytest.mark.parametrize("messages", [[{"role": "user"}], [{"role": "system", "content": None}],
                                      [{"role": "user", "content": "hi"}, {"role": "user"}]])
def test_messages_other_than_assistant_need_content(messages):
    with pytest.raises(RequestValidationError) as info:
        ChatCompletionRequest.parse({"messages": messages})
    assert info.value.field.startswith("messages")


def test_an_assistant_message_may_omit_content():
    request = ChatCompletionRequest.parse({"messages": [{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": None},
                                                        {"role": "user", "content": "again"}]})
    assert request.text_messages()[1]["content"] == ""


@pytest.mark.parametrize(("field", "value"), [("logprobs", 6), ("logprobs", -1), ("n", 0), ("best_of", 0),
                                              ("temperature", 2.5)])
def test_completion_bad_field_is_named_with_openais_range(field, value):
    with pytest.raises(RequestValidationError) as info:
        CompletionRequest.parse({"prompt": "x", field: value}).to_generation_parameters()
    assert info.value.field == field and f"`{field}`" in info.value.message


def test_n_and_best_of_stay_the_openai_rule_not_generation_parameters():
    """sequences.openai_n reads them off the request; GenerationParameters keeps one sequence (so TGI's
    greedy rule does not refuse n=2 at temperature 0, which OpenAI answers with identical choices)."""
    request = CompletionRequest.parse({"prompt": "x", "n": 2, "best_of": 3, "temperature": 0})
    params = request.to_generation_parameters()
    assert (request.n, request.best_of) == (2, 3) and (params.n, params.best_of) == (1, None)
    assert params.to_sampling_params().greedy


@pytest.mark.parametrize(("field", "value"), [("suffix", "tail"), ("logits_processors", ["p"])])
def test_a_field_that_would_change_the_answer_but_is_not_implemented_is_refused_not_ignored(field, value):
    for parse in (lambda: chat(**{field: value}),
                  lambda: CompletionRequest.parse({"model": "smol", "prompt": "Hi", field: value})):
        with pytest.raises(RequestValidationError) as info:
            parse()
        assert info.value.status_code == 400 and info.value.field == field
        assert f"`{field}`" in info.value.message and "not supported" in info.value.message


def test_neutral_values_of_unimplemented_fields_are_accepted():
    """Clients send these defaults (text-generation's `chat` sends nulls; others empty lists or 'none')."""
    request = chat(logit_bias={}, tools=[], tool_choice="none", response_format={"type": "text"}, functions=None,
                   use_beam_search=False, min_tokens=0, guided_json=None)
    assert request.messages == MESSAGES
    assert CompletionRequest.parse({"model": "smol", "prompt": "Hi", "suffix": "", "logit_bias": None}).echo is False


def test_empty_values_of_unimplemented_fields_are_neutral():
    assert chat(response_format={}, guided_json={}, guided_choice=[], guided_regex="", bad_words=[]).messages == MESSAGES
    with pytest.raises(RequestValidationError) as info:
        chat(best_of=2)                     # chat has no best_of here (completions implement it)
    assert info.value.field == "best_of"



@pytest.mark.parametrize(("field", "value", "check"), [
    ("logit_bias", {"50": -100, "7": 2.5}, lambda p: p.logit_bias == ((7, 2.5), (50, -100.0))),
    ("response_format", {"type": "json_object"}, lambda p: p.structured_output.kind.value == "json_object"),
    ("guided_json", {"type": "object"}, lambda p: p.structured_output.kind.value == "json_schema"),
    ("guided_choice", ["a", "b"], lambda p: p.structured_output.choices == ("a", "b")),
    ("guided_regex", "[0-9]+", lambda p: p.structured_output.value == "[0-9]+"),
    ("structured_outputs", {"json": {}}, lambda p: p.structured_output.value == "{}"),
    ("prompt_logprobs", 2, lambda p: p.prompt_logprobs and p.prompt_top_n_tokens == 2),
    ("min_tokens", 4, lambda p: p.min_tokens == 4), ("allowed_token_ids", [2, 1, 2], lambda p: p.allowed_token_ids == (1, 2)),
])
def test_the_decoding_controls_are_accepted_and_reach_the_engine_on_both_routes(field, value, check):
    for request in (chat(**{field: value}, max_tokens=8),
                    CompletionRequest.parse({"model": "smol", "prompt": "Hi", field: value})):
        assert check(request.to_generation_parameters().to_sampling_params())


@pytest.mark.parametrize(("body", "field"), [
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"3": 101}}, "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"), ({"guided_choice": "yes"}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"guided_grammar": "start: (("}, "guided_grammar"), ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"min_tokens": -1}, "min_tokens"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": ["  "]}, "bad_words"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"use_beam_search": True, "n": 2, "temperature": 0.8}, "temperature"),
    ({"use_beam_search": True, "n": 2, "logprobs": True, "top_logprobs": 2}, "top_logprobs"),
])
def test_bad_decoding_controls_answer_400_naming_the_field(body, field):
    with pytest.raises(RequestValidationError) as info:
        chat(**body, max_tokens=8).to_generation_parameters()
    assert info.value.status_code == 400 and f"`{field}`" in info.value.message


def test_use_beam_search_runs_n_beams_greedily_and_completions_take_best_of_as_the_width():
    params = chat(use_beam_search=True, n=3, length_penalty=0.5, max_tokens=8).to_generation_parameters()
    assert (params.num_beams, params.length_penalty, params.is_greedy()) == (3, 0.5, True)
    request = CompletionRequest.parse({"prompt": "x", "use_beam_search": True, "n": 2, "best_of": 4})
    assert request.to_generation_parameters().num_beams == 4


def test_completions_take_max_completion_tokens_over_max_tokens_as_batch_lines_do():
    request = CompletionRequest.parse({"prompt": "Hi", "max_tokens": 9, "max_completion_tokens": 5})
    assert request.to_generation_parameters().max_new_tokens == 5
    assert CompletionRequest.parse({"prompt": "Hi"}).to_generation_parameters().max_new_tokens == 16


def test_truncate_prompt_tokens_is_lmi_truncate_and_its_errors_keep_the_vllm_name():
    assert chat(truncate_prompt_tokens=7).to_generation_parameters().truncate == 7
    with pytest.raises(RequestValidationError) as info:
        chat(truncate_prompt_tokens=0)
    assert info.value.field == "truncate_prompt_tokens"


def test_stream_options_without_stream_is_refused_as_vllm_does():
    with pytest.raises(RequestValidationError) as info:
        chat(stream_options={"include_usage": True})
    assert info.value.field == "stream_options" and "stream=true" in info.value.message
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage


@pytest.mark.parametrize("body, field", [({"max_tokens": 2}, "prompt"), ({"prompt": None, "max_tokens": 2}, "prompt")])
def test_a_missing_field_is_named_as_required_without_echoing_the_body(body, field):
    with pytest.raises(RequestValidationError) as info:
        CompletionRequest.parse(body)
    assert info.value.field == field and "required" in info.value.message and "max_tokens" not in info.value.message


def test_chat_logprobs_take_openais_content_shape_with_bytes_and_top_logprobs():
    plan = make_plan(Kind.OPENAI_CHAT, logprobs=True, decode_token=lambda i: f"<{i}>")
    ms = members("abc", plan.prompts[0].params, plan.sequences)
    outs = [RequestOutput("abc", [tok(2, " 我", top=True)], " 我", True, FinishReason.LENGTH, 4, 1)]
    body = response_body(plan, [ms], {"abc": outs})
    (entry,) = body["choices"][0]["logprobs"]["content"]
    assert entry["token"] == " 我" and entry["logprob"] == -0.2 and entry["bytes"] == list(" 我".encode())
    assert entry["top_logprobs"] == [{"token": "<2>", "logprob": -0.2, "bytes": list(b"<2>")},
                                     {"token": "<99>", "logprob": -5.0, "bytes": list(b"<99>")}]


def test_completion_logprobs_list_tokens_offsets_and_the_sampled_token_beside_the_top_ones():
    sampled_not_top = TokenOutput(3, "c", -1.5, False, [(4, -0.5)])
    top_and_sampled = TokenOutput(4, "dd", -0.5, False, [(4, -0.5)])
    no_alternatives = TokenOutput(5, "e", -0.7, False, None)        # logprobs=0: the sampled token only
    got = completion_logprobs([sampled_not_top, top_and_sampled, no_alternatives], lambda i: "dd", text_offset=4)
    assert got == {"tokens": ["c", "dd", "e"], "token_logprobs": [-1.5, -0.5, -0.7],
                   "top_logprobs": [{"dd": -0.5, "c": -1.5}, {"dd": -0.5}, {"e": -0.7}], "text_offset": [4, 5, 7]}


def test_echoed_prompt_tokens_come_first_in_logprobs_the_first_one_null_offsets_from_zero():
    prompt = [TokenOutput(7, "Say", None, False), TokenOutput(8, ":", -2.0, False, [(9, -0.1)])]
    got = completion_logprobs([TokenOutput(3, "c", -1.5, False, [(3, -1.5)])], lambda i: "x", text_offset=4,
                              prompt_tokens=prompt)
    assert got == {"tokens": ["Say", ":", "c"], "token_logprobs": [None, -2.0, -1.5],
                   "top_logprobs": [None, {"x": -0.1, ":": -2.0}, {"x": -1.5}], "text_offset": [0, 3, 4]}


@pytest.mark.parametrize("wire", [Wire.JSON, Wire.SSE])
def test_echo_with_max_tokens_zero_answers_the_prompt_alone_with_its_log_probs_and_finish_reason_length(wire):
    plan = make_plan(Kind.OPENAI_COMPLETION, wire, return_full_text=True, logprobs=True, echo_only=True)
    sent = [text for text in run(plan, steps(FinishReason.EOS_TOKEN)) if text]
    chunks = [line for text in sent for line in lines_of(text, True)] if plan.stream else [json.loads(sent[0])]
    choices = [choice for chunk in chunks for choice in chunk["choices"]]
    assert "".join(c["text"] for c in choices) == PROMPT and choices[-1]["finish_reason"] == "length"
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert tokens == ["Say", ":"]
    assert choices[0]["logprobs"]["token_logprobs"] == [None, -2.0]
    if wire is Wire.JSON:
        assert chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4}


def test_a_list_of_prompts_answers_one_body_with_choices_indexed_across_prompts_and_usage_summed():
    two = SequencePlan(2, Combine.CHOICES, 2)
    plan = make_plan(Kind.OPENAI_COMPLETION, params=SamplingParams(greedy=False, seed=3), sequences=two,
                     prompts=(Prompt("abc-0", "A", (1,), SamplingParams(seed=3)),
                              Prompt("abc-1", "B", (2, 3), SamplingParams(seed=3))))
    by_prompt = plan.members()
    outputs = {m.request_id: [RequestOutput(m.request_id, [tok(5, m.request_id)], m.request_id, True,
                                            FinishReason.LENGTH, len(p.token_ids), 1)]
               for p, ms in zip(plan.prompts, by_prompt) for m in ms}
    body = response_body(plan, by_prompt, outputs)
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "abc-0#0"), (1, "abc-0#1"), (2, "abc-1#0"), (3, "abc-1#1")]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
