"""option.dtype and option.quantize: the decision (engine/precision.py), the refusals named at start-up,
and a bf16 checkpoint loaded without widening (loader + ModelRunner)."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from lmi_handler.config import ConfigError, Settings
from lmi_handler.engine.model.kernels import PackedWeight, cpu_kernels
from lmi_handler.engine.model.loader import load_model
from lmi_handler.engine.model_runner import ModelRunner
from lmi_handler.engine.precision import checkpoint_dtype, pick_device, resolve_precision
from tests.engine.helpers import build_tiny_llama

CPU, CUDA = torch.device("cpu"), torch.device("cuda:0")
# an engine with device_id -1 runs on CUDA where there is one (benchmarks/gpu_check.sh): the tests of what a CPU
# engine logs and of its C++ bf16 forms do not apply there
CPU_ENGINE_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the engine runs on CUDA here, not the CPU")


def decide(requested, checkpoint, native=True, built=True, quantize=None, device=CPU):
    return resolve_precision(requested, quantize, checkpoint, device, native_bf16=native, kernels_built=lambda: built)


@pytest.mark.parametrize("checkpoint", [torch.bfloat16, torch.float16])
def test_auto_runs_a_bf16_or_fp16_checkpoint_in_bf16_where_the_cpu_has_native_bf16(checkpoint):
    p = decide("auto", checkpoint)
    assert p.dtype == torch.bfloat16 and not p.warn and "native bf16" in p.reason


def test_auto_runs_bf16_checkpoints_in_fp32_without_native_bf16_or_without_kernels_and_says_why():
    p = decide("auto", torch.bfloat16, native=False)
    assert p.dtype == torch.float32 and "AVX512_BF16" in p.reason and "option.dtype=bf16" in p.reason
    assert "did not build" in decide("auto", torch.bfloat16, built=False).reason
    assert decide("auto", torch.float32).dtype == torch.float32
    assert decide("auto", None).dtype == torch.float32


def test_an_explicit_dtype_is_obeyed_and_bf16_without_native_support_warns():
    assert decide("float32", torch.bfloat16).dtype == torch.float32
    p = decide("bfloat16", torch.float32)
    assert p.dtype == torch.bfloat16 and not p.warn
    assert "option.dtype, checkpoint float32" in p.reason and "native bf16" in p.reason   # the log line says why
    slow = decide("bfloat16", torch.float32, native=False)
    assert slow.dtype == torch.bfloat16 and slow.warn and "slower" in slow.reason


def test_fp16_on_cpu_runs_as_bf16_with_a_warning_as_vllm_does():
    p = decide("float16", torch.float16)
    assert p.dtype == torch.bfloat16 and p.warn and "fp16" in p.reason


def test_cuda_keeps_the_old_auto_rule_and_obeys_an_explicit_dtype():
    assert decide("auto", torch.float32, device=CUDA).dtype == torch.bfloat16
    assert decide("auto", torch.float16, device=CUDA).dtype == torch.float16
    assert decide("float32", torch.bfloat16, device=CUDA).dtype == torch.float32


def test_int8_is_refused_where_the_engine_cannot_serve_it_naming_the_option():
    with pytest.raises(ConfigError, match=r"option\.quantize='int8' runs on CPU only"):
        decide("auto", torch.float32, quantize="int8", device=CUDA)
    with pytest.raises(ConfigError, match=r"option\.quantize='int8' needs the C\+\+ CPU kernels"):
        decide("auto", torch.float32, quantize="int8", built=False)
    with pytest.raises(ConfigError, match=r"option\.quantize='bitsandbytes'"):
        decide("auto", torch.float32, quantize="bitsandbytes")
    p = decide("auto", torch.bfloat16, quantize="int8")
    assert p.dtype == torch.bfloat16 and p.quantize == "int8" and "int8" in p.reason


@pytest.mark.parametrize("key,value,match", [("quantize", "int3", r"option\.quantize='int3'.*'int8'"),
                                             ("quantize", "bitsandbytes", r"option\.quantize='bitsandbytes'"),
                                             ("dtype", "int8", r"option\.dtype='int8'")])
def test_unknown_dtype_and_quantize_values_are_refused_at_start_up_naming_the_option(key, value, match):
    with pytest.raises(ConfigError, match=match):
        Settings.from_properties({key: value})


def test_quantize_reaches_the_engine_config_and_none_means_off():
    assert Settings.from_properties({"quantize": "int8"}).engine_config().quantize == "int8"
    assert Settings.from_properties({"quantize": "none"}).engine_config().quantize is None
    assert Settings.from_properties({}).engine_config().quantize is None


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A tiny random Llama saved by transformers in bfloat16, and its float32 original."""
    fp32_dir, bf16_dir = tmp_path_factory.mktemp("tiny_fp32"), tmp_path_factory.mktemp("tiny_bf16")
    model = build_tiny_llama(fp32_dir, tie_word_embeddings=True)
    model.to(torch.bfloat16).save_pretrained(bf16_dir, safe_serialization=True)
    return fp32_dir, bf16_dir


def test_the_checkpoint_dtype_is_read_from_the_safetensors_header(bf16_checkpoint):
    fp32_dir, bf16_dir = bf16_checkpoint
    assert checkpoint_dtype(fp32_dir) == torch.float32 and checkpoint_dtype(bf16_dir) == torch.bfloat16


