"""LoRA in the engine: engine/model/lora.py (PEFT adapters read and checked, the registry, the batched LoRA
product: exact against transformers with the adapter merged, a row's bits independent of the rows beside it),
the scheduler's prefix cache keyed on the adapter and max_loras, and the engine applying adapters in its
forward on every path (the cpp backend's fused stack and its op-by-op walk, the torch reference's walk): greedy tokens as
transformers' with the adapter merged, the base beside them as the base alone, a request's bits the same
whatever other adapters share its step; the same for the other families (family_models.py) on the C++ ops and
the torch reference."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmi_handler.config import EngineConfig, LoraConfig
from lmi_handler.engine.engine import Engine, RequestRejected
from lmi_handler.engine.kv_cache import BlockAllocator
from lmi_handler.engine.model.loader import read_config
from lmi_handler.engine.model.lora import (
    AdapterRegistry,
    LoraAdapter,
    LoraBatch,
    LoraError,
    LoraLimits,
    base_module_shapes,
    linear_with_lora,
    load_adapter,
    lora_delta,
)
from lmi_handler.engine.precision import pick_device
from lmi_handler.engine.scheduler import Scheduler, SchedulerConfig
from lmi_handler.engine.sequence import SamplingParams, Sequence
from tests.engine.device_syncs import DeviceSyncs
from tests.engine.family_models import build_tiny_family
from tests.engine.helpers import hf_greedy, run_step
from tests.engine.lora_helpers import PEFT_PREFIX, merge_adapter, write_peft_adapter


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A tiny random Llama (transformers' own classes, fp32) and its config.json as a dict."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                         initializer_range=0.2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("lora_base")
    model.save_pretrained(path)
    return model, json.loads((path / "config.json").read_text())


def _limits(tmp_path, **kw) -> LoraLimits:
    return LoraLimits(**({"allowed_roots": (tmp_path,)} | kw))


def _reference_forward(hf, input_ids: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
    """A plain-torch Llama forward over one sequence's rows (causal attention, no cache), every projection
    through linear_with_lora: (T,) ids -> (T, vocab) logits."""
    m, cfg = hf.model, hf.config
    num_heads, num_kv, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    t = input_ids.shape[0]
    inv_freq = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(t).float(), inv_freq)
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]

    def rope(x):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def rms(x, norm):
        return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))

    x = m.embed_tokens(input_ids)
    for i, layer in enumerate(m.layers):
        attn, mlp, h = layer.self_attn, layer.mlp, rms(x, layer.input_layernorm)
        q = rope(linear_with_lora(h, attn.q_proj.weight, None, lora, i, "q_proj").view(t, num_heads, head_dim))
        k = rope(linear_with_lora(h, attn.k_proj.weight, None, lora, i, "k_proj").view(t, num_kv, head_dim))
        v = linear_with_lora(h, attn.v_proj.weight, None, lora, i, "v_proj").view(t, num_kv, head_dim)
        rep = num_heads // num_kv
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                           v.repeat_interleave(rep, 1).transpose(0, 1), is_causal=True)
        x = x + linear_with_lora(o.transpose(0, 1).reshape(t, -1), attn.o_proj.weight, None, lora, i, "o_proj")
        h = rms(x, layer.post_attention_layernorm)
        gate = linear_with_lora(h, mlp.gate_proj.weight, None, lora, i, "gate_proj")
        up = linear_with_lora(h, mlp.up_proj.weight, None, lora, i, "up_proj")
        x = x + linear_with_lora(F.silu(gate) * up, mlp.down_proj.weight, None, lora, i, "down_proj")
    return hf.lm_head(rms(x, m.norm))


@torch.no_grad()
def test_adapter_through_the_helper_matches_transformers_with_the_adapter_merged(tiny_hf, tmp_path):
    hf, config = tiny_hf
    tensors = write_peft_adapter(tmp_path / "a", hf.config, rank=8, alpha=16)
    adapter = load_adapter("a", tmp_path / "a", config, _limits(tmp_path))
    assert adapter.scale == 2.0 and adapter.modules == ("down_proj", "gate_proj", "o_proj", "q_proj", "v_proj")
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1))
    lora = LoraBatch.build([adapter], [12], [0], base_module_shapes(config), torch.device("cpu"))
    ours = _reference_forward(hf, ids, lora)
    base = _reference_forward(hf, ids, None)
    assert torch.allclose(base, hf(ids[None]).logits[0], atol=1e-4)         # the reference forward is right
    merged = type(hf)(hf.config).eval()
    merged.load_state_dict(hf.state_dict())
    merge_adapter(merged, tensors, adapter.scale)
    expected = merged(ids[None]).logits[0]
    assert (ours - base).abs().max() > 0.1                                   # the adapter changes the answer
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_rslora_scales_by_alpha_over_the_root_of_the_rank(tiny_hf, tmp_path):
    hf, config = tiny_hf
    write_peft_adapter(tmp_path / "r", hf.config, rank=4, alpha=8, use_rslora=True)
    assert load_adapter("r", tmp_path / "r", config, _limits(tmp_path)).scale == 4.0


def test_a_row_gets_the_same_bits_alone_and_in_a_mixed_batch():
    torch.manual_seed(0)
    num_slots, r_max, in_features, out_features = 4, 8, 96, 80
    a_stack, b_stack = torch.randn(num_slots, r_max, in_features), torch.randn(num_slots, out_features, r_max)
    a_stack[2, 5:] = 0                                                        # a rank-5 adapter, zero-padded
    b_stack[2, :, 5:] = 0
    scale = torch.tensor([2.0, 0.5, 1.0, 4.0])
    x = torch.randn(41, in_features)
    row_slot = torch.tensor([i % 5 - 1 for i in range(41)])                  # base rows and all four adapters
    mixed = lora_delta(x, row_slot, a_stack, b_stack, scale)
    for t in range(41):
        alone = lora_delta(x[t:t + 1], row_slot[t:t + 1], a_stack, b_stack, scale)
        assert torch.equal(alone[0], mixed[t]), t
        s = int(row_slot[t])
        expected = torch.zeros(out_features) if s < 0 else (x[t] @ a_stack[s].T) @ b_stack[s].T * scale[s]
        torch.testing.assert_close(mixed[t], expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(mixed[row_slot < 0], torch.zeros(int((row_slot < 0).sum()), out_features))


def test_a_row_gets_the_same_bits_however_many_tiles_its_adapter_fills():
    """Slots of several 16-row tiles each (a prefill's rows): a row's term is the same bits alone, in a slice of
    the step and in the whole step."""
    torch.manual_seed(1)
    a_stack, b_stack, scale = torch.randn(3, 24, 96), torch.randn(3, 160, 24), torch.tensor([0.5, 2.0, 1.0])
    x, row_slot = torch.randn(230, 96), torch.randint(-1, 3, (230,), generator=torch.Generator().manual_seed(2))
    mixed = lora_delta(x, row_slot, a_stack, b_stack, scale)
    for t in range(0, 230, 9):
        for n in (1, 40):
            assert torch.equal(lora_delta(x[t:t + n], row_slot[t:t + n], a_stack, b_stack, scale)[0], mixed[t]), t
    s = row_slot[5]
    expected = (x[5] @ a_stack[s].T) @ b_stack[s].T * scale[s] if s >= 0 else torch.zeros(160)
    torch.testing.assert_close(mixed[5], expected, atol=1e-3, rtol=1e-4)


def test_a_sets_backend_stacks_are_prepared_once_and_shared_by_the_copies_its_steps_make():
    """LoraBatch.backend_stacks: each (layer, projection)'s pair through the backend's `prepare` at the first call
    only, the result shared by the runner's per-step copies (dataclasses.replace) of the kept set."""
    stacks = {(0, "qkv_proj"): (torch.ones(2, 4, 8), torch.ones(2, 12, 4)),
              (1, "down_proj"): (torch.ones(2, 4, 16), torch.ones(2, 8, 4))}
    kept = LoraBatch(torch.tensor([0, -1, 1]), torch.tensor([1.0, 2.0]), stacks)
    calls = []

    def prepare(a, b):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return a.shape[2], b.shape[1]

    first = kept.backend_stacks(prepare)
    step = replace(kept, row_slot=torch.tensor([1, 1]))
    assert step.backend_stacks(prepare) is first and kept.backend_stacks(prepare) is first
    assert first == {(0, "qkv_proj"): (8, 12), (1, "down_proj"): (16, 8)}
    assert sorted(calls) == [((2, 4, 8), (2, 12, 4)), ((2, 4, 16), (2, 8, 4))]


def test_a_fused_projection_gives_each_part_its_own_term(tiny_hf, tmp_path):
    hf, config = tiny_hf
    write_peft_adapter(tmp_path / "a", hf.config, modules=("q_proj", "v_proj", "gate_proj"), seed=3)
    write_peft_adapter(tmp_path / "b", hf.config, rank=4, modules=("k_proj", "up_proj"), seed=4)
    limits, shapes = _limits(tmp_path), base_module_shapes(config)
    adapters = [load_adapter(n, tmp_path / n, config, limits) for n in ("a", "b")]
    lora = LoraBatch.build(adapters, [3, 2, 4], [0, None, 1], shapes, torch.device("cpu"),
                           fused=("qkv_proj", "gate_up_proj"))
    x = torch.randn(9, 64)
    attn = hf.model.layers[1].self_attn
    fused_weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
    fused = linear_with_lora(x, fused_weight, None, lora, 1, "qkv_proj")
    parts = torch.cat([linear_with_lora(x, getattr(attn, p).weight.detach(), None, lora, 1, p)
                       for p in ("q_proj", "k_proj", "v_proj")], -1)
    torch.testing.assert_close(fused, parts, atol=1e-5, rtol=1e-5)
    assert torch.equal(fused[3:5], F.linear(x, fused_weight)[3:5])           # base rows: the base's bits


@pytest.mark.parametrize("case, message", [
    ("rank", "rank 32, over option.max_lora_rank=16"),
    ("module", "module 'lm_head' "),
    ("shape", "has shape (8, 63), the base model needs (8, 64)"),
    ("layer", "names layer 5, the base has 2"),
    ("lonely", "lora_A without lora_B"),
    ("dora", "use_dora=True"),
    ("target", "not in option.lora_target_modules"),
    ("missing", "has no adapter_model.safetensors"),
])
def test_a_bad_adapter_is_refused_naming_what_is_wrong(tiny_hf, tmp_path, case, message):
    hf, config = tiny_hf
    good = f"{PEFT_PREFIX}.0.self_attn.q_proj"
    kwargs, limits = {}, _limits(tmp_path)
    if case == "rank":
        kwargs = {"rank": 32}
    elif case == "module":
        kwargs = {"tensors": {f"{PEFT_PREFIX}.0.self_attn.lm_head.lora_A.weight": torch.ones(8, 64),
                              f"{PEFT_PREFIX}.0.self_attn.lm_head.lora_B.weight": torch.ones(64, 8)}}
    elif case == "shape":
        kwargs = {"tensors": {f"{good}.lora_A.weight": torch.ones(8, 63), f"{good}.lora_B.weight": torch.ones(64, 8)}}
    elif case == "layer":
        kwargs = {"tensors": {f"{PEFT_PREFIX}.5.self_attn.q_proj.lora_A.weight": torch.ones(8, 64),
                              f"{PEFT_PREFIX}.5.self_attn.q_proj.lora_B.weight": torch.ones(64, 8)}}
    elif case == "lonely":
        kwargs = {"tensors": {f"{good}.lora_A.weight": torch.ones(8, 64)}}
    elif case == "dora":
        kwargs = {"extra": {"use_dora": True}}
    elif case == "target":
        limits = _limits(tmp_path, target_modules=("q_proj",))
    write_peft_adapter(tmp_path / "bad", hf.config, **kwargs)
    if case == "missing":
        (tmp_path / "bad" / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        load_adapter("bad", tmp_path / "bad", config, limits)
    assert err.value.status_code == 400


def test_a_path_outside_the_allowed_roots_is_refused(tiny_hf, tmp_path):
    hf, config = tiny_hf
    write_peft_adapter(tmp_path / "outside" / "a", hf.config)
    limits = LoraLimits(allowed_roots=(tmp_path / "adapters",))
    (tmp_path / "adapters").mkdir()
    (tmp_path / "adapters" / "link").symlink_to(tmp_path / "outside" / "a")   # a link out is outside too
    for path in (tmp_path / "outside" / "a", tmp_path / "adapters" / ".." / "outside" / "a",
                 tmp_path / "adapters" / "link"):
        with pytest.raises(LoraError, match="outside the allowed roots"):
            load_adapter("a", path, config, limits)
    assert load_adapter("a", tmp_path / "outside" / "a", config, limits, check_root=False).rank == 8


def test_the_registry_evicts_the_least_recently_used_adapter_no_request_holds(tiny_hf, tmp_path):
    hf, config = tiny_hf
    for name in "abcd":
        write_peft_adapter(tmp_path / name, hf.config)
    held: set[str] = set()
    registry = AdapterRegistry(config, _limits(tmp_path, max_cpu_loras=2), held=lambda: held)
    registry.load("a", tmp_path / "a")
    registry.load("b", tmp_path / "b")
    registry.get("a")                                       # b is now the least recently used
    held.add("b")                                           # ... but a running request holds it
    registry.load("c", tmp_path / "c")
    assert [a.name for a in registry.adapters()] == ["b", "c"] and registry.num_evictions == 1
    held.add("c")
    with pytest.raises(LoraError, match="in use by running requests") as err:
        registry.load("d", tmp_path / "d")
    assert err.value.status_code == 503 and [a.name for a in registry.adapters()] == ["b", "c"]
    with pytest.raises(LoraError, match="already loaded") as err:
        registry.load("b", tmp_path / "b")
    assert err.value.status_code == 409
    first_key = registry.get("b").key
    registry.unload("b")
    with pytest.raises(LoraError, match="'b' is not loaded") as err:
        registry.get("b")
    assert err.value.status_code == 404
    assert registry.load("b", tmp_path / "b").key != first_key      # a new load never shares cached KV


# ---- the scheduler: prefix cache keyed on the adapter, max_loras ----------------------------------------

PROMPT = list(range(100, 117))      # 4 full blocks of 4 and one token more


def _adapter(name: str) -> LoraAdapter:
    return LoraAdapter(name, Path(name), rank=8, scale=1.0, weights={})


def _seq(request_id: str, adapter: LoraAdapter | None) -> Sequence:
    return Sequence(request_id, list(PROMPT), SamplingParams(max_new_tokens=4, adapter=adapter and adapter.name),
                    adapter=adapter)


def _check_blocks(alloc: BlockAllocator) -> None:
    assert alloc.num_free_blocks + alloc.num_used_blocks == alloc.num_blocks


def _cached_after(first: Sequence, second: Sequence) -> int:
    """Tokens `second` finds in the prefix cache once `first` has computed the same prompt."""
    alloc = BlockAllocator(32, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), alloc)
    sched.add(first)
    run_step(sched)
    sched.add(second)
    run_step(sched)
    _check_blocks(alloc)
    return second.num_cached_tokens


def test_two_adapters_never_share_cached_kv_and_one_adapter_does():
    a, b = _adapter("a"), _adapter("b")
    assert _cached_after(_seq("1", a), _seq("2", a)) == 16           # same adapter: the prefix is reused
    assert _cached_after(_seq("1", a), _seq("2", b)) == 0            # another adapter: computed afresh
    assert _cached_after(_seq("1", a), _seq("2", None)) == 0         # the base never reads an adapter's K/V
    assert _cached_after(_seq("1", None), _seq("2", a)) == 0         # ... nor an adapter the base's
    assert _cached_after(_seq("1", None), _seq("2", None)) == 16
    assert _cached_after(_seq("1", a), _seq("2", _adapter("a"))) == 0  # the same name loaded again: a new key


def test_a_step_holds_at_most_max_loras_adapters_and_the_base_runs_beside_them():
    alloc = BlockAllocator(64, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, max_loras=2), alloc)
    a, b, c = _adapter("a"), _adapter("b"), _adapter("c")
    seqs = [_seq("a1", a), _seq("b1", b), _seq("c1", c), _seq("base", None), _seq("a2", a)]
    for seq in seqs:
        sched.add(seq)
    first = run_step(sched)
    assert [s.request_id for s in first] == ["a1", "b1", "base", "a2"]   # c waits: a and b fill max_loras
    sched.finish(seqs[0])
    sched.finish(seqs[4])                                                  # adapter a has no running request left
    assert "c1" in [s.request_id for s in run_step(sched)]
    _check_blocks(alloc)


