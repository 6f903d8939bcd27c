"""Service.plan on the real demo model, no server: one validated plan per request, errors named before inference."""
from __future__ import annotations

import json

import pytest

from lmi_handler.config import Settings
from lmi_handler.protocol.dialects import ROUTE_CHAT, ROUTE_COMPLETIONS, Dialect
from lmi_handler.protocol.encoder import Wire
from lmi_handler.protocol.errors import RequestValidationError
from lmi_handler.protocol.plan import Kind, Shape
from lmi_handler.protocol.sequences import Combine
from lmi_handler.service import Service

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def service(model_dir) -> Service:
    return Service(Settings.from_properties({"model_id": str(model_dir), "max_rolling_batch_size": "4",
                                             "tgi_compat": "true"}))


def test_an_lmi_text_request_becomes_one_tokenized_prompt_with_its_answer_rules(service, tokenizer):
    plan = service.plan(json.dumps({"inputs": "The sky is", "parameters": {"max_new_tokens": 5}}).encode(),
                        request_id="r1")
    assert (plan.kind, plan.shape, plan.wire, plan.stream) == (Kind.LMI_TEXT, Shape.LMI, Wire.JSON, False)
    assert plan.tgi_names and plan.details            # tgi_compat: TGI names, details on by default
    (prompt,) = plan.prompts
    assert prompt.request_id == "r1" and list(prompt.token_ids) == tokenizer.encode("The sky is")
    assert prompt.params.max_new_tokens == 5 and plan.content_type == "application/json"


def test_a_streamed_request_under_tgi_compat_is_sse(service):
    plan = service.plan(b'{"inputs": "Hi", "stream": true}')
    assert plan.stream and plan.wire is Wire.SSE and plan.content_type == "text/event-stream"


def test_openai_routes_take_openai_kinds_and_sse_streams(service):
    chat = service.plan(b'{"messages": [{"role": "user", "content": "Hi"}], "stream": true}', route=ROUTE_CHAT)
    assert (chat.kind, chat.shape, chat.wire) == (Kind.OPENAI_CHAT, Shape.CHAT, Wire.SSE) and chat.dialect is Dialect.OPENAI
    assert not chat.tgi_names
    completion = service.plan(b'{"prompt": "Hi", "echo": true}', route=ROUTE_COMPLETIONS)
    assert completion.kind is Kind.OPENAI_COMPLETION and completion.return_full_text


def test_best_of_plans_several_sequences_and_refuses_streaming(service):
    body = {"inputs": "Hi", "parameters": {"best_of": 3, "do_sample": True}}
    assert service.plan(json.dumps(body)).sequences.combine is Combine.BEST_OF
    with pytest.raises(RequestValidationError) as info:
        service.plan(json.dumps({**body, "stream": True}))
    assert info.value.field == "best_of"


def test_with_strict_model_name_a_model_the_server_does_not_serve_is_a_404_on_openai_routes(model_dir):
    plain = Service(Settings.from_properties({"model_id": str(model_dir), "max_rolling_batch_size": "4",
                                              "strict_model_name": "true"}))
    with pytest.raises(RequestValidationError) as info:
        plain.plan(b'{"model": "gpt-4", "prompt": "Hi"}', route=ROUTE_COMPLETIONS)
    assert info.value.status_code == 404 and info.value.field == "model"
    assert plain.plan(json.dumps({"model": plain.model_name, "prompt": "Hi"}).encode(), route=ROUTE_COMPLETIONS)
    line = plain.plan_openai_body({"model": "gpt-4", "prompt": "Hi", "max_tokens": 2}, ROUTE_COMPLETIONS, "line-1",
                                  greedy_when_unset=True)       # batch lines take any model, strict or not
    assert line.model_name == plain.model_name


def test_by_default_any_model_name_is_answered_by_the_loaded_model_on_every_openai_kind(service):
    """The served-model rule (Service.answering_model): TGI's and LMI's, so InferenceClient's "tgi" works."""
    for name in ("tgi", "m", "gpt-4o-mini", service.model_name):
        body = {"model": name, "prompt": "Hi", "max_tokens": 2}
        live = service.plan(json.dumps(body).encode(), route=ROUTE_COMPLETIONS)
        line = service.plan_openai_body(body, ROUTE_COMPLETIONS, "line-1", greedy_when_unset=True)
        assert live.model_name == line.model_name == service.model_name


