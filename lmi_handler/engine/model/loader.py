"""Read an HF model directory (config.json + model.safetensors or a sharded index) into forward.DecoderModel.

Owns the one loader of every family: the checkpoint's tensors by the spec's roles (families.layer_tensor_names),
q/k/v and gate/up rows fused unless the checkpoint fuses them already (Phi-3), only a tensor-parallel rank's
shard of each weight, and the backend's packed form of the linears (the cpp backend's float32, bfloat16 or
int8 panels, all in one buffer in step order). Leaves what a family is to families.py, the backend choice to
backend.py, the forward to forward.py, which slice a rank holds to engine/parallel/layout.py and the KV cache
and batching to model_runner.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from lmi_handler.config import ConfigError
from lmi_handler.engine.model.backend import backend_ops, choose_backend, log_choice
from lmi_handler.engine.model.families import build_spec, layer_tensor_names
from lmi_handler.engine.model.forward import DecoderModel, LayerWeights
from lmi_handler.engine.model.moe import MoeWeights
from lmi_handler.engine.model.kernels import panel_arena, panels_shape
from lmi_handler.engine.model.quant import check_backend as check_quantized_backend
from lmi_handler.engine.model.quant import quantized_linears
from lmi_handler.engine.model.spec import ModelSpec
from lmi_handler.engine.model.vision import family_of, text_tensors
from lmi_handler.engine.parallel.layout import ShardLayout, shard_of, take

LINEARS = ("qkv", "o", "gate_up", "down")    # the roles a backend may pack, in the order a step reads them
MOE_LINEARS = ("router", "shared_gate", "shared_gate_up", "shared_down")   # a sparse layer's, before its experts
EXPERT_LINEARS = ("experts_gate_up", "experts_down")                      # one entry per expert
EXPERT_BIASES = ("experts_gate_up_bias", "experts_down_bias")              # gpt-oss: one entry per expert


def read_config(model_dir: str | Path) -> dict:
    """config.json as a dict. Raises FileNotFoundError when absent."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def spec_from_config(cfg: dict) -> ModelSpec:
    """The model's layer description (families.build_spec). Raises ConfigError for what we do not serve."""
    return build_spec(cfg)


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


def _tensor(hf: dict[str, torch.Tensor], names: str | list[str] | tuple) -> torch.Tensor:
    """The checkpoint tensor `names`, the row concatenation of a list of them (q/k/v, gate/up), or (name, e):
    expert e's slice of a stacked (E, out, in) tensor, or (name, e, transform): that slice transformed
    (_expert_slice: gpt-oss's transposed, interleaved experts). Raises KeyError naming the weights the
    checkpoint lacks."""
    if isinstance(names, tuple):
        t = _tensor(hf, names[0])[names[1]]
        return _expert_slice(t, names[2]) if len(names) > 2 else t
    parts = [names] if isinstance(names, str) else names
    if missing := [n for n in parts if n not in hf]:
        raise KeyError(f"weights missing from the checkpoint: {missing}")
    return hf[names] if isinstance(names, str) else torch.cat([hf[n] for n in names])


def _expert_slice(t: torch.Tensor, transform: str | None) -> torch.Tensor:
    """One expert's slice of gpt-oss's stacked tensors in our (out, in) layout (families._gpt_oss_expert_names):
    "transposed": (in, out) -> (out, in); "transposed_pairs": (in, 2I) with gate and up interleaved by column
    -> (2I, in) = cat(gate rows, up rows); "pairs": a (2I,) bias the same way; None: as it is. Exact copies."""
    if transform in ("transposed", "transposed_pairs"):
        t = t.T
    if transform in ("pairs", "transposed_pairs"):
        t = torch.cat([t[0::2], t[1::2]])
    return t.contiguous()


