"""Formatters: response objects of json / jsonlines / sse / tgi_compat / TGI / chat / completions over several
steps, as the encoder sends them.
OpenAI n > 1 and best_of: choices by index, usage with the prompt once, streamed chunks per choice, the usage
chunk only when asked.
"""
from __future__ import annotations

import json

import pytest

from lmi_handler.engine.sequence import FinishReason, RequestOutput, SamplingParams, TokenOutput
from lmi_handler.protocol.encoder import DONE, SSE_DONE, Wire, encode
from lmi_handler.protocol.formatters import StreamAnswer, outputs_line, response_body, stream_failure
from lmi_handler.protocol.plan import Kind
from lmi_handler.protocol.sequences import Combine, Member, SequencePlan
from tests.protocol.helpers import PROMPT, choices_plan, lines_of, make_plan, run, steps, tok


def ctx(chat: bool = False, completion: bool = False, stream: bool = False, output_formatter: str = "json",
        tgi_compat: bool = False, **fields):
    """The plan of the old ResponseContext spelling (kept so each case reads as before)."""
    kind = Kind.OPENAI_CHAT if chat else Kind.OPENAI_COMPLETION if completion else Kind.LMI_TEXT
    if chat and output_formatter == "jsonlines":
        kind = Kind.LMI_CHAT            # LMI's jsonlines_chat: /invocations with messages
    wire = Wire(output_formatter) if stream else Wire.JSON
    return make_plan(kind, wire, tgi_names=tgi_compat, **fields)


def test_json_sends_one_document_when_finished():
    sent = run(ctx(), steps())
    assert sent[:2] == ["", ""]
    assert json.loads(sent[2]) == {"generated_text": "Hi 我😀"}
    assert "我😀" in sent[2]  # UTF-8 kept, not \u-escaped (LMI)


