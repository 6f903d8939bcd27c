"""The C++ kernels the families beyond Llama need (kernels/families.h, attention.h's window and score cap),
as the C++ ops backend (backends/cpp.py) calls them: each against the pure-PyTorch reference backend
(backends/torch_ref.py), and each row's bits the same alone and in any batch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmi_handler.engine.model.attention import AttentionMetadata, attention_paged
from lmi_handler.engine.model.backends import cpp, torch_ref
from lmi_handler.engine.model.kernels import cpu_kernels, pack_weight
from tests.engine.helpers import make_meta, random_paged_case


@pytest.fixture(scope="module", autouse=True)
def built_kernels():
    assert cpu_kernels() is not None, "the C++ kernels must build on the test machines (g++ and ninja)"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def attention_case(head_dim: int, block_size: int, dtype: torch.dtype, seed: int = 0):
    """Six sequences, prefill chunks and decode rows, contexts up to ~60 keys (past every window tested)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(1, 20, (6,), generator=g)]
    lengths[1] = lengths[3] = 1
    starts = [int(x) for x in torch.randint(0, 40, (6,), generator=g)]
    starts[0] = 0
    q, k_cache, v_cache, meta, _, _ = random_paged_case(starts, lengths, 8, 2, head_dim, block_size, seed=seed + 1)
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), meta, starts, lengths


WINDOWS = [(None, None), (5, None), (16, None), (None, 3.0), (7, 2.0)]


@pytest.mark.parametrize("window,softcap", WINDOWS)
@pytest.mark.parametrize("head_dim,block_size", [(16, 4), (12, 16), (32, 5)])   # 12: the scalar score path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_and_capped_paged_attention_matches_the_reference(window, softcap, head_dim, block_size, dtype):
    """bf16: the reference's softmax weights stay float32 where the kernel rounds them to bf16 (torch's CPU
    flash attention's rounding), so the two are a bf16 rounding or two apart."""
    q, k_cache, v_cache, meta, _, _ = attention_case(head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    ours = cpp.paged_attention(q, k_cache, v_cache, meta, scale, window, softcap)
    expected = torch_ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale, window, softcap)
    assert ours.dtype == dtype
    tol = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2e-2)
    torch.testing.assert_close(ours.float(), expected, **tol)


@pytest.mark.parametrize("window,softcap", WINDOWS[1:])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_windowed_row_has_the_same_bits_alone_as_a_decode_row_and_in_the_batch(window, softcap, dtype):
    """Every row of the batch (prefill chunks among decodes) against the same row computed alone as a decode
    step at its position (the cache already holds its keys): bitwise, in float32 and bfloat16."""
    q, k_cache, v_cache, meta, starts, lengths = attention_case(16, 4, dtype, seed=3)
    scale = 0.25
    batched = cpp.paged_attention(q, k_cache, v_cache, meta, scale, window, softcap)
    tables = meta.block_tables.tolist()
    row = 0
    for i, (start, n) in enumerate(zip(starts, lengths)):
        for j in range(n):
            alone = make_meta([tables[i]], [start + j], [1], meta.block_size)
            out = cpp.paged_attention(q[row:row + 1], k_cache, v_cache, alone, scale, window, softcap)
            assert torch.equal(bits(out), bits(batched[row:row + 1])), (i, j)
            row += 1


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_sinks_join_each_head_s_softmax_as_the_reference_s_and_keep_each_row_s_bits(window, dtype):
    """gpt-oss's sinks (one logit per query head in the denominator, attending to nothing): against the
    reference, different from no sinks, and each row bitwise the same alone (a decode at its position)."""
    q, k_cache, v_cache, meta, starts, lengths = attention_case(16, 4, dtype, seed=7)
    sinks = torch.linspace(-2.0, 3.0, q.shape[1])
    ours = cpp.paged_attention(q, k_cache, v_cache, meta, 0.25, window, None, sinks)
    expected = torch_ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, 0.25, window, None, sinks)
    tol = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2e-2)
    torch.testing.assert_close(ours.float(), expected, **tol)
    plain = torch_ref.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, 0.25, window)
    assert (plain - expected).abs().max() > 0.05
    tables, row = meta.block_tables.tolist(), 0
    for i, (start, n) in enumerate(zip(starts, lengths)):
        for j in range(n):
            alone = make_meta([tables[i]], [start + j], [1], meta.block_size)
            out = cpp.paged_attention(q[row:row + 1], k_cache, v_cache, alone, 0.25, window, None, sinks)
            assert torch.equal(bits(out), bits(ours[row:row + 1])), (i, j)
            row += 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_window_past_every_context_gives_the_unmasked_kernel_s_bits(dtype):
    """The masked form with nothing to mask runs the same operations as the fused stack's kernel."""
    q, k_cache, v_cache, meta, _, _ = attention_case(16, 4, dtype, seed=5)
    masked = cpp.paged_attention(q, k_cache, v_cache, meta, 0.25, 1000)
    assert torch.equal(bits(masked), bits(attention_paged(q, k_cache, v_cache, meta, 0.25)))
    assert torch.equal(bits(cpp.paged_attention(q, k_cache, v_cache, meta, 0.25)), bits(masked))


