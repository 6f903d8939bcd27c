"""Every family we serve against transformers on tiny random checkpoints, the layer description read from
config.json, and the start-up refusals (families.py, spec.py, backend.py, forward.py)."""
from __future__ import annotations

import json

import pytest
import torch

from lmi_handler import handler
from lmi_handler.config import ConfigError, Settings
from lmi_handler.djl import OwnInput, PairList, binary_decode
from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.model.backend import choose_backend
from lmi_handler.engine.model.families import build_spec
from lmi_handler.engine.model_runner import ModelRunner
from lmi_handler.engine.scheduler import SchedulerConfig
from tests.engine.family_models import TINY_FAMILIES, WINDOW, build_tiny_family
from tests.engine.helpers import (
    PRECISIONS,
    TINY_TOKENIZER_TEXTS,
    assert_hit_logits_bitwise_equal,
    assert_logits_bitwise_identical_alone_and_in_batch,
    build_tiny_tokenizer,
    greedy_generate,
    hf_greedy,
)
from tests.server.helpers import fresh_server

CPU = torch.device("cpu")
LONG_PROMPT = [1] + [(7 * i + 3) % 500 + 3 for i in range(26)]            # 27 tokens: past the window of 16
PROMPTS = [LONG_PROMPT, [1, 250, 17, 99], [1] + list(range(40, 80))]       # the last one past phi3's 32 too
FUSED_FAMILIES = ("llama", "mistral-nowindow", "qwen2-nowindow", "phi3-nowindow")   # specs the fused C++ stack runs


@pytest.fixture(scope="module", params=sorted(TINY_FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, build_tiny_family(path, request.param)


def _runner(path, backend="auto", dtype=torch.float32, quantize=None):
    return ModelRunner(path, dtype, CPU, block_size=4, num_blocks=96, kernel_backend=backend, quantize=quantize)


def test_every_family_gives_transformers_greedy_tokens_on_the_torch_backend(family):
    name, path, hf = family
    runner = _runner(path, "torch")
    assert runner.kernel_backend == "torch"
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    # longrope: a sequence crossing original_max_position_embeddings (32) in its decode is the exception below
    for prompt in PROMPTS if name != "phi3-longrope" else PROMPTS[1:]:
        ours, _ = greedy_generate(runner, allocator, [prompt], 12)
        assert ours[0] == hf_greedy(hf, prompt, 12), f"{name}: prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_longrope_crossing_its_original_length_in_decode_keeps_the_short_keys_as_transformers_forward_does(
        tmp_path, backend):
    """A sequence's step takes the long factors once its length passes original_max_position_embeddings; keys
    already cached keep the short ones, as transformers' forward with a cache computes them (its generate()
    instead recomputes the whole cache at that token, Phi3ForCausalLM.prepare_inputs_for_generation)."""
    hf = build_tiny_family(tmp_path, "phi3-longrope")
    runner = _runner(tmp_path, backend)
    assert runner.kernel_backend == backend
    ours, _ = greedy_generate(runner, BlockAllocator(runner.num_blocks, runner.block_size), [LONG_PROMPT], 10)
    with torch.no_grad():
        out = hf(torch.tensor([LONG_PROMPT]), use_cache=True)
        theirs = [int(out.logits[0, -1].argmax())]
        for pos in range(len(LONG_PROMPT), len(LONG_PROMPT) + 9):
            out = hf(torch.tensor([[theirs[-1]]]), past_key_values=out.past_key_values,
                     position_ids=torch.tensor([[pos]]), use_cache=True)
            theirs.append(int(out.logits[0, -1].argmax()))
    assert ours[0] == theirs


def test_every_family_s_logits_are_bitwise_the_same_alone_and_in_a_batch(family):
    name, path, _ = family
    runner = _runner(path, "torch")
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    assert_logits_bitwise_identical_alone_and_in_batch(runner, allocator, LONG_PROMPT, PROMPTS[1:], 6, chunks=[3, 7])


@pytest.mark.parametrize("name", ["gemma2", "qwen3", "phi3-longrope"])
def test_bf16_runs_every_op_in_bf16_and_stays_bitwise_batch_invariant(name, tmp_path):
    build_tiny_family(tmp_path, name)
    runner = _runner(tmp_path, "torch", dtype=torch.bfloat16)
    assert runner.kernel_backend == "torch" and runner.kv_cache.dtype == torch.bfloat16
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    assert_logits_bitwise_identical_alone_and_in_batch(runner, allocator, PROMPTS[2], PROMPTS[:2], 4, chunks=[5, 2])


# ---- the cpp backend: the fused C++ stack for Llama-shaped specs, the C++ ops walked one by one for the rest ---

def test_every_family_gives_transformers_greedy_tokens_on_the_cpp_backend(family, caplog):
    name, path, hf = family
    with caplog.at_level("INFO", logger="lmi_handler.engine.model.backend"):
        runner = _runner(path)                                       # auto on CPU
    fused = name in FUSED_FAMILIES
    assert runner.kernel_backend == "cpp" and (runner.model.stack is not None) == fused
    form = "the fused C++ decoder stack" if fused else "the C++ ops walking the layer description"
    assert f"kernel_backend=cpp for model_type={TINY_FAMILIES[name][0]} (auto: CPU, the C++ kernels are built; " \
           f"{form}" in caplog.text
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    for prompt in PROMPTS if name != "phi3-longrope" else PROMPTS[1:]:
        ours, _ = greedy_generate(runner, allocator, [prompt], 12)
        assert ours[0] == hf_greedy(hf, prompt, 12), f"{name}: prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_every_family_s_logits_are_bitwise_the_same_alone_and_in_a_batch_on_the_cpp_backend_in_every_precision(
        family, precision):
    """fp32, bf16 and int8 weights (with fp32 or bf16 activations): each runs on the C++ kernels (int8 panels
    for int8) and a sequence's logits have the same bits alone and beside prefill chunks and decodes."""
    name, path, _ = family
    dtype, quantize = PRECISIONS[precision]
    runner = _runner(path, "cpp", dtype, quantize)
    assert runner.kernel_backend == "cpp" and runner.kv_cache.dtype == dtype
    assert runner.model.layer_weights[0].qkv.kind == (quantize or str(dtype).removeprefix("torch."))
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    assert_logits_bitwise_identical_alone_and_in_batch(runner, allocator, LONG_PROMPT, PROMPTS[1:], 6, chunks=[3, 7])


