"""Tensor-parallel shard layout (engine/parallel/layout.py): vLLM's degree rules and wording, and shards that
put the whole model back together, checked on a tiny random Llama's real tensors."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from lmi_handler.config import ConfigError
from lmi_handler.engine.model.loader import read_config, spec_from_config
from lmi_handler.engine.parallel.layout import ShardLayout, check_degree, shard_of, take
from tests.engine.helpers import build_tiny_llama

# SmolLM2-135M-Instruct: 9 query heads, 3 KV heads, intermediate 1536, vocabulary 49152 (head_dim 64)
DEMO = SimpleNamespace(num_heads=9, num_kv_heads=3, intermediate_size=1536, vocab_size=49152, head_dim=64)


def test_the_demo_shape_takes_degree_3_and_refuses_2_with_vllms_message():
    check_degree(DEMO, 3)
    check_degree(DEMO, 1)
    with pytest.raises(ConfigError) as refused:
        check_degree(DEMO, 2)
    message = str(refused.value)
    assert message.startswith("option.tensor_parallel_degree=2: ")
    assert "Total number of attention heads (9) must be divisible by tensor parallel size (2)." in message
    assert "Total number of KV heads (3)" in message
    assert message.endswith("Degrees this model takes: 1, 3.")


@pytest.mark.parametrize(("shape", "degree", "words"), [
    (dict(intermediate_size=1000), 3, "Intermediate size (1000) must be divisible by tensor parallel size (3)."),
    (dict(vocab_size=49153), 3, "Vocabulary size (49153) must be divisible by tensor parallel size (3)."),
    (dict(num_heads=12, num_kv_heads=3), 4, "Total number of KV heads (3) must be divisible by tensor parallel size "
     "(4), or tensor parallel size a multiple of it"),
])
def test_each_rule_is_named_in_the_refusal(shape, degree, words):
    args = SimpleNamespace(**{**vars(DEMO), **shape})
    with pytest.raises(ConfigError, match=r"^option\.tensor_parallel_degree=") as refused:
        check_degree(args, degree)
    assert words in str(refused.value)
    assert ("attention heads" in str(refused.value)) == bool(args.num_heads % degree)   # only the rules broken


def test_kv_heads_are_split_when_they_divide_and_replicated_when_the_degree_is_their_multiple():
    split = [ShardLayout.of(DEMO, r, 3) for r in range(3)]
    assert [s.heads for s in split] == [(0, 3), (3, 6), (6, 9)]
    assert [s.kv_heads for s in split] == [(0, 1), (1, 2), (2, 3)] and {s.kv_replicas for s in split} == {1}
    assert [s.vocab for s in split] == [(0, 16384), (16384, 32768), (32768, 49152)]
    assert [s.intermediate for s in split] == [(0, 512), (512, 1024), (1024, 1536)]
    wide = SimpleNamespace(**{**vars(DEMO), "num_heads": 12, "num_kv_heads": 2, "vocab_size": 49152})
    replicated = [ShardLayout.of(wide, r, 4) for r in range(4)]
    assert [s.kv_heads for s in replicated] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert {s.kv_replicas for s in replicated} == {2} and {s.num_kv_heads for s in replicated} == {1}
    # every query head's KV head (GQA: head h uses KV head h // (heads / kv heads)) is on its rank
    for s in replicated:
        assert {h // (12 // 2) for h in range(*s.heads)} == {s.kv_heads[0]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_tp")
    build_tiny_llama(path, tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    return path, spec_from_config(read_config(path)), load_file(path / "model.safetensors")


@pytest.mark.parametrize("degree", [2, 4])
def test_the_shards_of_every_weight_put_the_checkpoint_back_together(tiny, degree):
    path, args, tensors = tiny
    layouts = [ShardLayout.of(args, r, degree) for r in range(degree)]
    for name, full in tensors.items():
        shards = [shard_of(name, layout) for layout in layouts]
        if shards[0] is None:
            assert all(s is None for s in shards) and torch.equal(take(full, None), full)
            continue
        parts = [take(full, s) for s in shards]
        if layouts[0].kv_replicas > 1 and ("k_proj" in name or "v_proj" in name):
            parts = parts[::layouts[0].kv_replicas]          # replicated KV heads: one copy per head
        assert torch.equal(torch.cat(parts, dim=shards[0].dim), full), name


def test_a_shard_read_from_a_safetensors_slice_is_the_shard_of_the_tensor(tiny):
    path, args, tensors = tiny
    layout = ShardLayout.of(args, 1, 2)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                     "model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.up_proj.bias", "lm_head.weight",
                     "model.norm.weight"):
            assert torch.equal(take(f.get_slice(name), shard_of(name, layout)), take(tensors[name], shard_of(name, layout)))


@pytest.mark.parametrize("degree", [2, 4])
def test_a_fused_tensors_shard_is_the_concatenation_of_its_parts_shards(degree):
    """Phi-3's qkv_proj (q | k | v rows) and gate_up_proj (gate | up): each rank's rows of each part, in that
    order, as the separate tensors' shards would be; at degree 4 the 2 KV heads are each held by 2 ranks."""
    shape = SimpleNamespace(num_heads=4, num_kv_heads=2, intermediate_size=8, vocab_size=16, head_dim=3)
    q, k, v = torch.randn(12, 5), torch.randn(6, 5), torch.randn(6, 5)
    gate, up = torch.randn(8, 5), torch.randn(8, 5)
    for rank in range(degree):
        layout = ShardLayout.of(shape, rank, degree)
        parts = [take(t, shard_of(f"model.layers.0.self_attn.{n}_proj.weight", layout)) for n, t in zip("qkv", (q, k, v))]
        fused = shard_of("model.layers.0.self_attn.qkv_proj.weight", layout)
        assert torch.equal(take(torch.cat([q, k, v]), fused), torch.cat(parts))
        parts = [take(t, shard_of(f"model.layers.0.mlp.{n}_proj.weight", layout)) for n, t in zip(("gate", "up"), (gate, up))]
        assert torch.equal(take(torch.cat([gate, up]), shard_of("model.layers.0.mlp.gate_up_proj.weight", layout)),
                           torch.cat(parts))


