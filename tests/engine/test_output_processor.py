"""OutputProcessor on its own: hand-made step results (tensors) in, RequestOutputs out, with a tiny
byte-level BPE tokenizer built in the test (no prepared model): stop strings held back across tokens,
multi-byte characters, finish reasons, top-n alternatives, prompt log probs, one host copy per step."""
from __future__ import annotations

import pytest
import torch

from lmi_handler.engine.model_runner import ModelOutput
from lmi_handler.engine.output_processor import (
    OutputProcessor,
    StepSample,
    gather_prompt_logprobs,
    plan_prompt_logprobs,
)
from lmi_handler.engine.sampler import SamplerOutput
from lmi_handler.engine.scheduler import SchedulerOutput
from lmi_handler.engine.sequence import FinishReason, SamplingParams, Sequence
from lmi_handler.engine.stopping import STOP_EOS, STOP_LENGTH, STOP_NONE


def new_seq(proc: OutputProcessor, request_id: str = "r", prompt=(5, 6, 7), **params) -> Sequence:
    seq = Sequence(request_id, list(prompt), SamplingParams(**params))
    proc.add(seq)
    return seq


def one_step(proc, seqs, token_ids, reasons=None, logprobs=None, top=None):
    """A step whose sampled rows are `seqs`: token ids, stop codes, log probs and optional top-n as tensors."""
    n = len(seqs)
    logprobs = torch.tensor(logprobs or [-0.25] * n, dtype=torch.float32)
    top_ids, top_lps = (None, None) if top is None else (torch.tensor(top[0]), torch.tensor(top[1]))
    sampled = SamplerOutput(torch.tensor(token_ids, dtype=torch.int64), logprobs, top_ids, top_lps)
    codes = torch.tensor(reasons or [STOP_NONE] * n, dtype=torch.int8)
    return proc.process(StepSample(list(seqs), sampled, codes, [], None))


def run_tokens(proc, seq, token_ids, last_reason=STOP_NONE):
    outs = []
    for i, token_id in enumerate(token_ids):
        reason = last_reason if i == len(token_ids) - 1 else STOP_NONE
        outs += one_step(proc, [seq], [token_id], [reason])
        if seq.finish_reason is not None:
            break
    return outs


def streamed(outs) -> str:
    return "".join(t.text for out in outs for t in out.new_tokens)


def test_a_stop_string_split_across_tokens_is_held_back_then_cut(tiny_tokenizer):
    proc = OutputProcessor(tiny_tokenizer)
    seq = new_seq(proc, stop_sequences=("STOP",))
    ids = tiny_tokenizer.encode("Stop here. STOP now!")
    outs = run_tokens(proc, seq, ids)
    assert seq.finish_reason is FinishReason.STOP_SEQUENCE
    assert outs[-1].finished and outs[-1].generated_text == "Stop here. "
    assert streamed(outs) == outs[-1].generated_text                      # streamed texts concat to the answer
    assert all(outs[-1].generated_text.startswith(out.generated_text) for out in outs)   # never released past
    assert sum(len(out.new_tokens) for out in outs) == seq.num_output_tokens   # one Token per generated token


def test_a_multibyte_character_is_carried_by_the_token_that_completes_it(tiny_tokenizer):
    proc = OutputProcessor(tiny_tokenizer)
    seq = new_seq(proc, max_new_tokens=30)
    text = "日本語 🎉 ok"
    ids = tiny_tokenizer.encode(text)
    outs = run_tokens(proc, seq, ids, last_reason=STOP_LENGTH)
    pieces = [t.text for out in outs for t in out.new_tokens]
    assert "".join(pieces) == text == outs[-1].generated_text
    assert all("\ufffd" not in p for p in pieces) and "" in pieces       # byte tokens wait for their character
    assert outs[-1].finish_reason is FinishReason.LENGTH


def test_stop_codes_become_finish_reasons_and_unfinished_rows_go_on(tiny_tokenizer):
    proc = OutputProcessor(tiny_tokenizer)
    a, b, c = (new_seq(proc, rid) for rid in "abc")
    ids = tiny_tokenizer.encode("Hello world")
    outs = one_step(proc, [a, b, c], [ids[0], ids[1], 1], [STOP_NONE, STOP_LENGTH, STOP_EOS])
    assert [o.finished for o in outs] == [False, True, True]
    assert [o.finish_reason for o in outs] == [None, FinishReason.LENGTH, FinishReason.EOS_TOKEN]
    assert outs[2].new_tokens[0].special_token and outs[2].generated_text == ""   # skip_special_tokens
    assert [s.output_token_ids for s in (a, b, c)] == [[ids[0]], [ids[1]], [1]]