# ---- the engine's gate ----------------------------------------------------------------------------------

def _config(model_dir):
    return EngineConfig(model_path=model_dir, dtype="float32", device_id=-1, max_num_seqs=4,
                        max_num_batched_tokens=64, max_model_len=None, block_size=4, kv_cache_bytes=1 << 22)


@pytest.fixture(scope="module")
def lora_base(tiny_model_dir, tmp_path_factory):
    """The tiny GQA checkpoint, three random rank-8 adapters of it (a, b: q/v/o/gate/down; c: rank 4 on
    k/up, the parts of the fused projections the others leave out) and transformers' model with each merged
    (fp32)."""
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("lora_adapters")
    base = LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    tensors = {"a": write_peft_adapter(root / "a", base.config, seed=11),
               "b": write_peft_adapter(root / "b", base.config, seed=12),
               "c": write_peft_adapter(root / "c", base.config, rank=4, seed=13, modules=("k_proj", "up_proj"))}
    merged = {}
    for name, weights in tensors.items():
        model = LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
        merge_adapter(model, weights, 16.0 / (4 if name == "c" else 8))
        merged[name] = model
    return tiny_model_dir, root, base, merged


def _lora_engine(lora_base, tokenizer, **options) -> Engine:
    model_dir, root, _, _ = lora_base
    lora = LoraConfig(max_loras=4, max_cpu_loras=4, adapter_roots=(root,))
    engine = Engine(replace(_config(model_dir), lora=lora, **options), tokenizer)
    for name in ("a", "b", "c"):
        engine.adapters.load(name, root / name)
    return engine


