"""OpenAI n > 1 and best_of: choices by index, usage with the prompt once, streamed chunks per choice,
the usage chunk only when asked, and logprobs in OpenAI's shapes (no model needed)."""
from __future__ import annotations

from lmi_handler.engine.sequence import FinishReason, RequestOutput, SamplingParams, TokenOutput
from lmi_handler.protocol.encoder import DONE, SSE_DONE, Wire, encode
from lmi_handler.protocol.formatters import StreamAnswer, response_body
from lmi_handler.protocol.openai import completion_logprobs
from lmi_handler.protocol.plan import Kind
from lmi_handler.protocol.sequences import Combine, SequencePlan, members
from tests.protocol.helpers import lines_of, make_plan, steps, tok

SAMPLED = SamplingParams(greedy=False, seed=10)


def one_token_run(request_id: str, text: str, log_prob: float, reason=FinishReason.EOS_TOKEN) -> list[RequestOutput]:
    token = TokenOutput(id=5, text=text, log_prob=log_prob, special_token=False)
    return [RequestOutput(request_id, [token], text, True, reason, 4, 1)]


def choices_plan(kind: Kind, count: int, num_choices: int, wire: Wire = Wire.JSON, **fields):
    return make_plan(kind, wire, params=SAMPLED, sequences=SequencePlan(count, Combine.CHOICES, num_choices),
                     **fields)


def test_n_members_take_seeds_seed_plus_one_and_distinct_ids():
    plan = choices_plan(Kind.OPENAI_CHAT, 3, 3)
    (ms,) = plan.members()
    assert [m.params.seed for m in ms] == [10, 11, 12] and [m.request_id for m in ms] == ["abc#0", "abc#1", "abc#2"]


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


def stream_events(plan, outputs_by_step: list[dict]) -> tuple[list, StreamAnswer]:
    (ms,) = plan.members()
    stream = StreamAnswer(plan, ms)
    return [stream.events(step) for step in outputs_by_step], stream


def interleaved(first: list[RequestOutput], second: list[RequestOutput]) -> list[dict]:
    """Step k holds the k-th output of each member that still runs."""
    return [{o.request_id: o for o in pair if o is not None}
            for pair in zip(first + [None] * (len(second) - len(first)), second + [None] * (len(first) - len(second)))]


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
