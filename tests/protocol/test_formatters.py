"""Output formatters: byte shapes of json / jsonlines / sse / tgi_compat / chat / completions over several steps."""
from __future__ import annotations

import json

import pytest

from lmi_handler.engine.sequence import FinishReason, RequestOutput, TokenOutput
from lmi_handler.protocol.formatters import (SSE_DONE, ResponseContext, dynamic_batch_body,
                                             dynamic_batch_stream_line, error_body, make_formatter,
                                             resolve_output_formatter)

PROMPT = "Say:"


def tok(i: int, text: str, top: bool = False) -> TokenOutput:
    return TokenOutput(i, text, -0.1 * i, False, [(i, -0.1 * i), (99, -5.0)] if top else None)


def steps(reason: FinishReason = FinishReason.LENGTH, top: bool = False) -> list[RequestOutput]:
    """Three steps: one token, none (text held back), then two tokens and finish; "Hi 我😀"."""
    return [
        RequestOutput("r1", [tok(1, "Hi", top)], "Hi", False, None, 4, 1,
                      prompt_tokens=[TokenOutput(7, "Say", None, False), TokenOutput(8, ":", -2.0, False)]),
        RequestOutput("r1", [], "Hi", False, None, 4, 2),
        RequestOutput("r1", [tok(2, " 我", top), tok(3, "😀", top)], "Hi 我😀", True, reason, 4, 3),
    ]


def ctx(**kw) -> ResponseContext:
    base = dict(stream=False, details=False, decoder_input_details=False, return_full_text=False,
                prompt_text=PROMPT, output_formatter="json", model_name="smol", request_id="abc", created=1700000000)
    return ResponseContext(**{**base, **kw})


def run(context: ResponseContext, outs: list[RequestOutput]) -> list[str]:
    formatter = make_formatter(context)
    return [formatter.format(out) for out in outs]


def lines_of(text: str, sse: bool = False) -> list[dict]:
    """The JSON objects in one step's text ("" = nothing sent); SSE events must be `data: ...`."""
    if not text:
        return []
    if sse:
        events = [e for e in text.split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events)
        return [json.loads(e[len("data: "):]) for e in events if e != "data: [DONE]"]
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


# ---- json --------------------------------------------------------------------------------

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
    outs = steps()[:2] + [RequestOutput("r1", [], "Hi", True, FinishReason.ERROR, 4, 1, error="CUDA OOM")]
    doc = json.loads(run(ctx(), outs)[2])
    assert doc["generated_text"] == "Hi" and doc["error"] == "CUDA OOM"
    assert doc["details"]["finish_reason"] == "error"


def test_json_error_under_tgi_compat_is_tgi_error_object():
    outs = [RequestOutput("r1", [], "", True, FinishReason.ERROR, 4, 0, error="boom")]
    assert json.loads(run(ctx(tgi_compat=True), outs)[0]) == {"error": "boom", "error_type": "generation"}


# ---- jsonlines / sse ---------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["jsonlines", "sse"])
def test_stream_one_line_per_token_only_last_carries_final_fields(fmt):
    c = ctx(stream=True, details=True, output_formatter=fmt)
    formatter = make_formatter(c)
    sent = [formatter.format(out) for out in steps()]
    assert formatter.content_type == {"jsonlines": "application/jsonlines", "sse": "text/event-stream"}[fmt]
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
    outs = [RequestOutput("r1", [tok(1, "A")], "A", False, None, 2, 1),
            RequestOutput("r1", [], "A", True, FinishReason.STOP_SEQUENCE, 2, 4)]
    sent = run(ctx(stream=True, details=True, output_formatter="jsonlines"), outs)
    last = lines_of(sent[1])
    assert len(last) == 1 and last[0]["token"]["id"] == -1 and last[0]["token"]["text"] == ""
    assert last[0]["generated_text"] == "A" and last[0]["details"]["finish_reason"] == "stop_sequence"
    assert last[0]["details"]["generated_tokens"] == 1