def test_a_new_adapter_sets_stacks_reach_the_device_without_a_blocking_copy(lora_base, tiny_tokenizer):
    """The first step of an adapter set builds its stacks (LoraBatch.build) before the forward. Every copy to the
    device is non-blocking (on CUDA a blocking one synchronizes the stream), as DeviceSyncs sees it on CPU."""
    engine = _lora_engine(lora_base, tiny_tokenizer)
    adapters = [engine.adapters.get(name) for name in ("a", "c")]
    shapes = base_module_shapes(read_config(lora_base[0]))
    device = pick_device(-1)
    with DeviceSyncs(device) as probe:
        batch = LoraBatch.build(adapters, [3, 2], [0, 1], shapes, device)
    assert probe.syncs == [] and batch.row_slot.tolist() == [0, 0, 0, 1, 1]


PROMPTS = [[1, 17, 300, 45, 9, 88], [1, 250, 3], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]


@pytest.mark.parametrize("path", ["stack", "walk", "torch"])
def test_adapter_requests_answer_as_transformers_with_the_adapter_merged_beside_base_requests(
        lora_base, tiny_tokenizer, path):
    """The cpp backend's fused stack (DecoderStack.forward_lora), its walk (stack None: cpp.lora_add's C++ term
    after each projection) and the torch reference's walk (LoraBatch.add) each give transformers' tokens."""
    _, _, base, merged = lora_base
    engine = _lora_engine(lora_base, tiny_tokenizer, kernel_backend="torch" if path == "torch" else "cpp")
    assert engine.applies_lora
    if path == "walk":
        engine.runner.model.stack = None
    assert (engine.runner.model.stack is not None) == (path == "stack")
    requests = [(f"{name}{i}", prompt, SamplingParams(max_new_tokens=6, greedy=True, adapter=name))
                for i, prompt in enumerate(PROMPTS) for name in ("a", "b", "c", None)]
    results = engine.generate(requests)                           # one step mixes all three and the base
    tokens = {rid: [t.id for out in outs for t in out.new_tokens] for rid, outs in results.items()}
    for i, prompt in enumerate(PROMPTS):
        assert tokens[f"None{i}"] == hf_greedy(base, prompt, 6)
        for name in ("a", "b", "c"):
            assert tokens[f"{name}{i}"] == hf_greedy(merged[name], prompt, 6), (name, i)
        assert tokens[f"a{i}"] != tokens[f"None{i}"]               # the adapter changes the answer


