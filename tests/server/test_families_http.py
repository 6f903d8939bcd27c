"""Non-Llama families served end to end: handle() and the HTTP routes on tiny random Qwen3, Gemma 2 and Phi-3
checkpoints (transformers' own classes, window 16, a byte-level BPE tokenizer of the same vocabulary), their
greedy tokens equal to transformers' generate()."""
from __future__ import annotations

import json

import pytest

from lmi_handler import handler
from lmi_handler.djl import OwnInput, PairList, binary_decode
from tests.engine.family_models import build_tiny_family
from tests.engine.helpers import TINY_TOKENIZER_TEXTS, build_tiny_tokenizer, hf_greedy
from tests.server.helpers import fresh_server

PROMPT = " ".join(TINY_TOKENIZER_TEXTS[:3])      # about 40 tokens: past the window of 16
NEW_TOKENS = 8
OPTIONS = {"kv_cache_bytes": str(1 << 22), "dtype": "fp32", "num_threads": "1", "block_size": "4"}


@pytest.fixture(scope="module", params=["qwen3", "gemma2", "phi3"])
def family_dir(request, tmp_path_factory):
    """(model_dir, transformers' greedy ids for PROMPT) of one tiny family checkpoint with a tokenizer."""
    path = tmp_path_factory.mktemp(request.param)
    hf = build_tiny_family(path, request.param)
    tokenizer = build_tiny_tokenizer()
    tokenizer.save_pretrained(path)
    prompt_ids = tokenizer(PROMPT).input_ids
    assert len(prompt_ids) > 16
    want = hf_greedy(hf, prompt_ids, NEW_TOKENS)
    return path, want[:want.index(2) + 1] if 2 in want else want      # generate() stops at eos (id 2) too


def test_the_invocations_and_openai_routes_answer_transformers_greedy_tokens(family_dir):
    path, want = family_dir
    with fresh_server(model_id=str(path), **OPTIONS) as server:
        assert server.service.engine.runner.kernel_backend == "torch"
        for _ in range(2):          # the second request reuses the first's cached prefix blocks
            response = server.post("/invocations", json={"inputs": PROMPT, "parameters": {
                "max_new_tokens": NEW_TOKENS, "do_sample": False, "details": True}})
            assert response.status_code == 200, response.text
            assert [t["id"] for t in response.json()["details"]["tokens"]] == want
        assert server.service.engine.allocator.prefix_cache_stats.num_hit_tokens >= 16
        response = server.post("/v1/completions", json={"model": "any", "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                                                        "temperature": 0, "logprobs": 1})
        assert response.status_code == 200, response.text
        tokens = response.json()["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == len(want)


def test_handle_answers_a_rolling_batch_request_with_transformers_greedy_tokens(family_dir):
    path, want = family_dir
    worker = handler.Handler()
    assert worker.handle(OwnInput({"model_id": str(path), "max_rolling_batch_size": "4", "device_id": "-1",
                                   **OPTIONS})) is None
    body = json.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "do_sample": False},
                       "stream": True}).encode()
    ids, last = [], "false"
    for step in range(3 * NEW_TOKENS):
        content = PairList()
        content.add("batch_000.data", body if step == 0 else b"")
        props = {"batch_size": "1", "batch_000.Content-Type": "application/json", "batch_000.requestId": "r"}
        entry = binary_decode(worker.handle(OwnInput(props, content)).content.value_at(0))
        ids += [json.loads(line)["token"]["id"] for line in entry["data"].splitlines() if line.strip()]
        if (last := entry["last"]) == "true":
            break
    assert last == "true" and ids == want
