"""The pooling engine: prefill-only steps over many sequences at once, each answered with its pooled hidden
state (and its classifier's logits), no KV kept after the step.

Owns PoolingEngine (admission by option.max_rolling_batch_size sequences and
max_rolling_batch_prefill_tokens tokens a step, first come first served; a decoder input longer than the
token budget runs alone in chunks through a KV cache that lives for its step only) and loading the model a
pooling checkpoint needs (engine/model/encoder.py's EncoderModel for BERT / RoBERTa / XLM-R, the decoder walk
forward.DecoderModel for the decoder families). What a vector becomes for a request (normalize, dimensions,
the activation) is pooling.py's; the wire is protocol/'s.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from lmi_handler.engine.kv_cache import build_block_tables, build_slot_mapping
from lmi_handler.engine.model.attention import AttentionMetadata
from lmi_handler.engine.model.encoder import is_encoder, load_encoder
from lmi_handler.engine.model.loader import read_config
from lmi_handler.engine.pooling import PoolerConfig, pool, read_pooler_config, resolve_task

BLOCK_SIZE = 16      # the step-local KV cache's block (decoders)


@dataclass
class PoolingRequest:
    """One text to pool: its token ids, its token type ids (a cross-encoder's pair: 0 for the query, 1 for the
    text; None: all 0), and how many leading tokens are the prompt's (left out of mean / max when the
    pooler's include_prompt is false)."""

    request_id: str
    token_ids: list[int]
    token_type_ids: list[int] | None = None
    num_prompt_tokens: int = 0


@dataclass
class PoolingOutput:
    """One request's result: its pooled vector (hidden,) float32 (before normalization and truncation), the
    classifier's logits (labels,) float32 on a classification model (else None), its token count."""

    request_id: str
    vector: torch.Tensor
    logits: torch.Tensor | None
    num_tokens: int


