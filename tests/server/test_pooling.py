"""The pooling routes on in-process apps of tiny BERT checkpoints (an embedder, a cross-encoder, a
classifier), their answers checked against transformers' own models, and the openai client unchanged."""
from __future__ import annotations

import httpx
import pytest
import torch

from tests.engine.pooling_models import build_encoder, write_sentence_transformers, write_wordpiece_tokenizer
from tests.server.helpers import fresh_server

pytestmark = pytest.mark.slow       # in-process servers (three tiny models)
TEXTS = ["what is deep learning?", "cats sleep", "paris is the capital of france"]


def _server(tmp_path_factory, name: str, **build):
    path = tmp_path_factory.mktemp(name)
    hf = build_encoder(path, "bert", **build)
    write_wordpiece_tokenizer(path)
    return path, hf


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path, hf = _server(tmp_path_factory, "embedder")
    write_sentence_transformers(path, "mean", normalize=True, prompts={"query": "query: "})
    with fresh_server(model_id=str(path), task="text-embedding", served_model_name="tiny-embed") as server:
        yield server, hf, server.app.state.pooling.tokenizer


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path, hf = _server(tmp_path_factory, "reranker", num_labels=1)
    with fresh_server(model_id=str(path), task="auto") as server:
        yield server, hf, server.app.state.pooling.tokenizer


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path, hf = _server(tmp_path_factory, "classifier", num_labels=3)
    with fresh_server(model_id=str(path), task="classification", api_key="sesame") as server:
        server.client.headers["Authorization"] = "Bearer sesame"
        yield server, hf, server.app.state.pooling.tokenizer


def _expected_vector(hf, tokenizer, text: str, normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
    vector = hidden.mean(0)
    return vector / vector.norm() if normalize else vector


def _expected_logits(hf, tokenizer, first: str, second: str | None = None) -> torch.Tensor:
    with torch.no_grad():
        return hf(**tokenizer(first, second, return_tensors="pt")).logits[0]


def test_openai_client_embeddings_create_unchanged_float_and_base64_with_dimensions(embedder):
    from openai import AsyncOpenAI

    server, hf, tok = embedder
    client = AsyncOpenAI(api_key="none", base_url="http://app/v1",
                         http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app),
                                                       base_url="http://app"))
    answer = server.loop.run_until_complete(client.embeddings.create(input=TEXTS, model="tiny-embed"))
    assert [d.index for d in answer.data] == [0, 1, 2] and answer.model == "tiny-embed"
    assert answer.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in TEXTS)
    for text, item in zip(TEXTS, answer.data):            # the client asks for base64 and decodes it
        torch.testing.assert_close(torch.tensor(item.embedding), _expected_vector(hf, tok, text), atol=1e-5, rtol=0)
    short = server.loop.run_until_complete(client.embeddings.create(input="cats sleep", model="tiny-embed",
                                                                    dimensions=8, encoding_format="float"))
    vector = torch.tensor(short.data[0].embedding)
    assert vector.shape == (8,) and vector.norm().item() == pytest.approx(1.0, abs=1e-5)
    ids = tok("cats sleep")["input_ids"]
    by_ids = server.post("/v1/embeddings", json={"input": [ids, ids[:3]]}).json()
    assert by_ids["data"][0]["embedding"] == pytest.approx(answer.data[1].embedding, abs=1e-6)


def test_tei_embed_lmi_invocations_and_vllm_pooling_answer_their_own_shapes(embedder):
    server, hf, tok = embedder
    raw = server.post("/embed", json={"inputs": "cats sleep", "normalize": False}).json()
    torch.testing.assert_close(torch.tensor(raw[0]), _expected_vector(hf, tok, "cats sleep", False), atol=1e-5, rtol=0)
    one = server.post("/invocations", json={"inputs": "cats sleep"}).json()
    many = server.post("/invocations", json={"inputs": ["cats sleep", "hello world"]}).json()
    assert isinstance(one[0], float) and len(many) == 2 and many[0] == pytest.approx(one, abs=1e-6)
    prompted = server.post("/embed", json={"inputs": ["cats sleep"], "prompt_name": "query"}).json()[0]
    torch.testing.assert_close(torch.tensor(prompted), _expected_vector(hf, tok, "query: cats sleep"), atol=1e-5,
                               rtol=0)
    pooled = server.post("/pooling", json={"input": "cats sleep"}).json()
    assert pooled["object"] == "list" and pooled["data"][0]["object"] == "pooling"
    assert pooled["data"][0]["data"] == pytest.approx(one, abs=1e-6)


