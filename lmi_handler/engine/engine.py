"""Engine: add_request / step / abort — the continuous-batching loop both batch modes share.

Owns the step's order (schedule, prepare, forward, sample, update, emit) and the requests in flight;
the parts it calls own their nouns (scheduler, model runner, sampler, stopping, output processor).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import torch

from lmi_handler.config import ConfigError, EngineConfig
from lmi_handler.engine.beam_search import BeamSearch, beam_candidates
from lmi_handler.engine.grammar import GrammarCompiler
from lmi_handler.engine.kv_cache import BlockAllocator, num_blocks_needed
from lmi_handler.engine.model.backend import backend_ops
from lmi_handler.engine.model.loader import spec_from_config
from lmi_handler.engine.model.lora import AdapterRegistry, LoraAdapter, LoraError, LoraLimits
from lmi_handler.engine.model.vision import text_config_of
from lmi_handler.engine.model_runner import ModelOutput, read_model_config
from lmi_handler.engine.output_processor import (
    OutputProcessor,
    PromptChunk,
    StepSample,
    gather_prompt_logprobs,
    plan_prompt_logprobs,
)
from lmi_handler.engine.parallel.launch import start_runner
from lmi_handler.engine.precision import pick_device, pick_precision
from lmi_handler.engine.sampler import Sampler, SamplingMetadata
from lmi_handler.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from lmi_handler.engine.sequence import FinishReason, RequestOutput, SamplingParams, Sequence, random_seed
from lmi_handler.engine.speculative import VerifyRows, build_speculator, expand_rows, gather_logits
from lmi_handler.engine.stopping import StopTable
from lmi_handler.engine.threads import ThreadControl

logger = logging.getLogger(__name__)


LORA_NOT_APPLIED = ("LoRA adapters are not applied under tensor parallelism (tensor_parallel_degree > 1): requests "
                    "naming one are refused")


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


class Engine:
    """Continuous batching over our own model runner: requests join and leave between steps."""

    def __init__(self, config: EngineConfig, tokenizer=None):
        from transformers import AutoTokenizer

        self.threads = ThreadControl(config.num_threads)   # fixed, or auto: sized to the CPU and adapted
        check_max_model_len(config)
        self.device = pick_device(config.device_id)
        precision = pick_precision(config, self.device)
        (logger.warning if precision.warn else logger.info)("%s", precision.reason)
        # a ModelRunner, or under tensor parallelism rank 0's executor over the group (engine/parallel/)
        self.runner = start_runner(config, self.device, precision)
        if config.lora is not None and self.runner.kernel_backend == "transformers":
            raise ConfigError("option.enable_lora runs on the native implementation only, not on the transformers "
                              "fallback (option.model_impl)")
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(config.model_path))
        self.max_model_len = config.max_model_len or self.runner.config.max_model_len
        self.allocator = BlockAllocator(self.runner.num_blocks, self.runner.block_size)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   enable_prefix_caching=config.enable_prefix_caching,
                                                   max_loras=config.lora.max_loras if config.lora else None,
                                                   scheduling_policy=config.scheduling_policy),
                                   self.allocator)
        # LoRA adapters by name (option.enable_lora), None when off; loaded by service.py and the adapter routes
        self.adapters = self._adapter_registry(config)
        # Whether the model's forward adds the adapters' terms (the runner's LoraBatch per step, LoraBatch.add
        # after each projection): a one-process ModelRunner does; a tensor-parallel executor does not, and
        # requests naming an adapter are refused there (LORA_NOT_APPLIED), never answered by the base model.
        self.applies_lora = self.runner.applies_lora
        # on the Triton backend its row-wise log_softmax / greedy / seeded draw pick the tokens (on the device)
        self.sampler = Sampler(backend_ops("triton") if self.runner.kernel_backend == "triton"
                               else None)
        self.row_tables = RowTables(self.runner.config.vocab_size, self.eos_token_ids, self.max_model_len,
                                    self.device)
        self.output = OutputProcessor(self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.runner.config.vocab_size, self.eos_token_ids,
                                        config.structured_output_compile_timeout_s)
        self.beams = BeamSearch(self.scheduler, self.tokenizer, self.eos_token_ids)
        self.seqs: dict[str, Sequence] = {}
        self._compiling: list[Sequence] = []   # waiting for their grammar, in arrival order
        # speculative decoding (option.speculative_config; engine/speculative/), None when off
        self.speculator = build_speculator(config, self.runner, self.tokenizer, self.max_model_len)
        logger.info("engine ready: %s %s, %d KV blocks of %d tokens, max_model_len %d",
                    self.device, self.runner.dtype, self.runner.num_blocks, self.runner.block_size,
                    self.max_model_len)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.runner.config.eos_token_ids

    def _adapter_registry(self, config: EngineConfig) -> AdapterRegistry | None:
        if config.lora is None:
            return None
        limits = LoraLimits(config.lora.max_lora_rank, config.lora.target_modules, config.lora.max_cpu_loras,
                            config.lora.adapter_roots)
        base = text_config_of(json.loads((Path(config.model_path) / "config.json").read_text()))   # a VLM's LM
        return AdapterRegistry(base, limits, held=self._held_adapters, sparse_layers=sparse_layers(base))

    def _held_adapters(self) -> set[str]:
        """Names of the adapters live sequences hold (called from the adapter routes' thread: tuple() copies
        the dict's values in one step under the GIL)."""
        return {seq.adapter.name for seq in tuple(self.seqs.values()) if seq.adapter is not None}

    def failure(self) -> Exception | None:
        """The EngineFatal error that ended this engine for good (a tensor-parallel rank failed), else None;
        cheap enough for every health check."""
        return self.runner.failure()

    # ---- requests in and out -------------------------------------------------------------

    def check_priority(self, priority: int) -> None:
        """Raise RequestRejected (field "priority") for a priority other than 0 unless the scheduler orders by
        priority (option.scheduling_policy=priority): under fcfs it would be ignored, and vLLM refuses it so."""
        if priority != 0 and not self.scheduler.config.by_priority:
            raise RequestRejected("priority", f"priority {priority} needs option.scheduling_policy=priority; this "
                                  "server schedules first come, first served (fcfs), where only priority 0 is taken")

    def check_fits(self, num_prompt_tokens: int, max_new_tokens: int, num_beams: int = 1) -> None:
        """Raise RequestTooLong unless prompt + max_new_tokens fits the context and the KV cache (for each of
        num_beams beams, counting no sharing); RequestRejected unless num_beams fits max_num_seqs."""
        total = num_prompt_tokens + max_new_tokens
        counts = dict(num_prompt_tokens=num_prompt_tokens, max_new_tokens=max_new_tokens)
        if num_prompt_tokens >= self.max_model_len or total > self.max_model_len:
            raise RequestTooLong(
                "inputs", f"inputs has {num_prompt_tokens} tokens and max_new_tokens is {max_new_tokens}: "
                f"their sum {total} exceeds the model's token limit of {self.max_model_len} "
                f"(shorten the input, lower max_new_tokens, or set parameters.truncate)",
                **counts, limit=self.max_model_len, limit_name="context")
        if num_beams > self.scheduler.config.max_num_seqs:
            raise RequestRejected("num_beams", f"num_beams {num_beams} exceeds max_rolling_batch_size "
                                  f"({self.scheduler.config.max_num_seqs}): every beam is a sequence of the batch")
        if num_blocks_needed(total, self.allocator.block_size) * num_beams > self.allocator.num_blocks:
            cache_tokens = self.allocator.num_blocks * self.allocator.block_size
            what = f"{num_beams} beams of {total} tokens" if num_beams > 1 else f"{total} tokens"
            raise RequestTooLong("max_new_tokens", f"{what} exceed the KV cache ({cache_tokens} tokens)",
                                 **counts, limit=cache_tokens // num_beams, limit_name="kv_cache")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    seed: int | None = None) -> Sequence:
        """Queue a request. `seed` is the front end's seed, used when params.seed is None.

        Sampled rows always get a seed here (drawn once at admission when neither is given), so
        their draws depend only on (seed, position). num_beams > 1 runs a beam search (deterministic: the
        sampling knobs are ignored) that reports once, at its end. Raises RequestRejected (see check_fits,
        check_priority).
        """
        self.check_fits(len(prompt_token_ids), params.max_new_tokens, params.num_beams)
        self.check_priority(params.priority)
        if request_id in self.seqs:
            raise RequestRejected("request_id", f"request_id {request_id!r} is already running")
        if params.seed is None:
            params = replace(params, seed=seed if seed is not None else random_seed())
        if params.uses_beam_search:
            params = replace(params, greedy=True)
        seq = Sequence(request_id, list(prompt_token_ids), params, arrival_time=time.monotonic(),
                       adapter=self._adapter(params.adapter))
        if params.uses_beam_search:
            self.beams.add(seq, min(params.max_new_tokens, self.max_model_len - len(prompt_token_ids)))
        if params.structured_output is not None:
            seq.grammar_ticket = self.grammars.submit(params.structured_output)
            self._compiling.append(seq)
        self.seqs[request_id] = seq
        self.output.add(seq)
        self.scheduler.add(seq)
        return seq

    def _adapter(self, name: str | None) -> LoraAdapter | None:
        """The loaded adapter `name` names (None: the base). Raises RequestRejected (field "adapter") when LoRA
        is off, the runner does not apply adapters (tensor parallelism), or no adapter of that name is loaded."""
        if name is None:
            return None
        if self.adapters is None:
            raise RequestRejected("adapter", f"adapter {name!r} requested but LoRA is off (option.enable_lora)")
        if not self.applies_lora:
            raise RequestRejected("adapter", LORA_NOT_APPLIED)
        try:
            return self.adapters.get(name)
        except LoraError as exc:
            raise RequestRejected("adapter", str(exc)) from None

    def abort(self, request_id: str) -> None:
        """Drop a request at once (client gone, reset); frees its KV blocks. Unknown ids are ignored."""
        seq = self.seqs.pop(request_id, None)
        self.output.remove(request_id)
        self.beams.abort(request_id)
        if seq is not None:
            self.scheduler.finish(seq)
            if self.speculator is not None:
                self.speculator.forget(seq)

    def abort_all(self) -> None:
        for request_id in list(self.seqs):
            self.abort(request_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step for every scheduled sequence; return the outputs of requests that moved."""
        failed = self._poll_grammars()                   # compiled grammars attach; failed compiles end
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)   # decode rows' drafts, verified this step
        sched = self.scheduler.schedule()                # which sequences, how many tokens each
        if sched.is_empty:
            self._idle_wait()
            return failed
        model_input = self.runner.prepare(sched)         # SchedulerOutput -> ModelInput (plain tensors)
        sampling = self._prepare_sampling(sched)         # rows due a token, their tables (device)
        with self.threads.measure(sum(sched.num_scheduled_tokens)):
            model_out = self.runner.execute(model_input)  # forward: logits
        self.scheduler.update_from_output(sched)         # their tokens are in the KV cache now
        sampled = self._sample(sampling, model_out)      # token ids, log probs, stop reasons (device)
        outputs = self.output.process(sampled)           # the one host sync; text, stop strings, grammars
        outputs += self._advance_beams(sampled)          # beams fork, die or end
        if self.speculator is not None:
            self.speculator.settle(sampled.accepted, self.scheduler)   # accepted drafts' K/V kept, the rest freed
        self._finish(sampled.seqs)                       # free what finished
        return failed + outputs

    def _poll_grammars(self) -> list[RequestOutput]:
        """Attach the grammars that finished compiling; end (finish reason error) the requests whose compile
        failed or ran past option.structured_output_compile_timeout_s. Never blocks."""
        if not self._compiling:
            return []
        now, failed, still = time.monotonic(), [], []
        for seq in self._compiling:
            if self.seqs.get(seq.request_id) is not seq:
                continue                                 # aborted meanwhile
            outcome = seq.grammar_ticket.outcome(now, self.eos_token_ids + seq.params.stop_token_ids)
            if outcome is None:
                still.append(seq)
            elif isinstance(outcome, str):
                failed.append(self._fail_waiting(seq, outcome))
            else:
                seq.grammar = outcome
        self._compiling = still
        return failed

    def _fail_waiting(self, seq: Sequence, error: str) -> RequestOutput:
        seq.finish_reason, seq.error = FinishReason.ERROR, error
        self.beams.abort(seq.request_id)
        self._finish([seq])
        return RequestOutput(seq.request_id, [], "", True, FinishReason.ERROR, seq.num_prompt_tokens, 0, error=error,
                             invalid_request=True)

    def _idle_wait(self) -> None:
        """Nothing to run: rather than spin, wait a moment for the first pending compile (the caller loops)."""
        if self._compiling:
            self.grammars.wait_any([s.grammar_ticket for s in self._compiling], timeout_s=0.05)

    def _prepare_sampling(self, sched: SchedulerOutput) -> SamplingInput:
        """Before the forward, so every host -> device copy is queued ahead of it: the rows whose prompt is
        done after this step (a token is due), their sampling and stop tables, the prompt-logprob targets."""
        rows = [i for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_scheduled_tokens))
                if seq.num_computed_tokens + n == seq.num_tokens + len(seq.draft_token_ids)]
        seqs = [sched.seqs[i] for i in rows]
        chunks, targets = plan_prompt_logprobs(sched, self.device)
        if not seqs:
            return SamplingInput(seqs, None, None, None, chunks, targets)
        verify = expand_rows(seqs, rows) if any(seq.draft_token_ids for seq in seqs) else None
        meta, stops = self.row_tables.get(verify.views if verify is not None else seqs)
        row_index = None if verify is not None or len(rows) == len(sched.seqs) else \
            torch.tensor(rows).to(self.device, non_blocking=True)
        return SamplingInput(verify.owners if verify is not None else seqs, row_index, meta, stops, chunks, targets,
                             verify)

    def _sample(self, sampling: SamplingInput, model_out: ModelOutput) -> StepSample:
        """Sample the due rows and check eos / stop ids / length, all on the device."""
        prompt_values, prompt_top = gather_prompt_logprobs(sampling.prompt_chunks, sampling.prompt_targets, model_out)
        if not sampling.seqs:
            return StepSample([], None, None, sampling.prompt_chunks, prompt_values, prompt_top)
        logits = model_out.logits if sampling.verify is None else gather_logits(model_out, sampling.verify)
        if sampling.row_index is not None:                                          # (B, vocab) float32
            logits = logits.index_select(0, sampling.row_index)                     # (B, vocab)
        layout = self.beams.layout(sampling.seqs)
        if layout is not None:   # beam rows score log probs; processors then edit those (transformers' order)
            rows = torch.tensor([r for group_rows in layout[1] for r in group_rows]).to(self.device, non_blocking=True)
            logits = logits.index_copy(0, rows, torch.log_softmax(logits.index_select(0, rows), dim=-1))
        meta = self._with_grammar_masks(sampling.seqs, sampling.meta, sampling.verify)
        processed = self.sampler.process(logits, meta)
        sampled = self.sampler.pick(processed, meta)
        self.row_tables.record(sampled.token_ids)
        reasons = sampling.stops.reasons(sampled.token_ids, sampling.meta.positions + 1)
        candidates = beam_candidates(processed, *layout) if layout is not None else None
        return StepSample(sampling.seqs, sampled, reasons, sampling.prompt_chunks, prompt_values, prompt_top,
                          beam_groups=layout[0] if layout is not None else [], beam_candidates=candidates,
                          drafts=sampling.verify.drafts if sampling.verify is not None else {})

    def _advance_beams(self, step: StepSample) -> list[RequestOutput]:
        """Each beam group's step from its candidates (brought to the host with the step's one sync)."""
        outputs = []
        for group, candidates in zip(step.beam_groups, step.beam_results):
            out = self.beams.advance(group, *candidates)
            if out is not None:
                out.prompt_tokens = self.output.take_prompt_tokens(group.request_id)
                self.seqs.pop(group.request_id, None)
                self.output.remove(group.request_id)
                outputs.append(out)
        return outputs

    def _with_grammar_masks(self, seqs: list[Sequence], meta: SamplingMetadata,
                            verify: VerifyRows | None = None) -> SamplingMetadata:
        """The step's metadata with a bitmask row for each constrained row (filled while the forward runs on an
        accelerator; on CPU, after it); a verify row's mask follows the drafts before it."""
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return meta
        prefixes = [verify.prefixes[i] for i in rows] if verify is not None else None
        bitmask = self.grammars.fill_bitmask([seqs[i] for i in rows], prefixes).to(self.device, non_blocking=True)
        index = None if len(rows) == len(seqs) else torch.tensor(rows).to(self.device, non_blocking=True)
        return replace(meta, grammar_rows=index, grammar_bitmask=bitmask)

    def _finish(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                if self.speculator is not None:
                    self.speculator.forget(seq)
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
    verify: VerifyRows | None = None     # rows of sequences verifying drafts (seqs: their owners), None if none


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
        # a beam's new token is its group's choice, not the token its row sampled: steps with beams rebuild
        same = (self._tables is not None and self._last_tokens is not None and len(seqs) == len(self._seqs)
                and all(a is b and a.beam_group is None for a, b in zip(seqs, self._seqs))
                and all(c == c0 + 1 for c, c0 in zip(counts, self._counts)))   # each row gained one token
        if same:
            meta, stops = self._tables
            self._tables = (meta.advanced(self._last_tokens), stops)
        else:
            self._tables = (SamplingMetadata.from_sequences(seqs, self.vocab_size, self.device, self.eos_token_ids),
                            StopTable.from_sequences(seqs, self.eos_token_ids, self.max_model_len, self.device))
        self._seqs, self._counts, self._last_tokens = list(seqs), counts, None
        return self._tables

    def record(self, token_ids: torch.Tensor) -> None:
        """The (B,) int64 tokens just sampled for the rows of the last get()."""
        self._last_tokens = token_ids


def check_max_model_len(config: EngineConfig) -> None:
    """Refuse option.max_model_len past the model's own context (config.json max_position_embeddings), as vLLM
    does, before anything loads: positions past it were never trained. Raises ConfigError naming both."""
    model_len = read_model_config(config.model_path, config.model_impl, config.trust_remote_code).max_model_len
    if config.max_model_len is not None and config.max_model_len > model_len:
        raise ConfigError(f"option.max_model_len={config.max_model_len} exceeds the model's context of {model_len} "
                          "tokens (max_position_embeddings in its config.json): set it to at most that, or unset")


def sparse_layers(cfg: dict) -> frozenset[int]:
    """The mixture-of-experts layers of config.json's model (the layer description's rule, families.py); none
    for a model the layer description does not serve (the transformers fallback takes no adapters)."""
    try:
        spec = spec_from_config(cfg)
    except ConfigError:
        return frozenset()
    return frozenset(i for i, layer in enumerate(spec.layers) if layer.moe is not None)