def test_a_step_with_or_without_adapters_keeps_the_fused_stack(lora_base, tiny_tokenizer, monkeypatch):
    """The demo model's speed: a step never leaves the one-call C++ stack, adapters or none (the stack adds
    their terms itself: DecoderStack.forward_lora), and never walks the ops one by one."""
    from lmi_handler.engine.model.backends import cpp

    engine = _lora_engine(lora_base, tiny_tokenizer)
    stack = engine.runner.model.stack
    taken = []
    monkeypatch.setattr(stack, "kernel", _Recording(stack.kernel, taken))
    for op in ("rms_norm", "act_mul", "lora_add"):          # the walk's (lm_head's linear runs either way)
        original = getattr(cpp, op)
        monkeypatch.setattr(cpp, op, lambda *a, _n=op, _f=original: taken.append(_n) or _f(*a))
    engine.generate([("base", PROMPTS[0], SamplingParams(max_new_tokens=2, greedy=True))])
    assert taken and set(taken) == {"forward"}
    taken.clear()
    engine.generate([("base", PROMPTS[0], SamplingParams(max_new_tokens=2, greedy=True, ignore_eos=True)),
                     ("a", PROMPTS[0], SamplingParams(max_new_tokens=2, greedy=True, ignore_eos=True, adapter="a"))])
    assert taken and set(taken) == {"forward_lora"}                  # every step holds the adapter's row


