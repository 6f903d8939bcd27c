"""PoolingEngine against transformers' own models and sentence-transformers' pooling, and its batch invariance."""
from __future__ import annotations

import pytest
import torch

from lmi_handler.engine.pooling_engine import PoolingEngine, PoolingRequest
from tests.engine.pooling_models import (
    build_decoder_embedder,
    build_encoder,
    reference_pool,
    write_sentence_transformers,
)

CPU = torch.device("cpu")
TEXTS = [[5, 17, 33, 2, 90, 41, 7], [3, 8], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [44]]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """model_type -> (checkpoint dir, HF model) of tiny bare encoders."""
    out = {}
    for model_type in ("bert", "roberta", "xlm-roberta"):
        path = tmp_path_factory.mktemp(model_type)
        out[model_type] = (path, build_encoder(path, model_type))
    return out


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-embedding")
    return path, build_decoder_embedder(path)


def _hf_hidden(model, ids: list[int], token_type_ids=None) -> torch.Tensor:
    with torch.no_grad():
        kwargs = {} if token_type_ids is None else {"token_type_ids": torch.tensor([token_type_ids])}
        return model(input_ids=torch.tensor([ids]), **kwargs).last_hidden_state[0]


def _requests(texts, skip: int = 0) -> list[PoolingRequest]:
    return [PoolingRequest(f"r{i}", ids, num_prompt_tokens=skip) for i, ids in enumerate(texts)]


@pytest.mark.parametrize("model_type", ["bert", "roberta", "xlm-roberta"])
@pytest.mark.parametrize("mode", ["cls", "mean", "max", "lasttoken"])
def test_encoder_vectors_equal_transformers_hidden_states_pooled_as_sentence_transformers_does(encoders, model_type,
                                                                                               mode):
    path, hf = encoders[model_type]
    write_sentence_transformers(path, mode)
    for backend in ("torch", "cpp") if model_type == "bert" else ("cpp",):     # the reference linear once
        engine = PoolingEngine(path, torch.float32, CPU, "text-embedding", kernel_backend=backend)
        assert engine.pooler.mode == mode and engine.model.kernel_backend == backend
        outputs = engine.encode(_requests(TEXTS))
        for i, ids in enumerate(TEXTS):
            expected = reference_pool(_hf_hidden(hf, ids), mode)
            torch.testing.assert_close(outputs[f"r{i}"].vector, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["lasttoken", "mean"])
def test_decoder_embedder_vectors_equal_transformers_and_a_prompt_is_left_out_of_the_mean_when_asked(decoder, mode):
    path, hf = decoder
    write_sentence_transformers(path, mode, include_prompt=False)
    engine = PoolingEngine(path, torch.float32, CPU, "text-embedding", kernel_backend="cpp")
    outputs = engine.encode(_requests(TEXTS, skip=1))
    for i, ids in enumerate(TEXTS):
        expected = reference_pool(_hf_hidden(hf, ids), mode, skip=min(1, len(ids) - 1))   # one token is kept
        torch.testing.assert_close(outputs[f"r{i}"].vector, expected, atol=1e-5, rtol=0)


def test_a_decoder_input_longer_than_the_token_budget_runs_in_chunks_with_the_same_bits(decoder):
    path, _ = decoder
    write_sentence_transformers(path, "mean")
    long = list(range(3, 43))
    whole = PoolingEngine(path, torch.float32, CPU, "text-embedding", max_num_batched_tokens=64)
    chunked = PoolingEngine(path, torch.float32, CPU, "text-embedding", max_num_batched_tokens=16)
    a = whole.encode([PoolingRequest("a", long)])["a"].vector
    assert torch.equal(a, chunked.encode([PoolingRequest("a", long)])["a"].vector)


@pytest.mark.parametrize("dtype, quantize", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "int8")])
def test_a_vector_is_bitwise_the_same_alone_and_in_any_batch(encoders, decoder, dtype, quantize):
    for path in (encoders["bert"][0], decoder[0]):
        write_sentence_transformers(path, "mean")
        engine = PoolingEngine(path, dtype, CPU, "text-embedding", kernel_backend="cpp", quantize=quantize,
                               max_num_seqs=8)
        alone = engine.encode([PoolingRequest("t", TEXTS[0])])["t"].vector
        for others in (TEXTS[1:], TEXTS[2:3], TEXTS[::-1]):
            batch = [PoolingRequest(f"o{i}", ids) for i, ids in enumerate(others)] + [PoolingRequest("t", TEXTS[0])]
            assert torch.equal(engine.encode(batch)["t"].vector, alone), (path.name, dtype, quantize)


@pytest.mark.parametrize("model_type, num_labels, task", [("bert", 1, "rerank"), ("bert", 3, "classification"),
                                                          ("xlm-roberta", 1, "rerank"),
                                                          ("roberta", 3, "classification")])
def test_classifier_logits_equal_transformers_and_auto_picks_the_task_by_the_labels(tmp_path, model_type, num_labels,
                                                                                    task):
    hf = build_encoder(tmp_path, model_type, num_labels=num_labels)
    engine = PoolingEngine(tmp_path, torch.float32, CPU, "auto", kernel_backend="cpp")
    assert engine.task == task and engine.pooler.activation == ("sigmoid" if num_labels == 1 else "softmax")
    pair, types = [2, 9, 10, 3, 20, 21, 22, 3], [0, 0, 0, 0, 1, 1, 1, 1]
    types = types if model_type == "bert" else None          # RoBERTa has one token type
    out = engine.encode([PoolingRequest("p", pair, types)])["p"]
    with torch.no_grad():
        kwargs = {} if types is None else {"token_type_ids": torch.tensor([types])}
        expected = hf(input_ids=torch.tensor([pair]), **kwargs).logits[0]
    torch.testing.assert_close(out.logits, expected, atol=1e-5, rtol=0)


def test_inputs_over_the_model_length_or_empty_are_refused_with_the_numbers(encoders):
    engine = PoolingEngine(encoders["bert"][0], torch.float32, CPU, "text-embedding", max_model_len=16)
    with pytest.raises(ValueError, match="17 tokens, more than the model's 16"):
        engine.add_request(PoolingRequest("x", list(range(17))))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(PoolingRequest("x", []))


def test_a_generation_checkpoint_asked_for_rerank_is_refused_naming_the_need(decoder):
    with pytest.raises(ValueError, match="ForSequenceClassification"):
        PoolingEngine(decoder[0], torch.float32, CPU, "rerank")
