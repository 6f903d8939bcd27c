"""Output quality per precision: our engine against transformers on MT-bench prompts, teacher-forced.

For each variant, the reference is transformers' model on the same weights (bf16 against transformers'
bf16 model; fp32 and both int8 variants against transformers' fp32 model). Per prompt (chat template,
greedy): the reference's `--tokens` greedy tokens (generate()); the log-prob each engine gives each of
those tokens, teacher-forced (one forward over prompt + tokens; ours through ModelRunner's prompt
log-prob rows, float32 log_softmax); our own greedy tokens. Reports the mean and max |Δ log-prob|, how
many prompts' greedy tokens equal generate()'s, where they first differ, the share of positions where our
argmax is the reference token, and how many of the misses are ties in the reference's own logits (bf16
logits round to 2**-8 relative: at magnitude 16-32 a step is 0.125, and argmax then takes the lowest id;
"first_difference_at_reference_tie" counts the prompts whose greedy tokens part where generate() chose
among equal logits, our token one of them).
A row "hf_bf16" puts transformers' own bf16 model against its fp32 one, for scale.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/quality.py [--prompts 16 --tokens 32 --variants bf16,int8]

Writes benchmarks/results/quality-<date>.json.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
# the repo's copy of the MT-bench questions, else ../shared beside the checkout (or beside a worktree)
PROMPT_FILES = (BENCH / "data" / "mt_bench_questions.jsonl", REPO.parent / "shared" / "data" / "mt_bench_questions.jsonl",
                REPO.parent.parent / "shared" / "data" / "mt_bench_questions.jsonl")

VARIANTS = {   # name -> (our activations' dtype, quantize, reference dtype)
    "fp32": (torch.float32, None, torch.float32), "bf16": (torch.bfloat16, None, torch.bfloat16),
    "int8": (torch.float32, "int8", torch.float32), "int8-bf16": (torch.bfloat16, "int8", torch.float32),
}


def mt_bench_questions(path: Path | None = None) -> list[str]:
    """First turns of the MT-bench questions, in file order."""
    path = path or next((p for p in PROMPT_FILES if p.is_file()), PROMPT_FILES[0])
    return [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]


def chat_ids(tokenizer, text: str) -> list[int]:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False)


class Ours:
    """Our ModelRunner driven directly: teacher-forced log-probs and greedy decoding of one prompt at a time."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, quantize: str | None, lm_head_kind: str | None = None):
        from lmi_handler.engine.kv_cache import BlockAllocator
        from lmi_handler.engine.model.loader import load_model
        from lmi_handler.engine.model_runner import ModelRunner

        self.runner = ModelRunner(model_dir, dtype, torch.device("cpu"), block_size=16, num_blocks=128, quantize=quantize)
        if lm_head_kind is not None:   # the same runner with another lm_head (for the int8 lm_head decision)
            self.runner.model = load_model(model_dir, dtype, torch.device("cpu"), pack_weights=True, quantize=quantize,
                                           lm_head_kind=lm_head_kind)
            self.runner.forward = self.runner.model
        self.allocator = BlockAllocator(self.runner.num_blocks, self.runner.block_size)

    def _step(self, seq, n: int):
        from lmi_handler.engine.scheduler import SchedulerOutput

        return self.runner.execute(self.runner.prepare(SchedulerOutput(seqs=[seq], num_scheduled_tokens=[n])))

    def _seq(self, token_ids: list[int], max_tokens: int, prompt_logprobs: bool):
        from lmi_handler.engine.kv_cache import num_blocks_needed
        from lmi_handler.engine.sequence import SamplingParams, Sequence

        seq = Sequence("q", list(token_ids), SamplingParams(prompt_logprobs=prompt_logprobs))
        seq.block_table = self.allocator.allocate(num_blocks_needed(max_tokens, self.runner.block_size))
        return seq

    def logprobs(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """(len(tokens), vocab) float32 log-probs at the positions that predict `tokens`."""
        full = prompt + tokens
        seq = self._seq(full, len(full), prompt_logprobs=True)
        try:
            logits = self._step(seq, len(full)).chunk_logits[0]
        finally:
            self.allocator.free(seq.block_table)
        return logits[len(prompt) - 1:-1].log_softmax(-1)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        seq = self._seq(prompt, len(prompt) + n, prompt_logprobs=False)
        try:
            todo = len(prompt)
            while seq.num_output_tokens < n:
                out = self._step(seq, todo)
                seq.num_computed_tokens += todo
                seq.output_token_ids.append(int(out.logits[0].argmax()))   # sync: host loop
                todo = 1
        finally:
            self.allocator.free(seq.block_table)
        return list(seq.output_token_ids)


class Reference:
    """transformers' model: greedy generate() and teacher-forced log-probs (float32 log_softmax of its logits)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()

    @torch.inference_mode()
    def greedy(self, prompt: list[int], n: int) -> list[int]:
        return self.greedy_with_logits(prompt, n)[0]

    @torch.inference_mode()
    def greedy_with_logits(self, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        """generate()'s greedy tokens and the (n, vocab) logits its argmax chose them from."""
        ids = torch.tensor([prompt])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)

    @torch.inference_mode()
    def logits(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """(len(tokens), vocab) logits in the model's dtype (the values its argmax sees)."""
        return self.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]


