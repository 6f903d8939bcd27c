"""benchmarks/quality.py on a few MT-bench prompts: the bf16 engine against transformers' bf16 model and
int8 against transformers' fp32 model, teacher-forced; the row of transformers' own bf16 model with float32 logits;
the variant names refused; the plot (the full run is the script's; its figures are in
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


@pytest.mark.slow
def test_the_reference_row_with_float32_logits_is_transformers_own_bf16_forward(model_dir, tokenizer, mt_bench_prompts):
    """quality.py's hf_bf16_f32_logits row (what the greedy-equal count reaches when logits stay float32, on the
    reference's own hidden states): the variant builds transformers' bf16 model with only its lm_head's output
    left in float32, against transformers' bf16 model. Its logits are float32, not bf16 values, and rounded to bf16
    they are the plain model's to within bf16 rounding (the same hidden states: at most 2**-7 relative apart);
    against the plain model it parts only at ties of the plain model's logits, its log-probs within 0.02."""
    prompts = [quality.chat_ids(tokenizer, q) for q in mt_bench_prompts[:2]]
    floor, ref_dtype = quality.variant("hf_bf16_f32_logits", model_dir)
    assert isinstance(floor, quality.ReferenceFloat32Logits) and ref_dtype == torch.bfloat16
    ref = quality.Reference(model_dir, ref_dtype)
    logits, plain = floor.logits(prompts[0], [5, 6, 7]), ref.logits(prompts[0], [5, 6, 7]).float()
    assert logits.dtype == torch.float32
    assert not torch.equal(logits, logits.bfloat16().float())   # not rounded to bf16
    assert bool(((logits.bfloat16().float() - plain).abs() <= plain.abs() * 2.0 ** -7 + 1e-6).all())
    result = quality.compare(floor, ref, prompts, 8)
    assert result["greedy_equal"] + result["first_difference_at_reference_tie"] == result["prompts"], result
    assert result["mean_abs_dlogprob"] < 0.02, result
    assert result["argmax_agreement"] >= 0.75, result


@pytest.mark.parametrize("argv,message", [
    (["--variants", "bf32"], "--variants: unknown 'bf32'; allowed: fp32, bf16"),
    (["--variants", "bf16,"], "--variants: unknown an empty name"),
    (["--prompts", "0"], "--prompts must be 1..80"),
    (["--prompts", "81"], "--prompts must be 1..80"),
    (["--prompts", "-1"], "--prompts must be 1..80"),
    (["--tokens", "0"], "--tokens must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--model-dir", "/nonexistent"], "--model-dir: no config.json in /nonexistent"),
])
def test_bad_options_are_refused_before_anything_loads(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        quality.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_variant_names_are_stripped_and_repeats_dropped_and_an_existing_out_is_kept(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")   # a checkpoint directory as far as the options' check goes
    model = ["--model-dir", str(tmp_path)]
    assert quality.parse_args([*model, "--variants", " bf16, int8,bf16"]).variants == "bf16,int8"
    existing = tmp_path / "q.json"
    existing.write_text("{}")
    with pytest.raises(SystemExit):
        quality.parse_args([*model, "--out", str(existing)])
    assert "exists (not overwritten)" in capsys.readouterr().err and existing.read_text() == "{}"


def test_an_unknown_variant_is_refused_by_name():
    with pytest.raises(ValueError, match="'bf32'.*allowed: fp32, bf16, int8, int8-bf16, hf_bf16, hf_bf16_f32_logits"):
        quality.variant("bf32", REPO / "model")


def test_the_plot_shows_each_variant(tmp_path):
    """quality.plot writes a PNG from a report's variants (the counts and the log-prob gaps quality.py prints),
    a row for each variant, in the report's order."""
    row = {"prompts": 16, "tokens": 32, "greedy_equal": 5, "first_difference_at_reference_tie": 8,
           "mean_abs_dlogprob": 0.023, "max_abs_dlogprob": 0.18, "reference": "transformers bfloat16"}
    report = {"date": "2026-12-06T07:31:38+00:00", "variants": {"bf16": row, "hf_bf16_f32_logits": {**row, "greedy_equal": 7}}}
    out = tmp_path / "quality.png"
    labels = quality.plot(report, out)
    assert [label.split("\n")[0] for label in labels] == ["bf16", "hf_bf16_f32_logits"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
