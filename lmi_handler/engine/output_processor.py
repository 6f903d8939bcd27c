"""The text side of a step: sampled token ids -> tokens, text, stop strings, RequestOutputs.

Owns each request's TextState (incremental detokenizer, stop-string matcher, tokens held back for a
possible stop string, prompt tokens for decoder_input_details) and the step's one host-device sync.
Leaves sampling to sampler.py, eos / stop-id / length checks to stopping.py, queues and blocks to the engine.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from lmi_handler.engine.detokenizer import IncrementalDetokenizer
from lmi_handler.engine.model_runner import ModelOutput
from lmi_handler.engine.sampler import SamplerOutput
from lmi_handler.engine.scheduler import SchedulerOutput
from lmi_handler.engine.sequence import FinishReason, RequestOutput, Sequence, TokenOutput
from lmi_handler.engine.stopping import (
    FINISH_REASONS,
    STOP_EOS,
    STOP_ERROR,
    STOP_LENGTH,
    STOP_NONE,
    StopStringMatcher,
)


@dataclass
class TextState:
    """A request's text side: incremental detokenizer, stop-string matcher, tokens awaiting release."""

    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher
    pending: list[TokenOutput] = field(default_factory=list)
    prompt_tokens: list[TokenOutput] | None = None


@dataclass
class PromptChunk:
    """Prompt log probs due this step for one sequence (index `index` of the step): `num_targets` values
    for prompt positions start + 1 .. start + num_targets (position p predicts token p + 1)."""

    index: int
    seq: Sequence
    num_targets: int
    ends_prompt: bool        # the chunk reaches the prompt's end: its prompt tokens go out this step


@dataclass
class StepSample:
    """What a step computed, still on the device: the sampled rows' tokens and stop reasons, and the
    prompt log probs of its prompt-logprob chunks. OutputProcessor.process brings it to the host at once."""

    seqs: list[Sequence]                   # the sampled rows, in row order
    sampled: SamplerOutput | None          # token ids, log probs, top-n of those rows (None: no row sampled)
    stop_reasons: torch.Tensor | None      # (B,) int8 stopping codes
    prompt_chunks: list[PromptChunk]
    prompt_logprobs: torch.Tensor | None   # (sum of num_targets,) float32, in prompt_chunks order
    # vLLM prompt_logprobs=k: (M, K) top ids and log probs of the targets of chunks with prompt_top_n_tokens,
    # in prompt_chunks order (M = their targets, K = the largest k), and (M,) int64 each target's rank
    prompt_top: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    beam_groups: list = field(default_factory=list)     # BeamGroups whose beams are among the rows
    beam_candidates: tuple[torch.Tensor, ...] | None = None   # beam_search.beam_candidates' 4 (G, K) tensors
    # filled by OutputProcessor.process: per group (values, parents, tokens, log probs) as lists
    beam_results: list[tuple[list[float], list[int], list[int], list[float]]] = field(default_factory=list)
    # speculative decoding (engine/speculative/verify.py): first row of each verifying sequence -> its drafts
    # (its rows are that one and the next len(drafts)); process fills `accepted`: id(seq) -> drafts kept
    drafts: dict[int, list[int]] = field(default_factory=dict)
    accepted: dict[int, int] = field(default_factory=dict)


def plan_prompt_logprobs(sched: SchedulerOutput,
                         device: torch.device) -> tuple[list[PromptChunk], torch.Tensor | None]:
    """decoder_input_details, before the forward: which prompt-logprob chunks report this step (the
    runner's chunk rows: params.prompt_logprobs and a chunk starting inside the prompt), and their target
    ids ((N,) int64 on `device`, copied before the forward is queued). Chunks recomputed after a
    preemption are skipped (reported already)."""
    chunks, targets = [], []
    for index, (seq, n) in enumerate(zip(sched.seqs, sched.num_scheduled_tokens)):
        start = seq.num_computed_tokens
        if not seq.params.prompt_logprobs or start >= seq.num_prompt_tokens:
            continue
        if seq.prompt_token_logprobs is None:
            seq.prompt_token_logprobs = [None]
        elif len(seq.prompt_token_logprobs) > start + 1:
            continue
        ids = seq.prompt_token_ids[start + 1:min(start + n + 1, seq.num_prompt_tokens)]
        chunks.append(PromptChunk(index, seq, len(ids), start + n >= seq.num_prompt_tokens))
        targets += ids
    return chunks, (torch.tensor(targets, dtype=torch.int64).to(device, non_blocking=True) if targets else None)


