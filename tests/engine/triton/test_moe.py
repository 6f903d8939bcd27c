"""The fused MoE kernel (backends/triton/moe.py) against the reference experts (torch_ref.moe_experts), each
token's bits alone and in batches of 3 and 8, and the sort that groups pairs by expert (CPU tensors under
TRITON_INTERPRET=1 without a GPU: 4 experts, hidden 40, width 24, a partial K tile)."""
from __future__ import annotations

import pytest
import torch

from lmi_handler.engine.model.backends import torch_ref
from lmi_handler.engine.model.backends import triton as tb
from lmi_handler.engine.model.moe import MoeWeights, route
from lmi_handler.engine.model.spec import MoeSpec

needs_triton = pytest.mark.skipif(not tb.available(), reason="triton is not installed (pip install triton)")
HIDDEN, WIDTH, EXPERTS = 40, 24, 4
SPEC = MoeSpec(num_experts=EXPERTS, top_k=2, intermediate_size=WIDTH)


def _case(num_tokens: int, device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, HIDDEN, generator=g)
    w = MoeWeights(router=torch.randn(EXPERTS, HIDDEN, generator=g),
                   gate_up=[torch.randn(2 * WIDTH, HIDDEN, generator=g) * 0.2 for _ in range(EXPERTS)],
                   down=[torch.randn(HIDDEN, WIDTH, generator=g) * 0.2 for _ in range(EXPERTS)])
    ids, weights = route(x @ w.router.T, SPEC)
    on = MoeWeights(router=w.router, gate_up=[t.to(device) for t in w.gate_up], down=[t.to(device) for t in w.down])
    return x, ids, weights, w, on


@needs_triton
def test_the_fused_moe_kernel_equals_the_reference_experts(device):
    x, ids, weights, w, on = _case(8, device)
    assert ids.unique().numel() == EXPERTS                                    # every expert has rows
    ours = tb.moe_experts(x.to(device), ids.to(device), weights.to(device), on).cpu()
    torch.testing.assert_close(ours, torch_ref.moe_experts(x, ids, weights, w), atol=1e-5, rtol=1e-5)


@needs_triton
def test_a_token_s_expert_outputs_are_bitwise_the_same_alone_and_in_batches_of_3_and_8(device):
    x, ids, weights, _, on = _case(8, device)
    x, ids, weights = x.to(device), ids.to(device), weights.to(device)
    alone = tb.moe_experts(x[:1], ids[:1], weights[:1], on)
    for n in (3, 8):
        assert torch.equal(tb.moe_experts(x[:n], ids[:n], weights[:n], on)[:1], alone)


@needs_triton
def test_pairs_are_sorted_by_expert_into_whole_blocks_and_unchosen_experts_get_none(device):
    from lmi_handler.engine.model.backends.triton.moe import BLOCK_M, sort_pairs

    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=device)                 # expert 1 chosen by no token
    sorted_pairs, block_expert = sort_pairs(ids, EXPERTS)
    assert block_expert.tolist() == [0, 2, 3] + [-1] * (1 + EXPERTS - 3)
    runs = sorted_pairs.view(-1, BLOCK_M)
    assert [r[r >= 0].tolist() for r in runs[:3]] == [[1, 4], [0, 2, 5], [3]]   # pair t * 2 + k, token order
    assert (runs[3:] == -1).all()


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("family,prompt", [("qwen2_moe", [1, 250, 17, 99, 5, 6, 7, 8]),
                                          ("gpt_oss", [1] + [(7 * i + 3) % 500 + 3 for i in range(19)])])
def test_qwen2_moe_and_gpt_oss_on_the_triton_backend_give_transformers_greedy_tokens(tmp_path, device, family,
                                                                                      prompt):
    """The whole forward with the fused MoE kernel: sparse layers around a dense one, the gated shared expert
    (Qwen2-MoE); gpt-oss's sinks, alternating windows (the prompt past its window of 16) and clamped experts."""
    from lmi_handler.engine.kv_cache import BlockAllocator
    from lmi_handler.engine.model_runner import ModelRunner
    from tests.engine.family_models import build_tiny_moe
    from tests.engine.helpers import greedy_generate, hf_greedy

    hf = build_tiny_moe(tmp_path, family)
    runner = ModelRunner(tmp_path, torch.float32, device, block_size=4, num_blocks=16, kernel_backend="triton")
    ours, _ = greedy_generate(runner, BlockAllocator(runner.num_blocks, runner.block_size), [prompt], 3)
    assert ours[0] == hf_greedy(hf, prompt, 3)


@needs_triton
def test_gpt_oss_s_biased_clamped_experts_on_triton_equal_the_reference_and_keep_a_token_s_bits(device):
    """The grouped walk over Triton's linear with the experts' biases and the clamped SwiGLU (gpt-oss)."""
    from dataclasses import replace

    spec = replace(SPEC, routing="topk_softmax", activation="clamped_swiglu", swiglu_alpha=1.702, swiglu_limit=1.0,
                   expert_bias=True)
    x, ids, weights, w, on = _case(8, device)
    g = torch.Generator().manual_seed(1)
    w.gate_up_bias = [torch.randn(2 * WIDTH, generator=g) for _ in range(EXPERTS)]
    w.down_bias = [torch.randn(HIDDEN, generator=g) for _ in range(EXPERTS)]
    on.gate_up_bias, on.down_bias = [b.to(device) for b in w.gate_up_bias], [b.to(device) for b in w.down_bias]
    x, ids, weights = x.to(device), ids.to(device), weights.to(device)
    ours = tb.moe_experts(x, ids, weights, on, spec)
    expected = torch_ref.moe_experts(x.cpu(), ids.cpu(), weights.cpu(), w, spec)
    torch.testing.assert_close(ours.cpu(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(tb.moe_experts(x[:1], ids[:1], weights[:1], on, spec), ours[:1])
