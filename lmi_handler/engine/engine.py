"""Engine: add_request / step / abort — the continuous-batching loop both batch modes share.

Owns the step's order (schedule, forward, sample, stop, detokenize, emit) and each request's
text state; the parts it calls own their nouns (scheduler, model runner, sampler, stopping).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from lmi_handler.config import EngineConfig
from lmi_handler.engine.detokenizer import IncrementalDetokenizer
from lmi_handler.engine.kv_cache import BlockAllocator, num_blocks_needed
from lmi_handler.engine.model_runner import ModelOutput, ModelRunner
from lmi_handler.engine.sampler import Sampler, SamplerOutput, SamplingMetadata
from lmi_handler.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from lmi_handler.engine.sequence import FinishReason, RequestOutput, SamplingParams, Sequence, TokenOutput, random_seed
from lmi_handler.engine.stopping import FINISH_REASONS, STOP_NONE, StopStringMatcher, build_stop_ids, token_stop_reasons

logger = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """The engine cannot take the request as given (e.g. it can never fit the context or KV cache)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class TextState:
    """A request's text side: incremental detokenizer, stop-string matcher, tokens awaiting release."""

    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher
    pending: list[TokenOutput] = field(default_factory=list)
    prompt_tokens: list[TokenOutput] | None = None


