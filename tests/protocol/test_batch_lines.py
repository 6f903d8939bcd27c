"""protocol/batch_lines.py: the batch JSONL line rules of DESIGN §4, one rule per test (no model needed)."""
from __future__ import annotations

import json
import logging

import pytest

from lmi_handler.protocol.batch_lines import (
    DEFAULTS_WARNING,
    BatchDefaults,
    BatchLine,
    LineError,
    check_lines,
    read_batch,
)
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.openai import ChatCompletionRequest, CompletionRequest

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def line(custom_id: str, body: dict, url: str = CHAT, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}], **fields}


def checked(text: str, **defaults) -> BatchLine | LineError:
    return next(check_lines([text], BatchDefaults.parse(defaults)))


def params_of(item: BatchLine):
    request = (ChatCompletionRequest if item.url == CHAT else CompletionRequest).parse(item.body)
    return request.to_generation_parameters()


def test_max_completion_tokens_wins_over_max_tokens_and_the_batch_length():
    item = checked(line("a", chat(max_completion_tokens=5, max_tokens=50)), max_decoding_length=7)
    assert params_of(item).max_new_tokens == 5


def test_max_tokens_wins_over_the_batch_length():
    item = checked(line("a", chat(max_tokens=4)), max_decoding_length=7)
    assert params_of(item).max_new_tokens == 4


def test_the_batch_length_serves_lines_without_one_on_both_routes():
    assert params_of(checked(line("a", chat()), max_decoding_length=7)).max_new_tokens == 7
    item = checked(line("p", {"prompt": "1, 2,"}, COMPLETIONS), max_decoding_length=7)
    assert params_of(item).max_new_tokens == 7   # not the completions route's default of 16


def test_max_completion_tokens_is_honoured_on_a_completions_line():
    item = checked(line("p", {"prompt": "1, 2,", "max_completion_tokens": 6, "max_tokens": 30}, COMPLETIONS))
    assert params_of(item).max_new_tokens == 6
    assert "max_completion_tokens" not in item.body   # the completions route's only length field is max_tokens


def test_a_batch_where_some_lines_have_no_length_is_rejected_naming_them():
    lines = [line("has", chat(max_tokens=3)), line("none-1", chat()), line("p", {"prompt": "x"}, COMPLETIONS)]
    plan = read_batch(lines, BatchDefaults())
    assert [b.custom_id for b in plan.missing_length] == ["none-1", "p"]
    assert "line 2 (none-1)" in plan.rejection() and "line 3 (p)" in plan.rejection()
    assert read_batch(lines, BatchDefaults(max_decoding_length=4)).rejection() is None


def test_temperature_absent_everywhere_is_greedy():
    item = checked(line("a", chat(max_tokens=3, top_p=0.5)))
    assert item.body["temperature"] == 0.0
    assert params_of(item).is_greedy()


def test_the_batch_temperature_serves_lines_without_one():
    params = params_of(checked(line("a", chat(max_tokens=3)), temperature=1.3))
    assert not params.is_greedy() and params.temperature == 1.3


def test_a_line_temperature_wins_over_the_batch_temperature():
    params = params_of(checked(line("a", chat(max_tokens=3, temperature=0)), temperature=1.3))
    assert params.is_greedy()
    params = params_of(checked(line("b", chat(max_tokens=3, temperature=0.5)), temperature=1.3))
    assert params.temperature == 0.5


def test_top_p_and_top_k_come_from_the_line_then_the_batch_then_off():
    assert params_of(checked(line("a", chat(max_tokens=3, temperature=1.0)))).top_p == 1.0
    assert params_of(checked(line("a", chat(max_tokens=3, temperature=1.0)))).top_k == 0
    both = params_of(checked(line("a", chat(max_tokens=3, temperature=1.0)), top_p=0.8, top_k=5))
    assert (both.top_p, both.top_k) == (0.8, 5)
    own = params_of(checked(line("a", chat(max_tokens=3, temperature=1.0, top_p=0.5, top_k=1)), top_p=0.8, top_k=5))
    assert (own.top_p, own.top_k) == (0.5, 1)
    assert params_of(checked(line("a", chat(max_tokens=3, temperature=1.0, top_k=0)), top_k=5)).top_k == 0


