"""benchmarks/quality.py on a few MT-bench prompts: the bf16 engine against transformers' bf16 model and
int8 against transformers' fp32 model, teacher-forced (the full run is the script's; its figures are in
benchmarks/README.md). The bounds: bf16 within 0.05 of transformers' log-prob of each of its greedy tokens on
average (the issue's bound; measured 0.024 on 16 prompts x 32 tokens); int8 within 0.1 (measured 0.043:
weight-only int8 of a 135M model moves log-probs about twice as much as bf16 does); our argmax is
transformers' token at >= 90 % of the positions (measured 96 % bf16, 95 % int8). Four prompts, not the
README's 16: transformers' bf16 generate() alone takes minutes here."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import quality  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("variant,bound", [("bf16", 0.05), ("int8", 0.1)])
def test_teacher_forced_log_probs_stay_close_to_transformers(model_dir, tokenizer, mt_bench_prompts, variant, bound):
    dtype, quantize, ref_dtype = quality.VARIANTS[variant]
    prompts = [quality.chat_ids(tokenizer, q) for q in mt_bench_prompts[:4]]
    result = quality.compare(quality.Ours(model_dir, dtype, quantize), quality.Reference(model_dir, ref_dtype),
                             prompts, 16)
    assert result["mean_abs_dlogprob"] < bound, result
    assert result["argmax_agreement"] >= 0.9, result
    if variant == "bf16":   # the log-probs are float32 (never rounded to bf16) even in a bf16 model
        ours = quality.Ours(model_dir, dtype, quantize)
        assert ours.logprobs(prompts[0], [5, 6]).dtype == torch.float32