def pick_device(device_id: int) -> torch.device:
    """cuda:device_id (cuda:0 for -1) when CUDA is present, else CPU."""
    if torch.cuda.is_available():
        return torch.device(f"cuda:{max(device_id, 0)}")
    return torch.device("cpu")


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is float32 on CPU and bfloat16 on CUDA; otherwise the named dtype."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class Engine:
    """Continuous batching over our own model runner: requests join and leave between steps."""

    def __init__(self, config: EngineConfig, tokenizer=None):
        from transformers import AutoTokenizer

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = pick_device(config.device_id)
        self.runner = ModelRunner(config.model_path, pick_dtype(config.dtype, self.device), self.device,
                                  block_size=config.block_size, kv_cache_bytes=config.kv_cache_bytes,
                                  batch_invariant=config.batch_invariant)
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(config.model_path))
        model_len = self.runner.config.max_model_len
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        self.allocator = BlockAllocator(self.runner.num_blocks, self.runner.block_size)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens),
                                   self.allocator)
        self.sampler = Sampler()
        self.seqs: dict[str, Sequence] = {}
        self.texts: dict[str, TextState] = {}
        logger.info("engine ready: %s %s, %d KV blocks of %d tokens, max_model_len %d",
                    self.device, self.runner.dtype, self.runner.num_blocks, self.runner.block_size,
                    self.max_model_len)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.runner.config.eos_token_ids

    # ---- requests in and out -------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise RequestRejected unless prompt + max_new_tokens fits the context and the KV cache."""
        total = num_prompt_tokens + max_new_tokens
        if num_prompt_tokens >= self.max_model_len or total > self.max_model_len:
            raise RequestRejected(
                "inputs", f"inputs has {num_prompt_tokens} tokens and max_new_tokens is {max_new_tokens}: "
                f"their sum {total} exceeds the model's token limit of {self.max_model_len} "
                f"(shorten the input, lower max_new_tokens, or set parameters.truncate)")
        if num_blocks_needed(total, self.allocator.block_size) > self.allocator.num_blocks:
            raise RequestRejected("max_new_tokens", f"{total} tokens exceed the KV cache "
                                  f"({self.allocator.num_blocks * self.allocator.block_size} tokens)")

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
            chosen = seed if seed is not None else random_seed()
            params = _with_seed(params, chosen)
        seq = Sequence(request_id, list(prompt_token_ids), params, arrival_time=time.monotonic())
        self.seqs[request_id] = seq
        self.texts[request_id] = TextState(
            IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens),
            StopStringMatcher(params.stop_sequences, params.include_stop_str_in_output))
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        """Drop a request at once (client gone, reset); frees its KV blocks. Unknown ids are ignored."""
        seq = self.seqs.pop(request_id, None)
        self.texts.pop(request_id, None)
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
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        model_out = self.runner.execute(sched.seqs, sched.num_scheduled_tokens)
        self.scheduler.update_from_output(sched)
        self._record_prompt_logprobs(sched, model_out)
        rows = [i for i, seq in enumerate(sched.seqs) if seq.num_computed_tokens == seq.num_tokens]
        outputs = self._sample_and_append([sched.seqs[i] for i in rows], model_out.logits[rows])
        for seq in sched.seqs:
            if seq.is_finished:
                self._release(seq)
        return outputs

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

    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor) -> list[RequestOutput]:
        if not seqs:
            return []
        meta = SamplingMetadata.from_sequences(seqs, self.runner.config.vocab_size, logits.device)
        sampled = self.sampler(logits, meta)
        reasons = self._token_reasons(seqs, sampled.token_ids)
        # one host sync per step: the new tokens, their log probs and stop reasons go to Python
        token_ids = sampled.token_ids.tolist()
        logprobs = sampled.logprobs.tolist()
        tops = _top_lists(sampled)
        reasons_list = reasons.tolist()
        now = time.monotonic()
        outputs = []
        for i, seq in enumerate(seqs):
            if seq.first_token_time is None:
                seq.first_token_time = now
            top = tops[i][:seq.params.top_n_tokens] if tops and seq.params.top_n_tokens else None
            outputs.append(self._append_token(seq, token_ids[i], logprobs[i], top, reasons_list[i]))
        return outputs

    def _token_reasons(self, seqs: list[Sequence], token_ids: torch.Tensor) -> torch.Tensor:
        device = token_ids.device
        stop_ids, is_eos = build_stop_ids(seqs, self.eos_token_ids, device)
        num_out = torch.tensor([s.num_output_tokens + 1 for s in seqs], dtype=torch.int64, device=device)
        # the context limit acts as a length limit too
        max_new = torch.tensor([min(s.params.max_new_tokens, self.max_model_len - s.num_prompt_tokens)
                                for s in seqs], dtype=torch.int64, device=device)
        return token_stop_reasons(token_ids, stop_ids, num_out, max_new, is_eos=is_eos)

    def _append_token(self, seq: Sequence, token_id: int, logprob: float,
                      top: list[tuple[int, float]] | None, reason_code: int) -> RequestOutput:
        seq.output_token_ids.append(token_id)
        seq.output_logprobs.append(logprob)
        text_state = self.texts[seq.request_id]
        text = text_state.detokenizer.decode_next(token_id)
        if reason_code != STOP_NONE:  # the last token: complete characters held back go out with it
            text += text_state.detokenizer.flush()
        text_state.pending.append(TokenOutput(token_id, text, logprob,
                                              text_state.detokenizer.is_special(token_id), top))
        matched = text_state.matcher.add(text)
        if matched:
            seq.finish_reason = FinishReason.STOP_SEQUENCE
        elif reason_code != STOP_NONE:
            seq.finish_reason = FINISH_REASONS[reason_code]
        finished = seq.finish_reason is not None
        if finished:
            self.scheduler.finish(seq)
        return self._emit(seq, text_state, final=finished)

    def _emit(self, seq: Sequence, state: TextState, final: bool) -> RequestOutput:
        released = state.matcher.release(final=final)
        new_tokens = state.pending[:len(released)]
        del state.pending[:len(released)]
        for token, text in zip(new_tokens, released):
            token.text = text
        prompt_tokens = None
        if state.prompt_tokens is not None:
            prompt_tokens, state.prompt_tokens = state.prompt_tokens, None
        return RequestOutput(seq.request_id, new_tokens, state.matcher.text, seq.is_finished,
                             seq.finish_reason, seq.num_prompt_tokens, seq.num_output_tokens,
                             prompt_tokens=prompt_tokens)

    def _release(self, seq: Sequence) -> None:
        self.seqs.pop(seq.request_id, None)
        self.texts.pop(seq.request_id, None)

    def _record_prompt_logprobs(self, sched: SchedulerOutput, model_out: ModelOutput) -> None:
        """decoder_input_details: log prob of each prompt token given the ones before it."""
        for index, chunk_logits in model_out.chunk_logits.items():
            seq = sched.seqs[index]
            end = seq.num_computed_tokens
            start = end - sched.num_scheduled_tokens[index]
            if seq.prompt_token_logprobs is None:
                seq.prompt_token_logprobs = [None]
            elif len(seq.prompt_token_logprobs) > start + 1:
                continue  # recomputed after a preemption: these were reported already
            # position p predicts token p + 1; keep only targets inside the prompt
            targets = seq.all_token_ids[start + 1:min(end + 1, seq.num_prompt_tokens)]
            if targets:
                logp = torch.log_softmax(chunk_logits[:len(targets)].float(), dim=-1)
                target_t = torch.tensor(targets, device=logp.device).unsqueeze(1)
                # host sync: prompt log probs are reported once, with the first output
                seq.prompt_token_logprobs.extend(logp.gather(1, target_t).squeeze(1).tolist())
            if end >= seq.num_prompt_tokens:
                self._set_prompt_tokens(seq)

    def _set_prompt_tokens(self, seq: Sequence) -> None:
        state = self.texts[seq.request_id]
        texts = state.detokenizer.decode_prompt_tokens()
        state.prompt_tokens = [
            TokenOutput(tid, text, lp, state.detokenizer.is_special(tid))
            for tid, text, lp in zip(seq.prompt_token_ids, texts, seq.prompt_token_logprobs)]


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)


def _top_lists(sampled: SamplerOutput) -> list[list[tuple[int, float]]] | None:
    if sampled.top_ids is None:
        return None
    # host sync: top-n alternatives are reported per token
    ids, lps = sampled.top_ids.tolist(), sampled.top_logprobs.tolist()
    # alternatives filtered out of a row's distribution come back as -inf: not real choices
    return [[(tid, lp) for tid, lp in zip(row_ids, row_lps) if lp != float("-inf")]
            for row_ids, row_lps in zip(ids, lps)]