def test_batch_defaults_log_the_priority_warning_once(caplog):
    defaults = BatchDefaults.parse({"temperature": 1.3, "max_decoding_length": 7})
    with caplog.at_level(logging.WARNING, logger="lmi_handler.protocol.batch_lines"):
        defaults.log_once()
        BatchDefaults.parse({"max_decoding_length": 7}).log_once()   # no sampling default: no warning
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert messages[0].startswith(DEFAULTS_WARNING) and "temperature=1.3" in messages[0]


@pytest.mark.parametrize("name, value", [("temperature", -1.0), ("top_p", 1.5), ("top_k", -2),
                                         ("max_decoding_length", 0), ("temperature", "hot")])
def test_a_bad_batch_default_is_refused_naming_it(name, value):
    with pytest.raises(RequestValidationError) as err:
        BatchDefaults.parse({name: value})
    assert err.value.field == name and name in err.value.message


@pytest.mark.parametrize("text, code, param, custom_id", [
    ('{"custom_id": "x", "method": "POST", "url": ', "invalid_json", "line", None),
    ('[1, 2]', "invalid_json", "line", None),
    (json.dumps({"method": "POST", "url": CHAT, "body": chat(max_tokens=2)}), "missing_custom_id", "custom_id", None),
    (line("m", chat(max_tokens=2), method="GET"), "invalid_method", "method", "m"),
    (line("u", {"input": "Hi"}, url="/v1/embeddings"), "invalid_url", "url", "u"),
    (json.dumps({"custom_id": "b", "method": "POST", "url": CHAT}), "missing_body", "body", "b"),
    (line("s", chat(max_tokens=2, stream=True)), "invalid_stream", "body.stream", "s"),
    (line("t", chat(max_tokens=2, temperature=-1.0)), "invalid_parameter", "temperature", "t"),
    (line("p", chat(max_tokens=2, top_p=1.5)), "invalid_parameter", "top_p", "p"),
    (line("k", chat(max_tokens=0)), "invalid_parameter", "max_tokens", "k"),
    (line("c", chat(max_completion_tokens=2.5)), "invalid_parameter", "max_completion_tokens", "c"),
    (line("n", {"messages": []}), "invalid_parameter", "messages", "n"),
    (line("q", {"max_tokens": 3}, COMPLETIONS), "invalid_parameter", "prompt", "q"),
])
def test_each_kind_of_bad_line_gets_its_own_error_and_the_next_line_still_runs(text, code, param, custom_id):
    good = line("good", chat(max_tokens=2))
    first, second = list(check_lines([text, good], BatchDefaults()))
    assert isinstance(first, LineError)
    assert (first.code, first.param, first.custom_id, first.line) == (code, param, custom_id, 1)
    assert first.message.startswith("line 1:")
    assert first.status_code == (400 if code == "invalid_parameter" else None)
    assert isinstance(second, BatchLine) and second.custom_id == "good"


def test_a_stream_error_mentions_streaming_and_a_url_error_names_the_url():
    assert "stream" in checked(line("s", chat(max_tokens=2, stream=True))).message
    assert "/v1/embeddings" in checked(line("u", {"input": "x"}, url="/v1/embeddings")).message


def test_a_duplicate_custom_id_fails_the_later_line_only():
    items = list(check_lines([line("a", chat(max_tokens=2)), line("a", chat(max_tokens=3))], BatchDefaults()))
    assert isinstance(items[0], BatchLine)
    assert isinstance(items[1], LineError) and items[1].code == "duplicate_custom_id" and "line 1" in items[1].message


def test_blank_lines_are_skipped_but_still_counted():
    items = list(check_lines(["", line("a", chat(max_tokens=2)), "   "], BatchDefaults()))
    assert [(i.line, i.custom_id) for i in items] == [(2, "a")]


def test_a_job_endpoint_fails_lines_of_the_other_route():
    lines = [line("c", chat(max_tokens=2)), line("p", {"prompt": "x", "max_tokens": 2}, COMPLETIONS)]
    plan = read_batch(lines, BatchDefaults(), endpoint=CHAT)
    assert plan.num_good == 1 and plan.errors[0].custom_id == "p" and plan.errors[0].code == "invalid_url"
