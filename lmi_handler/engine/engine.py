"""Engine: add_request / step / abort — the continuous-batching loop both batch modes share.

Owns the step's order (schedule, prepare, forward, sample, update, emit) and the requests in flight;
the parts it calls own their nouns (scheduler, model runner, sampler, stopping, output processor).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from lmi_handler.config import EngineConfig
from lmi_handler.engine.kv_cache import BlockAllocator, num_blocks_needed
from lmi_handler.engine.model_runner import ModelOutput
from lmi_handler.engine.output_processor import (
    OutputProcessor,
    PromptChunk,
    StepSample,
    gather_prompt_logprobs,
    plan_prompt_logprobs,
)
from lmi_handler.engine.parallel.launch import start_runner
from lmi_handler.engine.precision import Precision, checkpoint_dtype, resolve_precision
from lmi_handler.engine.sampler import Sampler, SamplingMetadata
from lmi_handler.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from lmi_handler.engine.sequence import RequestOutput, SamplingParams, Sequence, random_seed
from lmi_handler.engine.stopping import StopTable

logger = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """The engine cannot take the request as given (e.g. it can never fit the context or KV cache)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class RequestTooLong(RequestRejected):
    """prompt + max_new_tokens can never fit: past the model's context (`limit_name` "context") or the whole
    KV cache ("kv_cache"). Carries the numbers (tokens) so each dialect can word the 400 in its own fields."""

    def __init__(self, field: str, message: str, *, num_prompt_tokens: int, max_new_tokens: int, limit: int,
                 limit_name: str):
        super().__init__(field, message)
        self.num_prompt_tokens, self.max_new_tokens = num_prompt_tokens, max_new_tokens
        self.limit, self.limit_name = limit, limit_name


def pick_device(device_id: int) -> torch.device:
    """cuda:device_id (cuda:0 for -1) when CUDA is present, else CPU."""
    if torch.cuda.is_available():
        return torch.device(f"cuda:{max(device_id, 0)}")
    return torch.device("cpu")


def pick_precision(config: EngineConfig, device: torch.device) -> Precision:
    """option.dtype and option.quantize for this checkpoint on this device (precision.resolve_precision).
    Raises: ConfigError naming option.quantize when the engine cannot serve it."""
    from lmi_handler.engine.model.kernels import cpu_kernels
    from lmi_handler.engine.model.kernels.build import native_bf16_cpu

    return resolve_precision(config.dtype, config.quantize, checkpoint_dtype(config.model_path), device,
                             native_bf16=device.type == "cpu" and native_bf16_cpu(),
                             kernels_built=lambda: cpu_kernels() is not None)


