"""The Triton backend's LoRA term (backends/triton/lora.py, lora_add): against lora.py's lora_delta (the torch
reference) for fp32 and fp16 inputs, a row's bits the same alone and beside other adapters' rows, and the whole
engine on option.kernel_backend=triton giving transformers' tokens with the adapter merged beside base rows.
Under Triton's interpreter on CPU tensors here (conftest.py), compiled on a GPU; tiny shapes."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lmi_handler.config import EngineConfig, LoraConfig
from lmi_handler.engine.engine import Engine
from lmi_handler.engine.model.backends import triton as tb
from lmi_handler.engine.model.lora import lora_delta
from lmi_handler.engine.sequence import SamplingParams
from tests.engine.helpers import build_tiny_llama, build_tiny_tokenizer, hf_greedy
from tests.engine.lora_helpers import merge_adapter, write_peft_adapter
from tests.engine.triton import reference as ref

pytestmark = pytest.mark.skipif(not tb.available(), reason="triton is not installed (pip install triton)")

NUM_SLOTS, R_MAX, IN, OUT = 3, 8, 40, 136          # OUT: two column blocks, the second one partial


def _stacks(device, seed: int = 0):
    """Three adapters' stacks (as lora_add takes them), slot 1 of rank 5 zero-padded to R_MAX, and their scales."""
    generator = torch.Generator().manual_seed(seed)
    a, b = torch.randn(NUM_SLOTS, R_MAX, IN, generator=generator), torch.randn(NUM_SLOTS, OUT, R_MAX, generator=generator)
    a[1, 5:], b[1, :, 5:] = 0, 0
    return tb.lora_stack(a.to(device), b.to(device)), torch.tensor([2.0, 0.5, 1.0], device=device)


@pytest.mark.parametrize("dtype", ref.kernel_dtypes())          # bf16 where compiled (a GPU)
def test_the_triton_lora_term_equals_lora_delta_with_base_rows_untouched(dtype, device):
    stack, scale = _stacks(device)
    x = (torch.randn(19, IN, generator=torch.Generator().manual_seed(1)) / 4).to(device, dtype)
    row_slot = torch.tensor([0, -1, 2, 1, -1, 0, 2, 2, 1, -1, 0, 1, 1, 2, -1, 0, 0, 2, 1], device=device)
    y = torch.randn(19, OUT, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    expected = lora_delta(x.float(), row_slot, stack.a, stack.b, scale)   # fp16/bf16 -> fp32 exact: the same products
    delta = tb.lora_rows(torch.zeros(19, OUT, device=device), x, row_slot, stack, scale)
    torch.testing.assert_close(delta, expected, atol=1e-5, rtol=1e-5)
    assert delta.abs().amin(dim=1)[row_slot >= 0].gt(0).all()      # every adapter row changed in every column
    out = tb.lora_rows(y.clone(), x, row_slot, stack, scale)
    assert torch.equal(out[row_slot < 0], y[row_slot < 0])          # base rows keep their bits
    # added in float32 and rounded once to y's dtype (a GPU may fuse the scale and the add into one FMA)
    rtol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out.float(), (y.float() + delta).to(dtype).float(), atol=1e-5, rtol=rtol)


def test_a_row_gets_the_same_bits_alone_and_in_batches_of_3_8_and_20_beside_other_adapters(device):
    """Batches of 3 and 8 (one row block) and of 20 (two: row 17 in the second)."""
    stack, scale = _stacks(device, seed=3)
    x = torch.randn(20, IN, generator=torch.Generator().manual_seed(4)).to(device)
    row_slot = torch.tensor([1, 0, -1, 2, 0, 1, 2, -1, 0, 0, 1, 2, -1, 2, 1, 0, 2, 0, 1, -1], device=device)
    zeros = torch.zeros(20, OUT, device=device)
    batch20 = tb.lora_rows(zeros.clone(), x, row_slot, stack, scale)
    batch8 = tb.lora_rows(zeros[:8].clone(), x[:8], row_slot[:8], stack, scale)
    batch3 = tb.lora_rows(zeros[:3].clone(), x[3:6], row_slot[3:6], stack, scale)     # rows 3, 4, 5 at 0, 1, 2
    for t in (0, 4, 17):
        alone = tb.lora_rows(zeros[:1].clone(), x[t:t + 1], row_slot[t:t + 1], stack, scale)
        assert torch.equal(alone[0], batch20[t]), t
    assert torch.equal(batch8, batch20[:8]) and torch.equal(batch3, batch20[3:6])
    assert not torch.equal(batch20[17], torch.zeros(OUT, device=device))