def gather_prompt_logprobs(chunks: list[PromptChunk], targets: torch.Tensor | None, model_out: ModelOutput
                           ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """Log prob of each planned target given the tokens before it: (N,) float32 on the device; and for chunks
    whose sequence asks for prompt alternatives (prompt_top_n_tokens), their targets' top ids and log probs
    ((M, K) int64 and float32, K the largest prompt_top_n_tokens of the step) and each target's rank ((M,)
    int64: 1 + the number of vocabulary entries with a strictly higher log prob, vLLM's definition), else None."""
    values, top_ids, top_values, top_ranks, offset = [], [], [], [], 0
    k = max((c.seq.params.prompt_top_n_tokens for c in chunks if c.num_targets), default=0)
    for chunk in chunks:
        if chunk.num_targets:
            logp = torch.log_softmax(model_out.chunk_logits[chunk.index][:chunk.num_targets].float(), dim=-1)
            target = targets[offset:offset + chunk.num_targets, None]                    # (n, 1)
            target_logp = logp.gather(1, target)                                            # (n, 1)
            values.append(target_logp.squeeze(1))
            offset += chunk.num_targets
            if chunk.seq.params.prompt_top_n_tokens:
                top = torch.topk(logp, min(k, logp.shape[1]), dim=-1)
                top_ids.append(top.indices)
                top_values.append(top.values)
                top_ranks.append(1 + (logp > target_logp).sum(dim=1))
    top = (torch.cat(top_ids), torch.cat(top_values), torch.cat(top_ranks)) if top_ids else None
    return (torch.cat(values) if values else None), top


class OutputProcessor:
    """Per-request text state, and `process`: a step's device results -> RequestOutputs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.texts: dict[str, TextState] = {}

    def add(self, seq: Sequence) -> None:
        params = seq.params
        self.texts[seq.request_id] = TextState(
            IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens),
            StopStringMatcher(params.stop_sequences, params.include_stop_str_in_output))

    def remove(self, request_id: str) -> None:
        self.texts.pop(request_id, None)

    def process(self, step: StepSample) -> list[RequestOutput]:
        """Record prompt log probs, append each sampled token, and emit what its text releases.

        Sets seq.finish_reason on the rows that stop (eos / stop id / length, or a stop string in the
        text); the caller finishes those in the scheduler. Returns one RequestOutput per sampled row.
        """
        host = _to_host(step)
        offset = top_offset = 0
        for chunk in step.prompt_chunks:
            chunk.seq.prompt_token_logprobs.extend(host.prompt_logprobs[offset:offset + chunk.num_targets])
            offset += chunk.num_targets
            n = chunk.seq.params.prompt_top_n_tokens
            if n and chunk.num_targets:
                if chunk.seq.prompt_top_tokens is None:
                    chunk.seq.prompt_top_tokens = [None]      # the first prompt token has no context
                chunk.seq.prompt_top_tokens.extend(row[:n] for row in host.prompt_tops[top_offset:
                                                                                        top_offset + chunk.num_targets])
                chunk.seq.prompt_token_ranks = chunk.seq.prompt_token_ranks or [None]
                chunk.seq.prompt_token_ranks.extend(host.prompt_ranks[top_offset:top_offset + chunk.num_targets])
                top_offset += chunk.num_targets
            if chunk.ends_prompt:
                self._set_prompt_tokens(chunk.seq)
        step.beam_results = host.beams
        now = time.monotonic()
        outputs, i = [], 0
        while i < len(step.seqs):
            seq, drafts = step.seqs[i], step.drafts.get(i)
            if seq.beam_group is not None:
                i += 1
                continue                   # beams advance as a group (engine/beam_search.py)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if drafts is None:
                outputs.append(self._append_row(seq, host, i))
                i += 1
                continue
            outs = self._append_verified(seq, host, i, drafts)
            step.accepted[id(seq)] = _kept(host, i, drafts, outs)
            outputs.append(_merge(outs))
            i += 1 + len(drafts)
        return outputs

    def _append_row(self, seq: Sequence, host: _HostStep, i: int) -> RequestOutput:
        """Append row i's token to `seq` (a constrained row's token goes through its grammar first)."""
        n = seq.params.top_n_tokens
        top = host.tops[i][:n] if host.tops and n else None
        reason = host.reasons[i] if seq.grammar is None else _grammar_reason(seq, host.token_ids[i], host.reasons[i])
        return self.append_token(seq, host.token_ids[i], host.logprobs[i], top, reason)

    def _append_verified(self, seq: Sequence, host: _HostStep, first: int, drafts: list[int]) -> list[RequestOutput]:
        """The verify rule: append rows first, first + 1, ... while each row's token (the target's own choice
        at that position) equals the draft that row's successor was computed after; the first that differs,
        or the row after the last draft, is appended too. A row that finishes the sequence (eos, stop id, stop
        string, length, grammar) ends it there."""
        outs = []
        for j in range(len(drafts) + 1):
            outs.append(self._append_row(seq, host, first + j))
            if seq.finish_reason is not None or j == len(drafts) or host.token_ids[first + j] != drafts[j]:
                break
        return outs

    def append_token(self, seq: Sequence, token_id: int, logprob: float,
                     top: list[tuple[int, float]] | None, reason_code: int) -> RequestOutput:
        """Add one generated token to `seq` and its text; `reason_code` is its stopping code (STOP_*)."""
        seq.output_token_ids.append(token_id)
        seq.output_logprobs.append(logprob)
        state = self.texts[seq.request_id]
        text = state.detokenizer.decode_next(token_id)
        if reason_code != STOP_NONE:  # the last token: complete characters held back go out with it
            text += state.detokenizer.flush()
        state.pending.append(TokenOutput(token_id, text, logprob, state.detokenizer.is_special(token_id), top))
        if state.matcher.add(text, search=seq.num_output_tokens > seq.params.min_tokens):
            seq.finish_reason = FinishReason.STOP_SEQUENCE
        elif reason_code != STOP_NONE:
            seq.finish_reason = FINISH_REASONS[reason_code]
        return self._emit(seq, state, final=seq.finish_reason is not None)

    def _emit(self, seq: Sequence, state: TextState, final: bool) -> RequestOutput:
        released = state.matcher.release(final=final)
        new_tokens = state.pending[:len(released)]
        del state.pending[:len(released)]
        for token, text in zip(new_tokens, released):
            token.text = text
        prompt_tokens, state.prompt_tokens = state.prompt_tokens, None
        return RequestOutput(seq.request_id, new_tokens, state.matcher.text, final, seq.finish_reason,
                             seq.num_prompt_tokens, seq.num_output_tokens, prompt_tokens=prompt_tokens,
                             error=seq.error)

    def take_prompt_tokens(self, request_id: str) -> list[TokenOutput] | None:
        """The prompt tokens (decoder_input_details) not yet handed out, e.g. for a beam search's one output."""
        state = self.texts.get(request_id)
        if state is None:
            return None
        prompt_tokens, state.prompt_tokens = state.prompt_tokens, None
        return prompt_tokens

    def _set_prompt_tokens(self, seq: Sequence) -> None:
        state = self.texts[seq.request_id]
        texts = state.detokenizer.decode_prompt_tokens()
        tops = seq.prompt_top_tokens or [None] * seq.num_prompt_tokens
        ranks = seq.prompt_token_ranks or [None] * seq.num_prompt_tokens
        state.prompt_tokens = [
            TokenOutput(tid, text, lp, state.detokenizer.is_special(tid), top, rank)
            for tid, text, lp, top, rank in zip(seq.prompt_token_ids, texts, seq.prompt_token_logprobs, tops, ranks)]


