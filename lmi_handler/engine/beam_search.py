"""Beam search with transformers' semantics over the engine's own sequences: candidates, scores, stopping.

Owns BeamGroup (one request's live beams in transformers' running order, their scores, the finished
hypotheses, length_penalty and early_stopping True / False / "never", as GenerationMixin._beam_search in
transformers 5) and beam_candidates (every group's top-K continuations in one tensor op). Leaves sharing KV
blocks and copy-on-write to scheduler.py and kv_cache.py, and token text to the engine's output side.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from lmi_handler.engine.detokenizer import IncrementalDetokenizer
from lmi_handler.engine.sequence import BeamOutput, FinishReason, RequestOutput, Sequence, TokenOutput


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens (the end token included) and score."""

    score: float                # float32 value: sum of log probs / num_generated ** length_penalty
    token_ids: list[int]
    logprobs: list[float]       # per token, the processed log prob it was chosen with
    finish_reason: FinishReason


@dataclass
class BeamStep:
    """What one step decided for a group (BeamGroup.advance), for the engine to carry out.

    running: the next live beams, best first, each (index of its parent in the current beams, token,
    accumulated score, token log prob). done: the search is over (hypotheses are final).
    """

    running: list[tuple[int, int, float, float]] = field(default_factory=list)
    done: bool = False


class BeamGroup:
    """One beam-search request. Before its first token it is a single sequence (the prompt, `started` False);
    every step afterwards all its live beams decode together and each offers its top continuations.

    Semantics follow transformers' vectorised beam search (the oracle test compares token for token):
    K = max(2, 1 + number of end ids) * num_beams candidates over all beams by accumulated log prob; a
    candidate that ends (an end id, or max_new_tokens reached) and ranks among the first num_beams becomes a
    hypothesis scored sum / num_generated ** length_penalty (its end token counted), unless the pool already
    holds num_beams hypotheses under early_stopping=True or no running beam can still beat the worst of a
    full pool; the best num_beams that do not end run on. The search stops when early_stopping=True and the
    pool is full, when that improvement test fails, or when every candidate ended.
    """

    def __init__(self, root: Sequence, end_ids: dict[int, FinishReason], max_new_tokens: int):
        params = root.params
        self.request_id = root.request_id
        self.num_beams, self.length_penalty, self.early_stopping = (params.num_beams, params.length_penalty,
                                                                    params.early_stopping)
        self.end_ids = end_ids                  # token id -> finish reason (eos_token / stop_sequence)
        self.max_new_tokens = max_new_tokens    # capped by the context
        self.num_candidates = max(2, 1 + len(end_ids)) * self.num_beams
        self.beams: list[Sequence] = [root]     # live beams, transformers' running order (best first)
        self.scores: list[float] = [0.0]        # their accumulated log probs (float32 values)
        self.finished: list[Hypothesis] = []    # best first, at most num_beams
        self.improvable = True                  # transformers' is_early_stop_heuristic_unsatisfied
        self.num_generated = 0
        self.started = False

    def advance(self, values: list[float], parents: list[int], tokens: list[int], logprobs: list[float]) -> BeamStep:
        """Take this step's K candidates (best first: accumulated score, parent beam index, token, the token's
        log prob) and decide the next beams and hypotheses. Pure host logic on a few values per group."""
        k, nb = self.num_candidates, self.num_beams
        # a candidate a grammar or allowed_token_ids masked out (-inf) is no candidate: with fewer allowed
        # continuations than K, a group runs on with fewer beams
        k = min(k, sum(v > float("-inf") for v in values[:k]))
        values, parents, tokens, logprobs = values[:k], parents[:k], tokens[:k], logprobs[:k]
        at_max = self.num_generated + 1 >= self.max_new_tokens
        ends = [at_max or t in self.end_ids for t in tokens]
        self._add_hypotheses(values, parents, tokens, logprobs, ends)
        order = [r for r in range(k) if not ends[r]] + [r for r in range(k) if ends[r]]
        # an ended candidate runs on only when fewer than num_beams did not end (the last step), at
        # transformers' float32 score - 1e9
        step = BeamStep([(parents[r], tokens[r], _f32(values[r] - 1e9) if ends[r] else values[r], logprobs[r])
                         for r in order[:nb]])
        self.num_generated += 1
        self.started = True
        if step.running:
            self._update_improvable(step.running[0][2])
        full = len(self.finished) == nb
        step.done = not self.improvable or (full and self.early_stopping is True) or all(ends)
        return step

    def _add_hypotheses(self, values, parents, tokens, logprobs, ends) -> None:
        """transformers' _update_finished_beams: ended candidates among the first num_beams join the pool."""
        nb = self.num_beams
        if (len(self.finished) == nb and self.early_stopping is True) or not self.improvable:
            return
        new = [r for r in range(min(nb, len(tokens))) if ends[r]]
        if not new:
            return
        # the same float32 division transformers does on its (batch, K) tensor
        norm = (torch.tensor([values[r] for r in new], dtype=torch.float32)
                / ((self.num_generated + 1) ** self.length_penalty)).tolist()
        for score, r in zip(norm, new):
            beam = self.beams[parents[r]]
            reason = self.end_ids.get(tokens[r], FinishReason.LENGTH)
            self.finished.append(Hypothesis(score, beam.output_token_ids + [tokens[r]],
                                            beam.output_logprobs + [logprobs[r]], reason))
        self.finished.sort(key=lambda h: -h.score)   # stable: earlier hypotheses win ties
        del self.finished[nb:]

    def _update_improvable(self, best_running: float) -> None:
        """transformers' _check_early_stop_heuristic, after the step (num_generated already counts it)."""
        if len(self.finished) < self.num_beams:
            return                                          # an empty slot: any running beam can improve
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = self.max_new_tokens
        else:
            length = self.num_generated
        best = (torch.tensor([best_running], dtype=torch.float32) / (length ** self.length_penalty)).item()
        self.improvable = self.improvable and best > min(h.score for h in self.finished)


