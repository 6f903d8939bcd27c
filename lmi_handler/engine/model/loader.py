"""Read an HF model directory (config.json + model.safetensors or a sharded index) into our model.

Owns reading the checkpoint into the chosen backend's model: LlamaModel (the fused C++ path) or forward.DecoderModel,
tensors fused by role (q/k/v and gate/up rows) and, for a tensor-parallel rank (either model), only its shard of
each weight;
leaves what a family is and its tensor names to families.py, the backend choice to backend.py, the
architecture to llama.py / forward.py, which slice a rank holds to engine/parallel/layout.py and the KV
cache and batching to model_runner.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from lmi_handler.engine.model.backend import backend_ops, choose_backend, log_choice
from lmi_handler.engine.model.families import build_spec, layer_tensor_names
from lmi_handler.engine.model.forward import DecoderModel, LayerWeights
from lmi_handler.engine.model.kernels import cpu_kernels
from lmi_handler.engine.model.llama import LlamaArgs, LlamaModel, rope_inv_freq
from lmi_handler.engine.model.spec import ModelSpec
from lmi_handler.engine.parallel.layout import ShardLayout, shard_of, take

def read_config(model_dir: str | Path) -> dict:
    """config.json as a dict. Raises FileNotFoundError when absent."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def spec_from_config(cfg: dict) -> ModelSpec:
    """The model's layer description (families.build_spec). Raises ConfigError for what we do not serve."""
    return build_spec(cfg)


def args_from_config(cfg: dict) -> LlamaArgs:
    """The model's shapes (and, for the C++ Llama path, its whole description) as LlamaArgs, for any family
    we serve: spec_from_config(cfg).llama_args(). Raises ConfigError for what we do not serve."""
    return build_spec(cfg).llama_args()


