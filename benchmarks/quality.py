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
A row "hf_bf16" puts transformers' own bf16 model against its fp32 one, for scale. A row "hf_bf16_f32_logits"
puts transformers' own bf16 model with float32 logits (its bf16 final hidden state, widened, times lm_head's
weight widened to float32: issue 16's rule that logits stay float32, applied to the reference's own hidden
states) against the same model's bf16 generate(): what the greedy-equal count reaches under that rule with the
reference's hidden states bit for bit. Where generate() picked among bf16 logits that round to equal values
(argmax takes the lowest id), float32 logits can rank those tokens otherwise, and then the greedy tokens part.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/quality.py [--prompts 16 --tokens 32 --variants bf16,int8]
        [--threads 2] [--out FILE.json]

Writes benchmarks/results/quality-<UTC date and time, YYYY-MM-DD-HHMM>.json (rewritten after each variant) and a plot beside it (.png: per
variant the prompts whose greedy tokens equal generate()'s, those that part at a tie in generate()'s logits, and
the mean and max |Δ log-prob|). Commit them only as a run a document cites
(tests/benchmarks/test_bench_tool.py).
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
PROMPT_FILE = BENCH / "data" / "mt_bench_questions.jsonl"   # the repo's copy of the MT-bench questions

VARIANTS = {   # name -> (our activations' dtype, quantize, reference dtype)
    "fp32": (torch.float32, None, torch.float32), "bf16": (torch.bfloat16, None, torch.bfloat16),
    "int8": (torch.float32, "int8", torch.float32), "int8-bf16": (torch.bfloat16, "int8", torch.float32),
}


def mt_bench_questions(path: Path | None = None) -> list[str]:
    """First turns of the MT-bench questions, in file order."""
    path = path or PROMPT_FILE
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
            self.runner.model = load_model(model_dir, dtype, torch.device("cpu"), quantize=quantize,
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
        """(len(tokens), vocab) logits in the model's dtype (the values its argmax sees; float32 with a
        Float32Head)."""
        return self.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]


class Float32Head(torch.nn.Module):
    """lm_head in float32: (..., hidden) bf16 -> (..., vocab) float32 = hidden.float() @ weight.float().T (never
    rounded to bf16). Stands in for a bf16 model's lm_head, so that its generate() runs its own loop on its own
    bf16 hidden states and takes the argmax of float32 logits."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight32 = weight.detach().float()   # a plain attribute: CPU only, as quality.py runs

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.float() @ self.weight32.T


class ReferenceFloat32Logits(Reference):
    """transformers' bf16 model whose lm_head gives float32 logits (Float32Head): everything before the
    lm_head is the reference's own bits."""

    def __init__(self, model_dir: Path):
        super().__init__(model_dir, torch.bfloat16)
        self.model.lm_head = Float32Head(self.model.lm_head.weight)


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