def test_json_details_and_prefill():
    doc = json.loads(run(ctx(details=True, decoder_input_details=True), steps())[2])
    details = doc["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 3 and details["inputs"] == PROMPT
    assert [t["text"] for t in details["tokens"]] == ["Hi", " 我", "😀"]
    assert set(details["tokens"][0]) == {"id", "text", "log_prob", "special_token"}
    assert details["prefill"] == [{"id": 7, "text": "Say", "log_prob": None}, {"id": 8, "text": ":", "log_prob": -2.0}]


def test_json_top_tokens_tgi_style():
    c = ctx(details=True, decode_token=lambda i: f"t{i}")
    details = json.loads(run(c, steps(top=True))[2])["details"]
    assert len(details["top_tokens"]) == 3
    assert details["top_tokens"][0] == [{"id": 1, "text": "t1", "log_prob": -0.1, "special_token": False},
                                        {"id": 99, "text": "t99", "log_prob": -5.0, "special_token": False}]


def test_json_return_full_text_prepends_prompt():
    assert json.loads(run(ctx(return_full_text=True), steps())[2])["generated_text"] == PROMPT + "Hi 我😀"


def test_json_tgi_compat_wraps_in_list_with_tgi_token_names():
    sent = run(ctx(tgi_compat=True, details=True), steps())[2]
    doc = json.loads(sent)
    assert isinstance(doc, list) and len(doc) == 1 and doc[0]["generated_text"] == "Hi 我😀"
    assert set(doc[0]["details"]["tokens"][0]) == {"id", "text", "logprob", "special"}
    assert doc[0]["details"]["prefill"] == []


def test_json_error_keeps_partial_text_and_says_error():
    outs = steps()[:2] + [RequestOutput("abc", [], "Hi", True, FinishReason.ERROR, 4, 1, error="CUDA OOM")]
    doc = json.loads(run(ctx(), outs)[2])
    assert doc["generated_text"] == "Hi" and doc["error"] == "CUDA OOM"
    assert doc["details"]["finish_reason"] == "error"


def test_json_error_under_tgi_compat_is_tgi_error_object():
    outs = [RequestOutput("abc", [], "", True, FinishReason.ERROR, 4, 0, error="boom")]
    assert json.loads(run(ctx(tgi_compat=True), outs)[0]) == {"error": "boom", "error_type": "generation"}


@pytest.mark.parametrize("fmt", ["jsonlines", "sse"])
def test_stream_one_line_per_token_only_last_carries_final_fields(fmt):
    c = ctx(stream=True, details=True, output_formatter=fmt)
    sent = run(c, steps())
    assert c.content_type == {"jsonlines": "application/jsonlines", "sse": "text/event-stream"}[fmt]
    assert sent[1] == ""  # no new token: nothing to send this step
    lines = [line for chunk in sent for line in lines_of(chunk, sse=fmt == "sse")]
    assert len(lines) == 3 and all("token" in line for line in lines)
    for line in lines[:-1]:
        assert set(line) == {"token"}
    last = lines[-1]
    assert "".join(line["token"]["text"] for line in lines) == last["generated_text"] == "Hi 我😀"
    assert last["details"] == {"finish_reason": "length", "generated_tokens": 3, "inputs": PROMPT}
    assert last["details"]["generated_tokens"] == len(lines)


def test_sse_event_framing():
    sent = run(ctx(stream=True, output_formatter="sse"), steps())
    assert sent[0] == 'data: {"token": {"id": 1, "text": "Hi", "log_prob": -0.1, "special_token": false}}\n\n'


def test_jsonlines_without_details_has_generated_text_only():
    last = lines_of(run(ctx(stream=True, output_formatter="jsonlines"), steps())[2])[-1]
    assert set(last) == {"token", "generated_text"}


def test_jsonlines_return_full_text_and_prefill():
    c = ctx(stream=True, output_formatter="jsonlines", return_full_text=True, details=True, decoder_input_details=True)
    last = lines_of(run(c, steps())[2])[-1]
    assert last["generated_text"] == PROMPT + "Hi 我😀"
    assert last["details"]["prefill"][0]["log_prob"] is None and "tokens" not in last["details"]


def test_jsonlines_finish_without_new_token_uses_sentinel_line():
    outs = [RequestOutput("abc", [tok(1, "A")], "A", False, None, 2, 1),
            RequestOutput("abc", [], "A", True, FinishReason.STOP_SEQUENCE, 2, 4)]
    sent = run(ctx(stream=True, details=True, output_formatter="jsonlines"), outs)
    last = lines_of(sent[1])
    assert len(last) == 1 and last[0]["token"]["id"] == -1 and last[0]["token"]["text"] == ""
    assert last[0]["generated_text"] == "A" and last[0]["details"]["finish_reason"] == "stop_sequence"
    assert last[0]["details"]["generated_tokens"] == 1


def test_jsonlines_mid_stream_error_is_final_line_with_error():
    outs = [RequestOutput("abc", [tok(1, "A")], "A", False, None, 2, 1),
            RequestOutput("abc", [], "A", True, FinishReason.ERROR, 2, 1, error="engine failed")]
    lines = [line for chunk in run(ctx(stream=True, output_formatter="jsonlines"), outs) for line in lines_of(chunk)]
    assert "generated_text" not in lines[0]
    assert lines[-1]["details"]["finish_reason"] == "error" and lines[-1]["error"] == "engine failed"
    assert lines[-1]["generated_text"] == "A"


def test_tgi_compat_stream_lines_use_tgi_names_index_and_top_tokens():
    c = ctx(stream=True, tgi_compat=True, details=True, output_formatter="sse")
    lines = [line for chunk in run(c, steps(top=True)) for line in lines_of(chunk, sse=True)]
    assert [line["index"] for line in lines] == [1, 2, 3]
    assert set(lines[0]["token"]) == {"id", "text", "logprob", "special"}
    assert lines[0]["top_tokens"][1]["id"] == 99
    assert lines[-1]["details"]["finish_reason"] == "length"


def test_tgi_stream_events_carry_every_key_and_end_with_generated_text_and_details():
    plan = make_plan(Kind.TGI_STREAM, Wire.SSE, details=True, tgi_names=True, decode_token=lambda i: f"t{i}")
    events = [e for chunk in run(plan, steps(top=True)) for e in lines_of(chunk, sse=True)]
    assert [e["index"] for e in events] == [1, 2, 3]
    assert all(set(e) == {"index", "token", "top_tokens", "generated_text", "details"} for e in events)
    assert events[0]["token"] == {"id": 1, "text": "Hi", "logprob": -0.1, "special": False}
    assert events[0]["top_tokens"][1] == {"id": 99, "text": "t99", "logprob": -5.0, "special": False}
    assert [e["generated_text"] for e in events] == [None, None, "Hi 我😀"]
    assert events[-1]["details"] == {"finish_reason": "length", "generated_tokens": 3, "seed": None,
                                     "input_length": 2}


def test_tgi_stream_error_is_tgi_error_event_and_compat_whole_answer_is_a_list():
    failed = [RequestOutput("abc", [], "", True, FinishReason.ERROR, 4, 0, error="boom")]
    plan = make_plan(Kind.TGI_STREAM, Wire.SSE, tgi_names=True)
    assert lines_of(run(plan, failed)[0], sse=True) == [{"error": "boom", "error_type": "generation"}]
    assert stream_failure("gone", 503, plan) == [{"error": "gone", "error_type": "generation"}]
    whole = json.loads(run(make_plan(Kind.TGI_COMPAT, tgi_names=True), steps())[2])
    assert whole == [{"generated_text": "Hi 我😀"}]
    assert json.loads(run(make_plan(Kind.TGI_GENERATE, tgi_names=True), steps())[2]) == {"generated_text": "Hi 我😀"}


def test_openai_streams_leave_out_done_when_the_plan_says_so():
    plan = make_plan(Kind.OPENAI_CHAT, Wire.SSE, sse_done=False)
    sent = "".join(run(plan, steps()))
    assert "[DONE]" not in sent and sent.endswith("\n\n")


def test_chat_completion_object():
    sent = run(ctx(chat=True), steps(FinishReason.EOS_TOKEN))
    assert sent[:2] == ["", ""]
    doc = json.loads(sent[2])
    assert doc["id"] == "chatcmpl-abc" and doc["object"] == "chat.completion" and doc["created"] == 1700000000
    assert doc["model"] == "smol"
    assert doc["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hi 我😀"},
                               "logprobs": None, "finish_reason": "stop"}]
    assert doc["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


def test_chat_stream_chunks_end_with_done():
    c = ctx(chat=True, stream=True, output_formatter="sse")
    sent = run(c, steps(FinishReason.STOP_SEQUENCE))
    assert c.content_type == "text/event-stream"
    assert sent[1] == "" and sent[-1].endswith(SSE_DONE)
    chunks = [c for chunk in sent for c in lines_of(chunk, sse=True)]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-abc" for c in chunks)
    # every delta carries role and tool_calls: null, as TGI sends them (the TGI client's ChoiceDelta requires them)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hi", "tool_calls": None}
    assert all(c["system_fingerprint"] and c["choices"][0]["delta"]["role"] == "assistant" for c in chunks)
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "Hi 我😀"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop"]


def test_chat_stream_usage_chunk_and_logprobs():
    c = ctx(chat=True, stream=True, output_formatter="sse", include_usage=True, logprobs=True)
    chunks = [x for chunk in run(c, steps()) for x in lines_of(chunk, sse=True)]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[0]["choices"][0]["logprobs"]["content"][0]["token"] == "Hi"
    assert chunks[1]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_jsonlines_has_no_done_marker():
    c = ctx(chat=True, stream=True, output_formatter="jsonlines")
    sent = "".join(run(c, steps()))
    assert c.content_type == "application/jsonlines" and "[DONE]" not in sent
    assert [json.loads(line)["object"] for line in sent.splitlines()] == ["chat.completion.chunk"] * 2


def test_chat_errors_are_openai_error_objects():
    err = RequestOutput("abc", [], "", True, FinishReason.ERROR, 4, 0, error="boom")
    assert json.loads(run(ctx(chat=True), [err])[0])["error"]["message"] == "boom"
    sent = run(ctx(chat=True, stream=True, output_formatter="sse"), [err])[0]
    assert sent.endswith(SSE_DONE) and lines_of(sent, sse=True)[0]["error"]["message"] == "boom"


def test_completion_object_and_echo():
    doc = json.loads(run(ctx(completion=True, return_full_text=True), steps())[2])
    assert doc["object"] == "text_completion" and doc["id"] == "cmpl-abc"
    assert doc["choices"][0]["text"] == PROMPT + "Hi 我😀" and doc["choices"][0]["finish_reason"] == "length"


def test_completion_stream_texts_concatenate():
    c = ctx(completion=True, stream=True, output_formatter="sse", logprobs=True)
    chunks = [x for chunk in run(c, steps()) for x in lines_of(chunk, sse=True)]
    assert "".join(x["choices"][0]["text"] for x in chunks) == "Hi 我😀"
    assert chunks[1]["choices"][0]["logprobs"]["text_offset"] == [2, 4]


def test_tgi_generate_answers_tgi_details_with_the_seed_of_a_sampled_request():
    plan = make_plan(Kind.TGI_GENERATE, params=SamplingParams(greedy=False, seed=5), details=True)
    doc = json.loads(run(plan, steps())[2])
    assert doc["generated_text"] == "Hi 我😀"
    assert list(doc["details"]) == ["finish_reason", "generated_tokens", "seed", "prefill", "tokens"]
    assert doc["details"]["seed"] == 5 and doc["details"]["prefill"] == []
    assert doc["details"]["tokens"][0] == {"id": 1, "text": "Hi", "logprob": -0.1, "special": False}


def test_tgi_generate_reports_no_seed_for_greedy_and_no_details_unless_asked():
    assert json.loads(run(make_plan(Kind.TGI_GENERATE), steps())[2]) == {"generated_text": "Hi 我😀"}
    doc = json.loads(run(make_plan(Kind.TGI_GENERATE, details=True), steps())[2])
    assert doc["details"]["seed"] is None


def test_dynamic_list_answers_one_lmi_document_per_prompt_in_order():
    plan = make_plan(Kind.DYNAMIC_LIST)
    plan = plan.__class__(**{**plan.__dict__, "prompts": (plan.prompts[0], plan.prompts[0].__class__(
        "abc-1", "Go:", (9,), SamplingParams()))})
    two = [[Member("abc", SamplingParams())], [Member("abc-1", SamplingParams())]]
    other = [RequestOutput("abc-1", [tok(4, "ok")], "ok", True, FinishReason.EOS_TOKEN, 1, 1)]
    assert response_body(plan, two, {"abc": steps(), "abc-1": other}) == [
        {"generated_text": "Hi 我😀"}, {"generated_text": "ok"}]


def test_openai_response_body_is_the_chat_completion_object():
    body = response_body(ctx(chat=True), [[Member("abc", SamplingParams())]], {"abc": steps(FinishReason.EOS_TOKEN)})
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "Hi 我😀"


def test_dynamic_batch_stream_line_shape():
    assert encode([outputs_line(["x", "y"])], Wire.JSONLINES) == '{"outputs": ["x", "y"]}\n'


@pytest.mark.parametrize("wire", [Wire.JSONLINES, Wire.SSE])
def test_a_stream_failure_is_a_final_lmi_error_line_in_the_plans_wire(wire):
    text = encode(stream_failure("boom", 424, make_plan(wire=wire)), wire)
    line = lines_of(text, sse=wire is Wire.SSE)[-1]
    assert line["details"]["finish_reason"] == "error" and line["code"] == 424 and line["token"]["id"] == -1


def test_an_openai_stream_failure_is_an_error_chunk_then_done():
    text = encode(stream_failure("boom", 424, make_plan(Kind.OPENAI_CHAT, Wire.SSE)), Wire.SSE)
    assert text.endswith(SSE_DONE) and lines_of(text, sse=True)[0]["error"]["message"] == "boom"


def test_best_of_under_tgi_compat_keeps_tgi_token_names():
    def run_of(request_id: str, text: str, log_prob: float) -> list[RequestOutput]:
        token = TokenOutput(id=7, text=text, log_prob=log_prob, special_token=False)
        return [RequestOutput(request_id, [token], text, True, FinishReason.LENGTH, 3, 1)]

    plan = make_plan(details=True, tgi_names=True, sequences=SequencePlan(2, Combine.BEST_OF))
    sampled = SamplingParams(greedy=False)
    two = [[Member("abc#0", sampled.__class__(greedy=False, seed=1)), Member("abc#1", sampled.__class__(greedy=False, seed=2))]]
    doc = response_body(plan, two, {"abc#0": run_of("abc#0", "a", -2.0), "abc#1": run_of("abc#1", "b", -0.5)})
    assert isinstance(doc, list) and doc[0]["generated_text"] == "b"
    details = doc[0]["details"]
    assert set(details["tokens"][0]) == {"id", "text", "logprob", "special"}
    other = details["best_of_sequences"][0]
    assert other["generated_text"] == "a" and other["seed"] == 1
    assert set(other["tokens"][0]) == {"id", "text", "logprob", "special"}


def one_token_run(request_id: str, text: str, log_prob: float, reason=FinishReason.EOS_TOKEN) -> list[RequestOutput]:
    token = TokenOutput(id=5, text=text, log_prob=log_prob, special_token=False)
    return [RequestOutput(request_id, [token], text, True, reason, 4, 1)]


def stream_events(plan, outputs_by_step: list[dict]) -> tuple[list, StreamAnswer]:
    (ms,) = plan.members()
    stream = StreamAnswer(plan, ms)
    return [stream.events(step) for step in outputs_by_step], stream


def interleaved(first: list[RequestOutput], second: list[RequestOutput]) -> list[dict]:
    """Step k holds the k-th output of each member that still runs."""
    return [{o.request_id: o for o in pair if o is not None}
            for pair in zip(first + [None] * (len(second) - len(first)), second + [None] * (len(first) - len(second)))]


def test_chat_n_two_answers_two_choices_by_index_and_counts_the_prompt_once():
    plan = choices_plan(Kind.OPENAI_CHAT, 2, 2)
    (ms,) = plan.members()
    body = response_body(plan, [ms], {"abc#0": steps(FinishReason.EOS_TOKEN, request_id="abc#0"),
                                      "abc#1": one_token_run("abc#1", "Yo", -0.3, FinishReason.LENGTH)})
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == ["Hi 我😀", "Yo"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3 + 1, "total_tokens": 8}


def test_completion_best_of_answers_the_n_highest_summed_log_probs_best_first():
    plan = choices_plan(Kind.OPENAI_COMPLETION, 3, 2)
    (ms,) = plan.members()
    body = response_body(plan, [ms], {"abc#0": one_token_run("abc#0", "a", -3.0),
                                      "abc#1": one_token_run("abc#1", "b", -0.5),
                                      "abc#2": one_token_run("abc#2", "c", -1.0)})
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "b"), (1, "c")]
    assert body["usage"]["completion_tokens"] == 2 and body["usage"]["prompt_tokens"] == 4


