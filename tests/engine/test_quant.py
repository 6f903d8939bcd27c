"""engine/model/quant: tiny Llamas saved in each quantized format (tests/engine/quant_checkpoints.py) served
end to end: transformers' greedy tokens on the float weights they dequantize to, bitwise alone = batched,
option.quantize=int4 at load, and the refusals naming the method."""
from __future__ import annotations

import json

import pytest
import torch

from lmi_handler.config import ConfigError
from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.model.kernels import cpu_kernels, quantize_int8
from lmi_handler.engine.model.quant import SUPPORTED, QuantWeight, quantize_fp8, quantize_int4
from lmi_handler.engine.model_runner import ModelRunner
from tests.engine.helpers import (
    assert_logits_bitwise_identical_alone_and_in_batch,
    build_tiny_llama,
    greedy_generate,
    hf_greedy,
)
from tests.engine.quant_checkpoints import build_quantized, quant_config

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ kernels did not build")

CPU = torch.device("cpu")
PROMPTS = [[1, 17, 300, 45, 9], [1] + list(range(40, 80))]
FORMATS = {   # name -> (method, packer options)
    "gptq-4bit-sym": ("gptq", dict(bits=4, group_size=32, sym=True)),
    "gptq-4bit-zeros-act-order": ("gptq", dict(bits=4, group_size=32, sym=False, desc_act=True)),
    "gptq-8bit-v2": ("gptq", dict(bits=8, group_size=64, sym=False, v1=False)),
    "awq-gemm": ("awq", dict(group_size=32)),
    "compressed-w4a16-group": ("compressed-tensors", dict(bits=4, group_size=32)),
    "compressed-w8a16-channel": ("compressed-tensors", dict(bits=8, group_size=None)),
    "compressed-w4a16-zero-points": ("compressed-tensors", dict(bits=4, group_size=32, sym=False)),
    "compressed-w8a8-int": ("compressed-tensors", dict(fmt="int-quantized")),
    "compressed-fp8-channel": ("compressed-tensors", dict(fmt="float-quantized", channel=True)),
    "compressed-fp8-tensor": ("compressed-tensors", dict(fmt="float-quantized")),
    "fp8-block-32": ("fp8", dict(block=(32, 32))),
    "fp8-per-tensor": ("fp8", dict(block=None)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (path, transformers model), each format's checkpoint built once for the module's tests."""
    built = {}

    def get(name: str):
        if name not in built:
            method, kw = FORMATS[name]
            path = tmp_path_factory.mktemp(name)
            built[name] = path, build_quantized(path, method, **kw)
        return built[name]

    return get


def _runner(path, backend="cpp", dtype=torch.float32, quantize=None):
    return ModelRunner(path, dtype, CPU, block_size=4, num_blocks=96, kernel_backend=backend, quantize=quantize)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_gives_transformers_greedy_tokens_on_the_weights_it_dequantizes_to(checkpoints, name, caplog):
    path, hf = checkpoints(name)
    with caplog.at_level("INFO", logger="lmi_handler.engine.model.quant"):
        runner = _runner(path)
    layer = runner.model.layer_weights[0]
    assert all(isinstance(w, QuantWeight) for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert runner.model.stack is not None and "quantized linears: " + FORMATS[name][0] in caplog.text
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    for prompt in PROMPTS:
        assert greedy_generate(runner, allocator, [prompt], 10)[0][0] == hf_greedy(hf, prompt, 10), name


@pytest.mark.parametrize("name", ["gptq-4bit-zeros-act-order", "compressed-w8a16-channel", "fp8-block-32",
                                  "compressed-w8a8-int", "compressed-w4a16-zero-points"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_model_s_logits_are_bitwise_the_same_alone_and_in_a_batch(checkpoints, name, dtype):
    path, _ = checkpoints(name)
    runner = _runner(path, dtype=dtype)
    assert runner.model.stack is not None                  # the quantized linears inside the fused stack
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    assert_logits_bitwise_identical_alone_and_in_batch(runner, allocator, PROMPTS[1], PROMPTS[:1], 5, chunks=[2])


@pytest.mark.parametrize("name", ["gptq-4bit-zeros-act-order", "awq-gemm", "compressed-w8a16-channel", "fp8-block-32",
                                  "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linears_run_inside_the_fused_stack_with_the_walk_s_bits(checkpoints, tiny_model_dir, name, dtype):
    """The fused C++ stack runs 4-bit, 8-bit and FP8 code linears itself (the linear's kind picks linear_quant.h;
    act order permutes x's columns first; FP8 passes its code format): its tokens and logits are bitwise the ops
    walked one by one (stack None), through chunked prefills beside decodes, for checkpoints' codes and
    option.quantize=int4's."""
    path, quantize = (tiny_model_dir, "int4") if name == "int4" else (checkpoints(name)[0], None)
    results = []
    for walk in (False, True):
        runner = _runner(path, dtype=dtype, quantize=quantize)
        assert runner.model.stack is not None and isinstance(runner.model.layer_weights[0].qkv, QuantWeight)
        if walk:
            runner.model.stack = None
        results.append(greedy_generate(runner, BlockAllocator(runner.num_blocks, runner.block_size), PROMPTS, 4,
                                       chunk_sizes=[2, 16]))
    (tokens, logits), (walk_tokens, walk_logits) = results
    assert tokens == walk_tokens
    assert all(torch.equal(a, b) for rows_a, rows_b in zip(logits, walk_logits) for a, b in zip(rows_a, rows_b))


def test_an_fp8_checkpoint_gives_the_tokens_of_transformers_own_fp8_loading_and_of_its_float_checkpoint(
        checkpoints, tmp_path):
    """transformers reads the fp8 checkpoint itself (FineGrainedFP8, dequantized on CPU to the float32 weights
    fp8 * scale_inv); the same weights saved as a float checkpoint run through our engine (float32 panels, the
    fused stack) give the same tokens and bitwise the same logits (the FP8 linear is the float32 chain over
    those weights)."""
    from transformers import AutoModelForCausalLM

    path, hf = checkpoints("fp8-block-32")
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    runs = []
    for where in (path, tmp_path):
        runner = _runner(where)
        runs.append(greedy_generate(runner, BlockAllocator(runner.num_blocks, runner.block_size), PROMPTS, 8))
    assert runs[0][0] == runs[1][0] == [hf_greedy(theirs, p, 8) for p in PROMPTS]
    for ours, floats in zip(runs[0][1], runs[1][1]):
        assert all(torch.equal(a, b) for a, b in zip(ours, floats))


def test_option_quantize_fp8_names_an_fp8_or_compressed_tensors_fp8_checkpoint(checkpoints):
    for name in ("fp8-per-tensor", "compressed-fp8-channel"):
        assert _runner(checkpoints(name)[0], quantize="fp8").model.layer_weights[0].o.kind.startswith("fp8")
    with pytest.raises(ConfigError, match=r"option\.quantize='fp8' names a pre-quantized checkpoint, but "
                                          r"config.json has quant_method='compressed-tensors'"):
        _runner(checkpoints("compressed-w8a8-int")[0], quantize="fp8")


def test_the_torch_backend_runs_a_quantized_checkpoint_on_its_dequantized_weights(tmp_path):
    hf = build_quantized(tmp_path, "gptq", bits=4, group_size=32, sym=False, desc_act=True)
    runner = _runner(tmp_path, "torch")
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    assert greedy_generate(runner, allocator, [PROMPTS[0]], 6)[0][0] == hf_greedy(hf, PROMPTS[0], 6)


def test_option_quantize_int4_rounds_a_float_checkpoint_at_load_to_4_bits_in_groups_of_32(tmp_path):
    hf = build_tiny_llama(tmp_path, tie_word_embeddings=False)
    runner = _runner(tmp_path, quantize="int4")
    qkv = runner.model.layer_weights[0].qkv
    assert isinstance(qkv, QuantWeight) and qkv.bits == 4 and qkv.group_size == 32
    assert runner.model.lm_head.kind == "int8"                          # lm_head as option.quantize=int8 has it
    with torch.no_grad():
        for module in hf.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(quantize_int4(module.weight).dequantize())
        q, scale = quantize_int8(hf.lm_head.weight)
        hf.lm_head.weight.copy_(q.float() * scale[:, None])
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    for prompt in PROMPTS:
        assert greedy_generate(runner, allocator, [prompt], 10)[0][0] == hf_greedy(hf, prompt, 10)


def test_option_quantize_fp8_rounds_a_float_checkpoint_s_layer_linears_to_e4m3_per_output_channel_at_load(tmp_path):
    hf = build_tiny_llama(tmp_path, tie_word_embeddings=False)
    runner = _runner(tmp_path, quantize="fp8")
    gate_up = runner.model.layer_weights[1].gate_up
    assert isinstance(gate_up, QuantWeight) and gate_up.kind == "fp8_g64" and gate_up.panels.dtype == torch.uint8
    assert runner.model.lm_head.kind == "float32"                     # lm_head stays float, as FP8 checkpoints
    with torch.no_grad():
        for module in hf.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(quantize_fp8(module.weight).dequantize())
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    for prompt in PROMPTS:
        assert greedy_generate(runner, allocator, [prompt], 10)[0][0] == hf_greedy(hf, prompt, 10)


def _quant_config(path, config: dict) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = config
    (path / "config.json").write_text(json.dumps(cfg))


def _w4a8() -> dict:
    config = quant_config("compressed-tensors")
    config["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "dynamic": True,
                                                               "strategy": "token"}
    return config


@pytest.mark.parametrize("config,named", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "hqq", "nbits": 4}, "'hqq'"),
    ({"quant_method": "exl2", "bits": 4.5}, "'exl2'"),
    ({"quant_method": "gguf"}, "'gguf'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "bits=3"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "'gemv'"),
    ({**quant_config("compressed-tensors"), "format": "nvfp4-pack-quantized"}, "'nvfp4-pack-quantized'"),
    (quant_config("compressed-tensors", fmt="float-quantized", sym=False), "asymmetric float weights"),
    (_w4a8(), "pack-quantized with int8 dynamic per token activations is not supported"),
])
def test_a_quantization_we_do_not_read_is_refused_at_start_up_naming_the_method_and_the_supported_list(
        tmp_path, config, named):
    build_tiny_llama(tmp_path)
    _quant_config(tmp_path, config)
    with pytest.raises(ConfigError) as info:
        _runner(tmp_path)
    text = str(info.value)
    assert named in text and f"supported quantized checkpoints: {list(SUPPORTED)}" in text


def test_option_quantize_must_name_the_checkpoint_s_own_method_and_a_float_layer_under_a_config_is_refused(tmp_path):
    build_quantized(tmp_path, "awq", group_size=32)
    with pytest.raises(ConfigError, match=r"option\.quantize='gptq' names a pre-quantized checkpoint, but "
                                          r"config.json has quant_method='awq'"):
        _runner(tmp_path, quantize="gptq")
    with pytest.raises(ConfigError, match=r"option\.quantize='int4' on a checkpoint already quantized"):
        _runner(tmp_path, quantize="int4")
    assert isinstance(_runner(tmp_path, quantize="awq").model.layer_weights[1].down, QuantWeight)
    float_dir = tmp_path / "float"
    build_tiny_llama(float_dir)
    _quant_config(float_dir, quant_config("gptq"))
    with pytest.raises(ConfigError, match=r"layer weight 'model.layers.0.self_attn.q_proj.weight' is stored in float"):
        _runner(float_dir)
