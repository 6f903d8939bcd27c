"""engine/model/quant/mxfp4.py: a tiny gpt-oss whose experts are saved in MXFP4 (blocks and scales written here
from the layout transformers' integrations/mxfp4.py reads: no quantization library imported), read as
transformers dequantizes it, served bitwise as the float checkpoint it dequantizes to (the dequantize-then-matmul
reference) with transformers' greedy tokens, and bitwise alone = batched."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmi_handler.config import ConfigError
from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.model.kernels import cpu_kernels, pack_weight, packed_linear
from lmi_handler.engine.model.quant import QuantWeight, mxfp4, pack_codes, quant_linear
from lmi_handler.engine.model_runner import ModelRunner
from tests.engine.family_models import build_tiny_moe
from tests.engine.helpers import assert_logits_bitwise_identical_alone_and_in_batch, build_tiny_llama, greedy_generate

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the C++ kernels did not build")

CPU = torch.device("cpu")
PROMPTS = [[1] + [(7 * i + 3) % 500 + 3 for i in range(26)], [1, 250, 17, 99]]
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])   # code & 7 -> magnitude; code & 8: the sign


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E, N, K) float -> (blocks (E, N, K / 32, 16) uint8, scales (E, N, K / 32) uint8, the float weight they
    hold): per group of 32 inputs the power of two 2^s that brings its largest magnitude to at most 6 (scale byte
    s + 127), each value rounded to the nearest e2m1 magnitude, inputs 2b / 2b + 1 in byte b's low / high nibble."""
    e, n, k = w.shape
    groups = w.reshape(e, n, k // 32, 32)
    s = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(s)[..., None]
    idx = (scaled.abs()[..., None] - E2M1).abs().argmin(-1)
    codes = (idx + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    held = torch.where(scaled < 0, -E2M1[idx], E2M1[idx]) * torch.exp2(s)[..., None]
    return blocks.contiguous(), (s + 127).to(torch.uint8), held.reshape(e, n, k)


def build_mxfp4_gpt_oss(root):
    """root/float: the tiny gpt-oss with each expert weight replaced by what its MXFP4 form holds; root/mxfp4:
    the same checkpoint with the experts as <name>_blocks / _scales and quantization_config mxfp4. Returns the
    float transformers model."""
    hf = build_tiny_moe(root / "float", "gpt_oss")
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            experts = layer.mlp.experts
            for proj in ("gate_up_proj", "down_proj"):       # stored (E, in, out): MXFP4 blocks are (E, out, in)
                param = getattr(experts, proj)
                blocks, scales, held = pack_mxfp4(param.data.transpose(1, 2).contiguous())
                param.copy_(held.transpose(1, 2))
                packed[f"model.layers.{i}.mlp.experts.{proj}"] = (blocks, scales)
    hf.save_pretrained(root / "float", safe_serialization=True)
    tensors = load_file(root / "float" / "model.safetensors")
    for name, (blocks, scales) in packed.items():
        del tensors[name]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    (root / "mxfp4").mkdir()
    save_file(tensors, root / "mxfp4" / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((root / "float" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (root / "mxfp4" / "config.json").write_text(json.dumps(cfg))
    (root / "mxfp4" / "generation_config.json").write_bytes((root / "float" / "generation_config.json").read_bytes())
    return hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    return root, build_mxfp4_gpt_oss(root)


def _runner(path, backend="cpp", dtype=torch.float32):
    return ModelRunner(path, dtype, CPU, block_size=4, num_blocks=120, kernel_backend=backend)


def test_transformers_dequantizes_the_written_blocks_to_the_float_weights_they_hold_as_ours_does(checkpoint):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    root, hf = checkpoint
    theirs = AutoModelForCausalLM.from_pretrained(root / "mxfp4", quantization_config=Mxfp4Config(dequantize=True),
                                                  dtype=torch.float32)
    tensors = load_file(root / "mxfp4" / "model.safetensors")
    for i, layer in enumerate(hf.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            expected = getattr(layer.mlp.experts, proj)                     # (E, in, out)
            assert torch.equal(getattr(theirs.model.layers[i].mlp.experts, proj).float(), expected)
            ours = mxfp4.dequantize(tensors[name + "_blocks"], tensors[name + "_scales"])   # (E, out, in)
            assert torch.equal(ours.transpose(1, 2), expected)


@pytest.mark.parametrize("backend", ["cpp", pytest.param("torch", marks=pytest.mark.slow)])   # torch: ~4 s
def test_an_mxfp4_gpt_oss_gives_its_dequantized_float_checkpoint_s_bits_and_transformers_greedy_tokens(
        checkpoint, backend):
    """The experts held as 4-bit e2m1 panels (never the float weight) give bitwise the logits of the float checkpoint
    whose experts are the dequantized values (the dequantize-then-matmul reference), and transformers' tokens."""
    from tests.engine.family_models import hf_greedy_with_logprobs

    root, hf = checkpoint
    quantized, plain = _runner(root / "mxfp4", backend), _runner(root / "float", backend)
    moe = quantized.model.layer_weights[0].moe
    assert isinstance(moe.gate_up[0], QuantWeight) and moe.gate_up[0].kind == "fp4_g32"
    for prompt in PROMPTS if backend == "cpp" else PROMPTS[1:]:
        tokens, logits = greedy_generate(quantized, BlockAllocator(quantized.num_blocks, 4), [prompt], 6)
        expected_tokens, expected_logits = greedy_generate(plain, BlockAllocator(plain.num_blocks, 4), [prompt], 6)
        assert tokens == expected_tokens
        assert all(torch.equal(a, b) for a, b in zip(logits[0], expected_logits[0]))
        assert tokens[0] == hf_greedy_with_logprobs(hf, prompt, 6)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_mxfp4_model_s_logits_are_bitwise_the_same_alone_and_in_a_batch(checkpoint, dtype):
    root, _ = checkpoint
    runner = _runner(root / "mxfp4", "cpp", dtype)
    others = [[1] + [(11 * i + 5) % 500 + 3 for i in range(n)] for n in (9, 3, 14)]
    assert_logits_bitwise_identical_alone_and_in_batch(runner, BlockAllocator(runner.num_blocks, 4), PROMPTS[0],
                                                       others, 4, [len(p) // 2 + 1 for p in others])


def test_mxfp4_panels_hold_the_checkpoint_s_values_exactly_for_every_code_and_scale():
    """Every e2m1 code pair in every group, scales from 2^-127 to 2^3: the 4-bit e2m1 panels' value is
    FP4 value * 2^(scale - 127) exactly (QuantWeight.dequantize, the kernel's float values)."""
    blocks = torch.arange(256, dtype=torch.uint8).repeat(4).reshape(4, 4, 4, 16)     # (N=4, G=4, 16) a row
    scales = torch.tensor([0, 1, 100, 127, 128, 120, 130, 110] * 8, dtype=torch.uint8).reshape(4, 4, 4)
    for e in range(4):
        weight = pack_codes(mxfp4.codes_of(blocks[e], scales[e]))
        assert weight.kind == "fp4_g32" and weight.panels.shape == (1, 128, 16)
        assert torch.equal(weight.dequantize(), mxfp4.dequantize(blocks[e], scales[e]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_e2m1_kernel_gives_the_bits_of_the_float32_linear_over_the_dequantized_weight_alone_and_in_any_batch(
        dtype):
    """kernels/linear_quant.h's e2m1 form (4-bit codes through the value table, AVX2 and scalar) against the
    float32 packed linear over the dequantized weight, for 1 to 40 rows, and each row alone as in the batch."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (70, 3, 16), generator=g).to(torch.uint8)          # (N=70, K=96)
    scales = torch.randint(118, 130, (70, 3), generator=g).to(torch.uint8)
    weight = pack_codes(mxfp4.codes_of(blocks, scales))
    floats = pack_weight(mxfp4.dequantize(blocks, scales), "float32")
    bias = torch.randn(70, generator=g)
    x = torch.randn(40, 96, generator=g).to(dtype)
    for rows in (1, 3, 40):
        assert torch.equal(quant_linear(x[:rows], weight, bias), packed_linear(x[:rows], floats, bias, dtype))
    batch = quant_linear(x, weight, bias)
    assert all(torch.equal(quant_linear(x[i:i + 1], weight, bias)[0], batch[i]) for i in (0, 17, 39))


def test_mxfp4_on_a_model_without_experts_is_refused_at_start_up(tmp_path):
    build_tiny_llama(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="mxfp4.*model_type=llama has none"):
        _runner(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_experts_in_one_cpp_call_are_bitwise_the_expert_by_expert_walk(dtype):
    """moe.cpp's moe_experts_quant (grouping, quant_linear with biases, the clamped SwiGLU, the rank-order sum) against
    moe.grouped_experts walking the cpp backend's linear (quant_linear) and clamped_swiglu in Python."""
    from lmi_handler.engine.model.backends import cpp
    from lmi_handler.engine.model.moe import MoeWeights, expert_activation, grouped_experts, route
    from lmi_handler.engine.model.spec import MoeSpec

    g = torch.Generator().manual_seed(2)

    def expert(n: int, k: int) -> QuantWeight:
        blocks = torch.randint(0, 256, (n, k // 32, 16), generator=g).to(torch.uint8)
        return pack_codes(mxfp4.codes_of(blocks, torch.randint(120, 126, (n, k // 32), generator=g).to(torch.uint8)))

    spec = MoeSpec(num_experts=4, top_k=2, intermediate_size=32, routing="topk_softmax", activation="clamped_swiglu",
                   swiglu_alpha=1.702, swiglu_limit=2.0, expert_bias=True)
    w = MoeWeights(router=None, gate_up=[expert(64, 64) for _ in range(4)], down=[expert(64, 32) for _ in range(4)],
                   gate_up_bias=[torch.randn(64, generator=g).to(dtype) for _ in range(4)],
                   down_bias=[torch.randn(64, generator=g).to(dtype) for _ in range(4)])
    x = torch.randn(11, 64, generator=g).to(dtype)
    ids, weights = route(torch.randn(11, 4, generator=g), spec)
    walk = grouped_experts(x, ids, weights, w, cpp.linear, cpp.act_mul,
                           expert_activation(spec, cpp.act_mul, cpp.clamped_swiglu))
    assert torch.equal(cpp.moe_experts(x, ids, weights, w, spec), walk)