def test_a_failed_choice_answers_the_request_with_an_openai_error_object():
    plan = choices_plan(Kind.OPENAI_CHAT, 2, 2)
    (ms,) = plan.members()
    failed = [RequestOutput("abc#1", [], "", True, FinishReason.ERROR, 4, 0, error="boom")]
    body = response_body(plan, [ms], {"abc#0": one_token_run("abc#0", "a", -1.0), "abc#1": failed})
    assert body["error"]["message"] == "boom"


def test_a_streamed_n_two_chat_sends_each_choices_chunks_by_index_then_one_done():
    plan = choices_plan(Kind.OPENAI_CHAT, 2, 2, Wire.SSE)
    sent, stream = stream_events(plan, interleaved(steps(FinishReason.LENGTH, request_id="abc#0"),
                                                   one_token_run("abc#1", "Yo", -0.3)))
    assert not any(DONE in s for s in sent[:-1]) and sent[-1][-1] is DONE and stream.finished
    chunks = [e for s in sent for e in s if e is not DONE]
    by_index = {0: [], 1: []}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        by_index[choice["index"]].append(choice)
    assert "".join(c["delta"]["content"] for c in by_index[0]) == "Hi 我😀"
    assert "".join(c["delta"]["content"] for c in by_index[1]) == "Yo"
    for index, reason in ((0, "length"), (1, "stop")):
        assert [c["finish_reason"] for c in by_index[index]][-1] == reason
        assert all(c["finish_reason"] is None for c in by_index[index][:-1])
        assert by_index[index][0]["delta"]["role"] == "assistant"
    assert all("usage" not in c for c in chunks)          # not asked: no usage anywhere