def test_every_family_s_logits_after_a_prefix_hit_are_bitwise_those_computed_without_the_cache(family):
    """A request whose first 24 tokens another request left in the prefix cache computes only the rest (past
    the window of 16: its window reaches into the cached blocks) and gets the logits and tokens it gets on an
    empty cache, whole-prompt and chunked (budget 12)."""
    _, path, _ = family
    runner = _runner(path)
    target, warmer = LONG_PROMPT + [40, 41, 42], LONG_PROMPT[:24] + [9, 9, 9]
    for budget in (64, 12):
        assert_hit_logits_bitwise_equal(runner, SchedulerConfig(4, budget), target, [warmer], 6)


def _config(name: str) -> dict:
    from transformers import AutoConfig

    from tests.engine.family_models import BASE

    model_type, overrides = TINY_FAMILIES[name]
    return json.loads(AutoConfig.for_model(model_type, **{**BASE, **overrides}).to_json_string())


def test_the_spec_reads_windows_norms_ropes_and_multipliers_per_family():
    windows = lambda name: [layer.window for layer in build_spec(_config(name)).layers]  # noqa: E731
    assert windows("mistral") == [WINDOW] * 3
    assert windows("qwen2") == [None, WINDOW, WINDOW]                   # max_window_layers=1
    assert windows("qwen2-nowindow") == [None] * 3
    assert windows("gemma2") == [WINDOW, None, WINDOW]                  # alternating
    gemma3 = build_spec(_config("gemma3_text"))
    local, full = gemma3.layers[0].rope, gemma3.layers[2].rope
    assert float(local.inv_freq[1]) == pytest.approx(10000 ** (-2 / 16))   # rope_local_base_freq
    assert float(full.inv_freq[1]) == pytest.approx(1e6 ** (-2 / 16))
    assert gemma3.norm_offset == 1.0 and gemma3.norm_placement == "both" and gemma3.qk_norm == "head"
    assert gemma3.activation == "gelu_tanh" and gemma3.embedding_scale == 8.0 and gemma3.scale == 0.25
    smollm3 = build_spec(_config("smollm3"))
    assert [layer.rope is None for layer in smollm3.layers] == [False, True, False]
    assert [layer.window for layer in smollm3.layers] == [None, WINDOW, None]
    olmo2 = build_spec(_config("olmo2"))
    assert olmo2.norm_placement == "post" and olmo2.qk_norm == "full"
    granite = build_spec(_config("granite"))
    assert (granite.embedding_scale, granite.scale, granite.residual_scale, granite.logit_scale) == (4.0, 0.1, 0.5, 2.0)
    assert build_spec(_config("phi3")).fused_qkv and build_spec(_config("qwen2")).qkv_bias
    assert build_spec(_config("llama")).cpp_misfits() == []
    assert "a sliding window" in build_spec(_config("mistral")).cpp_misfits()


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
     "original_max_position_embeddings": 64},
])
def test_scaled_rope_frequencies_are_transformers_own(rope):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                               rope_parameters={"rope_theta": 10000.0, **rope})
    spec_rope = build_spec(json.loads(cfg.to_json_string())).layers[0].rope
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    assert torch.equal(spec_rope.inv_freq, inv_freq.float()) and spec_rope.attention_scaling == scaling
    if rope["rope_type"] == "longrope":
        long, _ = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=65)
        assert torch.equal(spec_rope.inv_freq_for(65), long) and torch.equal(spec_rope.inv_freq_for(64), inv_freq)
    if rope["rope_type"] == "dynamic":
        grown, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=300)
        assert torch.equal(spec_rope.inv_freq_for(300), grown) and not torch.equal(grown, inv_freq)