def _experts_form(hf: dict[str, torch.Tensor], layer: dict) -> None:
    """Replace a sparse layer's "experts" entry (families.expert_tensor_names: the family's form and transformers'
    stacked one) by the roles experts_gate_up / experts_down of the form this checkpoint holds (the family's
    when both are there). Raises KeyError naming the family's form's missing weights when neither is."""
    alternatives = layer.pop("experts")
    for form in (alternatives["split"], alternatives["stacked"]):
        first = form[0][0]
        names = [first[0]] if isinstance(first, tuple) else [first] if isinstance(first, str) else first
        if all(n in hf for n in names):
            layer["experts_gate_up"], layer["experts_down"] = form
            return
    _tensor(hf, alternatives["split"][0][0])          # raises, naming the family's form


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, quantize: str | None = None,
               lm_head_kind: str | None = None, huge_pages: bool = True, layout: ShardLayout | None = None,
               kernel_backend: str = "auto", pooling: bool = False) -> DecoderModel:
    """forward.DecoderModel of an HF directory, in eval mode on `device`, activations in `dtype`, on the kernel
    backend option.kernel_backend picks (backend.choose_backend, logged; the model's `kernel_backend` names it).

    Every tensor is read by role (families.layer_tensor_names): fused tensors kept fused, separate q/k/v and
    gate/up concatenated by rows. layout: a tensor-parallel rank's shard (DecoderModel's docstring): only its
    slices are read (read_safetensors), fused tensors split into their parts first, so float32, bfloat16 and
    int8 panels are made per rank from the checkpoint's own values (int8 scales are per output channel: a
    column shard's are the whole weight's, a row shard's come from its slice of each row); the caller sets
    `model.group`.
    A backend with pack_linear (cpp) packs the linears once here, as panels of kind `quantize` ("int8",
    quantized from the checkpoint's own values, not from a cast copy) or `dtype`'s name, every layer's and
    lm_head's in one buffer in the order a step reads them (kernels.panel_arena, huge pages unless
    `huge_pages` is False); each checkpoint tensor is dropped once packed, so the load holds about one copy of
    the weights. lm_head_kind: lm_head's panels when they should differ from the layers' (benchmarks/quality.py
    compares choices). A tied lm_head packed as float32 or bfloat16 is the embedding too (its rows read back
    from the panels, exactly); packed as int8 it leaves the embedding in `dtype`. A backend with
    prepare_linear(weight) lays its linears out once here instead. Norms, biases and an unpacked embedding are
    copied to `dtype` on `device` (a bf16 checkpoint loaded as bfloat16 is never widened), so no view keeps the
    mapped checkpoint file resident.
    pooling: a pooling task's decoder (engine/pooling_engine.py), saved as the bare model (Qwen3-Embedding,
    gte-Qwen2): its tensors may lack the `model.` prefix and lm_head (never used: the embedding stands in).
    Raises: ConfigError for a model or backend we cannot serve here; KeyError naming a missing weight;
    ValueError for quantize on a backend without pack_linear."""
    cfg = read_config(model_dir)
    spec = build_spec(cfg)
    if layout is not None and spec.moe is not None:
        raise ConfigError(f"option.tensor_parallel_degree={layout.degree}: model_type={spec.model_type} is a "
                          "mixture-of-experts model, served on one process only for now (degree 1)")
    # engine/model/quant: a pre-quantized checkpoint's linears, or option.quantize=int4's (quantize: int8 or None)
    quant, quantize = quantized_linears(cfg, quantize, tensor_parallel=layout is not None)
    if quant is not None and quant.experts_only and spec.moe is None:
        raise ConfigError(f"config.json quantization_config ({quant.describe()}) quantizes a mixture-of-experts "
                          f"model's experts; model_type={spec.model_type} has none")
    if quant is not None and spec.moe is not None and not quant.experts_only:
        raise ConfigError(f"model_type={spec.model_type}: 4-bit or pre-quantized weights (option.quantize=int4, "
                          "GPTQ, AWQ, compressed-tensors) on a mixture-of-experts model are not served yet; serve "
                          "its float checkpoint (option.quantize=int8 packs its experts at load)")
    name, why = choose_backend(kernel_backend, spec, device, tensor_parallel=layout is not None, quantize=quantize)
    log_choice(name, why, spec)
    if quant is not None:
        check_quantized_backend(quant, name)
    ops = backend_ops(name)
    pack = vars(ops).get("pack_linear")
    if quantize is not None and pack is None:
        raise ValueError(f"quantize={quantize!r} needs the C++ ops backend (kernel_backend {name})")
    kind = quantize or str(dtype).removeprefix("torch.")
    head_kind = lm_head_kind or kind
    if layout is not None and family_of(cfg) is not None:
        raise ConfigError(f"option.tensor_parallel_degree={layout.degree}: model_type={cfg['model_type']} (a "
                          "vision-language model) is served on one process only for now (degree 1)")
    hf = text_tensors(cfg, read_safetensors(model_dir, layout, full_qk_norm=spec.qk_norm == "full"))
    if pooling and "model.embed_tokens.weight" not in hf:
        hf = {(k if k.startswith("lm_head.") else "model." + k): t for k, t in hf.items()}
    names = [layer_tensor_names(spec, i) for i in range(spec.num_layers)]
    for layer in names:
        if "experts" in layer:
            _experts_form(hf, layer)
    head_name = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    if pooling and head_name not in hf:
        head_name = "model.embed_tokens.weight"
    dense_kind = str(dtype).removeprefix("torch.")      # routers and the shared expert's gate: never int8
    linears = [(n, k) for layer in names for _, n, k in _layer_linears(layer, kind, dense_kind)]
    linears.append((head_name, head_kind))
    linears = [(n, k) for n, k in linears if quant is None or not quant.covers(hf, n)]   # quantized: not in the arena
    arena = iter(panel_arena([(panels_shape(*_shape(hf, n), k), k) for n, k in linears], huge_pages)
                 if pack is not None else [])

    def take_linear(names, kind: str):
        if quant is not None and quant.covers(hf, names):
            return quant.take(hf, names)
        t = _tensor(hf, names)
        if pack is None:
            t = t.to(device=device, dtype=dtype)
            prepare = vars(ops).get("prepare_linear")             # optional: a backend's layout hook
            return prepare(t) if prepare is not None else t
        packed = pack(t, kind, out=next(arena))
        if names != "model.embed_tokens.weight" and not isinstance(names, tuple):   # the panels replace the tensor
            for name in [names] if isinstance(names, str) else names:
                hf.pop(name, None)
        return packed

    def take_other(name):
        return _tensor(hf, name).to(device=device, dtype=dtype, copy=True)

    def take_layer(layer: dict) -> LayerWeights:
        weights: dict = {}
        for role, n, k in _layer_linears(layer, kind, dense_kind):              # the arena's order
            packed = take_linear(n, k)
            if role in EXPERT_LINEARS:
                weights.setdefault(role, []).append(packed)
            else:
                weights[role] = packed
        weights.update({role: take_other(n) for role, n in layer.items()
                        if role not in weights and role not in EXPERT_LINEARS + EXPERT_BIASES})
        weights.update({role: [take_other(n) for n in layer[role]] for role in EXPERT_BIASES if role in layer})
        for n in [n for role in EXPERT_LINEARS + EXPERT_BIASES for n in layer.get(role, [])]:
            if isinstance(n, tuple):                                # a stacked tensor, every expert now taken
                for suffix in ("", "_blocks", "_scales"):           # float, or MXFP4 (quant/mxfp4.py)
                    hf.pop(n[0] + suffix, None)
        return _layer_weights(weights)

    layers = [take_layer(layer) for layer in names]
    lm_head = take_linear(head_name, head_kind)
    tied_panels = spec.tie_word_embeddings and pack is not None and lm_head.scale is None
    embed = lm_head if tied_panels else take_other("model.embed_tokens.weight")
    model = DecoderModel(spec, ops, embed, take_other("model.norm.weight"), lm_head, layers, name, layout)
    return model.eval()