def test_top_alternatives_drop_filtered_tokens_and_keep_each_rows_count(tiny_tokenizer):
    proc = OutputProcessor(tiny_tokenizer)
    two, none = new_seq(proc, "two", top_n_tokens=2), new_seq(proc, "none")
    lps = [[-0.1, -2.5, float("-inf")], [-0.3, -0.7, -1.1]]
    outs = one_step(proc, [two, none], [10, 11], logprobs=[-0.1, -0.3], top=([[10, 12, 13], [11, 14, 15]], lps))
    assert outs[0].new_tokens[0].top_tokens == [(10, pytest.approx(-0.1)), (12, -2.5)]
    assert outs[1].new_tokens[0].top_tokens is None
    assert outs[0].new_tokens[0].log_prob == torch.tensor(-0.1, dtype=torch.float32).item()   # float32 value


def test_prompt_log_probs_cover_every_prompt_token_across_two_chunks(tiny_tokenizer):
    proc = OutputProcessor(tiny_tokenizer)
    prompt = tiny_tokenizer.encode("The cat sat on the mat.")
    seq = new_seq(proc, prompt=prompt, prompt_logprobs=True)
    logits = torch.randn(len(prompt), len(tiny_tokenizer), generator=torch.Generator().manual_seed(0))
    expected = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
    cut = 3
    outputs = []
    for start, end in ((0, cut), (cut, len(prompt))):
        sched = SchedulerOutput(seqs=[seq], num_scheduled_tokens=[end - start])
        seq.num_computed_tokens = start
        chunks, targets = plan_prompt_logprobs(sched, torch.device("cpu"))          # before the forward
        seq.num_computed_tokens = end                                                # the step ran
        values, _ = gather_prompt_logprobs(chunks, targets, ModelOutput(logits[end - 1:end], {0: logits[start:end]}))
        due = [seq] if end == len(prompt) else []
        tokens = [9] if due else []
        sampled = SamplerOutput(torch.tensor(tokens), torch.zeros(len(tokens)), None, None) if due else None
        codes = torch.zeros(len(tokens), dtype=torch.int8) if due else None
        outputs += proc.process(StepSample(due, sampled, codes, chunks, values))
    prompt_tokens = outputs[0].prompt_tokens
    assert [t.id for t in prompt_tokens] == prompt and prompt_tokens[0].log_prob is None
    assert [t.log_prob for t in prompt_tokens[1:]] == pytest.approx(expected, abs=1e-6)
    assert "".join(t.text for t in prompt_tokens) == "The cat sat on the mat."


def test_a_prompt_tokens_rank_counts_the_whole_vocabulary_across_chunks(tiny_tokenizer):
    proc = OutputProcessor(tiny_tokenizer)
    prompt = tiny_tokenizer.encode("The cat sat on the mat.")
    seq = new_seq(proc, prompt=prompt, prompt_logprobs=True, prompt_top_n_tokens=1)
    logits = torch.randn(len(prompt), len(tiny_tokenizer), generator=torch.Generator().manual_seed(1))
    logp = torch.log_softmax(logits, -1)
    # the definition (vLLM's), one position at a time: 1 + ids whose log prob is strictly higher
    expected = [1 + sum(v > logp[p, prompt[p + 1]] for v in logp[p].tolist()) for p in range(len(prompt) - 1)]
    assert max(expected) > 1   # some prompt tokens are not the top-1 alternative
    outputs = []
    for start, end in ((0, 3), (3, len(prompt))):
        sched = SchedulerOutput(seqs=[seq], num_scheduled_tokens=[end - start])
        seq.num_computed_tokens = start
        chunks, targets = plan_prompt_logprobs(sched, torch.device("cpu"))
        seq.num_computed_tokens = end
        values, top = gather_prompt_logprobs(chunks, targets, ModelOutput(logits[end - 1:end], {0: logits[start:end]}))
        due = [seq] if end == len(prompt) else []
        sampled = SamplerOutput(torch.tensor([9]), torch.zeros(1), None, None) if due else None
        codes = torch.zeros(1, dtype=torch.int8) if due else None
        outputs += proc.process(StepSample(due, sampled, codes, chunks, values, top))
    prompt_tokens = outputs[0].prompt_tokens
    assert prompt_tokens[0].rank is None and [t.rank for t in prompt_tokens[1:]] == expected
    assert [t.top_tokens[0][0] for t in prompt_tokens[1:]] == logp[:-1].argmax(-1).tolist()


def test_a_step_copies_its_results_to_the_host_once(tiny_tokenizer, monkeypatch):
    proc = OutputProcessor(tiny_tokenizer)
    seqs = [new_seq(proc, f"r{i}", top_n_tokens=1) for i in range(4)]
    calls = []
    original = torch.Tensor.tolist

    def counting(self):
        calls.append(tuple(self.shape))
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    one_step(proc, seqs, [3, 4, 5, 6], top=([[3], [4], [5], [6]], [[-0.5]] * 4))
    assert len(calls) == 1
