"""Tiny random checkpoints of the families the transformers fallback serves (no layer description), built with
transformers' own classes (seeded; 3 layers, vocab 512), for the fallback's tests against generate()."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.engine.helpers import TINY_VOCAB

WINDOW = 16
IDS = dict(vocab_size=TINY_VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2)
BASE = dict(IDS, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)

# name -> (model_type, config); each served by model_impl=auto through the fallback (BLOOM: refused, its
# attention does not go through transformers' attention interface)
FALLBACK_FAMILIES = {
    "gpt2": ("gpt2", dict(IDS, n_embd=64, n_layer=3, n_head=4, n_positions=256)),
    "starcoder2": ("starcoder2", dict(BASE, sliding_window=WINDOW)),          # GQA, biases, a window
    "stablelm": ("stablelm", dict(BASE, partial_rotary_factor=0.5, use_qkv_bias=True)),
    "gpt_neox": ("gpt_neox", dict(BASE, num_key_value_heads=None, rotary_pct=0.5)),
    "cohere": ("cohere", dict(BASE, logit_scale=0.5, use_qk_norm=False)),
    "bloom": ("bloom", dict(IDS, hidden_size=64, n_layer=3, n_head=4)),
}


def build_tiny_fallback(path: Path, name: str, seed: int = 0):
    """Write the tiny checkpoint `name` (FALLBACK_FAMILIES) to `path` with save_pretrained; return the HF model
    (eager attention: the reference)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, values = FALLBACK_FAMILIES[name]
    config = AutoConfig.for_model(model_type, **{k: v for k, v in values.items() if v is not None})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():   # biases and norm weights start at 0 / 1: make them matter
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname or ".ln" in pname:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model
