"""Pooling as sentence-transformers configures it: which task a checkpoint serves, how its token hidden
states become one vector, and what a request may change (normalize, Matryoshka dimensions, the prompt).

Owns PoolerConfig (read once at load from option.task / pooling / normalize and the checkpoint's
modules.json, 1_Pooling/config.json, config_sentence_transformers.json and config.json), the pooling modes
and the scores' activation. Running the model is pooling_engine.py's; request bodies are protocol/'s.
Each function works on one sequence's rows, so a text's vector never depends on the rest of its batch.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmi_handler.config import ConfigError

MODULE_TRANSFORMER, MODULE_POOLING, MODULE_NORMALIZE = "Transformer", "Pooling", "Normalize"
# 1_Pooling/config.json's switches -> our mode names (sentence-transformers' Pooling module)
_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
             "pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len"}


@dataclass(frozen=True)
class PoolerConfig:
    """How this model's outputs are served. task: text-embedding | rerank | classification; mode: cls, mean,
    max, lasttoken or mean_sqrt_len; include_prompt False: a prompt's tokens are left out of mean / max;
    normalize: the server's default (a request may say otherwise); dimensions: the vector's full size;
    prompts: sentence-transformers' named prompts (name -> text put before the input); activation of the
    scores: sigmoid (one label, or multi-label), softmax, or none."""

    task: str
    mode: str
    include_prompt: bool = True
    normalize: bool = False
    dimensions: int = 0
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    id2label: dict[int, str] = field(default_factory=dict)
    activation: str = "none"


def read_json(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _architectures(cfg: dict) -> list[str]:
    return list(cfg.get("architectures") or [])


def resolve_task(task: str, model_dir: Path, cfg: dict) -> str:
    """option.task with `auto` decided by the checkpoint: a *ForSequenceClassification is rerank with one
    label, classification with more; a sentence-transformers modules.json is text-embedding; else
    text-generation."""
    if task != "auto":
        return task
    if any(a.endswith("ForSequenceClassification") for a in _architectures(cfg)):
        return "rerank" if len(cfg.get("id2label") or {0: "LABEL_0", 1: "LABEL_1"}) == 1 else "classification"
    return "text-embedding" if (Path(model_dir) / "modules.json").is_file() else "text-generation"


def read_pooler_config(model_dir: str | Path, cfg: dict, task: str, pooling: str | None, normalize: bool | None,
                       hidden_size: int, encoder: bool) -> PoolerConfig:
    """PoolerConfig of a checkpoint for a pooling `task` (already resolved): option.pooling / normalize
    (None: the checkpoint's) over modules.json and its Pooling module's config. Raises ConfigError for a
    sentence-transformers pipeline we cannot run (a Dense module, several pooling modes at once)."""
    model_dir = Path(model_dir)
    modules = read_json(model_dir / "modules.json") or []
    kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    if unknown := [k for k in kinds if k not in (MODULE_TRANSFORMER, MODULE_POOLING, MODULE_NORMALIZE)]:
        raise ConfigError(f"modules.json: the sentence-transformers modules {unknown} are not served (Transformer, "
                          f"Pooling and Normalize are)")
    st_mode, include_prompt = None, True
    if MODULE_POOLING in kinds:
        path = modules[kinds.index(MODULE_POOLING)].get("path", "1_Pooling")
        pool_cfg = read_json(model_dir / path / "config.json") or {}
        modes = [mode for key, mode in _ST_MODES.items() if pool_cfg.get(key)]
        if len(modes) > 1 or pool_cfg.get("pooling_mode_weightedmean_tokens"):
            raise ConfigError(f"{path}/config.json: pooling modes {modes} at once are not served (one of "
                              f"{sorted(set(_ST_MODES.values()))})")
        st_mode = modes[0] if modes else None
        include_prompt = bool(pool_cfg.get("include_prompt", True))
    mode = pooling or st_mode or ("cls" if encoder else "lasttoken")
    st_config = read_json(model_dir / "config_sentence_transformers.json") or {}
    labels = {int(k): v for k, v in (cfg.get("id2label") or {}).items()} if task != "text-embedding" else {}
    return PoolerConfig(task=task, mode=mode, include_prompt=include_prompt,
                        normalize=normalize if normalize is not None else MODULE_NORMALIZE in kinds,
                        dimensions=hidden_size, prompts=dict(st_config.get("prompts") or {}),
                        default_prompt_name=st_config.get("default_prompt_name"), id2label=labels,
                        activation=_activation(cfg, labels) if labels else "none")


def _activation(cfg: dict, labels: dict) -> str:
    """sentence-transformers' CrossEncoder and transformers' pipeline: sigmoid for one label or multi-label
    problems, softmax otherwise (a checkpoint's sentence_transformers.activation_fn, when set, wins)."""
    named = ((cfg.get("sentence_transformers") or {}).get("activation_fn") or "").rsplit(".", 1)[-1]
    if named in ("Sigmoid", "Identity"):
        return "sigmoid" if named == "Sigmoid" else "none"
    return "sigmoid" if len(labels) == 1 or cfg.get("problem_type") == "multi_label_classification" else "softmax"


def pool(hidden: torch.Tensor, mode: str, skip: int = 0) -> torch.Tensor:
    """One sequence's hidden states (n, H) -> its vector (H,) float32. skip: leading tokens (the prompt's,
    when include_prompt is false) left out of mean / max, as sentence-transformers masks them."""
    rows = hidden.float()
    if mode == "cls":
        return rows[0].clone()
    if mode == "lasttoken":
        return rows[-1].clone()
    kept = rows[min(skip, rows.shape[0] - 1):]
    if mode == "max":
        return kept.max(0).values
    total = kept.sum(0)
    return total / (math.sqrt(kept.shape[0]) if mode == "mean_sqrt_len" else kept.shape[0])


def finish_embedding(vector: torch.Tensor, normalize: bool, dimensions: int | None = None) -> torch.Tensor:
    """A pooled vector as the request asks: Matryoshka truncation to `dimensions` first, then the L2
    normalization (so a truncated vector is unit length again, as vLLM and OpenAI answer). (H,) -> (d,)."""
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        vector = vector / vector.norm().clamp_min(1e-12)
    return vector


def activate(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """One sequence's logits (labels,) float32 -> its scores: sigmoid, softmax or unchanged."""
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "softmax":
        return logits.softmax(-1)
    return logits
