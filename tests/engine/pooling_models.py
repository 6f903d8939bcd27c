"""Tiny random pooling checkpoints built with transformers' own classes, sentence-transformers' files written
beside them (modules.json, 1_Pooling/config.json, config_sentence_transformers.json), for the pooling tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch

ENCODER = dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=80)
DECODER = dict(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=True)
ST_MODES = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens",
            "lasttoken": "pooling_mode_lasttoken"}


def _perturb(model, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():        # biases, norms and LayerNorms start at 0 / 1: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name.lower():
                p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def build_encoder(path: Path, model_type: str = "bert", num_labels: int | None = None, seed: int = 0):
    """A bare encoder (as sentence-transformers saves one), or with num_labels a *ForSequenceClassification;
    model_type bert, roberta or xlm-roberta. Returns the HF model (eval, float32)."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    config = AutoConfig.for_model(model_type, **ENCODER, **({"num_labels": num_labels} if num_labels else {}))
    torch.manual_seed(seed)
    if num_labels:
        model = AutoModelForSequenceClassification.from_config(config, attn_implementation="eager")
    else:
        model = AutoModel.from_config(config, add_pooling_layer=False, attn_implementation="eager")
    model = _perturb(model, seed + 1)
    model.save_pretrained(path, safe_serialization=True)
    return model


def build_decoder_embedder(path: Path, model_type: str = "qwen3", seed: int = 0):
    """A bare decoder (Qwen3-Embedding style: saved from Qwen3Model, no `model.` prefix, no lm_head)."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model(model_type, **DECODER)
    torch.manual_seed(seed)
    model = _perturb(AutoModel.from_config(config, attn_implementation="eager"), seed + 1)
    model.save_pretrained(path, safe_serialization=True)
    return model


def write_sentence_transformers(path: Path, mode: str, normalize: bool = False, include_prompt: bool = True,
                                prompts: dict | None = None) -> None:
    """modules.json (Transformer, Pooling, optionally Normalize), 1_Pooling/config.json for `mode`, and
    config_sentence_transformers.json with `prompts`."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    pooling = {key: key == ST_MODES[mode] for key in ST_MODES.values()}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **pooling,
                                                                "include_prompt": include_prompt}))
    (path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts or {},
                                                                        "default_prompt_name": None}))


def reference_pool(hidden: torch.Tensor, mode: str, skip: int = 0) -> torch.Tensor:
    """sentence-transformers' Pooling of one unpadded sequence's (n, H) hidden states, written out."""
    if mode == "cls":
        return hidden[0]
    if mode == "lasttoken":
        return hidden[-1]
    mask = torch.ones(hidden.shape[0])
    mask[:skip] = 0
    if mode == "max":
        return hidden.masked_fill(mask[:, None] == 0, -1e9).max(0).values
    return (hidden * mask[:, None]).sum(0) / mask.sum().clamp_min(1e-9)


WORDS = ("the a is of to and in what deep learning query passage hello world cats dogs sleep run fast slow big small "
         "red blue model text vector search rank good bad paris france capital city river").split()


def write_wordpiece_tokenizer(path: Path) -> None:
    """A BERT WordPiece tokenizer of ENCODER's vocabulary size (special tokens, WORDS, letters, ## pieces)."""
    from transformers import BertTokenizerFast

    letters = list("abcdefghijklmnopqrstuvwxyz0123456789:.,?!")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *letters, *[f"##{c}" for c in letters]]
    vocab = vocab[:ENCODER["vocab_size"]]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
