"""model_type -> its ModelSpec and checkpoint tensor names: one table row per family.

Owns the table of the families we serve and the start-up refusals (an unknown model_type or architectures
entry, an unknown RoPE type, an activation we do not implement, a pre-quantized checkpoint), each naming the
value and the supported list. The config is read through transformers' own config class for its model_type,
so legacy keys (rope_scaling, rope_local_base_freq, sliding_window_pattern, use_sliding_window /
max_window_layers) are normalized exactly as transformers' model would see them. A family that is a variant
of these is a new row, not new code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lmi_handler.config import ConfigError
from lmi_handler.engine.model.quant.config import check_quantization_config
from lmi_handler.engine.model.spec import ACTIVATIONS, ROPE_TYPES, LayerSpec, ModelSpec, MoeSpec, build_rope
from lmi_handler.engine.model.vision import text_config_of


@dataclass(frozen=True)
class Experts:
    """How a mixture-of-experts family's config.json and checkpoint name its experts.

    num_experts_key / width_key: the config keys of the expert count and each expert's intermediate width.
    norm_topk_prob: True (always renormalized: Mixtral) or the config key that says so. prefix: the layer's MLP
    module (block_sparse_moe, mlp); router: the router's weight under it. form: how the experts' tensors are
    saved: "w123" (experts.{e}.w1 / w3 / w2: Mixtral), "proj" (experts.{e}.gate_proj / up_proj / down_proj:
    Qwen, OLMoE), "stacked" (input_linear (E, 2I, H) = gate | up, output_linear (E, H, I): GraniteMoE),
    "gpt_oss" (experts.gate_up_proj (E, H, 2I) with gate and up interleaved column by column, its bias (E, 2I),
    experts.down_proj (E, I, H) and its bias (E, H), or gate_up_proj_blocks / _scales, down_proj_blocks /
    _scales in MXFP4: engine/model/quant/mxfp4.py). Any other family's checkpoint may instead hold
    transformers' own stacked experts.gate_up_proj (E, 2I, H) and experts.down_proj (E, H, I) (the loader
    takes whichever is there). sparse_steps: decoder_sparse_step and mlp_only_layers decide which layers are
    sparse (Qwen2/3-MoE); else every layer is. router_bias: the router has one (gpt-oss); clamped_swiglu: the
    experts are gpt-oss's (biases, swiglu_alpha and swiglu_limit: spec.MoeSpec).
    """

    num_experts_key: str
    width_key: str
    prefix: str
    router: str
    form: str
    routing: str = "softmax_topk"
    norm_topk_prob: bool | str = "norm_topk_prob"
    shared_expert: bool = False
    sparse_steps: bool = False
    router_bias: bool = False
    clamped_swiglu: bool = False


MIXTRAL_EXPERTS = Experts("num_local_experts", "intermediate_size", "block_sparse_moe", "gate.weight", "w123",
                          norm_topk_prob=True)
QWEN_EXPERTS = Experts("num_experts", "moe_intermediate_size", "mlp", "gate.weight", "proj", sparse_steps=True)


@dataclass(frozen=True)
class Family:
    """How one model_type differs from Llama.

    qkv_bias / o_bias: "always", "never" or the config's switch (attention_bias; Qwen2-MoE's qkv_bias). window: "all" (every
    layer takes config.sliding_window: Mistral, Phi-3), "layer_types" (the layers transformers' config marks
    sliding_attention: Qwen2/3's use_sliding_window + max_window_layers, Gemma 2/3 alternating, SmolLM3),
    None. embedding_scale: "sqrt_hidden" (Gemma) or "embedding_multiplier" (Granite). attention_scale:
    None (head_dim ** -0.5), "query_pre_attn_scalar" (Gemma) or "attention_multiplier" (Granite).
    """

    model_type: str
    architectures: tuple[str, ...]
    norm_placement: str = "pre"
    norm_offset: float = 0.0
    norm_weight_in_float: bool = False   # transformers' norm multiplies by the weight in float32 (Gemma, OLMo-2)
    qk_norm: str | None = None
    qkv_bias: str = "attention_bias"
    o_bias: str = "attention_bias"
    mlp_bias: bool = False          # read config.mlp_bias
    activation_key: str = "hidden_act"
    window: str | None = None
    fused_qkv: bool = False         # qkv_proj and gate_up_proj in the checkpoint (Phi-3)
    embedding_scale: str | None = None
    attention_scale: str | None = None
    granite: bool = False           # residual_multiplier and logits_scaling
    softcaps: bool = False          # final_logit_softcapping, attn_logit_softcapping (Gemma 2 / 3)
    no_rope_layers: bool = False    # SmolLM3's no_rope_layers (1: RoPE, 0: none)
    experts: Experts | None = None  # mixture-of-experts families
    attention_sinks: bool = False   # self_attn.sinks (gpt-oss)


FAMILIES = {f.model_type: f for f in (
    Family("llama", ("LlamaForCausalLM",), mlp_bias=True),
    Family("mistral", ("MistralForCausalLM",), qkv_bias="never", o_bias="never", window="all"),
    Family("qwen2", ("Qwen2ForCausalLM",), qkv_bias="always", o_bias="never", window="layer_types"),
    Family("qwen3", ("Qwen3ForCausalLM",), qk_norm="head", window="layer_types"),
    Family("gemma2", ("Gemma2ForCausalLM",), norm_placement="both", norm_offset=1.0, norm_weight_in_float=True,
           activation_key="hidden_activation", window="layer_types", embedding_scale="sqrt_hidden",
           attention_scale="query_pre_attn_scalar", softcaps=True),
    Family("gemma3_text", ("Gemma3ForCausalLM",), norm_placement="both", norm_offset=1.0, norm_weight_in_float=True,
           qk_norm="head",
           activation_key="hidden_activation", window="layer_types", embedding_scale="sqrt_hidden",
           attention_scale="query_pre_attn_scalar", softcaps=True),
    Family("phi3", ("Phi3ForCausalLM",), qkv_bias="never", o_bias="never", window="all", fused_qkv=True),
    Family("smollm3", ("SmolLM3ForCausalLM",), mlp_bias=True, window="layer_types", no_rope_layers=True),
    Family("granite", ("GraniteForCausalLM",), mlp_bias=True, embedding_scale="embedding_multiplier",
           attention_scale="attention_multiplier", granite=True),
    Family("olmo2", ("Olmo2ForCausalLM",), norm_placement="post", norm_weight_in_float=True, qk_norm="full"),
    Family("mixtral", ("MixtralForCausalLM",), qkv_bias="never", o_bias="never", window="all",
           experts=MIXTRAL_EXPERTS),
    Family("qwen2_moe", ("Qwen2MoeForCausalLM",), qkv_bias="qkv_bias", o_bias="never", window="layer_types",
           experts=replace(QWEN_EXPERTS, shared_expert=True)),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), qk_norm="head", window="all", experts=QWEN_EXPERTS),
    Family("olmoe", ("OlmoeForCausalLM",), qk_norm="full",
           experts=Experts("num_experts", "intermediate_size", "mlp", "gate.weight", "proj")),
    Family("granitemoe", ("GraniteMoeForCausalLM",), embedding_scale="embedding_multiplier",
           attention_scale="attention_multiplier", granite=True,
           experts=Experts("num_local_experts", "intermediate_size", "block_sparse_moe", "router.layer.weight",
                           "stacked", routing="topk_softmax", norm_topk_prob=False)),
    # the language models of Qwen2-VL / Qwen2.5-VL (engine/model/vision/qwen2_vl.py's text_config): Qwen2 with
    # M-RoPE (rope_parameters' mrope_section, spec.RopeSpec)
    Family("qwen2_vl_text", ("Qwen2VLForConditionalGeneration",), qkv_bias="always", o_bias="never",
           window="layer_types"),
    Family("qwen2_5_vl_text", ("Qwen2_5_VLForConditionalGeneration",), qkv_bias="always", o_bias="never",
           window="layer_types"),
    Family("gpt_oss", ("GptOssForCausalLM",), norm_weight_in_float=True, window="layer_types", attention_sinks=True,
           experts=Experts("num_local_experts", "intermediate_size", "mlp", "router.weight", "gpt_oss",
                           routing="topk_softmax", norm_topk_prob=False, router_bias=True, clamped_swiglu=True)),
)}

NORM_NAMES = {   # placement -> (before attention, after attention, before the MLP, after the MLP)
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
    "both": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm"),
}


def family_of(cfg: dict) -> Family:
    """The table row of config.json's model_type (default llama), its architectures entries checked and
    a quantization_config we read (engine/model/quant). Raises: ConfigError naming the value and what is supported."""
    check_quantization_config(cfg)     # engine/model/quant: a format it does not read is refused naming it
    model_type = cfg.get("model_type", "llama")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ConfigError(f"config.json model_type={model_type!r} is not supported; supported: {sorted(FAMILIES)}")
    bare = [a.replace("ForCausalLM", "Model") for a in family.architectures]    # embedders saved bare (pooling)
    for arch in cfg.get("architectures") or ():
        if arch not in family.architectures and arch not in bare:
            raise ConfigError(f"config.json architectures entry {arch!r} is not supported for model_type="
                              f"{model_type!r}; supported: {list(family.architectures)}")
    return family


def _rope_dicts(cfg: dict) -> list[dict]:
    """Every RoPE parameter dict config.json holds (per layer type for Gemma 3), old and new keys."""
    found = []
    for key in ("rope_scaling", "rope_parameters"):
        value = cfg.get(key) or {}
        nested = [v for v in value.values() if isinstance(v, dict)]
        found += nested or [value]
    return found


def check_rope_types(cfg: dict) -> None:
    """Raises ConfigError for a RoPE type we do not implement, naming it and ROPE_TYPES."""
    for params in _rope_dicts(cfg):
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ConfigError(f"config.json rope_type={kind!r} is not supported; supported: {list(ROPE_TYPES)}")


def hf_config_of(cfg: dict):
    """transformers' config object for this model_type (its defaults and legacy-key handling)."""
    from transformers import AutoConfig

    kwargs = {k: v for k, v in cfg.items() if k not in ("model_type", "transformers_version")}
    return AutoConfig.for_model(cfg.get("model_type", "llama"), **kwargs)


def build_spec(cfg: dict) -> ModelSpec:
    """The ModelSpec of a config.json dict. Raises ConfigError (family_of, check_rope_types, an activation
    not in spec.ACTIVATIONS). A vision-language checkpoint's spec is its language model's (vision.text_config_of)."""
    cfg = text_config_of(cfg)
    family = family_of(cfg)
    check_rope_types(cfg)
    hf = hf_config_of(cfg)
    c = hf.to_dict()                     # transformers' values, its defaults and legacy keys resolved
    act = c.get(family.activation_key) or c.get("hidden_act") or "silu"
    if act not in ACTIVATIONS or (family.experts is not None and ACTIVATIONS[act] != "silu"):
        raise ConfigError(f"config.json {family.activation_key}={act!r} is not supported; supported: "
                          f"{sorted(ACTIVATIONS)}")
    num_heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // num_heads
    max_pos = c["max_position_embeddings"]
    layers = _layers(hf, c, family, head_dim, max_pos)
    if family.experts is not None:
        layers = _sparse_layers(layers, hf, c, family.experts)

    def bias(rule: str) -> bool:
        return rule == "always" or (rule != "never" and bool(c.get(rule)))

    return ModelSpec(
        model_type=family.model_type, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=num_heads,
        num_kv_heads=c.get("num_key_value_heads") or num_heads, head_dim=head_dim,
        max_position_embeddings=max_pos, layers=layers, norm_eps=float(cfg.get("rms_norm_eps", c["rms_norm_eps"])),
        norm_offset=family.norm_offset, norm_weight_in_float=family.norm_weight_in_float, norm_placement=family.norm_placement, qk_norm=family.qk_norm,
        qkv_bias=bias(family.qkv_bias), o_bias=bias(family.o_bias),
        mlp_bias=family.mlp_bias and bool(c.get("mlp_bias")), activation=ACTIVATIONS[act],
        attention_scale=_attention_scale(c, family), embedding_scale=_embedding_scale(c, family),
        residual_scale=c["residual_multiplier"] if family.granite else None,
        logit_scale=c["logits_scaling"] if family.granite else None,
        final_logit_softcap=c.get("final_logit_softcapping") if family.softcaps else None,
        attn_softcap=c.get("attn_logit_softcapping") if family.softcaps else None,
        tie_word_embeddings=bool(c.get("tie_word_embeddings")), fused_qkv=family.fused_qkv,
        attention_sinks=family.attention_sinks)


def _sparse_layers(layers: tuple[LayerSpec, ...], hf, c: dict, experts: Experts) -> tuple[LayerSpec, ...]:
    """`layers` with the MoeSpec on each sparse one: every layer, or (Qwen2/3-MoE, transformers'
    Qwen2MoeDecoderLayer's rule) layer i when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step
    == 0. Keys are read through transformers' config object `hf` (its attribute_map: Qwen3-MoE saves
    num_experts as num_local_experts). Raises ConfigError for a config option we do not implement (OLMoE's
    clip_qkv)."""
    if c.get("clip_qkv") is not None:
        raise ConfigError(f"config.json clip_qkv={c['clip_qkv']!r} is not supported (only null)")
    norm = experts.norm_topk_prob if isinstance(experts.norm_topk_prob, bool) else \
        bool(getattr(hf, experts.norm_topk_prob))
    moe = MoeSpec(num_experts=getattr(hf, experts.num_experts_key), top_k=hf.num_experts_per_tok,
                  intermediate_size=getattr(hf, experts.width_key), routing=experts.routing, norm_topk_prob=norm,
                  shared_expert_size=hf.shared_expert_intermediate_size if experts.shared_expert else None,
                  router_bias=experts.router_bias)
    if experts.clamped_swiglu:
        moe = replace(moe, activation="clamped_swiglu", swiglu_alpha=float(hf.swiglu_alpha),
                      swiglu_limit=float(hf.swiglu_limit), expert_bias=True)

    def sparse(i: int) -> bool:
        if not experts.sparse_steps:
            return True
        step = c.get("decoder_sparse_step") or 1
        return i not in (c.get("mlp_only_layers") or ()) and moe.num_experts > 0 and (i + 1) % step == 0

    return tuple(replace(layer, moe=moe if sparse(i) else None) for i, layer in enumerate(layers))


def _rope_params(c: dict, layer_type: str | None) -> dict:
    params = dict(c.get("rope_parameters") or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    if "rope_theta" not in params:
        params["rope_theta"] = c.get("rope_theta", 10000.0)
    return params


def _layers(hf, c: dict, family: Family, head_dim: int, max_pos: int) -> tuple[LayerSpec, ...]:
    """Each layer's window and RoPE: one RopeSpec per layer type (shared by its layers). hf: transformers'
    config object (ROPE_INIT_FUNCTIONS read it), c: its values as a dict."""
    num_layers = c["num_hidden_layers"]
    layer_types = c.get("layer_types") or ["full_attention"] * num_layers
    per_type = isinstance((c.get("rope_parameters") or {}).get(layer_types[0]), dict)
    no_rope = c.get("no_rope_layers") if family.no_rope_layers else None
    ropes: dict = {}
    layers = []
    for i, kind in enumerate(layer_types[:num_layers]):
        key = kind if per_type else None
        if key not in ropes:
            ropes[key] = build_rope(hf, _rope_params(c, key), head_dim, max_pos, key)
        window = c.get("sliding_window")
        if family.window is None or (family.window == "layer_types" and kind != "sliding_attention"):
            window = None
        layers.append(LayerSpec(window=window, rope=None if no_rope and not no_rope[i] else ropes[key]))
    return tuple(layers)


def _attention_scale(c: dict, family: Family) -> float | None:
    if family.attention_scale is None:
        return None
    value = c[family.attention_scale]
    return value ** -0.5 if family.attention_scale == "query_pre_attn_scalar" else float(value)


def _embedding_scale(c: dict, family: Family) -> float | None:
    if family.embedding_scale == "sqrt_hidden":
        return math.sqrt(c["hidden_size"])
    return None if family.embedding_scale is None else float(c[family.embedding_scale])


def layer_tensor_names(spec: ModelSpec, i: int) -> dict[str, str | list[str]]:
    """Our role -> the checkpoint's tensor name(s) for layer i (a list: concatenated by rows at load).
    Roles: qkv, o, gate_up, down (weights), their biases qkv_bias, o_bias, gate_up_bias, down_bias, the norms
    attn_pre, attn_post, mlp_pre, mlp_post (those the placement has) and q_norm, k_norm."""
    p = f"model.layers.{i}."
    if spec.fused_qkv:
        names = {"qkv": p + "self_attn.qkv_proj.weight", "gate_up": p + "mlp.gate_up_proj.weight"}
    else:
        names = {"qkv": [p + f"self_attn.{n}_proj.weight" for n in "qkv"],
                 "gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]}
    names.update(o=p + "self_attn.o_proj.weight", down=p + "mlp.down_proj.weight")
    if spec.qkv_bias:
        names["qkv_bias"] = [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
    if spec.o_bias:
        names["o_bias"] = p + "self_attn.o_proj.bias"
    if spec.layers[i].moe is not None:
        del names["gate_up"], names["down"]
        names.update(expert_tensor_names(spec, i))
    if spec.mlp_bias:
        names["gate_up_bias"] = [p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"]
        names["down_bias"] = p + "mlp.down_proj.bias"
    for role, name in zip(("attn_pre", "attn_post", "mlp_pre", "mlp_post"), NORM_NAMES[spec.norm_placement]):
        if name is not None:
            names[role] = p + name + ".weight"
    if spec.qk_norm is not None:
        names.update(q_norm=p + "self_attn.q_norm.weight", k_norm=p + "self_attn.k_norm.weight")
    if spec.attention_sinks:
        names["sinks"] = p + "self_attn.sinks"
    return names


def expert_tensor_names(spec: ModelSpec, i: int) -> dict:
    """Sparse layer i's roles -> checkpoint names: router (E, H); experts_gate_up / experts_down, one entry per
    expert (a name list concatenated by rows, or (stacked name, e): row e of an (E, out, in) tensor): the
    family's form (Experts.form) and transformers' stacked form as the alternative (a dict {"split": ...,
    "stacked": ...} under "experts", the loader takes the one the checkpoint holds); Qwen2-MoE's shared
    expert: shared_gate_up, shared_down and shared_gate (1, H)."""
    experts = FAMILIES[spec.model_type].experts
    p = f"model.layers.{i}.{experts.prefix}."
    num = spec.layers[i].moe.num_experts
    if experts.form == "w123":
        split = ([[p + f"experts.{e}.w1.weight", p + f"experts.{e}.w3.weight"] for e in range(num)],
                 [p + f"experts.{e}.w2.weight" for e in range(num)])
    elif experts.form == "proj":
        split = ([[p + f"experts.{e}.gate_proj.weight", p + f"experts.{e}.up_proj.weight"] for e in range(num)],
                 [p + f"experts.{e}.down_proj.weight" for e in range(num)])
    elif experts.form == "gpt_oss":
        return _gpt_oss_expert_names(p, num)
    else:
        split = ([(p + "input_linear.weight", e) for e in range(num)], [(p + "output_linear.weight", e) for e in range(num)])
    stacked = ([(p + "experts.gate_up_proj", e) for e in range(num)], [(p + "experts.down_proj", e) for e in range(num)])
    names: dict = {"router": p + experts.router, "experts": {"split": split, "stacked": stacked}}
    if experts.shared_expert:
        names.update(shared_gate_up=[p + "shared_expert.gate_proj.weight", p + "shared_expert.up_proj.weight"],
                     shared_down=p + "shared_expert.down_proj.weight", shared_gate=p + "shared_expert_gate.weight")
    return names


def _gpt_oss_expert_names(p: str, num: int) -> dict:
    """gpt-oss's sparse layer (prefix p = model.layers.{i}.mlp.): its router with a bias and each expert's rows of
    the stacked, transposed tensors as (name, e, transform) (loader._tensor: "transposed" (in, out) -> (out, in);
    "transposed_pairs" also de-interleaves gate and up columns (GptOssExperts' gate_up[..., ::2] and [..., 1::2])
    into cat(gate, up) rows; "pairs" the same for the gate_up bias). An MXFP4 checkpoint holds <name>_blocks /
    <name>_scales instead (engine/model/quant/mxfp4.py reads the same entries)."""
    gate_up, down = p + "experts.gate_up_proj", p + "experts.down_proj"
    return {"router": p + "router.weight", "router_bias": p + "router.bias",
            "experts_gate_up": [(gate_up, e, "transposed_pairs") for e in range(num)],
            "experts_down": [(down, e, "transposed") for e in range(num)],
            "experts_gate_up_bias": [(gate_up + "_bias", e, "pairs") for e in range(num)],
            "experts_down_bias": [(down + "_bias", e, None) for e in range(num)]}