class Engine:
    """Continuous batching over our own model runner: requests join and leave between steps."""

    def __init__(self, config: EngineConfig, tokenizer=None):
        from transformers import AutoTokenizer

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = pick_device(config.device_id)
        precision = pick_precision(config, self.device)
        (logger.warning if precision.warn else logger.info)("%s", precision.reason)
        # a ModelRunner, or under tensor parallelism rank 0's executor over the group (engine/parallel/)
        self.runner = start_runner(config, self.device, precision)
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(config.model_path))
        model_len = self.runner.config.max_model_len
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        self.allocator = BlockAllocator(self.runner.num_blocks, self.runner.block_size)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   enable_prefix_caching=config.enable_prefix_caching),
                                   self.allocator)
        self.sampler = Sampler()
        self.row_tables = RowTables(self.runner.config.vocab_size, self.eos_token_ids, self.max_model_len,
                                    self.device)
        self.output = OutputProcessor(self.tokenizer)
        self.seqs: dict[str, Sequence] = {}
        logger.info("engine ready: %s %s, %d KV blocks of %d tokens, max_model_len %d",
                    self.device, self.runner.dtype, self.runner.num_blocks, self.runner.block_size,
                    self.max_model_len)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.runner.config.eos_token_ids

    def failure(self) -> Exception | None:
        """The EngineFatal error that ended this engine for good (a tensor-parallel rank failed), else None;
        cheap enough for every health check."""
        return self.runner.failure()

    # ---- requests in and out -------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise RequestTooLong unless prompt + max_new_tokens fits the context and the KV cache."""
        total = num_prompt_tokens + max_new_tokens
        counts = dict(num_prompt_tokens=num_prompt_tokens, max_new_tokens=max_new_tokens)
        if num_prompt_tokens >= self.max_model_len or total > self.max_model_len:
            raise RequestTooLong(
                "inputs", f"inputs has {num_prompt_tokens} tokens and max_new_tokens is {max_new_tokens}: "
                f"their sum {total} exceeds the model's token limit of {self.max_model_len} "
                f"(shorten the input, lower max_new_tokens, or set parameters.truncate)",
                **counts, limit=self.max_model_len, limit_name="context")
        if num_blocks_needed(total, self.allocator.block_size) > self.allocator.num_blocks:
            cache_tokens = self.allocator.num_blocks * self.allocator.block_size
            raise RequestTooLong("max_new_tokens", f"{total} tokens exceed the KV cache ({cache_tokens} tokens)",
                                 **counts, limit=cache_tokens, limit_name="kv_cache")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    seed: int | None = None) -> Sequence:
        """Queue a request. `seed` is the front end's seed, used when params.seed is None.

        Sampled rows always get a seed here (drawn once at admission when neither is given), so
        their draws depend only on (seed, position). Raises RequestRejected (see check_fits).
        """
        self.check_fits(len(prompt_token_ids), params.max_new_tokens)
        if request_id in self.seqs:
            raise RequestRejected("request_id", f"request_id {request_id!r} is already running")
        if params.seed is None:
            params = replace(params, seed=seed if seed is not None else random_seed())
        seq = Sequence(request_id, list(prompt_token_ids), params, arrival_time=time.monotonic())
        self.seqs[request_id] = seq
        self.output.add(seq)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        """Drop a request at once (client gone, reset); frees its KV blocks. Unknown ids are ignored."""
        seq = self.seqs.pop(request_id, None)
        self.output.remove(request_id)
        if seq is not None:
            self.scheduler.finish(seq)

    def abort_all(self) -> None:
        for request_id in list(self.seqs):
            self.abort(request_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step for every scheduled sequence; return the outputs of requests that moved."""
        sched = self.scheduler.schedule()                # which sequences, how many tokens each
        if sched.is_empty:
            return []
        model_input = self.runner.prepare(sched)         # SchedulerOutput -> ModelInput (plain tensors)
        sampling = self._prepare_sampling(sched)         # rows due a token, their tables (device)
        model_out = self.runner.execute(model_input)     # forward: logits
        self.scheduler.update_from_output(sched)         # their tokens are in the KV cache now
        sampled = self._sample(sampling, model_out)      # token ids, log probs, stop reasons (device)
        outputs = self.output.process(sampled)           # the one host sync; text, stop strings
        self._finish(sampled.seqs)                       # free what finished
        return outputs

    def _prepare_sampling(self, sched: SchedulerOutput) -> SamplingInput:
        """Before the forward, so every host -> device copy is queued ahead of it: the rows whose prompt is
        done after this step (a token is due), their sampling and stop tables, the prompt-logprob targets."""
        rows = [i for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_scheduled_tokens))
                if seq.num_computed_tokens + n == seq.num_tokens]
        seqs = [sched.seqs[i] for i in rows]
        chunks, targets = plan_prompt_logprobs(sched, self.device)
        if not seqs:
            return SamplingInput(seqs, None, None, None, chunks, targets)
        meta, stops = self.row_tables.get(seqs)
        row_index = None if len(rows) == len(sched.seqs) else torch.tensor(rows).to(self.device)
        return SamplingInput(seqs, row_index, meta, stops, chunks, targets)

    def _sample(self, sampling: SamplingInput, model_out: ModelOutput) -> StepSample:
        """Sample the due rows and check eos / stop ids / length, all on the device."""
        prompt_values = gather_prompt_logprobs(sampling.prompt_chunks, sampling.prompt_targets, model_out)
        if not sampling.seqs:
            return StepSample([], None, None, sampling.prompt_chunks, prompt_values)
        logits = model_out.logits                                                   # (S, vocab) float32
        if sampling.row_index is not None:
            logits = logits.index_select(0, sampling.row_index)                     # (B, vocab)
        sampled = self.sampler(logits, sampling.meta)
        self.row_tables.record(sampled.token_ids)
        reasons = sampling.stops.reasons(sampled.token_ids, sampling.meta.positions + 1)
        return StepSample(sampling.seqs, sampled, reasons, sampling.prompt_chunks, prompt_values)

    def _finish(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                self.seqs.pop(seq.request_id, None)
                self.output.remove(seq.request_id)

    def iterate(self, requests: list[tuple[str, list[int], SamplingParams]]) -> Iterator[list[RequestOutput]]:
        """Add the requests, then yield each step's outputs until all of them finished (dynamic batch).

        Closing the iterator early (client gone) aborts whichever of them are still running.
        """
        ids = [request_id for request_id, _, _ in requests]
        try:
            for request_id, prompt_ids, params in requests:
                self.add_request(request_id, prompt_ids, params)
            while any(rid in self.seqs for rid in ids):
                yield [out for out in self.step() if out.request_id in ids]
        finally:
            for request_id in ids:
                self.abort(request_id)

    def generate(self, requests: list[tuple[str, list[int], SamplingParams]]) -> dict[str, list[RequestOutput]]:
        """Run the given requests to completion (dynamic batch); returns each one's outputs, step by step."""
        outputs: dict[str, list[RequestOutput]] = {request_id: [] for request_id, _, _ in requests}
        for step_outputs in self.iterate(requests):
            for out in step_outputs:
                outputs[out.request_id].append(out)
        return outputs


@dataclass
class SamplingInput:
    """The sampling side of one step, built before its forward (Engine._prepare_sampling)."""

    seqs: list[Sequence]                 # rows due a token, in the step's order
    row_index: torch.Tensor | None       # (B,) int64 their rows in the step's logits; None = every row
    meta: SamplingMetadata | None
    stops: StopTable | None
    prompt_chunks: list[PromptChunk]
    prompt_targets: torch.Tensor | None  # (N,) int64 on the device


class RowTables:
    """The sampled rows' SamplingMetadata and StopTable, kept between steps.

    While a step samples the same sequences, in the same order, as the step before (steady decode),
    the tables are advanced on the device (positions + 1, the sampled tokens appended) instead of
    being rebuilt from the sequences; any other composition rebuilds them.
    """

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], max_model_len: int, device: torch.device):
        self.vocab_size, self.eos_token_ids, self.max_model_len = vocab_size, eos_token_ids, max_model_len
        self.device = device
        self._seqs: list[Sequence] = []
        self._counts: list[int] = []
        self._tables: tuple[SamplingMetadata, StopTable] | None = None
        self._last_tokens: torch.Tensor | None = None

    def get(self, seqs: list[Sequence]) -> tuple[SamplingMetadata, StopTable]:
        """Tables for these rows; record() must follow with the tokens sampled from them."""
        counts = [s.num_output_tokens for s in seqs]
        same = (self._tables is not None and self._last_tokens is not None and len(seqs) == len(self._seqs)
                and all(a is b for a, b in zip(seqs, self._seqs))
                and all(c == c0 + 1 for c, c0 in zip(counts, self._counts)))   # each row gained one token
        if same:
            meta, stops = self._tables
            self._tables = (meta.advanced(self._last_tokens), stops)
        else:
            self._tables = (SamplingMetadata.from_sequences(seqs, self.vocab_size, self.device),
                            StopTable.from_sequences(seqs, self.eos_token_ids, self.max_model_len, self.device))
        self._seqs, self._counts, self._last_tokens = list(seqs), counts, None
        return self._tables

    def record(self, token_ids: torch.Tensor) -> None:
        """The (B,) int64 tokens just sampled for the rows of the last get()."""
        self._last_tokens = token_ids