class _Recording:
    """The C++ stack's forward / forward_lora calls, recorded by name in `taken`."""

    def __init__(self, kernel, taken: list):
        self.kernel, self.taken = kernel, taken

    def forward(self, *args):
        self.taken.append("forward")
        return self.kernel.forward(*args)

    def forward_lora(self, *args):
        self.taken.append("forward_lora")
        return self.kernel.forward_lora(*args)


def test_a_requests_tokens_and_log_probs_are_bitwise_the_same_whatever_adapters_share_its_step(
        lora_base, tiny_tokenizer):
    engine = _lora_engine(lora_base, tiny_tokenizer, enable_prefix_caching=False)

    def answer(requests):
        results = engine.generate(requests)
        return {rid: [(t.id, t.log_prob, t.top_tokens) for out in outs for t in out.new_tokens]
                for rid, outs in results.items()}

    params = {name: SamplingParams(max_new_tokens=5, greedy=True, ignore_eos=True, top_n_tokens=4, adapter=name)
              for name in ("a", "b", None)}
    alone = {name: answer([("t", PROMPTS[2], params[name])])["t"] for name in ("a", "b", None)}
    mixed = answer([("x", PROMPTS[0], params["b"]), ("a", PROMPTS[2], params["a"]), ("y", PROMPTS[1], params[None]),
                    ("b", PROMPTS[2], params["b"]), ("base", PROMPTS[2], params[None]),
                    ("z", PROMPTS[1], params["a"])])
    for name, rid in (("a", "a"), ("b", "b"), (None, "base")):
        assert mixed[rid] == alone[name], name                    # floats compared exactly
    assert alone["a"] != alone[None] and alone["b"] != alone["a"]


