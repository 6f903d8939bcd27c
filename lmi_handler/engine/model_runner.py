"""The step contract: SchedulerOutput -> ModelInput (plain tensors) -> ModelRunner.execute -> logits.

Owns the paged KV-cache tensors, ModelConfig, ModelInput and the Sequence -> tensors flattening
(`prepare`); leaves choosing what to run (and allocating blocks) to scheduler.py, and sampling to sampler.py.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from itertools import accumulate
from pathlib import Path

import torch

from lmi_handler.config import ConfigError
from lmi_handler.engine.cuda_graphs import DecodeGraphs, graph_unfit
from lmi_handler.engine.gpu_memory import blocks_for_gpu
from lmi_handler.engine.image_rows import step_image_rows
from lmi_handler.engine.kv_cache import build_block_tables, slots_for_positions
from lmi_handler.engine.model.attention import AttentionMetadata
from lmi_handler.engine.model.fallback import fallback_shape, load_fallback
from lmi_handler.engine.model.kernels import empty_huge
from lmi_handler.engine.model.loader import load_model, read_config, spec_from_config
from lmi_handler.engine.model.lora import FUSED, LoraBatch, base_module_shapes
from lmi_handler.engine.model.model_impl import choose_impl
from lmi_handler.engine.model.vision import load_encoder, mrope_steps, text_config_of
from lmi_handler.engine.scheduler import SchedulerOutput
from lmi_handler.engine.sequence import Sequence

logger = logging.getLogger(__name__)


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
    # sequences with params.prompt_logprobs whose chunk starts inside the prompt; for a sequence verifying
    # drafts, (num_drafts, vocab_size): the rows before its last (engine/speculative/)


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def read_model_config(model_dir: str | Path, model_impl: str = "auto", trust_remote_code: bool = False) -> ModelConfig:
    """ModelConfig from config.json (and generation_config.json when present): the layer description's, or
    transformers' config's for a model the fallback serves (option.model_impl, model_impl.choose_impl).
    Raises ConfigError for a model neither serves."""
    cfg = read_config(model_dir)
    if choose_impl(cfg, model_impl, trust_remote_code).fallback:
        spec = fallback_shape(model_dir, trust_remote_code)
    else:
        spec = spec_from_config(cfg)
    eos = _as_ids(cfg.get("eos_token_id")) or _as_ids(text_config_of(cfg).get("eos_token_id"))
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        eos += _as_ids(json.loads(gen_path.read_text()).get("eos_token_id"))
    return ModelConfig(vocab_size=spec.vocab_size, max_model_len=spec.max_position_embeddings,
                       eos_token_ids=tuple(dict.fromkeys(eos)), num_layers=spec.num_layers,
                       num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)


@dataclass
class ModelInput:
    """One step's work as plain tensors and ints: what `ModelRunner.execute` runs (no Sequence objects).

    Built by `ModelRunner.prepare` from a SchedulerOutput, rows in the scheduler's order (the
    batch-invariant kernels make a row's bits independent of its neighbours, so nothing is reordered).
    Picklable (tensors, ints, lists, a dict), so a step can be broadcast to
    tensor-parallel workers; every tensor's shape depends only on the batch composition (the
    scheduled token counts and the longest block table), never on token values.

        flat rows   |<- seq 0: n0 rows ->|<- seq 1: n1 rows ->| ...   T = sum(n)
        logit_rows  [ chunk rows of prompt-logprob sequences, then the rows before the last of
                      sequences verifying drafts ...             | last row of every sequence ]
                    |<-------- num_chunk_rows ---------------->|<---------- S ------------->|
    """

    input_ids: torch.Tensor             # (T,) int64
    positions: torch.Tensor             # (T,) int64: num_computed_tokens + 0..n-1 of each sequence (RoPE's; M-RoPE:
                                        # (3, T) or moved, engine/model/mrope.py; slots are the index's)
    attn: AttentionMetadata             # slot_mapping (T,), block_tables (S, max_blocks), context_lens, ...
    logit_rows: torch.Tensor            # (R,) int64 flat rows lm_head runs on, R = num_chunk_rows + S
    num_chunk_rows: int                 # leading entries of logit_rows that are prompt-logprob chunks
    chunk_spans: dict[int, tuple[int, int]]  # caller's index -> rows [a, b) of lm_head's output (its chunk)
    blocks_to_copy: torch.Tensor | None = None  # (N, 2) int64 (src, dst) block ids, copied before the forward
    lora: LoraBatch | None = None       # the step's LoRA adapters (on the runner's device); None: no row has one
    graph: bool = False                 # the decode graphs replay it (prepare decides; its tensors stay on the host)
    image_rows: tuple[torch.Tensor, torch.Tensor] | None = None   # flat rows (K,) and their image embeddings

    @property
    def num_seqs(self) -> int:
        return self.attn.num_seqs

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device) -> "ModelInput":
        """The same step with every tensor on `device` (host -> device copies, no sync: a copy from pageable
        host memory is staged before it returns, so non_blocking is safe in this direction only)."""
        attn = replace(self.attn, **{f: getattr(self.attn, f).to(device, non_blocking=True) for f in _ATTN_TENSORS})
        copies = self.blocks_to_copy.to(device, non_blocking=True) if self.blocks_to_copy is not None else None
        return replace(self, input_ids=self.input_ids.to(device, non_blocking=True),
                       positions=self.positions.to(device, non_blocking=True), attn=attn,
                       logit_rows=self.logit_rows.to(device, non_blocking=True), blocks_to_copy=copies)


_ATTN_TENSORS = ("slot_mapping", "block_tables", "context_lens", "cu_seqlens_q")


class ModelRunner:
    """Owns the model and its paged KV cache; `prepare` builds a step's ModelInput, `execute` runs it.

    KV cache: per layer a K and a V tensor of shape (num_blocks, block_size, num_kv_heads,
    head_dim) in `dtype` (the activations' dtype: bfloat16 for a bf16 model, whatever the weights' kind),
    zero-initialised (so padded gathers never read NaN).
    `quantize` ("int8" or None): int8 weight panels, quantized at load (loader.load_model); the C++
    kernels run them in either mode.
    A sequence's logits are bitwise independent of the rest of its batch on every backend: each op
    computes a row from that row alone (forward.DecoderModel over the backend's ops).
    `huge_pages`: packed weights and the KV cache in huge-page memory (kernels.empty_huge; CPU).
    `kernel_backend`: option.kernel_backend (auto | cpp | triton | torch, engine/model/backend.py), chosen
    once here; `self.kernel_backend` names the one chosen.
    Tensor parallelism: `layout` (a ShardLayout) and `group` (its rank's TPGroup) make this runner one
    rank's: it loads only that shard, and its KV cache holds only the rank's own KV heads
    (layout.num_kv_heads); `num_blocks` is then the group's (the minimum over ranks). `config` stays the
    whole model's; `execute` returns the logits on rank 0 and None on the others.
    LoRA: `prepare` gives a step whose sequences have adapters a LoraBatch (the forward adds each row's
    adapter term after every projection); `applies_lora` says whether this runner does (one process only: a
    shard holds a slice of each projection's input, the LoRA term needs all of it).
    CUDA (one process): `gpu_memory_utilization` (not None, and `num_blocks` None) sizes the KV cache from the
    memory left after the weights, a profiling forward of the largest step and the graphs (engine/gpu_memory.py)
    instead of `kv_cache_bytes`; unless `enforce_eager`, decode steps of up to `max_num_seqs` sequences replay
    CUDA graphs captured here (engine/cuda_graphs.py, `self.graphs`; None where there are none, CPU included).
    `max_num_batched_tokens` sizes the profiling forward. Built directly, a runner is eager (enforce_eager=True);
    the engine's (parallel/launch.py) takes option.enforce_eager, false by default.
    """

    LORA_STACKS_KEPT = 8     # the stacked A/B of this many recent adapter sets (a set recurs step after step)

    def __init__(self, model_dir: str | Path, dtype: torch.dtype, device: torch.device,
                 block_size: int = 16, num_blocks: int | None = None, kv_cache_bytes: int = 2 * 1024**3,
                 huge_pages: bool = True, quantize: str | None = None,
                 layout=None, group=None, kernel_backend: str = "auto", gpu_memory_utilization: float | None = None,
                 enforce_eager: bool = True, max_num_seqs: int = 32, max_num_batched_tokens: int = 1024,
                 model_impl: str = "auto", trust_remote_code: bool = False):
        self.config = read_model_config(model_dir, model_impl, trust_remote_code)
        self.dtype, self.device, self.block_size = dtype, torch.device(device), block_size
        self.quantize = quantize
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)   # Triton launches and graph replays go to the current device
        self.impl = choose_impl(read_config(model_dir), model_impl, trust_remote_code)
        if self.impl.fallback:
            _check_fallback_settings(quantize, layout)
            self.model = load_fallback(model_dir, dtype, self.device, kernel_backend, trust_remote_code, self.impl.why)
            self.config = replace(self.config, num_kv_heads=self.model.num_kv_heads, head_dim=self.model.head_dim)
        else:
            self.model = load_model(model_dir, dtype, self.device, quantize=quantize, huge_pages=huge_pages,
                                    layout=layout, kernel_backend=kernel_backend)
        self.kernel_backend = self.model.kernel_backend
        # a vision-language checkpoint's tower and projector (engine/model/vision/), None for a text model
        self.vision = None if self.impl.fallback else load_encoder(model_dir, read_config(model_dir), dtype, self.device)
        self.mrope = None if self.vision is None else mrope_steps(read_config(model_dir))   # Qwen2-VL's M-RoPE
        if group is not None:
            self.model.group = group
        c = self.config
        num_kv_heads = c.num_kv_heads if layout is None else layout.num_kv_heads
        block_bytes = kv_block_bytes(c.num_layers, block_size, num_kv_heads, c.head_dim, dtype)
        why_eager = "enforce_eager" if enforce_eager else (
            "tensor parallelism" if layout is not None else graph_unfit(self.model, self.device))
        if self.device.type == "cuda" and num_blocks is None and gpu_memory_utilization is not None:
            num_blocks = blocks_for_gpu(self, gpu_memory_utilization, block_bytes, num_kv_heads, max_num_seqs,
                                        max_num_batched_tokens, graphs=not why_eager)
        self.num_blocks = num_blocks if num_blocks is not None else kv_cache_bytes // block_bytes
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={kv_cache_bytes} holds no block of {block_bytes} bytes")
        shape = (c.num_layers, 2, self.num_blocks, block_size, num_kv_heads, c.head_dim)
        self.kv_cache = empty_huge(*shape, dtype=dtype, device=self.device, huge_pages=huge_pages).zero_()
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        self.applies_lora = layout is None and not self.impl.fallback
        # the base's projection shapes the adapters' stacks are built to, read once (not at every new adapter set)
        self._lora_shapes = base_module_shapes(text_config_of(read_config(model_dir))) if self.applies_lora else None
        self._lora_stacks: dict[tuple[bytes, ...], LoraBatch] = {}    # adapter keys -> stacks, oldest first
        self.graphs: DecodeGraphs | None = None
        if not why_eager:
            self.graphs = self._capture_graphs(max_num_seqs)
        elif self.device.type == "cuda":
            logger.info("CUDA graphs off, every step eager: %s", why_eager)

    def _capture_graphs(self, max_num_seqs: int) -> DecodeGraphs:
        """Decode steps of 1..max_num_seqs sequences as CUDA graphs over this runner's cache, logged."""
        max_blocks = min(self.num_blocks, -(-self.config.max_model_len // self.block_size))
        graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, max_num_seqs, max_blocks,
                              self.config.vocab_size, self.device)
        with torch.inference_mode():
            seconds, nbytes = graphs.capture()
        logger.info("CUDA graphs: decode steps of %s sequences captured in %.2f s, %.1f MiB of GPU memory",
                    ",".join(map(str, graphs.sizes)), seconds, nbytes / 2**20)
        return graphs

    def prepare(self, sched: SchedulerOutput) -> ModelInput:
        """prepare_host's ModelInput on the runner's device (host -> device copies, no sync), with the step's
        LoraBatch when a sequence has an adapter. A step the decode graphs take stays on the host: run()
        copies its rows straight into the graphs' buffers."""
        model_input = self.prepare_host(sched)
        model_input.lora = self.lora_batch(sched.seqs, sched.num_scheduled_tokens)
        if self.vision is not None:
            model_input.image_rows = step_image_rows(self.vision, sched.seqs, sched.num_scheduled_tokens, self.device)
        model_input.graph = self.graphs is not None and model_input.image_rows is None and self.graphs.takes(model_input)
        if self.device.type != "cpu" and not model_input.graph:
            model_input = model_input.to(self.device)     # (a graph's step copies its rows into its buffers)
        return model_input

    def lora_batch(self, seqs: list[Sequence], counts: list[int]) -> LoraBatch | None:
        """The step's LoraBatch (None when no sequence has an adapter): sequence j's counts[j] rows take its adapter's
        slot (-1 for the base). The slots are the distinct adapters ordered by their load key, so the same set
        of adapters gets the same stacks whatever the order of its sequences; stacks are kept for the
        LORA_STACKS_KEPT latest sets (a set is keyed by its adapters' load keys: a reloaded adapter is a new
        set)."""
        adapters = sorted({seq.adapter.key: seq.adapter for seq in seqs if seq.adapter is not None}.items())
        if not adapters:
            return None
        keys = tuple(key for key, _ in adapters)
        stacks = self._lora_stacks.pop(keys, None)
        if stacks is None:
            stacks = LoraBatch.build([a for _, a in adapters], [], [], self._lora_shapes, self.device,
                                     fused=tuple(FUSED))
            while len(self._lora_stacks) >= self.LORA_STACKS_KEPT:
                del self._lora_stacks[next(iter(self._lora_stacks))]
        self._lora_stacks[keys] = stacks                                # most recently used last
        slot = {key: i for i, key in enumerate(keys)}
        row_slot = torch.repeat_interleave(
            torch.tensor([-1 if s.adapter is None else slot[s.adapter.key] for s in seqs], dtype=torch.int64),
            torch.tensor(counts, dtype=torch.int64)).to(self.device, non_blocking=True)
        return replace(stacks, row_slot=row_slot)      # a new LoraBatch: its tile layout is made when first used

    def prepare_host(self, sched: SchedulerOutput) -> ModelInput:
        """Flatten the step: sequence i computes seq.all_token_ids[c : c+n] at positions c..c+n-1, where
        c = seq.num_computed_tokens (prefix-cache hits included) and n = sched.num_scheduled_tokens[i],
        writing K/V into the blocks of seq.block_table (which must already hold c+n tokens).
        Prefill chunks and decode steps mix freely. Reads the sequences, never modifies them; the loops
        are per sequence, the per-token work is tensor ops. Returns the ModelInput on the CPU.

        Raises: IndexError if a block table is too short; ValueError if n < 1 or c+n > num_tokens.
        """
        seqs, counts = sched.seqs, sched.num_scheduled_tokens
        starts = [s.num_computed_tokens for s in seqs]
        token_ids: list[int] = []
        for seq, start, n in zip(seqs, starts, counts):
            _check_schedulable(seq, start, n, self.block_size)
            token_ids += _token_slice(seq, start, n)
        if len(token_ids) == len(seqs) and not sched.blocks_to_copy and not any(
                seq.params.prompt_logprobs and seq.num_computed_tokens < seq.num_prompt_tokens for seq in seqs):
            model_input = self._prepare_decode(seqs, starts, token_ids)
        else:
            model_input = self._prepare_general(sched, starts, token_ids)
        if self.mrope is not None:      # Qwen2-VL: the RoPE positions of image prompts (its slots stay the index's)
            model_input.positions = self.mrope.step_positions(seqs, counts, model_input.positions)
        return model_input

    def _prepare_general(self, sched: SchedulerOutput, starts: list[int], token_ids: list[int]) -> ModelInput:
        """prepare_host's ModelInput for any step (prefill chunks, prompt-logprob rows, block copies): the
        positions and slots as tensor ops over the flat rows."""
        seqs, counts = sched.seqs, sched.num_scheduled_tokens
        cu = list(accumulate(counts, initial=0))
        positions, seq_index = _positions(starts, counts, cu)
        block_tables = build_block_tables([s.block_table for s in seqs])
        context_lens = [start + n for start, n in zip(starts, counts)]
        attn = AttentionMetadata(
            slot_mapping=slots_for_positions(block_tables, seq_index, positions, self.block_size),
            block_tables=block_tables, context_lens=torch.tensor(context_lens, dtype=torch.int32),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), query_lens=counts,
            context_lens_host=context_lens, block_size=self.block_size)
        chunked = [j for j, seq in enumerate(seqs)
                   if seq.params.prompt_logprobs and seq.num_computed_tokens < seq.num_prompt_tokens]
        # a row verifying drafts (engine/speculative/) also needs the logits of every row before its last
        verifying = [j for j, seq in enumerate(seqs) if seq.draft_token_ids]
        ends = [cu[j + 1] for j in chunked] + [cu[j + 1] - 1 for j in verifying]
        starts_ = [cu[j] for j in chunked + verifying]
        logit_rows = torch.tensor([r for a, b in zip(starts_, ends) for r in range(a, b)] + cu[1:], dtype=torch.int64)
        logit_rows[-len(seqs):] -= 1                                    # each sequence's last row
        spans, row = {}, 0
        for j, a, b in zip(chunked + verifying, starts_, ends):
            spans[j] = (row, row + b - a)
            row += b - a
        copies = torch.tensor(sched.blocks_to_copy, dtype=torch.int64).view(-1, 2) if sched.blocks_to_copy else None
        model_input = ModelInput(
            input_ids=torch.tensor(token_ids, dtype=torch.int64), positions=positions, attn=attn,
            logit_rows=logit_rows, num_chunk_rows=row, chunk_spans=spans, blocks_to_copy=copies)
        return model_input

    def _prepare_decode(self, seqs: list[Sequence], starts: list[int], token_ids: list[int]) -> ModelInput:
        """prepare_host's ModelInput for a step of one row per sequence, no prompt-logprob chunk and no block
        copy (decode): the same values, each tensor made once from Python lists (the general path's slot
        arithmetic as tensor ops costs more than the ints of a few rows; measured here, batch 1 with the caches
        cold from the weights' stream: prepare 0.20 -> 0.08 ms a step). slot = block_table[pos // bs] * bs +
        pos % bs, block_tables padded with block 0 (build_block_tables)."""
        bs, n = self.block_size, len(seqs)
        slots = [seq.block_table[pos // bs] * bs + pos % bs for seq, pos in zip(seqs, starts)]
        block_tables = build_block_tables([s.block_table for s in seqs])
        context_lens = [start + 1 for start in starts]
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=block_tables,
            context_lens=torch.tensor(context_lens, dtype=torch.int32),
            cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32), query_lens=[1] * n,
            context_lens_host=context_lens, block_size=bs)
        return ModelInput(input_ids=torch.tensor(token_ids, dtype=torch.int64),
                          positions=torch.tensor(starts, dtype=torch.int64), attn=attn,
                          logit_rows=torch.arange(n, dtype=torch.int64), num_chunk_rows=0, chunk_spans={})

    def failure(self) -> Exception | None:
        """The error that ended this runner for good, for health checks: never, in one process (a
        tensor-parallel executor returns its RankFailed)."""
        return None

    @torch.inference_mode()
    def execute(self, model_input: ModelInput) -> ModelOutput | None:
        """Run one step: write its K/V into the cache, return float32 logits in the caller's order (None on a
        tensor-parallel rank other than 0, which only joins the collectives)."""
        mi = model_input
        if mi.graph:                                                                      # CUDA decode
            return ModelOutput(logits=self.graphs.run(mi), chunk_logits={})
        if mi.blocks_to_copy is not None:
            copy_blocks(self.kv_cache, mi.blocks_to_copy)
        hidden = self.model(mi.input_ids, mi.positions, self.kv_caches, mi.attn, mi.lora,     # (T, hidden)
                            image_rows=mi.image_rows)
        # one row per sequence and no prompt-logprob chunk: logit_rows is every row in order (no copy)
        rows = hidden if mi.num_chunk_rows == 0 and hidden.shape[0] == mi.num_seqs else hidden[mi.logit_rows]
        logits = self.model.compute_logits(rows)                                           # (R, vocab) f32
        if logits is None:
            return None
        last = logits[mi.num_chunk_rows:]
        chunk_logits = {i: logits[a:b] for i, (a, b) in mi.chunk_spans.items()}
        return ModelOutput(logits=last, chunk_logits=chunk_logits)


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one KV-cache block over every layer: (K, V) x layers x block_size x KV heads x head_dim x
    the dtype's bytes (a tensor-parallel rank counts only its own KV heads)."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def copy_blocks(kv_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    """Copy whole KV blocks in place, every layer's K and V at once: block dst <- block src for each row.

    kv_cache: (layers, 2, num_blocks, block_size, kv_heads, head_dim); pairs: (N, 2) int64 (src, dst) on
    its device, no dst repeated and no dst also a src (copy-on-write targets are fresh blocks).
    """
    kv_cache.index_copy_(2, pairs[:, 1], kv_cache.index_select(2, pairs[:, 0]))


def copy_blocks_reference(kv_cache: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """copy_blocks one block at a time, for the test that compares the two."""
    for src, dst in pairs:
        kv_cache[:, :, dst].copy_(kv_cache[:, :, src])


def _check_fallback_settings(quantize: str | None, layout) -> None:
    """The transformers fallback runs the checkpoint's own weights in one process. Raises ConfigError naming the
    option otherwise."""
    if quantize is not None:
        raise ConfigError(f"option.quantize={quantize} runs on the native implementation only, not on the "
                          "transformers fallback (option.model_impl)")
    if layout is not None:
        raise ConfigError("option.tensor_parallel_degree > 1 runs on the native implementation only; the "
                          "transformers fallback (option.model_impl) runs in one process")


def _check_schedulable(seq: Sequence, start: int, n: int, block_size: int) -> None:
    if n < 1 or start + n > seq.num_tokens + len(seq.draft_token_ids):
        raise ValueError(f"request {seq.request_id}: cannot schedule {n} tokens from "
                         f"position {start} of {seq.num_tokens}")
    if -(-(start + n) // block_size) > len(seq.block_table):
        raise IndexError(f"request {seq.request_id}: {len(seq.block_table)} blocks cannot hold "
                         f"{start + n} tokens of {block_size}")


def _token_slice(seq: Sequence, start: int, n: int) -> list[int]:
    """(seq.all_token_ids + seq.draft_token_ids)[start:start + n] without copying the whole sequence (decode
    reads one token; a verifying row its last token and its drafts)."""
    if start + n > seq.num_tokens:
        return _token_slice(seq, start, seq.num_tokens - start) + seq.draft_token_ids[:start + n - seq.num_tokens]
    num_prompt = seq.num_prompt_tokens
    if start >= num_prompt:
        return seq.output_token_ids[start - num_prompt:start - num_prompt + n]
    head = seq.prompt_token_ids[start:start + n]
    return head if start + n <= num_prompt else head + seq.output_token_ids[:start + n - num_prompt]


def _positions(starts: list[int], counts: list[int], cu: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """((T,) int64 positions, (T,) int64 sequence index of each flat row), as tensor ops."""
    num_tokens = cu[-1]
    if num_tokens == len(counts):                      # all decodes: one row per sequence
        return torch.tensor(starts, dtype=torch.int64), torch.arange(num_tokens)
    seq_index = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts), output_size=num_tokens)
    offset = torch.tensor(starts, dtype=torch.int64) - torch.tensor(cu[:-1], dtype=torch.int64)   # (S,)
    return torch.arange(num_tokens) + offset[seq_index], seq_index
