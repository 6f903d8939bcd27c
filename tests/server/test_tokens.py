"""Token prompts and token routes on the real server (float32, as transformers runs the demo model): completions
take token ids and lists of prompts, echo with logprobs answers the prompt's log probs (transformers' own, within
float noise), and /tokenize and /detokenize answer vLLM's and TGI's bodies. Through httpx and the `openai` SDK.
"""
from __future__ import annotations

import httpx
import openai
import pytest
import torch

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
# the same float32 weights through two implementations (ours, transformers'): summation order only
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def sdk(fp32_server):
    return openai.OpenAI(base_url=fp32_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(fp32_server):
    with httpx.Client(base_url=fp32_server.url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def transformers_logprobs(model_dir):
    """log_softmax of transformers' own float32 forward over token ids: (len(ids), vocab) per call."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs


def test_a_token_id_prompt_answers_as_its_text_does(sdk, tokenizer):
    ask = dict(model="model", max_tokens=6, temperature=0)
    by_text = sdk.completions.create(prompt=PROMPT, **ask)
    by_ids = sdk.completions.create(prompt=tokenizer.encode(PROMPT), **ask)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(tokenizer.encode(PROMPT))


@pytest.mark.parametrize("form", ["text", "ids"])
def test_a_list_of_prompts_answers_n_choices_each_indexed_prompt_by_prompt(sdk, tokenizer, form):
    prompts = [PROMPT, "One, two, three,"]
    sent = prompts if form == "text" else [tokenizer.encode(p) for p in prompts]
    answer = sdk.completions.create(model="model", prompt=sent, n=2, max_tokens=4, temperature=0)
    alone = [sdk.completions.create(model="model", prompt=p, max_tokens=4, temperature=0).choices[0].text
             for p in prompts]
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert [c.text for c in answer.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert answer.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert answer.usage.completion_tokens == 4 * 4


def test_a_streamed_list_of_prompts_joins_per_index_to_the_whole_answer(sdk, tokenizer):
    ask = dict(model="model", prompt=[tokenizer.encode(PROMPT), tokenizer.encode("Hello")], max_tokens=3,
               temperature=0, echo=True, logprobs=1)
    whole = sdk.completions.create(**ask)
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    for chunk in sdk.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens if choice.logprobs else [])
    assert texts == {c.index: c.text for c in whole.choices}
    assert tokens == {c.index: c.logprobs.tokens for c in whole.choices}
    assert texts[0].startswith(PROMPT) and texts[1].startswith("Hello")


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_answers_the_prompt_tokens_log_probs_as_transformers_computes_them(
        sdk, tokenizer, transformers_logprobs, max_tokens):
    ids = tokenizer.encode(PROMPT)
    choice = sdk.completions.create(model="model", prompt=ids, max_tokens=max_tokens, echo=True, logprobs=2,
                                    temperature=0).choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + max_tokens
    assert "".join(logprobs.tokens[:len(ids)]) == PROMPT and choice.text.startswith(PROMPT)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset[:len(ids)] == [len(tokenizer.decode(ids[:i])) for i in range(len(ids))]
    reference = transformers_logprobs(ids)
    expected = [reference[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert logprobs.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
    for i in range(1, len(ids)):         # the 2 best of the vocabulary, and the prompt's own token
        best = torch.topk(reference[i - 1], 2)
        top = logprobs.top_logprobs[i]
        assert set(top) >= {tokenizer.decode([t]) for t in best.indices.tolist()} | {logprobs.tokens[i]}
        assert len(top) <= 3
    if max_tokens == 0:
        assert choice.text == PROMPT and choice.finish_reason == "length"
    else:
        assert logprobs.text_offset[-1] == len(PROMPT)


def test_max_tokens_zero_without_echo_and_ids_outside_the_vocabulary_are_refused_naming_the_field(sdk, tokenizer):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model="model", prompt=[1, len(tokenizer)], max_tokens=1)
    assert info.value.body["param"] == "prompt" and f"[0, {len(tokenizer) - 1}]" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model="model", prompt=[[1, 2], [-1]], max_tokens=1)
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model="model", prompt="Hi", max_tokens=0)
    assert info.value.body["param"] == "max_tokens" and "echo" in info.value.body["message"]


def test_tokenize_answers_vllms_shape_for_a_prompt_and_for_messages(http, tokenizer, fp32_server):
    answer = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    ids = tokenizer.encode(PROMPT)
    assert answer["tokens"] == ids and answer["count"] == len(ids) and answer["max_model_len"] >= 2048
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    messages = [{"role": "user", "content": "Hi there"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False) and chat["token_strs"] is None
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPT}


def test_tgi_tokenize_answers_each_token_with_its_character_span(http):
    text = "Héllo wörld"
    tokens = http.post("/tokenize", json={"inputs": text, "parameters": {"max_new_tokens": 4}}).json()
    assert "".join(t["text"] for t in tokens) == text
    assert all(text[t["start"]:t["stop"]] == t["text"] for t in tokens)
    assert [t["start"] for t in tokens[1:]] == [t["stop"] for t in tokens[:-1]]


@pytest.mark.parametrize("path, body, field, shape", [
    ("/tokenize", {"prompt": 5}, "prompt", "openai"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt", "openai"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, "messages", "openai"),
    ("/tokenize", {"inputs": ["a"]}, "inputs", "tgi"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens", "openai"),
    ("/detokenize", {"tokens": [-1]}, "tokens", "openai"),
])
def test_bad_token_route_bodies_answer_400_naming_the_field(http, path, body, field, shape):
    response = http.post(path, json=body)
    assert response.status_code == 400
    error = response.json()
    if shape == "openai":
        assert error["error"]["param"] == field and f"`{field}`" in error["error"]["message"]
    else:
        assert error["code"] == 400 and f"`{field}`" in error["error"]
