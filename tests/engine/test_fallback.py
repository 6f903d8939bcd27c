"""engine/model/fallback.py: checkpoints without a layer description served by transformers' own model with this
engine's paged attention (registered in its AttentionInterface), against transformers' generate()."""
from __future__ import annotations

import json

import pytest
import torch

from lmi_handler.config import ConfigError
from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.model_runner import ModelRunner
from lmi_handler.engine.scheduler import Scheduler, SchedulerConfig
from lmi_handler.engine.sequence import SamplingParams
from tests.batch.helpers import COMPLETIONS, batch_line, read_jsonl, write_jsonl
from tests.engine.fallback_models import FALLBACK_FAMILIES, build_tiny_fallback
from tests.engine.helpers import (
    TINY_TOKENIZER_TEXTS,
    assert_logits_bitwise_identical_alone_and_in_batch,
    build_tiny_llama,
    build_tiny_tokenizer,
    greedy_generate,
    hf_greedy,
    make_engine,
    run,
    scheduled_greedy,
)
from tests.helpers import REPO
from tests.server.helpers import fresh_server

CPU = torch.device("cpu")
LONG_PROMPT = [1] + [(7 * i + 3) % 500 + 3 for i in range(26)]            # 27 tokens: past StarCoder2's window
PROMPTS = [LONG_PROMPT, [1, 250, 17, 99], [1] + list(range(40, 80))]
SERVED = sorted(name for name in FALLBACK_FAMILIES if name != "bloom")


@pytest.fixture(scope="module", params=SERVED)
def fallback_family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, build_tiny_fallback(path, request.param)


def _runner(path, **options) -> ModelRunner:
    return ModelRunner(path, torch.float32, CPU, block_size=4, num_blocks=96, **options)


def test_every_fallback_family_gives_transformers_greedy_tokens_batched_and_prefilled_in_chunks(fallback_family,
                                                                                                caplog):
    name, path, hf = fallback_family
    with caplog.at_level("INFO", logger="lmi_handler.engine.model.fallback"):
        runner = _runner(path)                                        # option.model_impl=auto
    model_type = FALLBACK_FAMILIES[name][0]
    assert runner.kernel_backend == "transformers" and runner.model.attention_backend == "cpp"
    assert f"model_impl=transformers for model_type={model_type} (model_type={model_type} has no layer " \
           "description" in caplog.text
    want = [hf_greedy(hf, prompt, 8) for prompt in PROMPTS]
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    assert greedy_generate(runner, allocator, PROMPTS, 8, chunk_sizes=[5, 3, 7])[0] == want