def plot(report: dict, path: Path) -> list[str]:
    """Write report's variants to `path` (PNG, matplotlib's Agg backend): greedy equal and parted-at-a-tie counts
    (stacked, out of the prompts), and mean / max |Δ log-prob| with issue 16's 0.05 bound (bf16's). Returns the
    rows' labels, in the plot's order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["variants"])
    rows = [report["variants"][n] for n in names]
    labels = [f"{n}\nvs {r['reference']}" for n, r in zip(names, rows)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.9 * len(rows) + 2.8))
    equal = [r["greedy_equal"] for r in rows]
    ties = [r["first_difference_at_reference_tie"] for r in rows]
    left.barh(labels, equal, color="tab:blue", label="greedy tokens equal generate()'s")
    left.barh(labels, ties, left=equal, color="tab:orange", label="part at a tie in generate()'s logits")
    for y, r in enumerate(rows):
        left.text(r["prompts"], y, f" {r['greedy_equal']} equal + {r['first_difference_at_reference_tie']} at a tie,"
                  f" of {r['prompts']}", va="center", fontsize=8)
    total = max(r["prompts"] for r in rows)
    left.axvline(total / 2, color="gray", linestyle=":", label="half the prompts (\"most\" is more)")
    left.axvline(total, color="black", linewidth=0.8, label=f"all {total} prompts (short of it: parted not at a tie)")
    left.xaxis.get_major_locator().set_params(integer=True)
    left.set_xlim(0, total * 1.45)
    left.set_xlabel("prompts")
    left.set_title(f"greedy, {rows[0]['tokens']} tokens a prompt", fontsize=10)
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    left.invert_yaxis()
    right.barh(labels, [r["mean_abs_dlogprob"] for r in rows], color="tab:green", label="mean")
    right.plot([r["max_abs_dlogprob"] for r in rows], range(len(rows)), "k.", label="max")
    right.axvline(0.05, color="red", linestyle=":", label="0.05: issue 16's bound on bf16's mean (not int8's)")
    right.set_xlabel("|Δ log-prob| of the reference's greedy tokens, teacher-forced")
    right.set_title("log-probs", fontsize=10)
    right.legend(fontsize=7, loc="lower right")
    right.invert_yaxis()
    right.tick_params(axis="y", labelleft=False)
    fig.suptitle(f"quality.py, {report['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return labels


HF_ROWS = {   # name -> what the row puts against what (transformers' own models, not ours)
    "hf_bf16": "transformers bf16 vs fp32",
    "hf_bf16_f32_logits": "transformers bf16 with float32 logits vs transformers bf16",
}
VARIANT_NAMES = (*VARIANTS, *HF_ROWS)


def variant(name: str, model_dir: Path, int8_lm_head: str | None = None) -> tuple[object, torch.dtype]:
    """(the engine or model measured, its reference's dtype) for a --variants name; ValueError for another."""
    if name == "hf_bf16":
        return Reference(model_dir, torch.bfloat16), torch.float32
    if name == "hf_bf16_f32_logits":
        return ReferenceFloat32Logits(model_dir), torch.bfloat16
    if name not in VARIANTS:
        raise ValueError(f"--variants: unknown variant {name!r}; allowed: {', '.join(VARIANT_NAMES)}")
    dtype, quantize, ref_dtype = VARIANTS[name]
    return Ours(model_dir, dtype, quantize, int8_lm_head if quantize else None), ref_dtype



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before anything loads: each bad value is refused (exit 2) naming its option and
    the allowed range. --variants is split on commas, names stripped, repeats dropped (first kept); `started` (UTC)
    is the run's start, `out` the JSON to write (the default named from `started`), refused when it or its PNG
    exists."""
    questions = len(mt_bench_questions())
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=REPO / "model", help="the HF checkpoint (a directory)")
    parser.add_argument("--prompts", type=int, default=16,
                        help=f"the first N MT-bench questions (1..{questions})")
    parser.add_argument("--tokens", type=int, default=32, help="the reference's greedy tokens a prompt (>= 1)")
    parser.add_argument("--variants", default="bf16,int8,int8-bf16,hf_bf16,hf_bf16_f32_logits",
                        help=f"comma-separated: {', '.join(VARIANTS)}, "
                             + ", ".join(f"{n} ({what})" for n, what in HF_ROWS.items()))
    parser.add_argument("--int8-lm-head", default=None, choices=("int8", "bfloat16", "float32"),
                        help="lm_head's panels for the int8 variants (default: the engine's choice)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (>= 1)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON to write, the PNG beside it (default: benchmarks/results/quality-<UTC date and "
                             "time, YYYY-MM-DD-HHMM>.json; an existing file is not overwritten)")
    args = parser.parse_args(argv)
    names = list(dict.fromkeys(n.strip() for n in args.variants.split(",")))
    unknown = [n for n in names if n not in VARIANT_NAMES]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(repr(n) if n else 'an empty name' for n in unknown)}; "
                     f"allowed: {', '.join(VARIANT_NAMES)}")
    args.variants = ",".join(names)
    if not 1 <= args.prompts <= questions:
        parser.error(f"--prompts must be 1..{questions} (the MT-bench questions there are), got {args.prompts}")
    if args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if not (args.model_dir / "config.json").is_file():
        parser.error(f"--model-dir: no config.json in {args.model_dir} (an HF checkpoint directory is needed)")
    args.started = dt.datetime.now(dt.timezone.utc)
    args.out = args.out or BENCH / "results" / f"quality-{args.started.strftime('%Y-%m-%d-%H%M')}.json"
    if args.out.exists() or args.out.with_suffix(".png").exists():
        parser.error(f"--out: {args.out} or its plot exists (not overwritten); a run started the same minute? "
                     "name another with --out")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import matplotlib  # noqa: F401  (the plot after each variant needs it: fail now, not after the first variant)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    prompts = [chat_ids(tokenizer, q) for q in mt_bench_questions()[:args.prompts]]
    refs: dict[torch.dtype, Reference] = {}
    report = {"date": args.started.isoformat(timespec="seconds"), "model": str(args.model_dir),
              "int8_lm_head": args.int8_lm_head, "variants": {}}
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.variants.split(","):
        start = time.perf_counter()
        ours, ref_dtype = variant(name, args.model_dir, args.int8_lm_head)
        if ref_dtype not in refs:
            refs[ref_dtype] = Reference(args.model_dir, ref_dtype)
        ref = refs[ref_dtype]
        result = compare(ours, ref, prompts, args.tokens)
        result["reference"] = f"transformers {str(ref_dtype).removeprefix('torch.')}"
        result["seconds"] = time.perf_counter() - start
        report["variants"][name] = result
        print(f"{name:18s} vs {result['reference']}: mean |dlogp| {result['mean_abs_dlogprob']:.4f} (max "
              f"{result['max_abs_dlogprob']:.3f}), greedy equal {result['greedy_equal']}/{result['prompts']} (of the rest, "
              f"{result['first_difference_at_reference_tie']} part at a tie in generate()'s logits), argmax "
              f"agreement {result['argmax_agreement']:.3f} ({result['argmax_misses']} misses, "
              f"{result['misses_at_reference_ties']} at reference ties)", flush=True)
        out.write_text(json.dumps(report, indent=1))   # after every variant: a run cut short keeps what it measured
        plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