class PoolingEngine:
    """add_request / step / has_unfinished, as the generation Engine, for the pooling tasks. model_dir: an
    HF checkpoint (an encoder, or a decoder family forward.DecoderModel serves, with or without the `model.`
    prefix, lm_head optional); the pooler config is read from `task` (resolved, not auto), `pooling`,
    `normalize` and the checkpoint's sentence-transformers files."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype, device: torch.device, task: str,
                 pooling: str | None = None, normalize: bool | None = None, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 4096, max_model_len: int | None = None, kernel_backend: str = "auto",
                 quantize: str | None = None):
        cfg = read_config(model_dir)
        self.task = resolve_task(task, Path(model_dir), cfg)
        self.is_encoder = is_encoder(cfg)
        self.device, self.dtype, self.vocab_size = device, dtype, cfg["vocab_size"]
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        if self.is_encoder:
            self.model = load_encoder(model_dir, dtype, device, kernel_backend, quantize)
            limit = self.model.spec.max_tokens
        else:
            from lmi_handler.engine.model.loader import load_model

            self.model = load_model(model_dir, dtype, device, quantize, kernel_backend=kernel_backend, pooling=True)
            limit = cfg.get("max_position_embeddings") or 4096
        self.max_model_len = min(limit, max_model_len) if max_model_len else limit
        self.pooler: PoolerConfig = read_pooler_config(model_dir, cfg, self.task, pooling, normalize,
                                                       cfg["hidden_size"], self.is_encoder)
        if self.task != "text-embedding" and not (self.is_encoder and self.model.num_labels):
            raise ValueError(f"task {self.task} needs a *ForSequenceClassification encoder checkpoint (BERT, "
                             f"RoBERTa, XLM-RoBERTa); {cfg.get('architectures')} has no classifier served here")
        if self.is_encoder and self.pooler.mode != "cls" and self.task != "text-embedding":
            self.pooler = PoolerConfig(**{**vars(self.pooler), "mode": "cls"})     # the head reads the first token
        self.waiting: deque[PoolingRequest] = deque()

    def check_fits(self, num_tokens: int) -> str | None:
        """Why an input of `num_tokens` cannot run (None when it can)."""
        if num_tokens == 0:
            return "the input is empty (no tokens)"
        if num_tokens > self.max_model_len:
            return f"the input has {num_tokens} tokens, more than the model's {self.max_model_len}"
        return None

    def add_request(self, request: PoolingRequest) -> None:
        """Queue `request`. Raises ValueError when it cannot run (check_fits)."""
        if why := self.check_fits(len(request.token_ids)):
            raise ValueError(why)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting)

    def step(self) -> list[PoolingOutput]:
        """Run the next sequences that fit one step's budget (at least one) and answer each of them."""
        batch, num_tokens = [], 0
        while self.waiting and len(batch) < self.max_num_seqs:
            n = len(self.waiting[0].token_ids)
            if batch and num_tokens + n > self.max_num_batched_tokens:
                break
            batch.append(self.waiting.popleft())
            num_tokens += n
        if not batch:
            return []
        with torch.inference_mode():
            hidden = self._encoder_hidden(batch) if self.is_encoder else self._decoder_hidden(batch)
            return self._outputs(batch, hidden)

    def encode(self, requests: list[PoolingRequest]) -> dict[str, PoolingOutput]:
        """Run `requests` to the end (offline use and tests): request_id -> its output."""
        for request in requests:
            self.add_request(request)
        outputs = {}
        while self.has_unfinished():
            outputs.update((out.request_id, out) for out in self.step())
        return outputs

    def _outputs(self, batch: list[PoolingRequest], hidden: torch.Tensor) -> list[PoolingOutput]:
        pooler, outputs, start = self.pooler, [], 0
        for request in batch:
            n = len(request.token_ids)
            rows = hidden[start:start + n]
            skip = 0 if pooler.include_prompt else request.num_prompt_tokens
            vector = pool(rows, pooler.mode, skip)
            logits = self.model.classify(rows[:1])[0].cpu() if pooler.id2label else None
            outputs.append(PoolingOutput(request.request_id, vector.cpu(), logits, n))
            start += n
        return outputs

    def _encoder_hidden(self, batch: list[PoolingRequest]) -> torch.Tensor:
        ids = torch.tensor([t for r in batch for t in r.token_ids], dtype=torch.int64, device=self.device)
        types = torch.tensor([t for r in batch for t in (r.token_type_ids or [0] * len(r.token_ids))],
                             dtype=torch.int64, device=self.device)
        return self.model.forward(ids, types, [len(r.token_ids) for r in batch])

    def _decoder_hidden(self, batch: list[PoolingRequest]) -> torch.Tensor:
        """The final-norm hidden states of the batch's tokens through a KV cache made for this step: each
        sequence its own blocks; in chunks of the token budget when one sequence is longer than it."""
        model, spec = self.model, self.model.spec
        lengths = [len(r.token_ids) for r in batch]
        tables, next_block = [], 0
        for n in lengths:
            count = math.ceil(n / BLOCK_SIZE)
            tables.append(list(range(next_block, next_block + count)))
            next_block += count
        shape = (next_block, BLOCK_SIZE, model.num_kv_heads, spec.head_dim)
        caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                   torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(spec.num_layers)]
        if sum(lengths) <= self.max_num_batched_tokens:
            return self._decoder_chunk(batch, tables, [0] * len(batch), lengths, caches)
        request, chunks = batch[0], []               # one sequence over the budget: the step runs it alone
        for start in range(0, lengths[0], self.max_num_batched_tokens):
            n = min(self.max_num_batched_tokens, lengths[0] - start)
            chunks.append(self._decoder_chunk([request], tables, [start], [n], caches))
        return torch.cat(chunks)

    def _decoder_chunk(self, batch, tables, starts: list[int], counts: list[int], caches) -> torch.Tensor:
        ids = [t for r, s, n in zip(batch, starts, counts) for t in r.token_ids[s:s + n]]
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts)])
        context = [s + n for s, n in zip(starts, counts)]
        cu = [0]
        for n in counts:
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(slot_mapping=build_slot_mapping(tables, starts, counts, BLOCK_SIZE).to(self.device),
                                 block_tables=build_block_tables(tables).to(self.device),
                                 context_lens=torch.tensor(context, dtype=torch.int32, device=self.device),
                                 cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=self.device),
                                 query_lens=list(counts), context_lens_host=context, block_size=BLOCK_SIZE)
        return self.model(torch.tensor(ids, dtype=torch.int64, device=self.device), positions.to(self.device),
                          caches, meta)