def test_q_k_norms_are_whole_per_head_and_the_ranks_heads_over_the_whole_projection():
    shape = SimpleNamespace(num_heads=4, num_kv_heads=2, intermediate_size=8, vocab_size=16, head_dim=3)
    layout = ShardLayout.of(shape, 1, 2)
    assert shard_of("model.layers.2.self_attn.q_norm.weight", layout) is None           # Qwen3, Gemma 3: (head_dim,)
    assert shard_of("model.layers.2.self_attn.q_norm.weight", layout, full_qk_norm=True).start == 6   # OLMo-2
    assert shard_of("model.layers.2.self_attn.k_norm.weight", layout, full_qk_norm=True).stop == 6


def test_a_name_outside_the_llama_layout_is_refused(tiny):
    _, args, _ = tiny
    with pytest.raises(KeyError, match="no tensor-parallel rule"):
        shard_of("model.layers.0.self_attn.rotary_emb.inv_freq", ShardLayout.of(args, 0, 2))


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _layer0(args, get, x):
    """Layer 0 of a Llama on hidden states x (T, hidden), without RoPE (position 0 for every row: the shard
    arithmetic is what is tested), from weights `get(name)`; returns (attention out, MLP out) before the
    residual, i.e. what a row-parallel layer's ranks sum."""
    p = "model.layers.0."
    h = _rms(x, get(p + "input_layernorm.weight"))
    q = F.linear(h, get(p + "self_attn.q_proj.weight"), get(p + "self_attn.q_proj.bias"))
    k = F.linear(h, get(p + "self_attn.k_proj.weight"), get(p + "self_attn.k_proj.bias"))
    v = F.linear(h, get(p + "self_attn.v_proj.weight"), get(p + "self_attn.v_proj.bias"))
    d = args.head_dim
    q, k, v = (t.view(x.shape[0], -1, d).transpose(0, 1) for t in (q, k, v))     # (heads, T, d)
    k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
    v = v.repeat_interleave(q.shape[0] // v.shape[0], dim=0)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(x.shape[0], -1)
    attn = F.linear(o, get(p + "self_attn.o_proj.weight"))
    g = F.linear(h, get(p + "mlp.gate_proj.weight"), get(p + "mlp.gate_proj.bias"))
    u = F.linear(h, get(p + "mlp.up_proj.weight"), get(p + "mlp.up_proj.bias"))
    return attn, F.linear(F.silu(g) * u, get(p + "mlp.down_proj.weight"))


@pytest.mark.parametrize("degree", [2, 4])
def test_row_parallel_partial_sums_and_vocab_parallel_logits_give_the_full_layer(tiny, degree):
    path, args, tensors = tiny
    x = torch.randn(7, args.hidden_size, generator=torch.Generator().manual_seed(0))
    full_attn, full_mlp = _layer0(args, tensors.__getitem__, x)
    attn_parts, mlp_parts, logit_parts = [], [], []
    for rank in range(degree):
        layout = ShardLayout.of(args, rank, degree)
        attn, mlp = _layer0(args, lambda name, layout=layout: take(tensors[name], shard_of(name, layout)), x)
        attn_parts.append(attn)
        mlp_parts.append(mlp)
        logit_parts.append(F.linear(x, take(tensors["lm_head.weight"], shard_of("lm_head.weight", layout))))
    torch.testing.assert_close(sum(attn_parts), full_attn, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sum(mlp_parts), full_mlp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(logit_parts, dim=-1), F.linear(x, tensors["lm_head.weight"]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_demo_model_config_takes_3_and_refuses_2(model_dir):
    args = spec_from_config(read_config(model_dir))
    assert (args.num_heads, args.num_kv_heads, args.intermediate_size, args.vocab_size) == (9, 3, 1536, 49152)
    check_degree(args, 3)
    with pytest.raises(ConfigError, match=r"Total number of attention heads \(9\) must be divisible by tensor "
                                          r"parallel size \(2\)\."):
        check_degree(args, 2)