def _shape(hf: dict[str, torch.Tensor], names: str | list[str] | tuple[str, int]) -> tuple[int, int]:
    """(out, in) of the checkpoint tensor `names`, of the row concatenation of a list of them, or of one expert
    of a stacked tensor."""
    if isinstance(names, tuple):
        return tuple(_tensor(hf, names).shape) if len(names) > 2 else tuple(_tensor(hf, names[0]).shape[1:])
    parts = [names] if isinstance(names, str) else names
    if missing := [n for n in parts if n not in hf]:
        raise KeyError(f"weights missing from the checkpoint: {missing}")
    return sum(hf[n].shape[0] for n in parts), hf[parts[0]].shape[1]


def _layer_linears(layer: dict, kind: str, dense_kind: str) -> list[tuple[str, object, str]]:
    """A layer's linears as (role, checkpoint names, panel kind), in the order a step reads them: qkv, o, then
    gate_up, down (dense) or the router, the shared expert and each expert's gate_up and down (sparse). Routers
    and the shared expert's gate (a few rows that decide the routing) are packed as `dense_kind`, never int8."""
    out = [(role, layer[role], kind) for role in LINEARS if role in layer]
    out += [(role, layer[role], dense_kind if role in ("router", "shared_gate") else kind)
            for role in MOE_LINEARS if role in layer]
    for gate_up, down in zip(layer.get("experts_gate_up", []), layer.get("experts_down", [])):
        out += [("experts_gate_up", gate_up, kind), ("experts_down", down, kind)]
    return out


def _layer_weights(weights: dict) -> LayerWeights:
    """LayerWeights of a layer's tensors by role; a sparse layer's router and experts gathered in MoeWeights."""
    if "router" not in weights:
        return LayerWeights(**weights)
    moe = MoeWeights(router=weights.pop("router"), gate_up=weights.pop("experts_gate_up"),
                     down=weights.pop("experts_down"), router_bias=weights.pop("router_bias", None),
                     gate_up_bias=weights.pop("experts_gate_up_bias", None),
                     down_bias=weights.pop("experts_down_bias", None),
                     shared_gate_up=weights.pop("shared_gate_up", None), shared_down=weights.pop("shared_down", None),
                     shared_gate=weights.pop("shared_gate", None))
    return LayerWeights(**weights, moe=moe)
