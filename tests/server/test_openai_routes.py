"""The OpenAI routes driven by the official `openai` client (base_url pointed at our server)."""
from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sdk(rolling_server):
    return openai.OpenAI(base_url=rolling_server.url + "/v1", api_key="unused", max_retries=0)


def test_chat_completion_with_the_sdk(sdk):
    reply = sdk.chat.completions.create(model="model", messages=[{"role": "user", "content": "Say hi."}],
                                        temperature=0, max_tokens=16)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 16 and reply.usage.prompt_tokens > 0


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
