"""Pooling as sentence-transformers configures it: the checkpoint's files, the options over them, the modes."""
from __future__ import annotations

import json

import pytest
import torch

from lmi_handler.config import ConfigError
from lmi_handler.engine.pooling import activate, finish_embedding, pool, read_pooler_config, resolve_task
from tests.engine.pooling_models import write_sentence_transformers


def test_the_checkpoints_pooling_normalize_and_prompts_are_read_and_the_options_win_over_them(tmp_path):
    write_sentence_transformers(tmp_path, "mean", normalize=True, include_prompt=False,
                                prompts={"query": "query: ", "passage": "passage: "})
    pooler = read_pooler_config(tmp_path, {}, "text-embedding", None, None, 32, encoder=True)
    assert (pooler.mode, pooler.normalize, pooler.include_prompt, pooler.dimensions) == ("mean", True, False, 32)
    assert pooler.prompts == {"query": "query: ", "passage": "passage: "}
    pooler = read_pooler_config(tmp_path, {}, "text-embedding", "cls", False, 32, encoder=True)
    assert (pooler.mode, pooler.normalize) == ("cls", False)


def test_without_sentence_transformers_files_encoders_take_cls_and_decoders_the_last_token(tmp_path):
    assert read_pooler_config(tmp_path, {}, "text-embedding", None, None, 8, encoder=True).mode == "cls"
    assert read_pooler_config(tmp_path, {}, "text-embedding", None, None, 8, encoder=False).mode == "lasttoken"


def test_a_dense_module_or_two_pooling_modes_at_once_are_refused_at_load_by_name(tmp_path):
    write_sentence_transformers(tmp_path, "mean")
    modules = json.loads((tmp_path / "modules.json").read_text())
    (tmp_path / "modules.json").write_text(json.dumps(modules + [{"path": "2_Dense",
                                                                   "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ConfigError, match="Dense"):
        read_pooler_config(tmp_path, {}, "text-embedding", None, None, 8, encoder=True)
    write_sentence_transformers(tmp_path, "mean")
    config = tmp_path / "1_Pooling" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pooling_mode_cls_token": True}))
    with pytest.raises(ConfigError, match="pooling modes"):
        read_pooler_config(tmp_path, {}, "text-embedding", None, None, 8, encoder=True)


def test_auto_task_follows_the_checkpoint(tmp_path):
    assert resolve_task("auto", tmp_path, {"architectures": ["LlamaForCausalLM"]}) == "text-generation"
    assert resolve_task("auto", tmp_path, {"architectures": ["BertForSequenceClassification"],
                                           "id2label": {"0": "LABEL_0"}}) == "rerank"
    assert resolve_task("auto", tmp_path, {"architectures": ["BertForSequenceClassification"],
                                           "id2label": {"0": "neg", "1": "pos"}}) == "classification"
    write_sentence_transformers(tmp_path, "cls")
    assert resolve_task("auto", tmp_path, {"architectures": ["BertModel"]}) == "text-embedding"
    assert resolve_task("rerank", tmp_path, {}) == "rerank"


def test_pooling_modes_and_matryoshka_truncation_before_normalizing():
    hidden = torch.tensor([[1.0, -2.0, 0.0], [3.0, 4.0, 2.0], [5.0, 0.0, -1.0]])
    assert pool(hidden, "cls").tolist() == [1.0, -2.0, 0.0]
    assert pool(hidden, "lasttoken").tolist() == [5.0, 0.0, -1.0]
    assert pool(hidden, "max").tolist() == [5.0, 4.0, 2.0]
    assert pool(hidden, "mean").tolist() == pytest.approx([3.0, 2.0 / 3, 1.0 / 3])
    assert pool(hidden, "mean", skip=1).tolist() == [4.0, 2.0, 0.5]
    vector = finish_embedding(torch.tensor([3.0, 4.0, 12.0]), normalize=True, dimensions=2)
    assert vector.tolist() == pytest.approx([0.6, 0.8])
    assert finish_embedding(torch.tensor([3.0, 4.0]), normalize=False).tolist() == [3.0, 4.0]


def test_scores_take_the_activation_of_their_head():
    logits = torch.tensor([0.0, 1.0])
    assert activate(logits, "sigmoid").tolist() == pytest.approx([0.5, 0.7310586])
    assert activate(logits, "softmax").sum().item() == pytest.approx(1.0)
    assert activate(logits, "none") is logits