def test_a_request_without_model_is_answered_with_the_served_name_not_null(service):
    """OpenAI's `model` is optional in a request but a string in every answer (vLLM answers its served name)."""
    chat = service.plan(b'{"messages": [{"role": "user", "content": "Hi"}]}', route=ROUTE_CHAT)
    completion = service.plan(b'{"prompt": [504, 3575], "max_tokens": 1}', route=ROUTE_COMPLETIONS)
    lmi_chat = service.plan(b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}')
    line = service.plan_openai_body({"prompt": "Hi", "max_tokens": 2}, ROUTE_COMPLETIONS, "line-1",
                                    greedy_when_unset=True)
    assert chat.model_name == completion.model_name == lmi_chat.model_name == line.model_name == service.model_name


def test_under_tgi_compat_any_model_name_is_the_model_as_tgi_clients_send_tgi_or_dummy(service):
    for name in ("tgi", "dummy", "gpt-4"):
        plan = service.plan(json.dumps({"model": name, "prompt": "Hi"}).encode(), route=ROUTE_COMPLETIONS)
        assert plan.kind is Kind.OPENAI_COMPLETION


def test_a_batch_line_body_plans_the_openai_object_of_its_url_and_never_streams(service):
    plan = service.plan_openai_body({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                     "stream": True}, ROUTE_CHAT, "line-1", greedy_when_unset=True)
    assert (plan.kind, plan.shape, plan.stream, plan.wire) == (Kind.BATCH_LINE, Shape.CHAT, False, Wire.JSON)
    assert plan.prompts[0].params.greedy and plan.prompts[0].params.max_new_tokens == 4


def test_an_over_long_prompt_is_refused_naming_the_token_counts(service):
    with pytest.raises(RequestValidationError) as info:
        service.plan(json.dumps({"inputs": "word " * 9000}))
    assert info.value.field == "inputs" and "exceeds" in info.value.message


@pytest.mark.parametrize("route, body, field, names", [
    (ROUTE_CHAT, {"messages": [{"role": "user", "content": "word " * 9000}]}, "messages", ("messages",)),
    (ROUTE_CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 9000},
     "max_completion_tokens", ("messages", "max_completion_tokens")),
    (ROUTE_COMPLETIONS, {"prompt": "Hi", "max_tokens": 9000}, "max_tokens", ("prompt", "max_tokens")),
    (ROUTE_COMPLETIONS, {"prompt": "word " * 9000, "max_tokens": 4}, "prompt", ("prompt",)),
])
def test_an_openai_request_too_long_for_the_context_names_its_own_fields(service, route, body, field, names):
    with pytest.raises(RequestValidationError) as info:
        service.plan(json.dumps(body).encode(), route=route)
    message = info.value.message
    assert info.value.status_code == 400 and info.value.field == field
    assert "maximum context length is 8192 tokens" in message and all(name in message for name in names)
    assert "inputs" not in message and "max_new_tokens" not in message and "truncate" not in message


def test_a_batch_line_too_long_for_the_context_names_the_openai_fields(service):
    with pytest.raises(RequestValidationError) as info:
        service.plan_openai_body({"prompt": "Hi", "max_tokens": 9000}, ROUTE_COMPLETIONS, "line-1",
                                 greedy_when_unset=True)
    assert info.value.field == "max_tokens" and "maximum context length" in info.value.message


def test_an_image_part_sent_to_a_text_only_model_is_a_400_naming_the_model_and_markdown_stays_text(service, tokenizer):
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look: "}, part]}]}
    with pytest.raises(RequestValidationError) as info:
        service.plan(json.dumps(body), route=ROUTE_CHAT)
    err = info.value
    assert err.status_code == 400 and err.field == "messages[0].content[1]"
    assert f"the model {service.model_name!r} (model_type llama) takes text only" in err.message
    text = "![](https://example.com/a.png) What is it?"          # TGI leaves markdown as text for a text model
    plan = service.plan(json.dumps({"inputs": text}))
    assert list(plan.prompts[0].token_ids) == tokenizer.encode(text) and plan.prompts[0].params.multimodal is None
