"""Each generation parameter's effect on the real model, through the running server (LMI schema)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.helpers import generated_text, invoke, stream_lines, streamed_text

pytestmark = pytest.mark.slow

PROMPT = "Write a short poem about the ocean."


def details(client, inputs=PROMPT, **params) -> dict:
    response = invoke(client, inputs, details=True, **params)
    assert response.status_code == 200, response.text
    return response.json()


def test_top_k_1_and_tiny_temperature_equal_greedy(client):
    greedy = generated_text(client, PROMPT, max_new_tokens=16)
    assert generated_text(client, PROMPT, do_sample=True, top_k=1, seed=5, max_new_tokens=16) == greedy
    assert generated_text(client, PROMPT, do_sample=True, temperature=1e-4, seed=9, max_new_tokens=16) == greedy
    for tiny in (1e-6, 1e-40, 1e-300):  # below vLLM's sampling epsilon: greedy, never inf/NaN logits
        assert generated_text(client, PROMPT, temperature=tiny, max_new_tokens=16) == greedy


def test_seeded_request_gives_the_same_tokens_alone_among_unseeded_and_in_a_dynamic_batch(
        rolling_server, dynamic_server, client):
    params = {"do_sample": True, "temperature": 1.0, "top_p": 0.95, "seed": 1234, "max_new_tokens": 24}
    alone = generated_text(client, PROMPT, **params)

    def send(index: int) -> str:
        body_params = params if index == 0 else {**params, "seed": None, "temperature": 0.9}
        with httpx.Client(base_url=rolling_server.url, timeout=300) as http:
            return generated_text(http, PROMPT if index == 0 else f"{PROMPT} #{index}", **body_params)

    with ThreadPoolExecutor(8) as pool:
        crowd = list(pool.map(send, range(8)))
    assert crowd[0] == alone
    with httpx.Client(base_url=dynamic_server.url, timeout=300) as http:
        batch = http.post("/invocations", json={"inputs": ["Tell me a joke.", PROMPT, "Hello!"], "parameters": params})
        assert batch.status_code == 200, batch.text
        assert batch.json()[1]["generated_text"] == alone
    assert generated_text(client, PROMPT, **{**params, "seed": 4321}) != alone
    assert generated_text(client, PROMPT, **{**params, "seed": -7}) == generated_text(client, PROMPT,
                                                                                       **{**params, "seed": -7})


@pytest.mark.parametrize("name, value", [("repetition_penalty", 1.8), ("presence_penalty", 2.0),
                                         ("frequency_penalty", 2.0)])
def test_penalties_change_the_greedy_text(client, name, value):
    prompt = "Repeat after me: apple apple apple apple apple"
    plain = generated_text(client, prompt, max_new_tokens=24)
    assert generated_text(client, prompt, max_new_tokens=24, **{name: value}) != plain


@pytest.mark.parametrize("params", [{"min_p": 0.05}, {"typical_p": 0.5}, {"top_p": 0.5}, {"top_k": 5}])
def test_filters_alone_turn_sampling_on_and_stay_reproducible_with_a_seed(client, params):
    first = generated_text(client, PROMPT, seed=11, max_new_tokens=12, **params)
    assert first == generated_text(client, PROMPT, seed=11, max_new_tokens=12, **params)


def test_return_full_text_prepends_the_prompt(client):
    text = generated_text(client, "The sky is", max_new_tokens=5)
    assert generated_text(client, "The sky is", max_new_tokens=5, return_full_text=True) == "The sky is" + text


def test_stop_token_ids_end_generation_with_stop_sequence(client):
    prompt = "The capital of France is"
    tokens = details(client, prompt, max_new_tokens=10)["details"]["tokens"]
    assert len(tokens) == 10
    target = tokens[3]["id"]
    stopped = details(client, prompt, max_new_tokens=10, stop_token_ids=[target])["details"]
    assert stopped["finish_reason"] == "stop_sequence"
    first_hit = next(i for i, t in enumerate(tokens) if t["id"] == target)
    assert stopped["generated_tokens"] == first_hit + 1


def test_stop_token_ids_outside_the_vocabulary_get_a_400(client):
    response = invoke(client, PROMPT, stop_token_ids=[49152])
    assert response.status_code == 400 and "stop_token_ids" in response.json()["error"]


def test_ignore_eos_runs_to_max_new_tokens(client):
    chat = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    natural = details(client, chat, max_new_tokens=60)["details"]
    assert natural["finish_reason"] == "eos_token" and natural["tokens"][-1]["special_token"] is True
    forced = details(client, chat, max_new_tokens=natural["generated_tokens"] + 5, ignore_eos=True)["details"]
    assert forced["finish_reason"] == "length"
    assert forced["generated_tokens"] == natural["generated_tokens"] + 5


def test_skip_special_tokens_false_renders_the_eos_marker(client):
    chat = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    assert "<|im_end|>" not in generated_text(client, chat, max_new_tokens=60)
    assert generated_text(client, chat, max_new_tokens=60, skip_special_tokens=False).endswith("<|im_end|>")


def test_truncate_keeps_the_last_prompt_tokens(client, tokenizer):
    long_prompt = "zebra " * 50 + "The capital of France is"
    ids = tokenizer.encode(long_prompt)
    cut = details(client, long_prompt, max_new_tokens=4, truncate=6, decoder_input_details=True)
    assert [t["id"] for t in cut["details"]["prefill"]] == ids[-6:]
    full = details(client, long_prompt, max_new_tokens=4, decoder_input_details=True)
    assert len(full["details"]["prefill"]) == len(ids) > 6


def test_decoder_input_details_returns_prompt_tokens_with_log_probs(client):
    body = details(client, "One, two, three,", max_new_tokens=3, decoder_input_details=True)
    prefill = body["details"]["prefill"]
    assert prefill[0]["log_prob"] is None
    assert all(t["log_prob"] <= 0 for t in prefill[1:])
    assert "".join(t["text"] for t in prefill) == "One, two, three,"


def test_top_n_tokens_returns_alternatives_led_by_the_greedy_choice(client):
    body = details(client, "The capital of France is", max_new_tokens=4, top_n_tokens=3)
    tops = body["details"]["top_tokens"]
    assert len(tops) == 4
    for token, alternatives in zip(body["details"]["tokens"], tops):
        assert len(alternatives) == 3
        assert alternatives[0]["id"] == token["id"]
        assert alternatives[0]["log_prob"] >= alternatives[1]["log_prob"] >= alternatives[2]["log_prob"]


def test_log_prob_is_the_chosen_tokens_log_probability(client):
    tokens = details(client, max_new_tokens=6)["details"]["tokens"]
    assert all(-30 < t["log_prob"] <= 0 for t in tokens)


@pytest.mark.parametrize("params, field", [({"num_beams": 2}, "num_beams"), ({"n": 2}, "n"),
                                           ({"best_of": 2}, "best_of")])
def test_beam_search_and_greedy_multi_sequence_requests_get_a_clear_400(client, params, field):
    response = invoke(client, PROMPT, **params)
    assert response.status_code == 400 and field in response.json()["error"]


def test_best_of_returns_the_most_likely_sequence_and_the_others_in_details(client):
    params = {"do_sample": True, "temperature": 1.0, "seed": 77, "max_new_tokens": 12, "details": True}
    body = details(client, "The capital of France is", best_of=3, **{k: v for k, v in params.items() if k != "details"})
    others = body["details"]["best_of_sequences"]
    assert len(others) == 2
    best_score = sum(t["log_prob"] for t in body["details"]["tokens"])
    seeds = set()
    for other in others:
        assert sum(t["log_prob"] for t in other["tokens"]) <= best_score
        assert other["generated_tokens"] == len(other["tokens"])
        seeds.add(other["seed"])
    assert len(seeds) == 2 and not seeds & {None}
    # each member is an ordinary seeded request: seed 77 + j gives the same text alone
    member_texts = {body["generated_text"]} | {o["generated_text"] for o in others}
    solo = {generated_text(client, "The capital of France is", **{**params, "seed": 77 + j, "details": False})
            for j in range(3)}
    assert member_texts == solo
    streamed = client.post("/invocations", json={"inputs": "Hi", "stream": True,
                                                 "parameters": {"best_of": 2, "do_sample": True}})
    assert streamed.status_code == 400 and "best_of" in streamed.json()["error"]


def test_chat_messages_on_invocations_answer_in_the_chat_completion_shape(client):
    response = client.post("/invocations", json={"messages": [{"role": "user", "content": "Say hi."}],
                                                 "max_tokens": 12, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant" and body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] <= 12


def test_streamed_texts_concatenate_to_generated_text_for_every_sampled_stream(client):
    for seed in range(3):
        lines = stream_lines(client, {"inputs": "Emoji and CJK: 😀 你好", "parameters": {
            "do_sample": True, "temperature": 1.2, "seed": seed, "max_new_tokens": 20}})
        assert streamed_text(lines) == lines[-1]["generated_text"]


def test_unknown_parameters_are_ignored_with_one_warning(client, rolling_server):
    response = invoke(client, "Hello", max_new_tokens=2, frobnicate_7x=True)
    assert response.status_code == 200
    warnings = [line for line in rolling_server.log_path.read_text().splitlines() if "frobnicate_7x" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0]


def test_openai_completions_route_answers_text_completion(client):
    response = client.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 5, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] <= 5
    assert body["choices"][0]["text"] == generated_text(client, "The sky is", max_new_tokens=5)
