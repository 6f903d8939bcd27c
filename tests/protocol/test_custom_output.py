"""protocol/custom_output.py: a model.py output formatter fed hand-made engine outputs step by step."""
from __future__ import annotations

from typing import Dict

import pytest

from lmi_handler.engine.sequence import FinishReason, RequestOutput, TokenOutput
from lmi_handler.protocol.custom_output import CustomAnswer, CustomOutputRule, FormatterError, takes_dict
from lmi_handler.request_io import TextGenerationOutput


def _out(tokens: list[tuple[int, str]], finished: bool = False, reason: FinishReason | None = None) -> RequestOutput:
    new = [TokenOutput(i, text, -0.5, False) for i, text in tokens]
    return RequestOutput("r", new, "", finished, reason if finished else None)


def _flags(request_output) -> str:
    token, first, last = request_output.sequences[request_output.best_sequence_index].get_next_token()
    if token is None:
        return f"[none:{request_output.finished}]"
    return f"{token.text}{'^' if first else ''}{'$' if last else ''}"


def _answer(formatter, stream: bool) -> CustomAnswer:
    return CustomAnswer(CustomOutputRule(formatter, {"max_new_tokens": 3}), "r", "Hi", (1, 2), stream)


def test_streamed_each_step_sends_one_call_per_new_token_with_first_and_last_marked():
    answer = _answer(_flags, stream=True)
    assert answer.step(None) == ("", False)                      # not in this step's outputs
    assert answer.step(_out([(5, "a")])) == ("a^", False)
    assert answer.step(_out([])) == ("", False)                  # text held back: nothing to say
    assert answer.step(_out([(6, "b"), (7, "c")], True, FinishReason.LENGTH)) == ("bc$", True)
    sequence = answer.output.sequences[0]
    assert sequence.finish_reason == "length" and answer.output.finished
    assert [t.id for t in sequence.tokens] == [5, 6, 7] and sequence.cumulative_log_prob == -1.5
    assert answer.output.input.input_text == "Hi" and answer.output.input.parameters == {"max_new_tokens": 3}


def test_not_streamed_the_texts_go_out_joined_once_the_request_finished():
    answer = _answer(_flags, stream=False)
    assert answer.step(_out([(5, "a")])) == ("", False)
    assert answer.step(_out([(6, "b")], True, FinishReason.EOS_TOKEN)) == ("a^b$", True)


def test_a_finished_step_without_tokens_still_calls_the_formatter_once():
    answer = _answer(_flags, stream=True)
    answer.step(_out([(5, "a")]))
    assert answer.step(_out([], True, FinishReason.STOP_SEQUENCE)) == ("[none:True]", True)


def test_a_formatter_that_raises_or_returns_no_text_is_a_formatter_error_naming_it():
    def broken(request_output):
        raise KeyError("sequences")

    with pytest.raises(FormatterError, match="the output formatter broken of model.py failed: KeyError: 'sequences'"):
        _answer(broken, stream=True).step(_out([(5, "a")]))

    def numbers(request_output):
        return 42

    with pytest.raises(FormatterError, match="returned int, not a str") as caught:
        _answer(numbers, stream=True).step(_out([(5, "a")]))
    assert caught.value.status_code == 500


def test_the_two_forms_are_told_apart_by_the_first_parameters_annotation():
    def vllm_form(response_data: dict) -> dict: ...
    def typed_dict(response_data: Dict[str, int]): ...
    def lmi_form(request_output: TextGenerationOutput) -> str: ...
    def bare(request_output): ...
    assert takes_dict(vllm_form) and takes_dict(typed_dict)
    assert not takes_dict(lmi_form) and not takes_dict(bare)


def test_the_dict_form_reshapes_answer_objects_and_lists_and_passes_markers():
    rule = CustomOutputRule(lambda response_data: {**response_data, "seen": True})
    marker = object()
    assert rule.reshape({"generated_text": "x"}) == {"generated_text": "x", "seen": True}
    assert rule.reshape([{"a": 1}]) == [{"a": 1, "seen": True}]
    assert rule.reshape(marker) is marker
    with pytest.raises(FormatterError, match="returned list, not a dict"):
        CustomOutputRule(lambda response_data: [response_data]).reshape({})