def test_every_fallback_family_s_logits_are_bitwise_the_same_alone_and_in_a_batch_on_the_cpp_backend(fallback_family):
    """fp32: the target's prefill and decodes share their steps with the others' chunked prefills and decodes;
    every linear (GPT-2's Conv1D and the lm_head too) runs the C++ packed row-invariant linear."""
    from lmi_handler.engine.model.fallback import RowInvariantLinear

    _, path, _ = fallback_family
    runner = _runner(path)
    assert runner.model.attention_backend == "cpp" and isinstance(runner.model.head, RowInvariantLinear)
    assert not any(isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D" for m in runner.model.modules())
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    assert_logits_bitwise_identical_alone_and_in_batch(runner, allocator, LONG_PROMPT, PROMPTS[1:], 6, chunks=[3, 7])


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_a_wrapped_activation_gives_a_row_the_same_bits_alone_and_among_others_whatever_the_thread_count(act):
    """Unwrapped, torch's CPU SiLU and GELU-tanh gave 6 and 10 of these 129 rows other bits in the batch (2 threads,
    width 1377: the per-thread chunks' unaligned edges take the scalar formula)."""
    from transformers.activations import ACT2FN

    from lmi_handler.engine.model.fallback import RowWiseActivation

    wrapped, threads = RowWiseActivation(ACT2FN[act]), torch.get_num_threads()
    x = torch.randn(1, 129, 1377, generator=torch.Generator().manual_seed(0)) * 4
    try:
        for num_threads in (2, 5):
            torch.set_num_threads(num_threads)
            batch = wrapped(x)
            assert all(torch.equal(batch[0, i], wrapped(x[:, i:i + 1])[0, 0]) for i in range(x.shape[1]))
    finally:
        torch.set_num_threads(threads)


def test_a_prefix_cache_hit_on_the_fallback_gives_transformers_tokens_computing_only_the_rest(tmp_path):
    """StarCoder2 (a window of 16): the target's first 24 tokens come from the cache another request left, its
    window reaches into them, chunked by a budget of 12."""
    hf = build_tiny_fallback(tmp_path, "starcoder2")
    runner = _runner(tmp_path)
    target, warmer = LONG_PROMPT + [40, 41, 42], LONG_PROMPT[:24] + [9, 9, 9]
    sched = Scheduler(SchedulerConfig(4, 12), BlockAllocator(runner.num_blocks, runner.block_size))
    scheduled_greedy(runner, sched, [warmer], 8, "warmer")
    (warm,), _ = scheduled_greedy(runner, sched, [target], 8, "warm")
    assert warm.num_cached_tokens >= 16 and warm.output_token_ids == hf_greedy(hf, target, 8)


def test_seeds_and_log_probs_on_the_fallback_work_as_on_a_native_family(tmp_path):
    """Through the engine: a seeded request gives the same tokens again and beside another request, and the
    log-prob reported with each greedy token is transformers' log_softmax of that position's logits."""
    hf = build_tiny_fallback(tmp_path, "gpt_neox")
    engine = make_engine(tmp_path, build_tiny_tokenizer())
    assert engine.runner.kernel_backend == "transformers"
    seeded = SamplingParams(greedy=False, temperature=1.5, seed=7, max_new_tokens=10, ignore_eos=True)
    alone = run(engine, [LONG_PROMPT], [seeded])[0]["r0"]
    assert run(engine, [LONG_PROMPT], [seeded])[0]["r0"] == alone
    assert run(engine, [PROMPTS[1], LONG_PROMPT], [SamplingParams(max_new_tokens=6), seeded])[0]["r1"] == alone
    assert run(engine, [LONG_PROMPT], [SamplingParams(greedy=False, temperature=1.5, seed=8, max_new_tokens=10,
                                                      ignore_eos=True)])[0]["r0"] != alone
    ids, outputs = run(engine, [LONG_PROMPT], [SamplingParams(max_new_tokens=6, ignore_eos=True)])
    assert ids["r0"] == hf_greedy(hf, LONG_PROMPT, 6)
    with torch.no_grad():
        logits = hf(torch.tensor([LONG_PROMPT + ids["r0"]])).logits[0, len(LONG_PROMPT) - 1:-1]
    want = logits.log_softmax(-1).gather(1, torch.tensor(ids["r0"])[:, None])[:, 0]
    got = torch.tensor([t.log_prob for out in outputs["r0"] for t in out.new_tokens])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_model_impl_transformers_runs_a_native_family_through_the_fallback_with_its_native_tokens(tmp_path):
    hf = build_tiny_llama(tmp_path, tie_word_embeddings=False)
    native, fallback = _runner(tmp_path), _runner(tmp_path, model_impl="transformers")
    assert native.kernel_backend == "cpp" and fallback.kernel_backend == "transformers"
    want = greedy_generate(native, BlockAllocator(native.num_blocks, native.block_size), PROMPTS, 10)[0]
    assert greedy_generate(fallback, BlockAllocator(96, 4), PROMPTS, 10, chunk_sizes=[4, 4, 9])[0] == want
    assert want == [hf_greedy(hf, prompt, 10) for prompt in PROMPTS]


@pytest.mark.slow
def test_the_demo_models_llama_through_the_fallback_gives_the_native_greedy_tokens():
    model = REPO / "model"
    prompts = [[1, 504, 3458, 314, 4909, 282, 4649, 42], [1, 9690, 30, 657, 359, 346, 47]]
    native = ModelRunner(model, torch.float32, CPU, num_blocks=64)
    fallback = ModelRunner(model, torch.float32, CPU, num_blocks=64, model_impl="transformers")
    assert fallback.kernel_backend == "transformers" and native.config == fallback.config
    want = greedy_generate(native, BlockAllocator(64, 16), prompts, 16)[0]
    assert greedy_generate(fallback, BlockAllocator(64, 16), prompts, 16)[0] == want


def test_bloom_is_refused_at_start_up_because_its_attention_does_not_go_through_the_interface(tmp_path):
    build_tiny_fallback(tmp_path, "bloom")
    with pytest.raises(ConfigError) as info:
        _runner(tmp_path)
    message = str(info.value)
    assert "model_type='bloom' (BloomForCausalLM) cannot run through the transformers fallback: its attention " \
           "does not go through transformers' attention interface" in message and "\n" not in message


@pytest.mark.parametrize(("options", "named"), [
    (dict(quantize="int8"), "option.quantize=int8 runs on the native implementation only"),
    (dict(kernel_backend="triton"), "option.kernel_backend=triton cannot run the transformers fallback here"),
])
def test_settings_the_fallback_cannot_honour_are_refused_naming_the_option(tmp_path, options, named):
    build_tiny_fallback(tmp_path, "gpt2")
    with pytest.raises(ConfigError, match=named):
        _runner(tmp_path, **options)


# ---- served end to end: the HTTP routes and `lmi-handler batch` (StarCoder2 with a tokenizer) ------------------

TEXT_PROMPT = " ".join(TINY_TOKENIZER_TEXTS[:3])      # about 40 tokens: past the window of 16
NEW_TOKENS = 8
HTTP_OPTIONS = {"kv_cache_bytes": str(1 << 22), "dtype": "fp32", "num_threads": "1", "block_size": "4"}


@pytest.fixture(scope="module")
def served_fallback(tmp_path_factory):
    """(model_dir, tokenizer, transformers' greedy ids for TEXT_PROMPT) of the tiny StarCoder2 with a tokenizer."""
    path = tmp_path_factory.mktemp("starcoder2-served")
    hf = build_tiny_fallback(path, "starcoder2")
    tokenizer = build_tiny_tokenizer()
    tokenizer.save_pretrained(path)
    want = hf_greedy(hf, tokenizer(TEXT_PROMPT).input_ids, NEW_TOKENS)
    return path, tokenizer, want[:want.index(2) + 1] if 2 in want else want      # generate() stops at eos (id 2)


@pytest.mark.slow
def test_the_server_streams_stops_seeds_and_reports_log_probs_on_a_fallback_family(served_fallback):
    path, tokenizer, want = served_fallback
    body = {"inputs": TEXT_PROMPT, "parameters": {"max_new_tokens": NEW_TOKENS, "do_sample": False, "details": True}}
    with fresh_server(model_id=str(path), **HTTP_OPTIONS) as server:
        assert server.service.engine.runner.kernel_backend == "transformers"
        whole = server.post("/invocations", json=body).json()
        assert [t["id"] for t in whole["details"]["tokens"]] == want
        assert all(t["log_prob"] <= 0 for t in whole["details"]["tokens"])
        lines = [json.loads(line) for line in server.post("/invocations", json={**body, "stream": True}).text.splitlines()]
        assert [line["token"]["id"] for line in lines] == want
        assert "".join(line["token"]["text"] for line in lines) == lines[-1]["generated_text"] == whole["generated_text"]
        text = whole["generated_text"]
        stop = next(t["text"] for t in whole["details"]["tokens"][2:] if t["text"].strip())
        stopped = server.post("/invocations", json={"inputs": TEXT_PROMPT, "parameters": {
            "max_new_tokens": NEW_TOKENS, "stop_sequences": [stop], "details": True}}).json()
        assert stopped["details"]["finish_reason"] == "stop_sequence"
        assert stopped["generated_text"] == text[:text.index(stop)]
        seeded = {"model": "any", "prompt": TEXT_PROMPT, "max_tokens": NEW_TOKENS, "temperature": 1.5, "seed": 11,
                  "logprobs": 1}
        first, again = (server.post("/v1/completions", json=seeded).json()["choices"][0] for _ in range(2))
        assert first["text"] == again["text"] and first["logprobs"]["token_logprobs"] == \
            again["logprobs"]["token_logprobs"]


@pytest.mark.slow
def test_lmi_handler_batch_answers_a_fallback_family_with_transformers_greedy_text(served_fallback, tmp_path):
    from lmi_handler.cli import main

    path, tokenizer, want = served_fallback
    props = tmp_path / "serving.properties"
    props.write_text("engine=Python\n" + "".join(f"option.{k}={v}\n" for k, v in
                                                  {"model_id": path, "huge_pages": "false", **HTTP_OPTIONS}.items()))
    lines = [batch_line(f"c{i}", {"prompt": TEXT_PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}, COMPLETIONS)
             for i in range(3)]
    source, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert main(["batch", str(source), "-o", str(out), "--properties", str(props)]) == 0
    texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in read_jsonl(out)}
    # (an incomplete UTF-8 character at the end is held back, as on every family: the detokenizer's rule)
    assert texts == {f"c{i}": tokenizer.decode(want, skip_special_tokens=True).rstrip("\ufffd") for i in range(3)}


