"""The Triton linear, row-wise and sampling kernels against the references (and every kernel compiled for sm_90), and each row's bits alone and in
batches (CPU tensors under TRITON_INTERPRET=1 without a GPU: tiny shapes, about 0.25 s a launch).

Tolerances against float64 references: float32 within 1e-5 abs + 1e-5 rel (reassociated sums); float16 and
bfloat16 (CUDA only) within one rounding of the output (fp16 2e-3 rel, bf16 1.6e-2 rel). log_softmax's float32
output within 1e-5 of torch's. Token choices (greedy, the seeded race) exactly.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmi_handler.engine.model.backends import triton as tb
from lmi_handler.engine.sampler import exponential_log_noise
from tests.engine.triton import reference as ref

needs_triton = pytest.mark.skipif(not tb.available(), reason="triton is not installed (pip install triton)")

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
HIDDEN, INTER, VOCAB = 100, 48, 2500     # K = 100: a full and a partial K tile; V: two and a half vocab blocks


def randn(*shape, dtype=torch.float32, device="cpu", seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


@needs_triton
@pytest.mark.parametrize("dtype", ref.kernel_dtypes())
def test_linear_equals_the_reference_with_and_without_bias(dtype, device):
    x, weight, bias = randn(5, HIDDEN, dtype=dtype, device=device), randn(70, HIDDEN, dtype=dtype, device=device,
                                                                           seed=1), randn(70, dtype=dtype, seed=2)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(tb.linear(x, weight, bias.to(device)).cpu(), ref.linear(x.cpu(), weight.cpu(), bias),
                               atol=atol * 10, rtol=rtol)      # |out| ~ 10: the abs part scaled with it
    torch.testing.assert_close(tb.linear(x, weight).cpu(), ref.linear(x.cpu(), weight.cpu()), atol=atol * 10,
                               rtol=rtol)


@needs_triton
@pytest.mark.parametrize("dtype", ref.kernel_dtypes())
def test_rms_norm_equals_the_reference_and_its_residual_is_the_sum_in_the_input_dtype(dtype, device):
    x, residual = randn(4, HIDDEN, dtype=dtype, device=device), randn(4, HIDDEN, dtype=dtype, device=device, seed=1)
    weight = randn(HIDDEN, dtype=dtype, device=device, seed=2)
    atol, rtol = TOL[dtype]
    out, residual_out = tb.rms_norm(x, weight, 1e-6, residual, weight_offset=1.0)     # Gemma's (1 + weight)
    expected, expected_residual = ref.rms_norm(x.cpu(), weight.cpu(), 1e-6, residual.cpu(), 1.0)
    torch.testing.assert_close(out.cpu(), expected, atol=atol, rtol=rtol)
    assert torch.equal(residual_out.cpu(), expected_residual)
    out, residual_out = tb.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out.cpu(), ref.rms_norm(x.cpu(), weight.cpu(), 1e-5)[0], atol=atol, rtol=rtol)
    assert residual_out is x
    out, _ = tb.rms_norm(x, weight, 1e-5, residual, 0.0, False)                       # LlamaRMSNorm's rounding
    torch.testing.assert_close(out.cpu(), ref.rms_norm(x.cpu(), weight.cpu(), 1e-5, residual.cpu(), 0.0, False)[0],
                               atol=atol, rtol=rtol)


@needs_triton
@pytest.mark.parametrize("dtype", ref.kernel_dtypes())
def test_rope_and_act_mul_equal_the_reference(dtype, device):
    atol, rtol = TOL[dtype]
    x = randn(3, 6, 16, dtype=dtype, device=device)
    angles = randn(3, 8, seed=1).repeat(1, 2)                   # HF's cat(freqs, freqs)
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    torch.testing.assert_close(tb.rope(x, cos, sin).cpu(), ref.rope(x.cpu(), cos.cpu(), sin.cpu()), atol=atol,
                               rtol=rtol)
    gate_up = randn(3, 2 * INTER, dtype=dtype, device=device, seed=2) * 3
    for act in ("silu", "gelu_tanh"):
        torch.testing.assert_close(tb.act_mul(gate_up, act).cpu(), ref.act_mul(gate_up.cpu(), act), atol=atol,
                                   rtol=rtol)


def test_the_reference_backend_agrees_with_the_float64_references_the_kernels_are_held_to():
    """backends/torch_ref.py (what kernel_backend=torch runs) and reference.py's float64 definitions are the same
    ops, so a kernel equal to one is equal to the other (no Triton needed; attention: test_attention.py)."""
    from lmi_handler.engine.model.backends import torch_ref

    x, weight, bias = randn(5, HIDDEN), randn(70, HIDDEN, seed=1), randn(70, seed=2)
    torch.testing.assert_close(torch_ref.linear(x, weight, bias), ref.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    residual, norm_weight = randn(5, HIDDEN, seed=3), randn(HIDDEN, seed=4)
    for got, expected in zip(torch_ref.rms_norm(x, norm_weight, 1e-6, residual, 1.0),
                             ref.rms_norm(x, norm_weight, 1e-6, residual, 1.0)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    angles = randn(3, 8, seed=5).repeat(1, 2)
    rows = randn(3, 6, 16, seed=6)
    torch.testing.assert_close(torch_ref.rope(rows, angles.cos(), angles.sin()),
                               ref.rope(rows, angles.cos(), angles.sin()), atol=1e-6, rtol=1e-6)
    gate_up = randn(3, 2 * INTER, seed=7) * 3
    for act in ("silu", "gelu_tanh"):
        torch.testing.assert_close(torch_ref.act_mul(gate_up, act), ref.act_mul(gate_up, act), atol=1e-5, rtol=1e-5)


@needs_triton
def test_act_mul_refuses_an_unknown_activation_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="'silu' or 'gelu_tanh', got 'relu'"):
        tb.act_mul(torch.zeros(1, 4), "relu")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_log_softmax_equals_torch_in_float32_with_masked_tokens(dtype, device):
    logits = randn(3, VOCAB, seed=3) * 4
    logits[1, 100:2400] = float("-inf")                      # a grammar mask leaves few tokens
    logits = logits.to(dtype)
    out = tb.log_softmax(logits.to(device)).cpu()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref.log_softmax(logits), atol=1e-5, rtol=1e-5)


@needs_triton
def test_greedy_takes_the_argmax_and_the_lowest_index_on_ties(device):
    logits = randn(3, VOCAB, seed=4)
    logits[1, [7, 1500, 2100]] = 50.0                         # ties across vocab blocks
    logits[2, [1030, 1031]] = 50.0                            # ties inside one block
    assert tb.greedy(logits.to(device)).tolist() == ref.greedy(logits).tolist() == [int(logits[0].argmax()), 7, 1030]


@needs_triton
def test_seeded_sample_draws_the_cpu_samplers_tokens_from_the_same_hash_of_seed_and_position(device):
    logprobs = torch.log_softmax(randn(6, VOCAB, seed=5) * 2, dim=-1)
    seeds = torch.tensor([0, 1, -7, 2 ** 62 + 3, -(2 ** 63), 123456789])
    positions = torch.tensor([0, 5, 5, 1000, 3, 2 ** 40])
    expected = (logprobs - exponential_log_noise(seeds, positions, VOCAB)).argmax(-1)
    got = tb.seeded_sample(logprobs.to(device), seeds.to(device), positions.to(device)).cpu()
    assert got.tolist() == expected.tolist()


def _ops(dtype, device):
    """Each row-wise op as a function of its (T, ...) rows, and the row inputs to feed it."""
    weight, norm_weight = randn(70, HIDDEN, dtype=dtype, device=device, seed=10), randn(HIDDEN, dtype=dtype, seed=11)
    angles = randn(8, 8, seed=12).repeat(1, 2)
    cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
    seeds, positions = torch.arange(8, device=device) * 977 - 3, torch.arange(8, device=device) + 40
    logprobs = torch.log_softmax(randn(8, VOCAB, seed=13), -1).to(device)
    return {
        "linear": (lambda x: tb.linear(x, weight), randn(8, HIDDEN, dtype=dtype, device=device, seed=14)),
        "rms_norm": (lambda x: tb.rms_norm(x[:, :HIDDEN], norm_weight.to(device), 1e-6, x[:, HIDDEN:])[0],
                     randn(8, 2 * HIDDEN, dtype=dtype, device=device, seed=15)),
        "rope": (lambda x: tb.rope(x, cos[:x.shape[0]], sin[:x.shape[0]]),
                 randn(8, 6, 16, dtype=dtype, device=device, seed=16)),
        "act_mul": (lambda x: tb.act_mul(x, "gelu_tanh"), randn(8, 2 * INTER, dtype=dtype, device=device, seed=17)),
        "log_softmax": (tb.log_softmax, randn(8, VOCAB, dtype=dtype, device=device, seed=18)),
        "greedy": (tb.greedy, randn(8, VOCAB, dtype=dtype, device=device, seed=19)),
        "seeded_sample": (lambda x: tb.seeded_sample(x, seeds[:x.shape[0]], positions[:x.shape[0]]), logprobs),
    }


@needs_triton
@pytest.mark.parametrize("op,dtype", [(op, dtype) for op in ("linear", "rms_norm", "rope", "act_mul", "log_softmax",
                                                             "greedy") for dtype in (torch.float32, torch.float16)]
                         + [("seeded_sample", torch.float32)])         # the sampler reads float32 log-probs
def test_a_row_has_the_same_bits_alone_and_in_batches_of_3_and_8_with_padding_rows(op, dtype, device):
    """Row 0 alone, first of 3 rows, and first of 5 rows padded with 3 zero rows to 8 (the M tile of linear the
    same, the row's position in it different: row 2 of the 3 is checked too, against row 2 alone)."""
    fn, rows = _ops(dtype, device)[op]
    padded = torch.cat([rows[:5], torch.zeros_like(rows[:3])])
    alone, of_3, of_8 = fn(rows[:1]), fn(rows[:3]), fn(padded)
    assert torch.equal(alone[0], of_3[0]) and torch.equal(alone[0], of_8[0])
    if op not in ("rope", "seeded_sample"):       # their inputs are keyed on the row's index, not only its values
        assert torch.equal(fn(rows[2:3])[0], of_3[2])


def test_without_triton_the_backend_imports_and_an_op_says_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)           # `import triton` fails as when it is not installed
    assert not tb.available()
    with pytest.raises(RuntimeError, match=r"needs the triton package \(pip install triton\)"):
        tb.greedy(torch.zeros(1, 4))