def test_a_negative_window_or_cap_is_refused():
    q, k_cache, v_cache, meta, _, _ = attention_case(16, 4, torch.float32)
    with pytest.raises(RuntimeError, match="window and softcap must be >= 0"):
        cpu_kernels().paged_attention_masked(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                             meta.cu_seqlens_q, 0.25, -1, 0.0)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("width", [64, 67, 16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_with_its_weight_offset_matches_the_reference(offset, width, with_residual):
    """float32: within the rounding of the sum of squares' order; bfloat16: within one bf16 step, the residual
    sum bitwise PyTorch's."""
    g = torch.Generator().manual_seed(width)
    x, residual = torch.randn(37, width, generator=g) * 3, torch.randn(37, width, generator=g)
    weight = torch.randn(width, generator=g) * 0.3
    for dtype in (torch.float32, torch.bfloat16):
        xd, rd, wd = x.to(dtype), residual.to(dtype) if with_residual else None, weight.to(dtype)
        out, h = cpp.rms_norm(xd, wd, 1e-6, rd, offset)
        ref_out, ref_h = torch_ref.rms_norm(xd, wd, 1e-6, rd, offset)
        assert out.dtype == dtype and torch.equal(bits(h), bits(ref_h))
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        else:
            step = ref_out.float().abs().clamp_min(1e-30) * 2 ** -7
            assert ((out.float() - ref_out.float()).abs() <= step * 1.01).all()


@pytest.mark.parametrize("width", [64, 67, 16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_the_llama_rounded_rms_norm_is_the_fused_stack_s_and_matches_the_reference(width, with_residual):
    """weight_in_float False (LlamaRMSNorm's rounding): rowwise.h's add_rmsnorm, the fused stack's norm, which
    adds the residual into x in place; within the reference's rounding (float32: the sum of squares' order;
    bf16: one bf16 step, twice rounded), the residual sum bitwise PyTorch's."""
    g = torch.Generator().manual_seed(width + 1)
    x, residual = torch.randn(37, width, generator=g) * 3, torch.randn(37, width, generator=g)
    weight = torch.randn(width, generator=g) * 0.3
    for dtype in (torch.float32, torch.bfloat16):
        xd, rd, wd = x.to(dtype), residual.to(dtype) if with_residual else None, weight.to(dtype)
        ref_out, ref_h = torch_ref.rms_norm(xd, wd, 1e-6, rd, 0.0, False)
        out, h = cpp.rms_norm(xd.clone(), wd, 1e-6, rd, 0.0, False)
        assert out.dtype == dtype and torch.equal(bits(h), bits(ref_h))
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        else:
            step = ref_out.float().abs().clamp_min(1e-30) * 2 ** -6
            assert ((out.float() - ref_out.float()).abs() <= step * 1.01).all()
    with pytest.raises(ValueError, match="no weight offset"):
        cpp.rms_norm(x, weight, 1e-6, None, 1.0, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 6, 128])
def test_rope_is_bitwise_the_reference(dtype, head_dim):
    """Two products and one add per element, each rounded to the dtype: torch_ref.rope's operations."""
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(11, 3, head_dim, generator=g).to(dtype)
    angles = torch.randn(11, head_dim // 2, generator=g) * 5
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    assert torch.equal(bits(cpp.rope(x, cos, sin)), bits(torch_ref.rope(x, cos, sin)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_times_up_matches_pytorch_and_its_vector_lanes_give_the_scalar_loops_bits(dtype):
    """gelu_tanh(g) as g / (1 + exp(-2 k)) (the same function as 0.5 g (1 + tanh(k))): within float32 rounding
    of PyTorch's F.gelu(approximate="tanh") * up (absolute 5e-6 where g < -4: there PyTorch's 1 + tanh(k)
    cancels to 0 where ours keeps the tiny true value), one bf16 step in bf16; the AVX-512 lanes (exp16_glibc)
    bitwise the scalar std::exp loop, on ordinary values, glibc's special lanes and a tail shorter than a
    vector."""
    g = torch.Generator().manual_seed(4)
    gate_up = torch.randn(40, 2 * 1544 + 2, generator=g) * 3
    special = [float("inf"), -float("inf"), 50.0, -50.0, 30.0, -30.0, 1e-40, -1e-40, 0.0, -0.0, 12.0, -12.0]
    gate_up[0, :len(special)] = torch.tensor(special)
    gate_up = gate_up.to(dtype)
    ours = cpp.act_mul(gate_up, "gelu_tanh")
    expected = torch_ref.act_mul(gate_up, "gelu_tanh")
    finite = ours.float().isfinite() & expected.float().isfinite()
    assert torch.equal(finite, expected.float().isfinite())
    if dtype == torch.float32:
        torch.testing.assert_close(ours[finite], expected[finite], rtol=1e-5, atol=5e-6)
    else:
        diff = (ours.float() - expected.float())[finite].abs()
        assert (diff <= expected.float()[finite].abs() * 2 ** -7 * 1.01 + 5e-6).all()
    if cpu_kernels().vector_exp_agrees():
        assert torch.equal(bits(cpu_kernels().gelu_tanh_mul(gate_up, True)),
                           bits(cpu_kernels().gelu_tanh_mul(gate_up, False)))


def test_silu_and_the_packed_linear_through_the_cpp_ops_match_the_reference():
    g = torch.Generator().manual_seed(6)
    gate_up, x = torch.randn(9, 70, generator=g), torch.randn(9, 48, generator=g)
    weight, bias = torch.randn(40, 48, generator=g), torch.randn(40, generator=g)
    torch.testing.assert_close(cpp.act_mul(gate_up, "silu"), torch_ref.act_mul(gate_up, "silu"))
    torch.testing.assert_close(cpp.linear(x, cpp.pack_linear(weight, "float32"), bias),
                               torch_ref.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    int8 = cpp.pack_linear(weight, "int8")
    assert int8.kind == "int8" and torch.equal(int8.panels, pack_weight(weight, "int8").panels)
    logits = torch.randn(5, 33, generator=g)
    logits[2, 7] = logits[2, 30] = logits[2].max() + 1                       # a tie: the lower index
    assert torch.equal(cpp.greedy(logits), torch_ref.greedy(logits)) and int(cpp.greedy(logits)[2]) == 7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_family_row_ops_give_a_row_the_same_bits_alone_and_in_any_batch(dtype):
    g = torch.Generator().manual_seed(8)
    x, residual = torch.randn(150, 72, generator=g).to(dtype), torch.randn(150, 72, generator=g).to(dtype)
    weight, gate_up = torch.randn(72, generator=g).to(dtype), torch.randn(150, 2 * 1030, generator=g).to(dtype)
    heads = torch.randn(150, 4, 32, generator=g).to(dtype)
    cos, sin = torch.randn(150, 32, generator=g).to(dtype), torch.randn(150, 32, generator=g).to(dtype)
    full_norm = cpp.rms_norm(x, weight, 1e-6, residual, 1.0)[0]
    full_act = cpp.act_mul(gate_up, "gelu_tanh")
    full_rope = cpp.rope(heads, cos, sin)
    for num_rows, start in ((1, 0), (1, 77), (3, 10), (64, 20), (149, 1)):
        rows = slice(start, start + num_rows)
        assert torch.equal(bits(cpp.rms_norm(x[rows], weight, 1e-6, residual[rows], 1.0)[0]), bits(full_norm[rows]))
        assert torch.equal(bits(cpp.act_mul(gate_up[rows], "gelu_tanh")), bits(full_act[rows]))
        assert torch.equal(bits(cpp.rope(heads[rows], cos[rows], sin[rows])), bits(full_rope[rows]))


def test_gelu_tanh_is_accurate_across_its_range():
    """Over [-12, 12]: within float32 rounding of the float64 value (relative 2e-5: exp(-2 k) turns k's rounding
    into |2 k| times as much, up to 88), and within 5e-7 of PyTorch's tanh form, whose 1 + tanh(k) cancels for
    g < -3 (it reaches 0 near g = -5.5; ours keeps the tiny value)."""
    import math

    gate = torch.linspace(-12, 12, 4801)
    ours = cpp.act_mul(torch.cat((gate, torch.ones_like(gate)))[None], "gelu_tanh")[0]
    g = gate.double()
    exact = g / (1 + torch.exp(-2 * math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
    torch.testing.assert_close(ours.double(), exact, rtol=2e-5, atol=1e-37)
    torch.testing.assert_close(ours, F.gelu(gate, approximate="tanh"), rtol=0, atol=5e-7)


def test_the_attention_metadata_of_a_step_is_read_as_the_reference_reads_it():
    """A sequence with several rows this step (a prefill chunk after cached tokens), window 3: row j at
    position p attends p - 2 .. p, the reference's mask."""
    q, k_cache, v_cache, _, _, _ = attention_case(16, 4, torch.float32)
    meta = AttentionMetadata(slot_mapping=torch.arange(6), block_tables=torch.tensor([[0, 1, 2]], dtype=torch.int32),
                             context_lens=torch.tensor([10], dtype=torch.int32),
                             cu_seqlens_q=torch.tensor([0, 6], dtype=torch.int32), query_lens=[6],
                             context_lens_host=[10], block_size=4)
    ours = cpp.paged_attention(q[:6], k_cache, v_cache, meta, 0.25, 3)
    torch.testing.assert_close(ours, torch_ref.paged_attention(q[:6], k_cache, v_cache, meta, 0.25, 3),
                               rtol=1e-5, atol=2e-6)