@pytest.mark.parametrize("path, body, field", [
    ("/v1/embeddings", {"input": 5}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {}, "input"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "dimensions": 33}, "dimensions"),
    ("/v1/embeddings", {"input": [[5, 100000]]}, "input"),
    ("/embed", {"inputs": ["x"], "normalize": "yes"}, "normalize"),
    ("/embed", {"inputs": "x", "prompt_name": "passage"}, "prompt_name"),
    ("/embed", {"inputs": "a " * 100}, "inputs"),
    ("/rerank", {"query": "a", "texts": ["b"]}, "task"),
])
def test_bad_bodies_answer_400_naming_the_field(embedder, path, body, field):
    reply = embedder[0].post(path, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["param"] == field) if path.startswith("/v1/") else (field in error)


def test_an_unknown_model_is_404_and_an_over_long_input_is_cut_when_asked(embedder):
    server = embedder[0]
    assert server.post("/v1/embeddings", json={"input": "x", "model": "other"}).status_code == 404
    assert server.post("/v1/embeddings", content=b"{not json").status_code == 400
    assert len(server.post("/embed", json={"inputs": "a " * 100, "truncate": True}).json()[0]) == 32


def test_rerank_routes_answer_the_cross_encoders_sigmoid_scores_best_first(reranker):
    server, hf, tok = reranker
    query, texts = "what is deep learning?", ["cats sleep", "deep learning is a model", "paris"]
    expected = [torch.sigmoid(_expected_logits(hf, tok, query, t))[0].item() for t in texts]
    tei = server.post("/rerank", json={"query": query, "texts": texts, "return_text": True}).json()
    assert [r["index"] for r in tei] == sorted(range(3), key=lambda i: -expected[i])
    assert [r["score"] for r in tei] == pytest.approx(sorted(expected, reverse=True), abs=1e-5)
    assert tei[0]["text"] == texts[tei[0]["index"]]
    for path in ("/v1/rerank", "/v2/rerank"):
        vllm = server.post(path, json={"query": query, "documents": texts, "top_n": 2}).json()
        assert len(vllm["results"]) == 2 and vllm["results"][0]["relevance_score"] == pytest.approx(max(expected))
    scored = server.post("/score", json={"text_1": query, "text_2": texts}).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=1e-5)
    raw = server.post("/rerank", json={"query": query, "texts": texts[:1], "raw_scores": True}).json()
    assert raw[0]["score"] == pytest.approx(_expected_logits(hf, tok, query, texts[0])[0].item(), abs=1e-5)
    plain = server.post("/rerank", json={"query": query, "texts": texts}).json()
    assert server.post("/invocations", json={"query": query, "texts": texts}).json() == plain


def test_classify_predict_and_invocations_answer_the_classifiers_softmax_behind_the_api_key(classifier):
    server, hf, tok = classifier
    assert server.post("/classify", json={"input": "x"}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    probs = [_expected_logits(hf, tok, t).softmax(-1) for t in TEXTS]
    vllm = server.post("/classify", json={"input": TEXTS}).json()
    for item, p in zip(vllm["data"], probs):
        assert item["probs"] == pytest.approx(p.tolist(), abs=1e-5) and item["num_classes"] == 3
        assert item["label"] == f"LABEL_{int(p.argmax())}"
    tei = server.post("/predict", json={"inputs": TEXTS[0]}).json()
    assert [x["score"] for x in tei] == pytest.approx(sorted(probs[0].tolist(), reverse=True), abs=1e-5)
    assert server.post("/invocations", json={"inputs": TEXTS[0]}).json() == tei
    pair = server.post("/predict", json={"inputs": [["cats sleep", "dogs run"]], "raw_scores": True}).json()[0]
    logits = _expected_logits(hf, tok, "cats sleep", "dogs run")
    assert max(x["score"] for x in pair) == pytest.approx(logits.max().item(), abs=1e-5)