def _f32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()


def beam_candidates(logprobs: torch.Tensor, groups: list[BeamGroup], rows: list[list[int]]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every group's top-K continuations in one topk over (G, max_beams * V).

    logprobs: (B, V) float32 processed log probs of the step's rows; rows[g]: the row of each of group g's
    beams, in its beam order. Returns (values (G, K) float32 accumulated scores best first, parents (G, K)
    int64 beam index, tokens (G, K) int64, token log probs (G, K) float32), K = max num_candidates; a group
    with fewer beams or candidates reads only its first num_candidates.
    """
    vocab = logprobs.shape[1]
    width = max(len(r) for r in rows)
    index = torch.tensor([r + [r[0]] * (width - len(r)) for r in rows], dtype=torch.int64)         # (G, Bm)
    scores = torch.tensor([g.scores + [float("-inf")] * (width - len(g.scores)) for g in groups],
                          dtype=torch.float32).to(logprobs.device, non_blocking=True)            # (G, Bm)
    index = index.to(logprobs.device, non_blocking=True)
    total = logprobs.index_select(0, index.flatten()).view(len(rows), width, vocab) + scores[:, :, None]
    k = min(max(g.num_candidates for g in groups), width * vocab)
    values, flat = torch.topk(total.view(len(rows), width * vocab), k, dim=1)
    parents, tokens = flat // vocab, flat % vocab
    token_logprobs = logprobs.view(-1).take(index.gather(1, parents) * vocab + tokens)
    return values, parents, tokens, token_logprobs


class BeamSearch:
    """The engine's beam-search requests: their groups, the step's row layout, forks and final outputs.

    The scheduler does the block work (fork shares a parent's blocks; finish frees a dead beam's); this
    class decides which beams live, appends their tokens and builds each request's one RequestOutput.
    """

    def __init__(self, scheduler, tokenizer, eos_token_ids: tuple[int, ...]):
        self.scheduler, self.tokenizer, self.eos_token_ids = scheduler, tokenizer, eos_token_ids
        self.groups: dict[str, BeamGroup] = {}

    def add(self, root: Sequence, max_new_tokens: int) -> None:
        """Make `root` (queued, params.num_beams > 1) a beam-search request. Its end ids: the model's eos ids
        (unless ignore_eos) end a beam as eos_token, stop_token_ids as stop_sequence."""
        params = root.params
        ends = {t: FinishReason.STOP_SEQUENCE for t in params.stop_token_ids}
        if not params.ignore_eos:
            ends.update({t: FinishReason.EOS_TOKEN for t in self.eos_token_ids})
        root.beam_group = self.groups[root.request_id] = BeamGroup(root, ends, max_new_tokens)

    def layout(self, seqs: list[Sequence]) -> tuple[list[BeamGroup], list[list[int]]] | None:
        """The groups with rows among the step's sampled rows `seqs`, and each one's rows in beam order;
        None when no row belongs to a beam search. (A group's beams are always sampled together.)"""
        row_of = {id(s): i for i, s in enumerate(seqs) if s.beam_group is not None}
        if not row_of:
            return None
        groups = list({id(seqs[i].beam_group): seqs[i].beam_group for i in row_of.values()}.values())
        return groups, [[row_of[id(b)] for b in g.beams] for g in groups]

    def advance(self, group: BeamGroup, values: list[float], parents: list[int], tokens: list[int],
                logprobs: list[float]) -> RequestOutput | None:
        """Carry out one step of `group` from its candidates; its RequestOutput when the search ended."""
        old = group.beams
        step = group.advance(values, parents, tokens, logprobs)
        if step.done:
            for beam in old:
                self.scheduler.finish(beam)
            return self._output(group)
        claimed: set[int] = set()
        children = []
        for parent_index, _, _, _ in step.running:     # forks first, from the parents as they are
            parent = old[parent_index]
            children.append(self.scheduler.fork(parent) if parent_index in claimed else parent)
            claimed.add(parent_index)
        for index, beam in enumerate(old):
            if index not in claimed:
                self.scheduler.finish(beam)
        now = time.monotonic()
        for child, (_, token, _, logprob) in zip(children, step.running):
            child.output_token_ids.append(token)
            child.output_logprobs.append(logprob)
            child.first_token_time = child.first_token_time or now
            if child.grammar is not None:
                child.grammar.advance(token)            # the mask allowed it: the matcher accepts it
        group.beams, group.scores = children, [score for _, _, score, _ in step.running]
        return None

    def abort(self, request_id: str) -> bool:
        """Drop a beam-search request's beams (their blocks freed); False if it is not one."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        for beam in group.beams:
            self.scheduler.finish(beam)
        return True

    def _output(self, group: BeamGroup) -> RequestOutput:
        self.groups.pop(group.request_id, None)
        root = group.beams[0]
        hypotheses = group.finished or [   # every continuation was masked out before any beam finished
            Hypothesis(score, list(b.output_token_ids), list(b.output_logprobs), FinishReason.LENGTH)
            for b, score in zip(group.beams, group.scores) if b.output_token_ids]
        if not hypotheses:
            return RequestOutput(group.request_id, [], "", True, FinishReason.ERROR, root.num_prompt_tokens, 0,
                                 error="beam search: no token was allowed (the constraints exclude every token)")
        beams = [self._beam_output(root, h) for h in hypotheses]
        best = beams[0]
        return RequestOutput(group.request_id, best.tokens, best.text, True, best.finish_reason,
                             root.num_prompt_tokens, len(best.tokens), beams=beams)

    def _beam_output(self, root: Sequence, hypothesis: Hypothesis) -> BeamOutput:
        """A hypothesis as tokens with texts (incremental detokenization, so the texts join to the text)."""
        detokenizer = IncrementalDetokenizer(self.tokenizer, root.prompt_token_ids, root.params.skip_special_tokens)
        tokens = [TokenOutput(t, detokenizer.decode_next(t), lp, detokenizer.is_special(t))
                  for t, lp in zip(hypothesis.token_ids, hypothesis.logprobs)]
        tokens[-1].text += detokenizer.flush()
        cumulative = torch.tensor(hypothesis.logprobs, dtype=torch.float32).sum().item()
        return BeamOutput("".join(t.text for t in tokens), tokens, hypothesis.score, cumulative,
                          hypothesis.finish_reason)