def test_jsonlines_mid_stream_error_is_final_line_with_error():
    outs = [RequestOutput("r1", [tok(1, "A")], "A", False, None, 2, 1),
            RequestOutput("r1", [], "A", True, FinishReason.ERROR, 2, 1, error="engine failed")]
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


# ---- chat / completions ------------------------------------------------------------------

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
    formatter = make_formatter(ctx(chat=True, stream=True, output_formatter="sse"))
    sent = [formatter.format(out) for out in steps(FinishReason.STOP_SEQUENCE)]
    assert formatter.content_type == "text/event-stream"
    assert sent[1] == "" and sent[-1].endswith(SSE_DONE)
    chunks = [c for chunk in sent for c in lines_of(chunk, sse=True)]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-abc" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hi"}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "Hi 我😀"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop"]


def test_chat_stream_usage_chunk_and_logprobs():
    c = ctx(chat=True, stream=True, output_formatter="sse", include_usage=True, logprobs=True)
    chunks = [x for chunk in run(c, steps()) for x in lines_of(chunk, sse=True)]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[0]["choices"][0]["logprobs"]["content"][0]["token"] == "Hi"
    assert chunks[1]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_jsonlines_has_no_done_marker():
    formatter = make_formatter(ctx(chat=True, stream=True, output_formatter="jsonlines"))
    sent = "".join(formatter.format(out) for out in steps())
    assert formatter.content_type == "application/jsonlines" and "[DONE]" not in sent
    assert [json.loads(line)["object"] for line in sent.splitlines()] == ["chat.completion.chunk"] * 2


def test_chat_errors_are_openai_error_objects():
    err = RequestOutput("r1", [], "", True, FinishReason.ERROR, 4, 0, error="boom")
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


# ---- helpers -----------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "stream", "tgi", "expected"), [
    (None, False, False, "json"), (None, True, False, "jsonlines"), (None, True, True, "sse"),
    ("sse", True, False, "sse"), ("jsonlines", False, False, "jsonlines"), ("bogus", True, False, "jsonlines"),
])
def test_resolve_output_formatter_follows_lmi(name, stream, tgi, expected):
    assert resolve_output_formatter(name, stream, tgi) == expected


def test_unknown_formatter_name_is_a_value_error():
    with pytest.raises(ValueError):
        make_formatter(ctx(output_formatter="xml"))


def test_error_body_and_dynamic_batch_shapes():
    assert json.loads(error_body("bad top_p", 400)) == {"error": "bad top_p", "code": 400}
    assert json.loads(dynamic_batch_body(["a", "b"])) == [{"generated_text": "a"}, {"generated_text": "b"}]
    assert dynamic_batch_stream_line(["x", "y"]) == '{"outputs": ["x", "y"]}\n'


def test_best_of_under_tgi_compat_keeps_tgi_token_names():
    from lmi_handler.protocol.formatters import render_best_of

    def run(text: str, log_prob: float) -> list[RequestOutput]:
        token = TokenOutput(id=7, text=text, log_prob=log_prob, special_token=False)
        return [RequestOutput("r", [token], text, True, FinishReason.LENGTH, 3, 1)]

    ctx = ResponseContext(stream=False, details=True, decoder_input_details=False, return_full_text=False,
                          prompt_text="p", tgi_compat=True)
    doc = json.loads(render_best_of(ctx, [run("a", -2.0), run("b", -0.5)], [1, 2]))
    assert isinstance(doc, list) and doc[0]["generated_text"] == "b"
    details = doc[0]["details"]
    assert set(details["tokens"][0]) == {"id", "text", "logprob", "special"}
    other = details["best_of_sequences"][0]
    assert other["generated_text"] == "a" and other["seed"] == 1
    assert set(other["tokens"][0]) == {"id", "text", "logprob", "special"}
