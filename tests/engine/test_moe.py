"""Mixture-of-experts families against transformers on tiny random checkpoints: the layer description
(families.py, spec.py), the router and experts (moe.py), their loading (loader.py) and each backend's
moe_experts op, bitwise alone and in batches."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmi_handler.config import ConfigError
from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.model.families import build_spec
from lmi_handler.engine.model_runner import ModelRunner
from tests.engine.family_models import BASE, TINY_MOE_FAMILIES, build_tiny_moe, hf_greedy_with_logprobs
from tests.engine.helpers import PRECISIONS, greedy_generate

CPU = torch.device("cpu")
PROMPTS = [[1] + [(7 * i + 3) % 500 + 3 for i in range(26)], [1, 250, 17, 99], [1] + list(range(40, 80))]
OTHERS = [[1] + [(11 * i + 5) % 500 + 3 for i in range(n)] for n in (9, 3, 14, 6, 21, 2, 30)]   # batches of 3, 8
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=sorted(TINY_MOE_FAMILIES))
def moe_family(request, tmp_path_factory):
    """(name, checkpoint path, transformers' results on PROMPTS: [(tokens, log-probs)], the (layer, expert)
    pairs its routers chose), computed once for both backends' tests."""
    path = tmp_path_factory.mktemp(request.param)
    hf = build_tiny_moe(path, request.param)
    results, reached = [], set()
    for prompt in PROMPTS:
        tokens, logprobs, chosen = hf_greedy_with_logprobs(hf, prompt, NEW_TOKENS)
        results.append((tokens, logprobs))
        reached |= chosen
    return request.param, path, results, reached