def test_include_usage_sends_one_last_chunk_with_empty_choices_and_all_choices_tokens():
    plan = choices_plan(Kind.OPENAI_COMPLETION, 2, 2, Wire.SSE, include_usage=True)
    sent, _ = stream_events(plan, interleaved(steps(request_id="abc#0"), one_token_run("abc#1", "Yo", -0.3)))
    text = "".join(encode(s, Wire.SSE) for s in sent)
    assert text.endswith(SSE_DONE)
    chunks = lines_of(text, sse=True)
    usage_chunks = [c for c in chunks if c["usage"] is not None]
    assert usage_chunks == [chunks[-1]] and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    assert chunks[-1]["object"] == "text_completion" and chunks[-1]["id"] == "cmpl-abc"


def test_an_error_in_one_streamed_choice_ends_the_stream_with_an_error_and_done():
    plan = choices_plan(Kind.OPENAI_CHAT, 2, 2, Wire.SSE)
    failed = RequestOutput("abc#1", [], "", True, FinishReason.ERROR, 4, 0, error="boom")
    sent, stream = stream_events(plan, [{"abc#0": steps(request_id="abc#0")[0], "abc#1": failed}])
    assert stream.finished and sent[0][-1] is DONE and sent[0][-2]["error"]["message"] == "boom"
