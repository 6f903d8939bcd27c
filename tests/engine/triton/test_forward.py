"""The whole engine on option.kernel_backend=triton: every op of the model's forward a Triton kernel (under
Triton's interpreter on CPU tensors here, TRITON_INTERPRET=1 from conftest.py; compiled on a GPU), against
transformers' greedy tokens in float32 and bitwise the same alone and batched. Tiny shapes: the interpreter
runs each program of each launch in Python."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lmi_handler.config import EngineConfig
from lmi_handler.engine.engine import Engine
from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.model.backends import triton as tb
from lmi_handler.engine.model_runner import ModelRunner
from lmi_handler.engine.sequence import SamplingParams
from tests.engine.family_models import TINY_FAMILIES, WINDOW, build_tiny_family
from tests.engine.helpers import (
    assert_logits_bitwise_identical_alone_and_in_batch,
    build_tiny_llama,
    build_tiny_tokenizer,
    greedy_generate,
    hf_greedy,
)

pytestmark = pytest.mark.skipif(not tb.available(), reason="triton is not installed (pip install triton)")

PROMPTS = [[1, 250, 17, 99, 5, 6], [1, 40, 41, 42], [1, 300, 7, 8, 9, 10, 11, 12, 13]]
SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)   # 2 layers


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return path, build_tiny_llama(path, attention_bias=True, **SMALL)


def _runner(path, device):
    runner = ModelRunner(path, torch.float32, device, block_size=4, num_blocks=32, kernel_backend="triton")
    assert runner.kernel_backend == "triton" and runner.model.ops is tb
    return runner, BlockAllocator(runner.num_blocks, runner.block_size)


def test_the_triton_backend_gives_transformers_greedy_tokens_on_a_tiny_llama(tiny_llama, device):
    path, hf = tiny_llama
    runner, allocator = _runner(path, device)
    ours, _ = greedy_generate(runner, allocator, PROMPTS[:2], 6)
    assert ours == [hf_greedy(hf, prompt, 6) for prompt in PROMPTS[:2]]


def test_the_triton_backend_s_logits_are_bitwise_the_same_alone_and_in_a_chunked_batch(tiny_llama, device):
    runner, allocator = _runner(tiny_llama[0], device)
    assert_logits_bitwise_identical_alone_and_in_batch(runner, allocator, PROMPTS[0], PROMPTS[1:], 3, chunks=[3, 4])


def test_the_engine_with_kernel_backend_triton_serves_transformers_greedy_tokens(tiny_llama, device):
    path, hf = tiny_llama
    config = EngineConfig(model_path=path, dtype="float32", device_id=0 if device.type == "cuda" else -1,
                          max_num_seqs=4, max_num_batched_tokens=8, max_model_len=None, block_size=4,
                          kv_cache_bytes=1 << 20, kernel_backend="triton")
    engine = Engine(config, tokenizer=build_tiny_tokenizer())
    assert engine.runner.kernel_backend == "triton"
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    results = engine.generate([(f"r{i}", prompt, dataclasses.replace(params)) for i, prompt in enumerate(PROMPTS)])
    tokens = {rid: [t.id for out in outs for t in out.new_tokens] for rid, outs in results.items()}
    assert tokens == {f"r{i}": hf_greedy(hf, prompt, 4) for i, prompt in enumerate(PROMPTS)}


@pytest.mark.parametrize("name", sorted(TINY_FAMILIES))
def test_every_family_on_the_triton_backend_gives_transformers_greedy_tokens_past_the_window(name, tmp_path, device):
    """The family tests' tiny checkpoints (3 layers; window 16 where the family has one, Gemma 2 / 3
    alternating with full layers, softcaps, q/k norms, NoPE layers, longrope, Granite's multipliers): a
    prompt of 27 tokens, decoding past the window, in float32."""
    hf = build_tiny_family(tmp_path, name)
    runner, allocator = _runner(tmp_path, device)
    windowed = bool(TINY_FAMILIES[name][1].get("sliding_window"))        # a window of 16 on some layer
    assert (WINDOW in [layer.window for layer in runner.model.spec.layers]) == windowed
    prompt = [1] + [(7 * i + 3) % 500 + 3 for i in range(26)]
    ours, _ = greedy_generate(runner, allocator, [prompt], 5)
    assert ours[0] == hf_greedy(hf, prompt, 5)


# one family for each thing the kernels do differently (biases, a window on some layers, softcaps, alternating
# windows with q/k norms, longrope on half the dims with fused qkv, NoPE layers, multipliers, post-norms):
# the other tiny families repeat one of these (mistral's window is qwen2's; phi3 without longrope is llama plus
# phi3-longrope's fused tensors), and under the interpreter each one costs CI about 10 s
BITWISE_FAMILIES = ["llama", "qwen2", "gemma2", "gemma3_text", "phi3-longrope", "smollm3", "granite", "olmo2"]


@pytest.mark.parametrize("name", BITWISE_FAMILIES)
def test_each_kind_of_family_on_the_triton_backend_keeps_its_logits_bits_alone_and_in_a_chunked_batch(
        name, tmp_path, device):
    build_tiny_family(tmp_path, name)
    runner, allocator = _runner(tmp_path, device)
    target = [1] + [(5 * i + 2) % 500 + 3 for i in range(19)]            # 20 tokens: past the window of 16
    assert_logits_bitwise_identical_alone_and_in_batch(runner, allocator, target, PROMPTS[:2], 3, [3, 2])
