"""Tiny random checkpoints of every family we serve, built with transformers' own classes (seeded; 3 layers,
GQA, window 16 where the family has one), for the family tests against transformers' generate()."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engine.helpers import TINY_VOCAB

WINDOW = 16
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=TINY_VOCAB, max_position_embeddings=256, initializer_range=0.2, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name -> (model_type, config overrides); a name is a family, or a family's variant after a dash
TINY_FAMILIES = {
    "llama": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    "mistral-nowindow": ("mistral", dict(sliding_window=None)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen2-nowindow": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen3": ("qwen3", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    # untied, smaller weights: tied tiny Gemmas repeat one token, which would check little
    "gemma2": ("gemma2", dict(query_pre_attn_scalar=16, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                              final_logit_softcapping=3.0, tie_word_embeddings=False, initializer_range=0.05)),
    "gemma3_text": ("gemma3_text", dict(query_pre_attn_scalar=16, sliding_window=WINDOW, tie_word_embeddings=False,
                                        initializer_range=0.05,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "phi3": ("phi3", dict(sliding_window=WINDOW)),
    "phi3-nowindow": ("phi3", dict()),
    "phi3-longrope": ("phi3", dict(max_position_embeddings=256, original_max_position_embeddings=32,
                                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.5,
                                                    "short_factor": [1.0, 1.1, 1.3, 1.7],
                                                    "long_factor": [1.5, 2.0, 3.0, 5.0],
                                                    "original_max_position_embeddings": 32})),
    "smollm3": ("smollm3", dict(no_rope_layers=[1, 0, 1], use_sliding_window=True, sliding_window=WINDOW)),
    "granite": ("granite", dict(embedding_multiplier=4.0, attention_multiplier=0.1, residual_multiplier=0.5,
                                logits_scaling=2.0)),
    "olmo2": ("olmo2", dict()),
}


def build_tiny_family(path: Path, name: str, seed: int = 0):
    """Write the tiny checkpoint `name` (TINY_FAMILIES) to `path` with save_pretrained; return the HF model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides = TINY_FAMILIES[name]
    config = AutoConfig.for_model(model_type, **{**BASE, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():   # biases and norm weights start at 0 / 1: make them matter
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model


# mixture-of-experts families: 4 experts of width 32, top 2 (routing every prompt's tokens to each expert);
# Qwen2-MoE with a dense layer between sparse ones (mlp_only_layers) and its shared expert, Qwen3-MoE with
# decoder_sparse_step 2 and norm_topk_prob, OLMoE's full-width q/k norm, GraniteMoE's multipliers
MOE = dict(num_experts_per_tok=2)
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 64, "rope_theta": 150000.0}
TINY_MOE_FAMILIES = {
    "mixtral": ("mixtral", dict(MOE, num_local_experts=4, intermediate_size=32, sliding_window=WINDOW)),
    "qwen2_moe": ("qwen2_moe", dict(MOE, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                    mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe": ("qwen3_moe", dict(MOE, num_experts=4, moe_intermediate_size=32, decoder_sparse_step=2,
                                    norm_topk_prob=True)),
    "olmoe": ("olmoe", dict(MOE, num_experts=4, intermediate_size=32)),
    "granitemoe": ("granitemoe", dict(MOE, num_local_experts=4, intermediate_size=32, embedding_multiplier=4.0,
                                      attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=2.0)),
    # alternating sliding / full layers (its default layer_types), sinks, YaRN, a limit the gates reach
    "gpt_oss": ("gpt_oss", dict(MOE, num_local_experts=4, intermediate_size=32, sliding_window=WINDOW,
                                swiglu_limit=2.0, rope_parameters=GPT_OSS_YARN)),
}


def build_tiny_moe(path: Path, name: str, seed: int = 0):
    """Write the tiny mixture-of-experts checkpoint `name` (TINY_MOE_FAMILIES) to `path` as build_tiny_family
    does; return the HF model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides = TINY_MOE_FAMILIES[name]
    config = AutoConfig.for_model(model_type, **{**BASE, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * 0.2)
            elif ("gate" in pname or "router" in pname) and p.dim() == 2 and p.shape[0] <= 4:   # routers: spread tokens
                p.normal_(0.0, 0.5)
            elif pname.endswith("sinks"):          # gpt-oss: sinks that take a real share of each softmax
                p.normal_(0.0, 1.0)
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_greedy_with_logprobs(hf, prompt: list[int], n: int) -> tuple[list[int], list[float], set]:
    """transformers' generate(): greedy tokens, each one's log-prob, and the (layer, expert) pairs its routers
    chose along the way."""
    chosen: set = set()
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        block = getattr(layer, "mlp", None) or layer.block_sparse_moe
        router = getattr(block, "gate", None) or getattr(block, "router", None)
        if router is not None and not isinstance(router, torch.nn.Linear):
            hooks.append(router.register_forward_hook(
                lambda _m, _in, out, i=i: chosen.update((i, e) for e in out[2].flatten().tolist())))
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0,
                      output_scores=True, return_dict_in_generate=True)
    for hook in hooks:
        hook.remove()
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(s[0].float().log_softmax(-1)[t]) for s, t in zip(out.scores, tokens)]
    return tokens, logprobs, chosen
