"""Read an HF model directory (config.json + model.safetensors or a sharded index) into our LlamaModel.

Owns the config-key and weight-name mapping (HF names -> our fused q/k/v and gate/up weights) and, for a
tensor-parallel rank, reading only its shard of each weight; leaves the architecture to llama.py, which
slice a rank holds to engine/parallel/layout.py and the KV cache and batching to model_runner.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from lmi_handler.engine.model.kernels import cpu_kernels
from lmi_handler.engine.model.llama import LlamaArgs, LlamaModel, rope_inv_freq
from lmi_handler.engine.parallel.layout import ShardLayout, shard_of, take

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def read_config(model_dir: str | Path) -> dict:
    """config.json as a dict. Raises FileNotFoundError when absent."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def args_from_config(cfg: dict) -> LlamaArgs:
    """Map an HF config dict to LlamaArgs.

    rope_theta comes from `rope_parameters` (transformers 5) or the top-level `rope_theta`;
    scaling from `rope_parameters` or the older `rope_scaling`. Qwen2 always has q/k/v bias.
    Raises: ValueError for a model_type we do not implement.
    """
    model_type = cfg.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not supported {SUPPORTED_MODEL_TYPES}")
    rope = dict(cfg.get("rope_parameters") or {})
    rope.update(cfg.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    num_heads = cfg["num_attention_heads"]
    return LlamaArgs(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope_theta=float(rope_theta),
        rope_scaling=rope,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        attention_bias=model_type == "qwen2" or cfg.get("attention_bias", False),
        o_proj_bias=model_type != "qwen2" and cfg.get("attention_bias", False),
        mlp_bias=cfg.get("mlp_bias", False),
    )


def safetensors_files(model_dir: str | Path) -> list[str]:
    """The checkpoint's safetensors file names: every shard named in model.safetensors.index.json, else
    model.safetensors; [] when neither file exists."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"] if (model_dir / "model.safetensors").is_file() else []


def read_safetensors(model_dir: str | Path, layout=None) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of every shard named in model.safetensors.index.json.

    `layout` (a ShardLayout, tensor parallelism): only that rank's part of each weight is read, through
    safetensors slices (layout.shard_of / take: rows of its heads, columns, vocabulary), so a rank never
    holds another rank's weights; names without a tensor-parallel rule (none that our model uses) are skipped.
    Returns CPU tensors keyed by HF name, in the checkpoint's dtype. Raises FileNotFoundError when
    neither file exists.
    """
    model_dir = Path(model_dir)
    files = safetensors_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no model.safetensors(.index.json) in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(model_dir / name, framework="pt") as f:
            for key in f.keys():
                if layout is None:
                    tensors[key] = f.get_tensor(key)
                elif (part := _shard_or_skip(key, layout)) is not False:
                    tensors[key] = take(f.get_slice(key), part)
    return tensors


def _shard_or_skip(name: str, layout):
    """The Shard of `name` for this rank (None: the whole tensor), or False for a name no rule covers."""
    try:
        return shard_of(name, layout)
    except KeyError:
        return False


def _layer_state(hf: dict[str, torch.Tensor], i: int, args: LlamaArgs) -> dict[str, torch.Tensor]:
    """Our parameter names for layer i, fusing q/k/v and gate/up by concatenating rows."""
    p = f"model.layers.{i}."
    ours = f"layers.{i}."
    state = {
        ours + "input_layernorm.weight": hf[p + "input_layernorm.weight"],
        ours + "post_attention_layernorm.weight": hf[p + "post_attention_layernorm.weight"],
        ours + "self_attn.qkv_weight": torch.cat([hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
        ours + "self_attn.o_weight": hf[p + "self_attn.o_proj.weight"],
        ours + "mlp.gate_up_weight": torch.cat([hf[p + "mlp.gate_proj.weight"],
                                                hf[p + "mlp.up_proj.weight"]]),
        ours + "mlp.down_weight": hf[p + "mlp.down_proj.weight"],
    }
    if args.attention_bias:
        state[ours + "self_attn.qkv_bias"] = torch.cat([hf[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
    if args.o_proj_bias:
        state[ours + "self_attn.o_bias"] = hf[p + "self_attn.o_proj.bias"]
    if args.mlp_bias:
        state[ours + "mlp.gate_up_bias"] = torch.cat([hf[p + "mlp.gate_proj.bias"], hf[p + "mlp.up_proj.bias"]])
        state[ours + "mlp.down_bias"] = hf[p + "mlp.down_proj.bias"]
    return state


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, pack_weights: bool = False,
               quantize: str | None = None, lm_head_kind: str | None = None, huge_pages: bool = True,
               layout: ShardLayout | None = None) -> LlamaModel:
    """Build LlamaModel from an HF directory, in eval mode on `device`, activations in `dtype`.

    layout: a tensor-parallel rank's shard (LlamaModel's docstring): only its slices are read from the
    checkpoint (read_safetensors), before packing, so float32, bfloat16 and int8 panels are made per rank
    from the checkpoint's own values (int8 scales are per output channel: a column shard's are the whole
    weight's; a row shard's come from its slice of each row). The caller sets `model.group`.

    pack_weights: repack the linear weights for the C++ row-invariant kernels (LlamaModel.pack_weights;
    float32 or bfloat16 on CPU only, else a no-op) straight from the checkpoint's tensors, after the
    checkpoint's own dict is released so that only one extra weight is held at a time: panels in `dtype`,
    or int8 ones when quantize="int8" (quantized from the checkpoint's values, not from a bf16 copy).
    lm_head_kind: lm_head's panels when they should differ from the layers' (default: the layers' kind, int8
    included; benchmarks/quality.py compares other choices).
    `huge_pages` puts the packed weights in huge-page memory.
    The other parameters (norms, biases, an embedding not read from lm_head's panels) are cast to
    `dtype`. A bf16 checkpoint loaded as bfloat16 is never widened.
    Raises: KeyError naming a missing weight; ValueError for an unsupported architecture, or for
    quantize="int8" where the packed kernels cannot run (not CPU, not float32/bfloat16, no C++ build).
    """
    args = args_from_config(read_config(model_dir))
    hf = read_safetensors(model_dir, layout)
    state = {"embed_tokens": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    if not args.tie_word_embeddings:
        state["lm_head"] = hf["lm_head.weight"]
    for i in range(args.num_layers):
        state.update(_layer_state(hf, i, args))
    with torch.device("meta"):
        model = LlamaModel(args, layout)
    model.load_state_dict(state, strict=False, assign=True)
    del hf, state        # the model holds the tensors now; packing below must be able to free them
    if args.tie_word_embeddings:
        model.lm_head = model.embed_tokens      # assign-loading replaced the tied Parameter
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise KeyError(f"weights missing from the checkpoint: {missing[:5]}")
    model.inv_freq = rope_inv_freq(args)        # off the meta device before .to()
    packable = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_kernels() is not None
    if quantize is not None and not (pack_weights and packable):
        raise ValueError(f"quantize={quantize!r} needs the C++ CPU kernels on CPU with float32 or bfloat16 "
                         f"activations (device {device}, dtype {dtype})")
    if pack_weights and packable:
        kind = "int8" if quantize == "int8" else str(dtype).removeprefix("torch.")
        model.pack_weights(kind, lm_head_kind, huge_pages)
    model = model.to(device=device, dtype=dtype).eval()
    # RoPE frequencies stay float32 whatever the weights' dtype (as transformers does)
    model.inv_freq = rope_inv_freq(args).to(device)
    return model
