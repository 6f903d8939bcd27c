"""Clients we did not write, run unchanged against real servers: the TGI client `text-generation` (in its own
venv, .venv-tgi: it pins huggingface-hub<1.0), huggingface_hub.InferenceClient and the `openai` package."""
from __future__ import annotations

import json
import subprocess

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient

from tests.helpers import REPO
from tests.server.helpers import generated_text

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
TGI_PYTHON = REPO / ".venv-tgi" / "bin" / "python"


def solo_text(server, prompt: str = PROMPT, max_new_tokens: int = 8) -> str:
    with httpx.Client(base_url=server.url, timeout=300) as http:
        return generated_text(http, prompt, max_new_tokens=max_new_tokens, do_sample=False)


def generate_text(server, prompt: str = PROMPT, max_new_tokens: int = 8) -> str:
    """TGI /generate greedy (its answer is not wrapped in a list under tgi_compat)."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}
    return httpx.post(server.url + "/generate", json=body, timeout=300).json()["generated_text"]


def test_the_tgi_client_generates_streams_and_chats_unchanged(tgi_server):
    if not TGI_PYTHON.is_file():
        pytest.fail("the TGI client's venv is missing: run `make test` (it creates .venv-tgi)")
    script = REPO / "tests" / "server" / "clients" / "tgi_client.py"
    run = subprocess.run([str(TGI_PYTHON), str(script), tgi_server.url, PROMPT, "8"], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout)
    assert got["generated_text"] == generate_text(tgi_server)
    assert got["generated_text"] == "".join(got["token_texts"]) and got["generated_tokens"] == len(got["token_texts"])
    assert got["finish_reason"] in ("length", "eos_token") and got["prefill_length"] > 0
    assert "".join(got["stream_texts"]) == got["stream_final"] == got["generated_text"]
    assert got["stream_details"] == got["finish_reason"]
    assert "max_new_tokens" in got["bad_request"]
    assert got["chat"] and got["chat_stream"] == got["chat"]


def test_inference_client_text_generation_without_tgi_compat(rolling_server):
    expected = solo_text(rolling_server)
    client = InferenceClient(model=rolling_server.url, timeout=300)
    assert client.text_generation(PROMPT, max_new_tokens=8) == expected
    detailed = client.text_generation(PROMPT, max_new_tokens=8, details=True, decoder_input_details=True)
    assert detailed.generated_text == expected
    assert detailed.details.generated_tokens == len(detailed.details.tokens) <= 8
    assert "".join(t.text for t in detailed.details.tokens) == expected and detailed.details.prefill
    assert "".join(client.text_generation(PROMPT, max_new_tokens=8, stream=True)) == expected
    events = list(client.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True))
    assert [e.index for e in events] == list(range(1, len(events) + 1))
    assert events[-1].generated_text == expected and events[-1].details.input_length > 0
    assert all(e.generated_text is None for e in events[:-1])


def test_inference_client_chat_completion_under_tgi_compat(tgi_server):
    client = InferenceClient(base_url=tgi_server.url, timeout=300)     # sends model="dummy", as TGI accepts
    messages = [{"role": "user", "content": "Name three colors."}]
    reply = client.chat_completion(messages, max_tokens=12, temperature=0)
    content = reply.choices[0].message.content
    assert content and reply.choices[0].finish_reason in ("stop", "length")
    assert reply.system_fingerprint and reply.usage.completion_tokens <= 12
    chunks = list(client.chat_completion(messages, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content


def test_the_openai_package_chats_and_completes_and_sees_our_errors(rolling_server):
    sdk = openai.OpenAI(base_url=rolling_server.url + "/v1", api_key="unused", max_retries=0)
    reply = sdk.chat.completions.create(model="model", messages=[{"role": "user", "content": "Say hi."}],
                                        temperature=0, max_tokens=8)
    assert reply.choices[0].message.content and reply.system_fingerprint
    stream = sdk.completions.create(model="model", prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == solo_text(rolling_server)
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.chat.completions.create(model="tgi", messages=[{"role": "user", "content": "Hi"}])
    assert "tgi" in missing.value.body["message"]
    with pytest.raises(openai.NotFoundError) as no_route:
        sdk.embeddings.create(model="model", input="hi")
    assert no_route.value.body["message"].startswith("no route POST /v1/embeddings")