def _runner(path, backend="auto", dtype=torch.float32, quantize=None):
    return ModelRunner(path, dtype, CPU, block_size=4, num_blocks=160, kernel_backend=backend, quantize=quantize)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_every_moe_family_gives_transformers_greedy_tokens_and_log_probs_in_fp32(moe_family, backend):
    """Prompts whose tokens reach every expert of every sparse layer (checked on transformers' routers)."""
    name, path, expected, reached = moe_family
    runner = _runner(path, backend)
    assert runner.kernel_backend == backend
    sparse = [i for i, layer in enumerate(runner.model.spec.layers) if layer.moe is not None]
    assert reached == {(i, e) for i in sparse for e in range(runner.model.spec.moe.num_experts)}
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    # the reference backend checks the longest prompt (the cpp backend every one): CI time
    for prompt, (theirs, their_logprobs) in zip(PROMPTS if backend == "cpp" else PROMPTS[:1], expected):
        ours, logits = greedy_generate(runner, allocator, [prompt], NEW_TOKENS)
        assert ours[0] == theirs, f"{name}: prompt of {len(prompt)} tokens"
        our_logprobs = [float(step.log_softmax(-1)[t]) for step, t in zip(logits[0], ours[0])]
        assert our_logprobs == pytest.approx(their_logprobs, abs=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_every_moe_family_s_logits_are_bitwise_the_same_alone_and_in_batches_of_3_and_8_on_the_cpp_backend(
        moe_family, precision):
    name, path, _, _ = moe_family
    dtype, quantize = PRECISIONS[precision]
    runner = _runner(path, "cpp", dtype, quantize)
    moe = next(w.moe for w in runner.model.layer_weights if w.moe is not None)
    assert moe.gate_up[0].kind == (quantize or str(dtype).removeprefix("torch."))
    assert moe.router.kind == str(dtype).removeprefix("torch.")          # routers never int8
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    _, alone = greedy_generate(runner, allocator, [PROMPTS[0]], 4)
    for others in (OTHERS[:2], OTHERS):         # the target's prefill and decodes beside chunked prefills and decodes
        _, batch = greedy_generate(runner, allocator, [PROMPTS[0]] + others, 4,
                                   chunk_sizes=[len(PROMPTS[0])] + [len(p) // 2 + 1 for p in others])
        assert all(torch.equal(a, b) for a, b in zip(alone[0], batch[0])), f"{name} {precision}, {len(others) + 1}"


def _config(name: str, **changes) -> dict:
    from transformers import AutoConfig

    model_type, overrides = TINY_MOE_FAMILIES[name]
    return json.loads(AutoConfig.for_model(model_type, **{**BASE, **overrides, **changes}).to_json_string())


def test_the_spec_reads_routing_sparse_layers_and_the_shared_expert_per_family():
    mixtral = build_spec(_config("mixtral"))
    assert mixtral.moe.routing == "softmax_topk" and mixtral.moe.norm_topk_prob and mixtral.moe.top_k == 2
    assert [layer.window for layer in mixtral.layers] == [16] * 3
    qwen2 = build_spec(_config("qwen2_moe"))
    assert [layer.moe is not None for layer in qwen2.layers] == [True, False, True]      # mlp_only_layers=[1]
    assert qwen2.moe.shared_expert_size == 64 and not qwen2.moe.norm_topk_prob and qwen2.qkv_bias
    assert qwen2.intermediate_size == 128 and qwen2.moe.intermediate_size == 32
    qwen3 = build_spec(_config("qwen3_moe"))
    assert [layer.moe is not None for layer in qwen3.layers] == [False, True, False]     # decoder_sparse_step=2
    assert qwen3.moe.norm_topk_prob and qwen3.moe.shared_expert_size is None
    assert build_spec(_config("granitemoe")).moe.routing == "topk_softmax"
    assert "mixture-of-experts layers" in build_spec(_config("olmoe")).cpp_misfits()


def test_olmoe_s_clip_qkv_is_refused_at_start_up_naming_it():
    with pytest.raises(ConfigError, match="clip_qkv=8.0"):
        build_spec(_config("olmoe", clip_qkv=8.0))


def test_a_checkpoint_with_transformers_stacked_experts_loads_to_the_same_logits(tmp_path):
    """experts.gate_up_proj (E, 2I, H) and experts.down_proj (E, H, I), as transformers holds them in memory,
    instead of the per-expert tensors the family's checkpoints save."""
    build_tiny_moe(tmp_path / "split", "qwen3_moe")
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    for f in ("config.json", "generation_config.json"):
        (stacked / f).write_bytes((tmp_path / "split" / f).read_bytes())
    tensors = load_file(tmp_path / "split" / "model.safetensors")
    p = "model.layers.1.mlp.experts."
    gate_up = [torch.cat([tensors.pop(p + f"{e}.gate_proj.weight"), tensors.pop(p + f"{e}.up_proj.weight")])
               for e in range(4)]
    tensors[p + "gate_up_proj"] = torch.stack(gate_up)
    tensors[p + "down_proj"] = torch.stack([tensors.pop(p + f"{e}.down_proj.weight") for e in range(4)])
    save_file(tensors, stacked / "model.safetensors")
    results = []
    for path in (tmp_path / "split", stacked):
        runner = _runner(path, "cpp")
        results.append(greedy_generate(runner, BlockAllocator(runner.num_blocks, runner.block_size), [PROMPTS[1]], 4))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1][0], results[1][1][0]))


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_a_single_token_reads_only_its_chosen_experts(backend):
    """Every expert the token did not choose holds NaN weights, and its output keeps its bits: those experts'
    weights are never read (a batch-1 decode step reads top_k experts)."""
    from lmi_handler.engine.model.backends import cpp, torch_ref
    from lmi_handler.engine.model.moe import MoeWeights

    g = torch.Generator().manual_seed(0)
    gate_up = [torch.randn(64, 64, generator=g) for _ in range(4)]
    down = [torch.randn(64, 32, generator=g) for _ in range(4)]
    ops = cpp if backend == "cpp" else torch_ref
    prepare = (lambda t: cpp.pack_linear(t, "float32")) if backend == "cpp" else (lambda t: t)
    x, ids, weights = torch.randn(1, 64, generator=g), torch.tensor([[2, 0]]), torch.tensor([[0.7, 0.3]])
    clean = ops.moe_experts(x, ids, weights, MoeWeights(None, [prepare(t) for t in gate_up],
                                                        [prepare(t) for t in down]))
    poisoned = MoeWeights(None, [prepare(t if e in (0, 2) else torch.full_like(t, float("nan")))
                                 for e, t in enumerate(gate_up)],
                          [prepare(t if e in (0, 2) else torch.full_like(t, float("nan"))) for e, t in enumerate(down)])
    assert torch.equal(ops.moe_experts(x, ids, weights, poisoned), clean)