# ---- start-up refusals -------------------------------------------------------------------------------------

def _write_config(path, **changes):
    cfg = {**_config("llama"), **changes}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(("changes", "named"), [
    (dict(model_type="not_a_model"), ["'not_a_model'", "qwen3", "gemma2"]),    # (others: the fallback's)
    (dict(architectures=["LlamaForSequenceClassification"]), ["LlamaForSequenceClassification", "LlamaForCausalLM"]),
    (dict(rope_parameters={"rope_type": "su", "rope_theta": 1e4}), ["'su'", "longrope", "yarn"]),
    (dict(quantization_config={"quant_method": "gptq", "bits": 3}), ["gptq", "bits=3", "not supported", "awq"]),
    (dict(quantization_config={"quant_method": "awq", "bits": 4, "version": "gemv"}), ["awq", "'gemv'"]),
    (dict(quantization_config={"quant_method": "mxfp4"}), ["mxfp4", "model_type=llama has none"]),   # no experts
    (dict(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}), ["bitsandbytes"]),
    (dict(hidden_act="relu"), ["'relu'", "silu", "gelu_pytorch_tanh"]),
])
def test_a_model_we_do_not_serve_is_refused_at_start_up_naming_the_value_and_the_supported_list(tmp_path, changes,
                                                                                                named):
    _write_config(tmp_path, **changes)
    with pytest.raises(ConfigError) as info:
        ModelRunner(tmp_path, torch.float32, CPU, num_blocks=4)
    for text in named:
        assert text in str(info.value)


def test_kernel_backend_option_is_validated_and_an_impossible_choice_is_refused_not_replaced(monkeypatch):
    with pytest.raises(ConfigError, match="kernel_backend.*'auto', 'cpp', 'triton' or 'torch'"):
        Settings.from_properties({"kernel_backend": "cuda"})
    assert Settings.from_properties({"kernel_backend": " Torch "}).engine_config().kernel_backend == "torch"
    mistral, gemma2, llama = (build_spec(_config(n)) for n in ("mistral", "gemma2", "llama"))
    with pytest.raises(ConfigError, match="kernel_backend='bogus'.*'auto', 'cpp', 'triton', 'torch'"):
        choose_backend("bogus", llama, CPU)
    assert choose_backend("auto", llama, CPU) == ("cpp", "auto: CPU, the C++ kernels are built; the fused C++ "
                                                         "decoder stack (one C++ call a step)")
    name, why = choose_backend("auto", gemma2, CPU)
    assert name == "cpp" and "the C++ ops walking the layer description (model_type=gemma2 has norm_offset" in why
    assert choose_backend("cpp", mistral, CPU)[0] == "cpp"
    assert choose_backend("auto", gemma2, CPU, quantize="int8")[0] == "cpp"
    assert choose_backend("torch", gemma2, CPU) == ("torch", "asked for")
    name, why = choose_backend("auto", llama, CPU, tensor_parallel=True)      # every family shards on every backend
    assert name == "cpp" and "tensor-parallel shards walk the spec with the C++ ops" in why
    assert choose_backend("torch", gemma2, CPU, tensor_parallel=True) == (
        "torch", "asked for; tensor-parallel shards walk the spec op by op")
    with pytest.raises(ConfigError, match="kernel_backend=cpp cannot run here: the C\\+\\+ kernels run on CPU, not cuda"):
        choose_backend("cpp", gemma2, torch.device("cuda"), tensor_parallel=True)
    with pytest.raises(ConfigError, match="quantize=int8 runs only on the cpp backend"):
        choose_backend("torch", llama, CPU, quantize="int8")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="kernel_backend=triton cannot run here"):
        choose_backend("triton", llama, CPU)
    from lmi_handler.engine.model.kernels import build

    monkeypatch.setitem(build._state, "module", None)
    with pytest.raises(ConfigError, match="cpp cannot run here: the C\\+\\+ kernels are not built"):
        choose_backend("cpp", llama, CPU)
    assert choose_backend("auto", llama, CPU) == ("torch", "auto: the C++ kernels are not built (no working C++ "
                                                            "compiler)")
    assert choose_backend("auto", gemma2, CPU)[0] == "torch"
    with pytest.raises(ConfigError, match="quantize=int8: the C\\+\\+ kernels are not built"):
        choose_backend("auto", gemma2, CPU, quantize="int8")