@pytest.mark.parametrize("dtype, quantize", [("float32", None), ("bfloat16", None), ("float32", "int8")])
def test_the_fused_stack_adds_the_adapters_terms_bitwise_as_the_ops_called_one_by_one(
        lora_base, tiny_tokenizer, dtype, quantize):
    """DecoderStack.forward_lora (the adapters' terms inside the one-call C++ stack) gives the bits of the
    walk (stack None), the same C++ ops and LoRA calls one projection at a time, in float32, bfloat16 and int8,
    with 2 threads: prefill chunks of several rows a sequence, then decode steps (6 rows, one a sequence)."""
    num_prompts = 2

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        results = []
        for split in (False, True):
            engine = _lora_engine(lora_base, tiny_tokenizer, dtype=dtype, quantize=quantize,
                                  enable_prefix_caching=False, max_num_batched_tokens=8)
            model = engine.runner.model
            stack = model.stack
            if split:
                model.stack = None
            requests = [(f"{name}{i}", prompt, SamplingParams(max_new_tokens=4, greedy=True, ignore_eos=True,
                                                              top_n_tokens=3, adapter=name))
                        for i, prompt in enumerate(PROMPTS[:num_prompts]) for name in ("a", "c", None)]
            outputs = engine.generate(requests)
            results.append({rid: [(t.id, t.log_prob, t.top_tokens) for out in outs for t in out.new_tokens]
                            for rid, outs in outputs.items()})
            assert (model.stack is None) == split and stack is not None
    finally:
        torch.set_num_threads(threads)
    fused, split = results
    assert fused == split                                                  # floats compared exactly
    assert all(fused[f"a{i}"] != fused[f"None{i}"] for i in range(num_prompts))