def safetensors_files(model_dir: str | Path) -> list[str]:
    """The checkpoint's safetensors file names: every shard named in model.safetensors.index.json, else
    model.safetensors; [] when neither file exists."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"] if (model_dir / "model.safetensors").is_file() else []


def read_safetensors(model_dir: str | Path, layout=None, full_qk_norm: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of every shard named in model.safetensors.index.json.

    `layout` (a ShardLayout, tensor parallelism): only that rank's part of each weight is read, through
    safetensors slices (layout.shard_of / take: rows of its heads, columns, vocabulary), so a rank never
    holds another rank's weights; names without a tensor-parallel rule (none that our model uses) are skipped.
    A fused tensor (Phi-3's qkv_proj, gate_up_proj) is read as the rank's rows of each part, concatenated;
    full_qk_norm (OLMo-2): q_norm / k_norm are read as the rank's heads' features (layout.shard_of).
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
                elif (part := _shard_or_skip(key, layout, full_qk_norm)) is not False:
                    tensors[key] = take(f.get_slice(key), part)
    return tensors


def _shard_or_skip(name: str, layout, full_qk_norm: bool = False):
    """The Shard(s) of `name` for this rank (None: the whole tensor), or False for a name no rule covers."""
    try:
        return shard_of(name, layout, full_qk_norm)
    except KeyError:
        return False


def _tensor(hf: dict[str, torch.Tensor], names: str | list[str]) -> torch.Tensor:
    """The checkpoint tensor `names`, or the row concatenation of a list of them (q/k/v, gate/up)."""
    return hf[names] if isinstance(names, str) else torch.cat([hf[n] for n in names])


LLAMA_ROLES = {"attn_pre": "input_layernorm.weight", "mlp_pre": "post_attention_layernorm.weight",
               "qkv": "self_attn.qkv_weight", "o": "self_attn.o_weight", "gate_up": "mlp.gate_up_weight",
               "down": "mlp.down_weight", "qkv_bias": "self_attn.qkv_bias", "o_bias": "self_attn.o_bias",
               "gate_up_bias": "mlp.gate_up_bias", "down_bias": "mlp.down_bias"}


def _layer_state(hf: dict[str, torch.Tensor], i: int, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """LlamaModel's parameter names for layer i (q/k/v and gate/up fused by rows unless the checkpoint
    already fuses them, Phi-3)."""
    return {f"layers.{i}.{LLAMA_ROLES[role]}": _tensor(hf, names)
            for role, names in layer_tensor_names(spec, i).items()}


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, pack_weights: bool = False,
               quantize: str | None = None, lm_head_kind: str | None = None, huge_pages: bool = True,
               layout: ShardLayout | None = None, kernel_backend: str = "auto"):
    """Build the model of an HF directory, in eval mode on `device`, activations in `dtype`, on the kernel
    backend option.kernel_backend picks (backend.choose_backend, logged): "cpp" is the fused Llama path
    (load_llama) for a spec it implements (spec.cpp_misfits() == []) and otherwise the C++ ops walking the spec
    in forward.DecoderModel; "torch" and "triton" walk the spec in forward.DecoderModel (load_decoder). The
    model's `kernel_backend` names the choice.
    Raises: ConfigError for a model or backend we cannot serve here; KeyError naming a missing weight;
    ValueError from load_llama (int8 where the packed kernels cannot run)."""
    spec = build_spec(read_config(model_dir))
    name, why = choose_backend(kernel_backend, spec, device, tensor_parallel=layout is not None, quantize=quantize)
    log_choice(name, why, spec)
    if name == "cpp" and not spec.cpp_misfits():
        model = load_llama(model_dir, spec, dtype, device, pack_weights, quantize, lm_head_kind, huge_pages, layout)
    else:
        model = load_decoder(model_dir, spec, dtype, device, name, quantize, layout)
    model.kernel_backend = name
    return model


def load_decoder(model_dir: str | Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                 backend: str, quantize: str | None = None, layout: ShardLayout | None = None) -> DecoderModel:
    """forward.DecoderModel of the checkpoint: every tensor by role (families.layer_tensor_names), fused
    tensors kept fused and separate q/k/v, gate/up concatenated, on `device` in `dtype`. A backend module
    may offer prepare_linear(weight) to pre-pack its linears' weights once, here, or pack_linear(weight, kind)
    (the C++ ops: panels of kind `quantize` or `dtype`'s name, made from the checkpoint's own tensor, so int8
    is quantized from its values, not from a cast copy; each checkpoint tensor is dropped once packed, so the
    load holds about one copy of the weights). quantize ("int8") needs pack_linear.
    layout: a tensor-parallel rank's shard (forward.DecoderModel's docstring): only its slices are read
    (read_safetensors), fused tensors split into their parts first; the caller sets `model.group`.
    Raises KeyError naming a missing weight; ValueError for quantize on a backend without pack_linear."""
    ops = backend_ops(backend)
    pack = vars(ops).get("pack_linear")
    if quantize is not None and pack is None:
        raise ValueError(f"quantize={quantize!r} needs the C++ ops backend (kernel_backend {backend})")
    kind = quantize or str(dtype).removeprefix("torch.")
    hf = read_safetensors(model_dir, layout, full_qk_norm=spec.qk_norm == "full")

    def take(names, linear: bool = False) -> torch.Tensor:
        try:
            t = _tensor(hf, names)
        except KeyError as exc:
            raise KeyError(f"weights missing from the checkpoint: {exc.args[0]}") from None
        if linear and pack is not None:
            packed = pack(t, kind)
            for name in [names] if isinstance(names, str) else names:   # the panels replace the tensor
                hf.pop(name, None)
            return packed
        t = t.to(device=device, dtype=dtype)
        prepare = vars(ops).get("prepare_linear")             # optional: a backend's packing hook
        return prepare(t) if linear and prepare is not None else t

    linears = ("qkv", "o", "gate_up", "down")
    layers = [LayerWeights(**{role: take(names, role in linears)
                              for role, names in layer_tensor_names(spec, i).items()})
              for i in range(spec.num_layers)]
    embed = take("model.embed_tokens.weight")
    lm_head = take("model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight", True)
    return DecoderModel(spec, ops, embed, take("model.norm.weight"), lm_head, layers, backend, layout).eval()


def load_llama(model_dir: str | Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
               pack_weights: bool = False, quantize: str | None = None, lm_head_kind: str | None = None,
               huge_pages: bool = True, layout: ShardLayout | None = None) -> LlamaModel:
    """Build LlamaModel (today's C++ path; spec.cpp_misfits() is []) from an HF directory.

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
    Raises: KeyError naming a missing weight; ValueError for quantize="int8" where the packed kernels cannot
    run (not CPU, not float32/bfloat16, no C++ build).
    """
    args = spec.llama_args()
    hf = read_safetensors(model_dir, layout)
    state = {"embed_tokens": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    if not args.tie_word_embeddings:
        state["lm_head"] = hf["lm_head.weight"]
    for i in range(args.num_layers):
        state.update(_layer_state(hf, i, spec))
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
