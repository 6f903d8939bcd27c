"""Turn one step's scheduled sequences into a flat token batch, run the model, return logits.

Owns the paged KV-cache tensors, ModelConfig, and the Sequence -> tensors flattening; leaves
choosing what to run (and allocating blocks) to scheduler.py, and sampling to sampler.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from lmi_handler.engine.kv_cache import build_block_tables, build_slot_mapping
from lmi_handler.engine.model.attention import AttentionMetadata
from lmi_handler.engine.model.loader import load_model, read_config
from lmi_handler.engine.sequence import Sequence


@dataclass
class ModelConfig:
    """What the engine needs to know about the model (config.json + generation_config.json)."""

    vocab_size: int
    max_model_len: int               # tokens: config.json max_position_embeddings
    eos_token_ids: tuple[int, ...]   # config eos_token_id (int or list) ∪ generation_config's
    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass
class ModelOutput:
    """Logits of one step, float32 on the runner's device."""

    logits: torch.Tensor                  # (num_seqs, vocab_size): at each sequence's last scheduled token
    chunk_logits: dict[int, torch.Tensor]  # seq index -> (num_scheduled_tokens_i, vocab_size), only for
    # sequences with params.prompt_logprobs whose chunk starts inside the prompt


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def read_model_config(model_dir: str | Path) -> ModelConfig:
    """ModelConfig from config.json (and generation_config.json when present)."""
    from lmi_handler.engine.model.loader import args_from_config

    cfg = read_config(model_dir)
    args = args_from_config(cfg)
    eos = _as_ids(cfg.get("eos_token_id"))
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        eos += _as_ids(json.loads(gen_path.read_text()).get("eos_token_id"))
    return ModelConfig(vocab_size=args.vocab_size, max_model_len=args.max_position_embeddings,
                       eos_token_ids=tuple(dict.fromkeys(eos)), num_layers=args.num_layers,
                       num_kv_heads=args.num_kv_heads, head_dim=args.head_dim)


class ModelRunner:
    """Owns the model and its paged KV cache; `execute` runs one engine step.

    KV cache: per layer a K and a V tensor of shape (num_blocks, block_size, num_kv_heads,
    head_dim) in `dtype`, zero-initialised (so padded gathers never read NaN).
    `batch_invariant` (default True) makes a sequence's logits bitwise independent of the rest of
    the batch: the C++ row-invariant linear over packed weights and the paged attention kernel
    (float32 CPU; elsewhere 16-row tiled GEMMs and one attention call per sequence, see llama.py).
    False: plain F.linear GEMMs, logits may move in the last bits with the batch.
    """

    def __init__(self, model_dir: str | Path, dtype: torch.dtype, device: torch.device,
                 block_size: int = 16, num_blocks: int | None = None, kv_cache_bytes: int = 2 * 1024**3,
                 batch_invariant: bool = True):
        self.config = read_model_config(model_dir)
        self.dtype, self.device, self.block_size = dtype, torch.device(device), block_size
        self.batch_invariant = batch_invariant
        self.model = load_model(model_dir, dtype, self.device, pack_weights=batch_invariant)
        c = self.config
        block_bytes = 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * dtype.itemsize
        self.num_blocks = num_blocks if num_blocks is not None else kv_cache_bytes // block_bytes
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={kv_cache_bytes} holds no block of {block_bytes} bytes")
        shape = (c.num_layers, 2, self.num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], num_scheduled_tokens: list[int]) -> ModelOutput:
        """Compute seq.all_token_ids[c : c+n] at positions c..c+n-1 for every sequence, where
        c = seq.num_computed_tokens and n = num_scheduled_tokens[i]; write their K/V into the
        blocks of seq.block_table (which must already hold c+n tokens) and attend causally to
        positions 0..c+n-1. Prefill chunks and decode steps mix freely. Does not modify seqs.

        Raises: IndexError if a block table is too short; ValueError if n < 1 or c+n > num_tokens.
        """
        input_ids, positions, meta = self._prepare(seqs, num_scheduled_tokens)
        invariant = self.batch_invariant
        hidden = self.model(input_ids, positions, self.kv_caches, meta, invariant)  # (T, hidden_size)
        rows, spans, num_chunk_rows = self._logit_rows(seqs, num_scheduled_tokens)
        logits = self.model.compute_logits(hidden[rows.to(self.device)], invariant)  # (R, vocab) f32
        chunk_logits = {i: logits[a:b] for i, (a, b) in spans.items()}
        return ModelOutput(logits=logits[num_chunk_rows:], chunk_logits=chunk_logits)

    def _prepare(self, seqs: list[Sequence], num_scheduled_tokens: list[int]):
        """Flatten the step into input_ids (T,), positions (T,) int64 and AttentionMetadata."""
        starts = [s.num_computed_tokens for s in seqs]
        ids: list[int] = []
        for seq, start, n in zip(seqs, starts, num_scheduled_tokens):
            if n < 1 or start + n > seq.num_tokens:
                raise ValueError(f"request {seq.request_id}: cannot schedule {n} tokens from "
                                 f"position {start} of {seq.num_tokens}")
            ids.extend(seq.all_token_ids[start:start + n])
        positions = [p for start, n in zip(starts, num_scheduled_tokens) for p in range(start, start + n)]
        tables = [s.block_table for s in seqs]
        context_lens = [start + n for start, n in zip(starts, num_scheduled_tokens)]
        cu = [0]
        for n in num_scheduled_tokens:
            cu.append(cu[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=build_slot_mapping(tables, starts, num_scheduled_tokens, self.block_size).to(dev),
            block_tables=build_block_tables(tables).to(dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            query_lens=list(num_scheduled_tokens), context_lens_host=context_lens,
            block_size=self.block_size)
        return (torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta)

    @staticmethod
    def _logit_rows(seqs: list[Sequence], num_scheduled_tokens: list[int]):
        """Flat-batch rows to run lm_head on: first the whole chunk of each prompt_logprobs
        sequence still in its prompt, then every sequence's
        last token. Returns ((R,) int64 CPU, {batch position: (a, b) rows of its chunk}, num chunk rows)."""
        last_rows, chunk_rows, spans = [], [], {}
        start = 0
        for i, (seq, n) in enumerate(zip(seqs, num_scheduled_tokens)):
            last_rows.append(start + n - 1)
            if seq.params.prompt_logprobs and seq.num_computed_tokens < seq.num_prompt_tokens:
                spans[i] = (len(chunk_rows), len(chunk_rows) + n)
                chunk_rows.extend(range(start, start + n))
            start += n
        return torch.tensor(chunk_rows + last_rows, dtype=torch.int64), spans, len(chunk_rows)