def compare(ours, ref: Reference, prompts: list[list[int]], n: int) -> dict:
    """Per-prompt and summary metrics of `ours` (Ours, or a Reference standing in for one) against `ref`."""
    rows = []
    for prompt in prompts:
        expected, step_logits = ref.greedy_with_logits(prompt, n)
        ref_logits = ref.logits(prompt, expected)
        ref_lp = ref_logits.float().log_softmax(-1)
        our_lp = ours.logprobs(prompt, expected) if isinstance(ours, Ours) else ours.logits(prompt, expected).float().log_softmax(-1)
        target = torch.tensor(expected)[:, None]
        diff = (our_lp.gather(1, target) - ref_lp.gather(1, target))[:, 0].abs()
        hits = our_lp.argmax(-1) == target[:, 0]
        top2 = ref_logits.topk(2, dim=-1).values
        ties = (top2[:, 0] == top2[:, 1]) & ~hits
        tokens = ours.greedy(prompt, n)
        first = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
        # did generate() pick between equal logits where we first part ways (our token among them)?
        at_tie = first is not None and bool(step_logits[first, tokens[first]] == step_logits[first].max())
        rows.append({"prompt_tokens": len(prompt), "mean_abs_dlogprob": diff.mean().item(),
                     "max_abs_dlogprob": diff.max().item(), "greedy_equal": tokens == expected,
                     "first_difference": first, "first_difference_at_reference_tie": at_tie,
                     "argmax_agreement": hits.float().mean().item(), "misses_at_reference_ties": int(ties.sum())})
    misses = sum(round((1 - r["argmax_agreement"]) * n) for r in rows)
    return {"prompts": len(rows), "tokens": n,
            "mean_abs_dlogprob": sum(r["mean_abs_dlogprob"] for r in rows) / len(rows),
            "max_abs_dlogprob": max(r["max_abs_dlogprob"] for r in rows),
            "greedy_equal": sum(r["greedy_equal"] for r in rows),
            "first_difference_at_reference_tie": sum(r["first_difference_at_reference_tie"] for r in rows),
            "argmax_agreement": sum(r["argmax_agreement"] for r in rows) / len(rows),
            "argmax_misses": misses, "misses_at_reference_ties": sum(r["misses_at_reference_ties"] for r in rows),
            "per_prompt": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=REPO / "model")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--variants", default="bf16,int8,int8-bf16,hf_bf16",
                        help=f"comma-separated: {', '.join(VARIANTS)}, hf_bf16 (transformers bf16 vs fp32)")
    parser.add_argument("--int8-lm-head", default=None, choices=("int8", "bfloat16", "float32"),
                        help="lm_head's panels for the int8 variants (default: the engine's choice)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    prompts = [chat_ids(tokenizer, q) for q in mt_bench_questions()[:args.prompts]]
    refs: dict[torch.dtype, Reference] = {}
    report = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "model": str(args.model_dir),
              "int8_lm_head": args.int8_lm_head, "variants": {}}
    for name in args.variants.split(","):
        start = time.perf_counter()
        if name == "hf_bf16":
            ours, ref_dtype = Reference(args.model_dir, torch.bfloat16), torch.float32
        else:
            dtype, quantize, ref_dtype = VARIANTS[name]
            ours = Ours(args.model_dir, dtype, quantize, args.int8_lm_head if quantize else None)
        ref = refs.setdefault(ref_dtype, Reference(args.model_dir, ref_dtype))
        result = compare(ours, ref, prompts, args.tokens)
        result["reference"] = f"transformers {str(ref_dtype).removeprefix('torch.')}"
        result["seconds"] = time.perf_counter() - start
        report["variants"][name] = result
        print(f"{name:10s} vs {result['reference']}: mean |dlogp| {result['mean_abs_dlogprob']:.4f} (max "
              f"{result['max_abs_dlogprob']:.3f}), greedy equal {result['greedy_equal']}/{result['prompts']} (of the rest, "
              f"{result['first_difference_at_reference_tie']} part at a tie in generate()'s logits), argmax "
              f"agreement {result['argmax_agreement']:.3f} ({result['argmax_misses']} misses, "
              f"{result['misses_at_reference_ties']} at reference ties)", flush=True)
    out = BENCH / "results" / f"quality-{dt.datetime.now().strftime('%Y-%m-%d-%H%M')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