def test_without_triton_kernel_backend_triton_is_refused_at_start_up_and_auto_on_cuda_takes_torch(monkeypatch):
    from transformers import LlamaConfig

    from lmi_handler.config import ConfigError
    from lmi_handler.engine.model.backend import choose_backend
    from lmi_handler.engine.model.families import build_spec

    spec = build_spec(LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                  num_hidden_layers=1).to_dict())
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(ConfigError, match=r"kernel_backend=triton cannot run here: .*\(pip install triton\)"):
        choose_backend("triton", spec, torch.device("cpu"))
    name, why = choose_backend("auto", spec, torch.device("cuda"))      # only the device's type is read
    assert name == "torch" and "pip install triton" in why


# Every kernel compiles for an H100/H200 (sm_90) without a GPU: the interpreter runs what the compiler may refuse
# (a type, a loop-carried value, a 3-D block), so the compiler itself checks the GPU path here.
ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(not tb.available(), reason="triton is not installed (pip install triton)")
def test_every_kernel_compiles_for_sm_90_through_ptxas():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}    # interpreted kernels do not compile
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-m", "tests.engine.triton.compile_check", "90"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from tests.engine.triton.compile_check import cases
    compiled = proc.stdout.splitlines()
    assert len(compiled) == 2 * len(list(cases("bf16"))) and all(line.startswith("sm_90 ") for line in compiled), proc.stdout