REMOTE_CONFIG = '''from transformers import LlamaConfig


class TinyConfig(LlamaConfig):
    model_type = "tiny_remote"
'''
REMOTE_MODEL = '''from transformers import LlamaForCausalLM

from .configuration_tiny import TinyConfig


class TinyForCausalLM(LlamaForCausalLM):
    config_class = TinyConfig
'''


def test_a_checkpoint_with_its_own_code_runs_only_with_trust_remote_code_and_gives_its_greedy_tokens(tmp_path):
    hf = build_tiny_llama(tmp_path, tie_word_embeddings=False)
    (tmp_path / "configuration_tiny.py").write_text(REMOTE_CONFIG)
    (tmp_path / "modeling_tiny.py").write_text(REMOTE_MODEL)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="tiny_remote", architectures=["TinyForCausalLM"],
                  auto_map={"AutoConfig": "configuration_tiny.TinyConfig",
                            "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="model_type='tiny_remote' needs trust_remote_code"):
        _runner(tmp_path)
    runner = _runner(tmp_path, trust_remote_code=True)
    assert runner.kernel_backend == "transformers" and type(runner.model.hf).__name__ == "TinyForCausalLM"
    allocator = BlockAllocator(runner.num_blocks, runner.block_size)
    assert greedy_generate(runner, allocator, PROMPTS[:2], 8)[0] == [hf_greedy(hf, p, 8) for p in PROMPTS[:2]]


def test_lora_and_tensor_parallelism_on_the_fallback_are_refused_at_start_up_naming_the_option(tmp_path):
    from lmi_handler.config import EngineConfig, LoraConfig
    from lmi_handler.engine.engine import Engine
    from lmi_handler.engine.parallel.launch import ModelRunnerSpec
    from lmi_handler.engine.precision import Precision

    build_tiny_fallback(tmp_path, "gpt2")
    config = EngineConfig(model_path=tmp_path, dtype="float32", device_id=-1, max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=None, block_size=4, kv_cache_bytes=1 << 22, lora=LoraConfig())
    with pytest.raises(ConfigError, match="option.enable_lora runs on the native implementation only"):
        Engine(config, tokenizer=build_tiny_tokenizer())
    with pytest.raises(ConfigError, match="option.tensor_parallel_degree=2: the transformers implementation"):
        ModelRunnerSpec(config, Precision(torch.float32, None, "")).check(2)