def test_lora_stack_refuses_stacks_of_two_ranks_and_lora_add_an_input_of_another_width(device):
    """The stacks' own shapes are checked once (lora_stack), the step's rows against them at every call."""
    a, b = torch.zeros(NUM_SLOTS, R_MAX, IN, device=device), torch.zeros(NUM_SLOTS, OUT, R_MAX + 1, device=device)
    with pytest.raises(ValueError, match=r"b_stack \(3, 136, 9\) must be \(num_slots, out, r_max\)"):
        tb.lora_stack(a, b)
    stack, scale = _stacks(device)
    row_slot = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"shapes do not match: y \(2, 136\), x \(2, 41\)"):
        tb.lora_rows(torch.zeros(2, OUT, device=device), torch.zeros(2, IN + 1, device=device), row_slot, stack, scale)


# ---- the engine on kernel_backend=triton ------------------------------------------------------------------

PROMPTS = [[1, 250, 17, 99, 5, 6], [1, 40, 41, 42]]


@pytest.fixture(scope="module")
def lora_llama(tmp_path_factory):
    """A tiny random Llama (hidden 32, 2 layers, GQA), a random rank-4 adapter on q/v/o/gate/down and
    transformers' model with it merged (fp32)."""
    from transformers import LlamaForCausalLM

    path, root = tmp_path_factory.mktemp("llama"), tmp_path_factory.mktemp("adapters")
    base = build_tiny_llama(path, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2)
    tensors = write_peft_adapter(root / "a", base.config, rank=4, alpha=8, seed=5, std=0.3)
    merged = LlamaForCausalLM.from_pretrained(path).eval()
    merge_adapter(merged, tensors, 2.0)
    return path, root, base, merged


def test_the_engine_on_triton_answers_as_transformers_with_the_adapter_merged_beside_a_base_request_bitwise(
        lora_llama, device):
    path, root, base, merged = lora_llama
    config = EngineConfig(model_path=path, dtype="float32", device_id=0 if device.type == "cuda" else -1,
                          max_num_seqs=4, max_num_batched_tokens=16, max_model_len=None, block_size=4,
                          kv_cache_bytes=1 << 20, kernel_backend="triton", enable_prefix_caching=False,
                          lora=LoraConfig(max_loras=2, max_cpu_loras=2, adapter_roots=(root,)))
    engine = Engine(config, tokenizer=build_tiny_tokenizer())
    engine.adapters.load("a", root / "a")
    assert engine.runner.kernel_backend == "triton" and engine.runner.model.ops is tb
    params = SamplingParams(max_new_tokens=4, greedy=True, ignore_eos=True)
    requests = [("a0", PROMPTS[0], replace(params, adapter="a")), ("base", PROMPTS[0], params),
                ("a1", PROMPTS[1], replace(params, adapter="a"))]

    def answer(requests):
        results = engine.generate(requests)
        return {rid: [(t.id, t.log_prob) for out in outs for t in out.new_tokens] for rid, outs in results.items()}

    mixed = answer(requests)                                      # every step holds adapter rows and base rows
    tokens = {rid: [token for token, _ in out] for rid, out in mixed.items()}
    assert tokens["base"] == hf_greedy(base, PROMPTS[0], 4)
    assert tokens["a0"] == hf_greedy(merged, PROMPTS[0], 4) and tokens["a1"] == hf_greedy(merged, PROMPTS[1], 4)
    assert tokens["a0"] != tokens["base"]                         # the adapter changes the answer
    assert answer(requests[:1])["a0"] == mixed["a0"]              # log-probs compared exactly: alone = beside others