def test_a_bf16_checkpoint_loaded_as_bf16_is_never_widened(bf16_checkpoint):
    """Every tensor the model holds is bf16 (packed panels included), and they equal those of the fp32
    checkpoint converted at load: the bf16 file's values are the same roundings."""
    assert cpu_kernels() is not None
    fp32_dir, bf16_dir = bf16_checkpoint
    model = load_model(bf16_dir, torch.bfloat16, CPU)
    held = [getattr(w, f.name) for w in model.layer_weights for f in dataclasses.fields(w)] + [model.final_norm]
    tensors = [t.panels if isinstance(t, PackedWeight) else t for t in held if t is not None] + [model.lm_head.panels]
    assert {t.dtype for t in tensors} == {torch.bfloat16}
    assert isinstance(model.embed_tokens, PackedWeight) and model.embed_tokens is model.lm_head
    converted = load_model(fp32_dir, torch.bfloat16, CPU)
    assert torch.equal(model.lm_head.panels, converted.lm_head.panels)
    assert torch.equal(model.layer_weights[1].down.panels, converted.layer_weights[1].down.panels)


@CPU_ENGINE_ONLY
def test_the_engine_logs_the_dtype_it_picked_and_why(bf16_checkpoint, tiny_tokenizer, caplog):
    from lmi_handler.config import EngineConfig
    from lmi_handler.engine.engine import Engine
    from lmi_handler.engine.model.kernels.build import native_bf16_cpu

    _, bf16_dir = bf16_checkpoint
    config = EngineConfig(model_path=bf16_dir, dtype="auto", device_id=-1, max_num_seqs=2, max_num_batched_tokens=64,
                          max_model_len=None, block_size=4, kv_cache_bytes=1 << 20)
    with caplog.at_level(logging.INFO, logger="lmi_handler.engine.engine"):
        engine = Engine(config, tokenizer=tiny_tokenizer)
    expected = torch.bfloat16 if native_bf16_cpu() else torch.float32
    assert engine.runner.dtype == expected and engine.runner.kv_cache.dtype == expected
    assert "option.dtype=auto: checkpoint bfloat16" in caplog.text


def test_quantized_runner_packs_int8_panels_and_keeps_the_embedding_exact(bf16_checkpoint):
    fp32_dir, _ = bf16_checkpoint
    runner = ModelRunner(fp32_dir, torch.float32, CPU, block_size=4, num_blocks=16, quantize="int8")
    model = runner.model
    assert model.layer_weights[0].gate_up.panels.dtype == torch.int8
    assert model.layer_weights[0].gate_up.scale.dtype == torch.float32
    plain = load_model(fp32_dir, torch.float32, CPU)
    ids = torch.tensor([0, 5, 511])
    assert torch.equal(model._embed(ids), plain._embed(ids))        # not read back from quantized panels
    assert runner.kv_cache.dtype == torch.float32


def test_option_bf16_kernel_reaches_the_engine_config_and_an_unknown_one_is_refused_naming_it():
    assert Settings.from_properties({"bf16_kernel": "FMA"}).engine_config().bf16_kernel == "fma"
    assert Settings.from_properties({}).engine_config().bf16_kernel == "auto"
    with pytest.raises(ConfigError, match=r"option\.bf16_kernel='avx'.*'auto', 'amx', 'native' or 'fma'"):
        Settings.from_properties({"bf16_kernel": "avx"})


@CPU_ENGINE_ONLY
def test_bf16_kernel_fma_is_the_form_the_engine_runs_and_it_stays_batch_invariant(bf16_checkpoint, tiny_tokenizer):
    """option.bf16_kernel=fma: every bf16 linear of the engine takes the FMA form (kernels.bf16_dot_form),
    a sequence's logits are bitwise the same alone and in a batch; the next engine started with auto
    takes auto's choice again."""
    from lmi_handler.config import EngineConfig
    from lmi_handler.engine.engine import Engine
    from lmi_handler.engine.model.kernels import BF16_FMA, bf16_dot_form, choose_bf16_dot
    from tests.engine.helpers import ENGINE_PROMPTS, assert_logits_bitwise_identical_alone_and_in_batch

    _, bf16_dir = bf16_checkpoint
    choose_bf16_dot("auto")
    auto_form = bf16_dot_form()

    def engine(kernel: str) -> Engine:
        config = EngineConfig(model_path=bf16_dir, dtype="bfloat16", device_id=-1, max_num_seqs=4,
                              max_num_batched_tokens=64, max_model_len=None, block_size=4, kv_cache_bytes=1 << 22,
                              bf16_kernel=kernel)
        return Engine(config, tokenizer=tiny_tokenizer)

    try:
        fma = engine("fma")
        assert fma.runner.dtype == torch.bfloat16 and bf16_dot_form() == BF16_FMA
        target, *others = ENGINE_PROMPTS
        assert_logits_bitwise_identical_alone_and_in_batch(fma.runner, fma.allocator, target, others, 6, [2, 3])
        assert bf16_dot_form() == BF16_FMA
        engine("auto")
        assert bf16_dot_form() == auto_form
    finally:
        choose_bf16_dot("auto")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (gpu_check.sh runs the engine tests there)")
def test_a_device_id_past_the_visible_gpus_is_refused_naming_the_option_and_range():
    count = torch.cuda.device_count()
    assert pick_device(-1) == torch.device("cuda:0") and pick_device(count - 1) == torch.device(f"cuda:{count - 1}")
    with pytest.raises(ConfigError, match=rf"option.device_id={count}: {count} CUDA device\(s\) visible, so -1 or 0"):
        pick_device(count)