def test_tensor_parallelism_of_a_family_is_refused_before_any_rank_starts_only_where_heads_do_not_divide(tmp_path):
    """Every backend shards every family (DecoderModel's walk), on CPU and CUDA alike: only the degree's own
    rules refuse (layout.check_degree), and a backend that cannot run on the device at all."""
    from dataclasses import replace

    from lmi_handler.config import EngineConfig, ParallelConfig
    from lmi_handler.engine.parallel.launch import ModelRunnerSpec
    from lmi_handler.engine.precision import Precision

    build_tiny_family(tmp_path, "gemma2")
    config = EngineConfig(model_path=tmp_path, dtype="float32", device_id=-1, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=None, block_size=4, kv_cache_bytes=1 << 20, parallel=ParallelConfig(2))
    spec = ModelRunnerSpec(config, Precision(torch.float32, None, "test"))
    spec.check(1)
    spec.check(2)
    spec.check(4)           # 4 query heads, each of the 2 KV heads held by 2 ranks
    with pytest.raises(ConfigError, match=r"tensor_parallel_degree=3: Total number of attention heads \(4\) must be "
                                          r"divisible by tensor parallel size \(3\)..*Degrees this model takes: 1, 2, 4"):
        spec.check(3)
    ModelRunnerSpec(replace(config, kernel_backend="torch"), spec.precision).check(2)
    ModelRunnerSpec(replace(config, kernel_backend="torch"), spec.precision).check(2, torch.device("cuda:0"))
    with pytest.raises(ConfigError, match=r"kernel_backend=cpp cannot run here: the C\+\+ kernels run on CPU"):
        ModelRunnerSpec(replace(config, kernel_backend="cpp"), spec.precision).check(2, torch.device("cuda:0"))


@pytest.mark.parametrize("name", sorted(set(TINY_FAMILIES) - {"phi3-longrope"}))
def test_tensor_parallel_shards_of_a_family_give_transformers_greedy_tokens(tmp_path, name):
    """Two ranks (threads of this process joined by gloo, real ModelRunners on their shards: 2 query heads and
    1 KV head each) decode transformers' greedy tokens in fp32, past the window, on the C++ ops walked one by
    one (the fused stack has no place for the reduce, FUSED_FAMILIES too): among them Qwen3's per-head q/k norm, Gemma 2's window, softcaps and four
    norms, Phi-3's fused qkv_proj / gate_up_proj split at load, OLMo-2's full-width q/k norm summed over the
    ranks. Logits stay within 1e-4 of one process's (the row-parallel sums round elsewhere). phi3-longrope is
    left out: its long prompt crosses original_max_position_embeddings in decode (the exception above). The
    torch reference backend's shards give the same tokens."""
    from tests.engine.parallel.helpers import sharded_greedy

    hf = build_tiny_family(tmp_path, name)
    prompts = PROMPTS[:2]
    tokens, logits = sharded_greedy(tmp_path, 2, prompts, 8)
    assert tokens == [hf_greedy(hf, prompt, 8) for prompt in prompts]
    assert sharded_greedy(tmp_path, 2, prompts, 8, kernel_backend="torch")[0] == tokens
    runner = _runner(tmp_path, "cpp")
    assert (runner.model.stack is not None) == (name in FUSED_FAMILIES)
    _, want_logits = greedy_generate(runner, BlockAllocator(runner.num_blocks, runner.block_size), prompts, 8)
    for rows_a, rows_b in zip(logits, want_logits):
        for a, b in zip(rows_a, rows_b):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["olmo2", "phi3"])