def test_tensor_parallel_mixture_of_experts_is_refused_at_load_naming_the_degree(tmp_path):
    from lmi_handler.engine.model.loader import load_model
    from lmi_handler.engine.parallel.layout import ShardLayout

    build_tiny_moe(tmp_path, "mixtral")
    spec = build_spec(json.loads((tmp_path / "config.json").read_text()))
    with pytest.raises(ConfigError, match="tensor_parallel_degree=2.*mixture-of-experts"):
        load_model(tmp_path, torch.float32, CPU, layout=ShardLayout.of(spec, 0, 2))


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_the_cpp_expert_op_is_bitwise_the_grouped_experts_over_the_same_packed_linears(kind):
    """moe.cpp (one C++ call: grouping, linear_silu and linear per chosen expert, the rank-order combination)
    against moe.grouped_experts walking the cpp backend's linear and act_mul in Python."""
    from lmi_handler.engine.model.backends import cpp
    from lmi_handler.engine.model.moe import MoeWeights, grouped_experts, route
    from lmi_handler.engine.model.spec import MoeSpec

    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    x = torch.randn(11, 64, generator=g).to(dtype)
    w = MoeWeights(router=None, gate_up=[cpp.pack_linear(torch.randn(64, 64, generator=g) * 0.2, kind) for _ in range(4)],
                   down=[cpp.pack_linear(torch.randn(64, 32, generator=g) * 0.2, kind) for _ in range(4)])
    ids, weights = route(torch.randn(11, 4, generator=g), MoeSpec(num_experts=4, top_k=2, intermediate_size=32))
    ours = cpp.moe_experts(x, ids, weights, w)
    assert ours.dtype == dtype
    assert torch.equal(ours, grouped_experts(x, ids, weights, w, cpp.linear, cpp.act_mul))


def test_an_adapter_naming_the_mlp_of_a_sparse_layer_is_refused_and_one_on_dense_layers_loads(tmp_path):
    """Qwen3-MoE with decoder_sparse_step 2: layer 1 is routed experts, layers 0 and 2 a dense MLP. An adapter's
    gate_proj on layer 1 would change nothing (there is no one gate_proj there): refused by name, never
    accepted and silently not applied; on layers 0 and 2, beside attention projections on every layer, it loads."""
    from lmi_handler.config import EngineConfig, LoraConfig
    from lmi_handler.engine.engine import Engine
    from lmi_handler.engine.model.lora import LoraError
    from tests.engine.helpers import build_tiny_tokenizer
    from tests.engine.lora_helpers import PEFT_PREFIX

    hf = build_tiny_moe(tmp_path / "base", "qwen3_moe")
    engine = Engine(EngineConfig(model_path=tmp_path / "base", dtype="float32", device_id=-1, max_num_seqs=2,
                                 max_num_batched_tokens=32, max_model_len=None, block_size=4, kv_cache_bytes=1 << 20,
                                 lora=LoraConfig(max_lora_rank=8, adapter_roots=(tmp_path,))),
                    tokenizer=build_tiny_tokenizer())
    assert engine.adapters.sparse_layers == frozenset({1})
    hidden, inter = hf.config.hidden_size, hf.config.intermediate_size

    def write(folder, layers):
        tensors = {f"{PEFT_PREFIX}.{i}.self_attn.q_proj.lora_A.weight": torch.ones(4, hidden) for i in range(3)}
        tensors |= {f"{PEFT_PREFIX}.{i}.self_attn.q_proj.lora_B.weight": torch.ones(hidden, 4) for i in range(3)}
        for i in layers:
            tensors[f"{PEFT_PREFIX}.{i}.mlp.gate_proj.lora_A.weight"] = torch.ones(4, hidden)
            tensors[f"{PEFT_PREFIX}.{i}.mlp.gate_proj.lora_B.weight"] = torch.ones(inter, 4)
        folder.mkdir()
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))

    write(tmp_path / "sparse", [0, 1])
    with pytest.raises(LoraError, match="layer 1, a mixture-of-experts layer") as err:
        engine.adapters.load("sparse", tmp_path / "sparse")
    assert err.value.status_code == 400 and "sparse" not in engine.adapters
    write(tmp_path / "dense", [0, 2])
    assert engine.adapters.load("dense", tmp_path / "dense").modules == ("gate_proj", "q_proj")


