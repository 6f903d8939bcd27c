"""The pooling part of the settings: which task the model serves (text generation, or one of the pooling
tasks: embeddings, rerank scores, class labels) and how its hidden states become a vector.

Owns option.task, option.normalize and option.pooling; reading what the checkpoint says (modules.json,
1_Pooling/config.json, `*ForSequenceClassification`) and pooling itself are engine/pooling.py's.
"""
from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from lmi_handler.config.base import Options

TASKS = ("text-generation", "text-embedding", "rerank", "classification", "auto")
POOLING_TASKS = ("text-embedding", "rerank", "classification")
POOLING_MODES = ("cls", "mean", "max", "lasttoken")
# other names users give the same task or mode (LMI's, vLLM's, sentence-transformers')
_TASK_ALIASES = {"embedding": "text-embedding", "embed": "text-embedding", "feature-extraction": "text-embedding",
                 "score": "rerank", "cross-encoder": "rerank", "classify": "classification",
                 "text-classification": "classification", "generate": "text-generation"}
_MODE_ALIASES = {"last": "lasttoken", "last_token": "lasttoken", "last-token": "lasttoken", "first": "cls",
                 "mean_tokens": "mean", "max_tokens": "max", "cls_token": "cls"}


class PoolingOptions(Options):
    """Pooling: embeddings, rerank scores and class labels instead of generated text (docs/embeddings.md)."""

    task: Literal["text-generation", "text-embedding", "rerank", "classification", "auto"] = "text-generation"
    """What the model serves: text-generation, text-embedding (vectors: /v1/embeddings, /embed, /invocations),
    rerank (a cross-encoder's relevance score of (query, text) pairs: /rerank, /score), classification (a
    sequence classifier's labels: /classify, /predict); auto: a pooling task where the checkpoint says
    (`*ForSequenceClassification` in config.json's architectures: rerank with one label, else classification;
    a sentence-transformers modules.json: text-embedding), text-generation otherwise. Aliases: embedding,
    feature-extraction, score, classify."""
    normalize: bool | None = None
    """Embeddings divided by their L2 norm. Unset: as the checkpoint's sentence-transformers modules.json says
    (a Normalize module), else false; a request's `normalize` (TEI) wins over both."""
    pooling: Literal["cls", "mean", "max", "lasttoken"] | None = None
    """How a text's token hidden states become one vector: cls (the first token), mean, max (per feature), or
    lasttoken. Unset: the checkpoint's 1_Pooling/config.json, else cls for encoders (BERT, RoBERTa) and
    lasttoken for decoders."""

    @field_validator("task", mode="before")
    @classmethod
    def _task_alias(cls, value):
        text = value.strip().lower() if isinstance(value, str) else value
        return _TASK_ALIASES.get(text, text)

    @field_validator("pooling", mode="before")
    @classmethod
    def _mode_alias(cls, value):
        text = value.strip().lower() if isinstance(value, str) else value
        if text in ("", "none"):
            return None
        return _MODE_ALIASES.get(text, text)

    @property
    def is_pooling(self) -> bool:
        """The task is not text generation (auto counts: the checkpoint decides at load)."""
        return self.task != "text-generation"