def test_four_ranks_holding_each_kv_head_twice_give_transformers_greedy_tokens(tmp_path, name):
    """Degree 4 over 2 KV heads (each held by 2 ranks): OLMo-2's k norm counts each head's squares once, Phi-3's
    fused qkv_proj gives each rank its one query head and its KV head's replica."""
    from tests.engine.parallel.helpers import sharded_greedy

    hf = build_tiny_family(tmp_path, name)
    tokens, _ = sharded_greedy(tmp_path, 4, PROMPTS[:2], 8)
    assert tokens == [hf_greedy(hf, prompt, 8) for prompt in PROMPTS[:2]]


# ---- served end to end: handle() and the HTTP routes (Qwen3, Gemma 2, Phi-3 with a tokenizer) --------------

TEXT_PROMPT = " ".join(TINY_TOKENIZER_TEXTS[:3])      # about 40 tokens: past the window of 16
NEW_TOKENS = 8
HTTP_OPTIONS = {"kv_cache_bytes": str(1 << 22), "dtype": "fp32", "num_threads": "1", "block_size": "4"}


@pytest.fixture(scope="module", params=["qwen3", "gemma2", "phi3"])
def served_family(request, tmp_path_factory):
    """(model_dir, transformers' greedy ids for PROMPT) of one tiny family checkpoint with a tokenizer."""
    path = tmp_path_factory.mktemp(request.param)
    hf = build_tiny_family(path, request.param)
    tokenizer = build_tiny_tokenizer()
    tokenizer.save_pretrained(path)
    prompt_ids = tokenizer(TEXT_PROMPT).input_ids
    assert len(prompt_ids) > 16
    want = hf_greedy(hf, prompt_ids, NEW_TOKENS)
    return path, want[:want.index(2) + 1] if 2 in want else want      # generate() stops at eos (id 2) too


def test_the_invocations_and_openai_routes_answer_transformers_greedy_tokens(served_family):
    path, want = served_family
    with fresh_server(model_id=str(path), **HTTP_OPTIONS) as server:
        assert server.service.engine.runner.kernel_backend == "cpp"
        for _ in range(2):          # the second request reuses the first's cached prefix blocks
            response = server.post("/invocations", json={"inputs": TEXT_PROMPT, "parameters": {
                "max_new_tokens": NEW_TOKENS, "do_sample": False, "details": True}})
            assert response.status_code == 200, response.text
            assert [t["id"] for t in response.json()["details"]["tokens"]] == want
        assert server.service.engine.allocator.prefix_cache_stats.num_hit_tokens >= 16
        response = server.post("/v1/completions", json={"model": "any", "prompt": TEXT_PROMPT, "max_tokens": NEW_TOKENS,
                                                        "temperature": 0, "logprobs": 1})
        assert response.status_code == 200, response.text
        tokens = response.json()["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == len(want)


@pytest.mark.parametrize("degree", [1, 2])
def test_handle_answers_a_rolling_batch_request_with_transformers_greedy_tokens(served_family, degree):
    """One process, and two ranks (option.tensor_parallel_degree=2: a follower process spawned by the init
    call, each rank on its shard of the C++ ops model)."""
    path, want = served_family
    worker = handler.Handler()
    assert worker.handle(OwnInput({"model_id": str(path), "max_rolling_batch_size": "4", "device_id": "-1",
                                   "tensor_parallel_degree": str(degree), **HTTP_OPTIONS})) is None
    try:
        assert _rolling_batch_ids(worker) == want
        if degree == 2:
            assert worker.service.engine.runner.degree == 2
    finally:
        if degree == 2:
            worker.service.engine.runner.close()


def _rolling_batch_ids(worker) -> list[int]:
    """The token ids of one streamed TEXT_PROMPT request through handle()'s rolling batch, run to its end."""
    body = json.dumps({"inputs": TEXT_PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "do_sample": False},
                       "stream": True}).encode()
    ids, last = [], "false"
    for step in range(3 * NEW_TOKENS):
        content = PairList()
        content.add("batch_000.data", body if step == 0 else b"")
        props = {"batch_size": "1", "batch_000.Content-Type": "application/json", "batch_000.requestId": "r"}
        entry = binary_decode(worker.handle(OwnInput(props, content)).content.value_at(0))
        ids += [json.loads(line)["token"]["id"] for line in entry["data"].splitlines() if line.strip()]
        if (last := entry["last"]) == "true":
            break
    assert last == "true"
    return ids