def test_with_lora_off_the_engine_has_no_registry_and_refuses_adapter_requests(tiny_model_dir, tiny_tokenizer):
    engine = Engine(_config(tiny_model_dir), tiny_tokenizer)
    assert engine.adapters is None
    with pytest.raises(RequestRejected, match="option.enable_lora"):
        engine.add_request("r", [1, 5], SamplingParams(adapter="a"))


@pytest.mark.slow
def test_a_random_adapter_on_the_demo_model_answers_as_transformers_with_it_merged(model_dir, tokenizer, tmp_path):
    """SmolLM2-135M with a random rank-8 adapter on q/v/o/gate/down (fp32): the engine's greedy tokens for an
    adapter request equal transformers' with the adapter merged, and a base request in the same steps equals
    transformers' base model."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tensors = write_peft_adapter(tmp_path / "demo", hf.config, seed=5, std=0.05)
    lora = LoraConfig(max_loras=2, max_cpu_loras=2, adapter_roots=(tmp_path,))
    config = replace(_config(model_dir), lora=lora, block_size=16, kv_cache_bytes=64 << 20)
    engine = Engine(config, tokenizer)
    engine.adapters.load("demo", tmp_path / "demo")
    prompt = tokenizer("The capital of France is").input_ids
    greedy = dict(max_new_tokens=8, greedy=True, ignore_eos=True)
    results = engine.generate([("demo", prompt, SamplingParams(**greedy, adapter="demo")),
                               ("base", prompt, SamplingParams(**greedy))])
    tokens = {rid: [t.id for out in outs for t in out.new_tokens] for rid, outs in results.items()}
    ids = torch.tensor([prompt])
    expected_base = hf.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(prompt):].tolist()
    merge_adapter(hf, tensors, 2.0)
    expected = hf.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(prompt):].tolist()
    assert tokens["base"] == expected_base
    assert tokens["demo"] == expected and expected != expected_base


# ---- the other families: DecoderModel's walk on the C++ ops and the torch reference (Llama-shaped ones: the
# fused C++ decoder stack on cpp) -------------------------------------------------------------------------------

# biases + windows, norm offset + softcaps + GELU, fused projections in the checkpoint (walked and on the fused
# C++ stack), full-width q/k norms, multipliers, NoPE layers: about half a second a family
LORA_FAMILIES = ["qwen2", "gemma2", "phi3", "phi3-nowindow", "olmo2", "qwen3", "qwen2-nowindow", "mistral",
                 "gemma3_text", "granite", "smollm3"]
LLAMA_SHAPED = ("phi3-nowindow", "qwen2-nowindow")     # the fused C++ decoder stack on cpp
FAMILY_PROMPTS = [[1, 250, 17, 99], [1] + [(7 * i + 3) % 500 + 3 for i in range(20)]]   # 21 tokens: past window 16


@pytest.fixture(scope="module", params=LORA_FAMILIES)
def lora_family(request, tmp_path_factory):
    """A tiny random checkpoint of a non-Llama family (family_models.py), two random adapters of it (a: rank 8
    on every projection the checkpoint has, Phi-3's fused qkv_proj / gate_up_proj; b: rank 4 on one attention
    and one MLP projection) and transformers' greedy tokens for each of FAMILY_PROMPTS on the base (None) and on
    the base with each adapter merged (fp32), computed once for both backends."""
    from transformers import AutoModelForCausalLM

    name = request.param
    path = tmp_path_factory.mktemp(f"lora_{name}")
    models = {None: build_tiny_family(path, name)}
    fused = name.startswith("phi3")
    every = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if fused else \
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    root = path / "adapters"
    tensors = {"a": write_peft_adapter(root / "a", models[None].config, seed=21, modules=every, std=0.05),
               "b": write_peft_adapter(root / "b", models[None].config, rank=4, seed=22, std=0.05,
                                       modules=("qkv_proj", "gate_up_proj") if fused else ("k_proj", "up_proj"))}
    for adapter, weights in tensors.items():
        models[adapter] = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        merge_adapter(models[adapter], weights, 16.0 / (8 if adapter == "a" else 4))
    expected = {(adapter, i): hf_greedy(model, prompt, 6)
                for adapter, model in models.items() for i, prompt in enumerate(FAMILY_PROMPTS)}
    assert any(expected["a", i] != expected[None, i] for i in range(len(FAMILY_PROMPTS)))   # a changes answers
    return name, path, root, expected


def _family_tokens(lora_family, tokenizer, **options) -> tuple[Engine, dict[str, list[int]]]:
    """Both adapters and the base over FAMILY_PROMPTS in one engine (`options`: EngineConfig fields): the engine
    and request id (adapter name or None, then the prompt's index) -> its greedy tokens."""
    _, path, root, _ = lora_family
    lora = LoraConfig(max_loras=2, max_cpu_loras=2, adapter_roots=(root,))
    engine = Engine(replace(_config(path), lora=lora, **options), tokenizer)
    assert engine.applies_lora
    for adapter in ("a", "b"):
        engine.adapters.load(adapter, root / adapter)
    requests = [(f"{adapter}{i}", prompt, SamplingParams(max_new_tokens=6, greedy=True, adapter=adapter))
                for i, prompt in enumerate(FAMILY_PROMPTS) for adapter in ("a", "b", None)]
    results = engine.generate(requests)                               # one step holds both adapters and the base
    return engine, {rid: [t.id for out in outs for t in out.new_tokens] for rid, outs in results.items()}


def _assert_transformers_tokens(lora_family, tokens: dict[str, list[int]]) -> None:
    name, _, _, expected = lora_family
    for i in range(len(FAMILY_PROMPTS)):
        for adapter in ("a", "b", None):
            assert tokens[f"{adapter}{i}"] == expected[adapter, i], (name, adapter, i)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_every_family_s_adapter_requests_answer_as_transformers_with_the_adapter_merged_beside_base_requests(
        lora_family, tiny_tokenizer, backend):
    """One engine serves both adapters and the base in the same steps on DecoderModel (the C++ ops or the torch
    reference walked op by op; a Llama-shaped checkpoint on cpp: the fused C++ decoder stack): each
    request's greedy tokens are transformers' on the base with its adapter merged, or on the base alone
    (biases and windows: qwen2; norm offset, softcaps, GELU: gemma2; fused projections: phi3; full-width q/k
    norms: olmo2; ...)."""
    engine, tokens = _family_tokens(lora_family, tiny_tokenizer, kernel_backend=backend)
    assert engine.runner.kernel_backend == backend
    llama_shaped = backend == "cpp" and lora_family[0] in LLAMA_SHAPED
    assert (engine.runner.model.stack is not None) == llama_shaped
    _assert_transformers_tokens(lora_family, tokens)


@pytest.mark.parametrize("lora_family", ["phi3-nowindow"], indirect=True)
def test_phi3_s_fused_projection_adapters_answer_as_transformers_on_the_cpp_walk_too(lora_family, tiny_tokenizer):
    """A Llama-shaped Phi-3 on cpp walked op by op (stack None, as every tensor-parallel shard and the families
    the stack does not fit): cpp.lora_add adds its qkv_proj / gate_up_proj terms as transformers' merge does."""
    _, path, root, _ = lora_family
    engine = Engine(replace(_config(path), lora=LoraConfig(max_loras=2, max_cpu_loras=2, adapter_roots=(root,))),
                    tiny_tokenizer)
    engine.runner.model.stack = None
    for adapter in ("a", "b"):
        engine.adapters.load(adapter, root / adapter)
    requests = [(f"{adapter}{i}", prompt, SamplingParams(max_new_tokens=6, greedy=True, adapter=adapter))
                for i, prompt in enumerate(FAMILY_PROMPTS) for adapter in ("a", "b", None)]
    results = engine.generate(requests)
    _assert_transformers_tokens(lora_family, {rid: [t.id for out in outs for t in out.new_tokens]
                                              for rid, outs in results.items()})