def _kept(host: "_HostStep", first: int, drafts: list[int], outs: list[RequestOutput]) -> int:
    """How many drafts the appended tokens confirmed: the leading rows whose token equals their draft."""
    kept = 0
    while kept < min(len(outs), len(drafts)) and host.token_ids[first + kept] == drafts[kept]:
        kept += 1
    return kept


def _merge(outs: list[RequestOutput]) -> RequestOutput:
    """One step's RequestOutput from the outputs of the tokens a verifying row appended, in order."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    last.new_tokens = [token for out in outs for token in out.new_tokens]
    last.prompt_tokens = next((out.prompt_tokens for out in outs if out.prompt_tokens is not None), None)
    return last


def _grammar_reason(seq: Sequence, token_id: int, reason_code: int) -> int:
    """Feed a constrained row's token to its grammar: an end id there ends the sequence (eos_token, or
    stop_sequence for a stop id: even under ignore_eos); a rejected token fails it (STOP_ERROR)."""
    if reason_code not in (STOP_NONE, STOP_LENGTH):
        return reason_code              # eos / a stop id, allowed by the mask only where the grammar may end
    ended, error = seq.grammar.advance(token_id)
    if error is not None:
        seq.error = error
        return STOP_ERROR
    return STOP_EOS if ended else reason_code


@dataclass
class _HostStep:
    token_ids: list[int]
    logprobs: list[float]
    reasons: list[int]
    tops: list[list[tuple[int, float]]] | None
    prompt_logprobs: list[float]
    beams: list[tuple[list[float], list[int], list[int], list[float]]]
    prompt_tops: list[list[tuple[int, float]]]
    prompt_ranks: list[int]


def _to_host(step: StepSample) -> _HostStep:
    """The step's results as Python values through one device -> host copy.

    Everything is packed into one float64 vector: token ids (< 2**53) and stop codes are exact in
    float64, float32 log probs widen exactly (so the values equal a float32 .tolist()).
    """
    parts, num_rows, k = [], len(step.seqs), 0
    s = step.sampled
    if s is not None:
        parts += [s.token_ids, s.logprobs, step.stop_reasons]
        if s.top_ids is not None:
            k = s.top_ids.shape[1]
            parts += [s.top_ids.flatten(), s.top_logprobs.flatten()]
    if step.prompt_logprobs is not None:
        parts.append(step.prompt_logprobs)
    num_prompt = step.prompt_logprobs.numel() if step.prompt_logprobs is not None else 0
    if step.beam_candidates is not None:
        parts += [t.flatten() for t in step.beam_candidates]
    if step.prompt_top is not None:
        parts += [t.flatten() for t in step.prompt_top]
    if not parts:
        return _HostStep([], [], [], None, [], [], [], [])
    # host sync, the step's only one: sampled tokens, stop reasons and log probs go to Python
    flat = torch.cat([p.to(torch.float64) for p in parts]).tolist()
    token_ids = [int(t) for t in flat[:num_rows]]
    logprobs = flat[num_rows:2 * num_rows]
    reasons = [int(r) for r in flat[2 * num_rows:3 * num_rows]]
    tops, end = None, 3 * num_rows
    if k:
        ids, lps = flat[end:end + num_rows * k], flat[end + num_rows * k:end + 2 * num_rows * k]
        end += 2 * num_rows * k
        # alternatives filtered out of a row's distribution come back as -inf: not real choices
        tops = [[(int(t), lp) for t, lp in zip(ids[r * k:(r + 1) * k], lps[r * k:(r + 1) * k]) if lp != float("-inf")]
                for r in range(num_rows)]
    prompt_logprobs, end = flat[end:end + num_prompt], end + num_prompt
    beams = []
    if step.beam_candidates is not None:
        num_groups, k = step.beam_candidates[0].shape
        n = num_groups * k
        values, parents, tokens, lps = (flat[end + j * n:end + (j + 1) * n] for j in range(4))
        beams = [(values[g * k:(g + 1) * k], [int(p) for p in parents[g * k:(g + 1) * k]],
                  [int(t) for t in tokens[g * k:(g + 1) * k]], lps[g * k:(g + 1) * k]) for g in range(num_groups)]
        end += 4 * n
    prompt_tops, prompt_ranks = [], []
    if step.prompt_top is not None:
        rows, k = step.prompt_top[0].shape
        ids, lps = flat[end:end + rows * k], flat[end + rows * k:end + 2 * rows * k]
        prompt_tops = [[(int(t), lp) for t, lp in zip(ids[r * k:(r + 1) * k], lps[r * k:(r + 1) * k])]
                       for r in range(rows)]
        prompt_ranks = [int(r) for r in flat[end + 2 * rows * k:end + 2 * rows * k + rows]]
    return _HostStep(token_ids, logprobs, reasons, tops, prompt_logprobs, beams, prompt_tops, prompt_ranks)