def test_the_spec_reads_gpt_oss_s_alternating_windows_sinks_router_bias_clamped_experts_and_yarn():
    spec = build_spec(_config("gpt_oss"))
    assert [layer.window for layer in spec.layers] == [16, None, 16]      # layer_types: sliding, full, sliding
    assert spec.attention_sinks and spec.qkv_bias and spec.o_bias and spec.norm_weight_in_float
    moe = spec.moe
    assert moe.routing == "topk_softmax" and moe.router_bias and moe.expert_bias
    assert (moe.activation, moe.swiglu_alpha, moe.swiglu_limit) == ("clamped_swiglu", 1.702, 2.0)
    assert spec.layers[0].rope.kind == "yarn" and spec.layers[0].rope.attention_scaling != 1.0
    assert "attention sinks" in spec.cpp_misfits()


@pytest.mark.parametrize("kind", ["float32", "bfloat16"])
def test_gpt_oss_s_biased_clamped_experts_in_one_cpp_call_are_bitwise_the_grouped_experts(kind):
    """moe.cpp with expert biases and the clamped SwiGLU against moe.grouped_experts walking the cpp backend's
    linear and clamped_swiglu; that op against the reference's torch operations (the clamp reached)."""
    from lmi_handler.engine.model.backends import cpp, torch_ref
    from lmi_handler.engine.model.moe import MoeWeights, expert_activation, grouped_experts, route
    from lmi_handler.engine.model.spec import MoeSpec

    g = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    spec = MoeSpec(num_experts=4, top_k=2, intermediate_size=32, routing="topk_softmax", activation="clamped_swiglu",
                   swiglu_alpha=1.702, swiglu_limit=2.0, expert_bias=True)
    x = torch.randn(11, 64, generator=g).to(dtype)
    w = MoeWeights(router=None, gate_up=[cpp.pack_linear(torch.randn(64, 64, generator=g) * 0.4, kind) for _ in range(4)],
                   down=[cpp.pack_linear(torch.randn(64, 32, generator=g) * 0.2, kind) for _ in range(4)],
                   gate_up_bias=[torch.randn(64, generator=g).to(dtype) for _ in range(4)],
                   down_bias=[torch.randn(64, generator=g).to(dtype) for _ in range(4)])
    ids, weights = route(torch.randn(11, 4, generator=g), spec)
    ours = cpp.moe_experts(x, ids, weights, w, spec)
    activate = expert_activation(spec, cpp.act_mul, cpp.clamped_swiglu)
    assert torch.equal(ours, grouped_experts(x, ids, weights, w, cpp.linear, cpp.act_mul, activate))
    gate_up = (torch.randn(9, 64, generator=g) * 3).to(dtype)
    assert gate_up.float().abs().max() > 2.0
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-2)
    torch.testing.assert_close(cpp.clamped_swiglu(gate_up, 1.702, 2.0), torch_ref.clamped_swiglu(gate_up, 1.702, 2.0),
                               **tol)
