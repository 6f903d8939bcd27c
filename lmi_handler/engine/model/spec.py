"""The layer description: everything a forward needs to know about a model, read once from config.json.

Owns ModelSpec / LayerSpec / RopeSpec (plain frozen values, built by families.py at load, never per token)
and the RoPE frequencies of every scaling kind (transformers' ROPE_INIT_FUNCTIONS for yarn, dynamic and
longrope). Leaves which model_type maps to which description to families.py, reading tensors to loader.py
and walking the description to forward.py (DecoderModel, the one forward of every family).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmi_handler.config import ConfigError

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True, eq=False)
class RopeSpec:
    """One rotary embedding (a model may hold two: Gemma 3's local and global bases).

    inv_freq: (rotary_dim // 2,) float32; cos and sin are multiplied by attention_scaling (yarn, longrope).
    rotary_dim < head_dim (Phi-4-mini's partial_rotary_factor): only the first rotary_dim features rotate.
    Sequence-length-dependent kinds pick their frequencies per sequence from the step's context length
    (as transformers does for a sequence generated alone): longrope takes long_inv_freq once the sequence is
    longer than original_max_position_embeddings; dynamic recomputes from hf_config past
    max_position_embeddings.
    mrope_section (Qwen2-VL's M-RoPE, transformers' rope_parameters["mrope_section"]): the rotary_dim // 2
    frequencies split into consecutive sections taken from the temporal, height and width position streams in
    turn (section i from stream i % 3, both halves of the rotate-half layout alike); None: one stream. Where
    the three streams are equal (text) the rows are the single stream's, bit for bit (mrope_cos_sin_rows).
    """

    kind: str
    rotary_dim: int
    inv_freq: torch.Tensor
    attention_scaling: float = 1.0
    long_inv_freq: torch.Tensor | None = None       # longrope
    original_max_position_embeddings: int | None = None  # longrope / dynamic: where scaling starts
    hf_config: object | None = field(default=None, repr=False)   # dynamic: recomputed per sequence length
    layer_type: str | None = None
    mrope_section: tuple[int, ...] | None = None

    @property
    def depends_on_length(self) -> bool:
        return self.kind in ("dynamic", "longrope")

    def inv_freq_for(self, seq_len: int) -> torch.Tensor:
        """The frequencies transformers uses for a sequence of `seq_len` tokens (its dynamic_rope_update)."""
        if self.kind == "longrope":
            return self.long_inv_freq if seq_len > self.original_max_position_embeddings else self.inv_freq
        if self.kind == "dynamic" and seq_len > self.original_max_position_embeddings:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            return ROPE_INIT_FUNCTIONS["dynamic"](self.hf_config, "cpu", seq_len=seq_len,
                                                  layer_type=self.layer_type)[0].float()
        return self.inv_freq


ROUTINGS = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True)
class MoeSpec:
    """A sparse layer's MLP: a router over `num_experts` SwiGLU experts of width `intermediate_size`, each token
    sent to its `top_k` highest-scoring experts (engine/model/moe.py walks it).

    routing: "softmax_topk" (Mixtral, Qwen2/3-MoE, OLMoE: softmax over every expert's logit in float32, then the
    top k probabilities, renormalized to sum 1 when norm_topk_prob) or "topk_softmax" (GraniteMoE, gpt-oss: the
    top k logits, then a softmax over those k). router_bias: the router has a bias (gpt-oss). shared_expert_size:
    Qwen2-MoE's shared expert (a dense SwiGLU MLP every token takes, scaled by sigmoid(shared_expert_gate(x)));
    None without one. activation: "silu" (silu(gate) * up) or "clamped_swiglu" (gpt-oss's GptOssExperts: gate
    clamped to <= swiglu_limit, up to [-swiglu_limit, swiglu_limit], then gate * sigmoid(swiglu_alpha * gate) *
    (up + 1)); expert_bias: each expert's gate_up and down have biases (gpt-oss).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    routing: str = "softmax_topk"
    norm_topk_prob: bool = True
    router_bias: bool = False
    shared_expert_size: int | None = None
    activation: str = "silu"
    swiglu_alpha: float = 1.0
    swiglu_limit: float = 0.0
    expert_bias: bool = False


@dataclass(frozen=True)
class LayerSpec:
    """What varies from layer to layer: the attention window, the rotary embedding (None: no RoPE, SmolLM3's
    NoPE layers) and the MLP (moe None: the dense MLP; else this sparse layer's MoeSpec, shared by every sparse
    layer: Qwen2-MoE's decoder_sparse_step and mlp_only_layers leave dense layers between them)."""

    window: int | None = None       # attends to positions [p - window + 1, p]; None = every earlier one
    rope: RopeSpec | None = None
    moe: MoeSpec | None = None


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only model, as forward.py walks it.

    Norms: RMSNorm with `norm_offset` added to the weight (Gemma: 1.0); norm_weight_in_float: the weight
    multiplies the normalized row in float32 before the one rounding to the activations' dtype (transformers'
    Gemma and OLMo-2 norms), else the normalized row is rounded first and then multiplied by the weight in
    that dtype (transformers' LlamaRMSNorm and the families that copy it). norm_placement: "pre" (Llama: a norm
    before attention and before the MLP), "post" (OLMo-2: a norm on each block's output before the residual
    add), "both" (Gemma 2 / 3: the four of them). qk_norm: None, "head" (RMSNorm over each head's head_dim:
    Qwen3, Gemma 3) or "full" (over the whole q / k projection: OLMo-2). Scalars: embedding_scale multiplies
    the embeddings (Gemma: sqrt(hidden), Granite: embedding_multiplier), residual_scale each block's output
    before its residual add (Granite), logit_scale divides the logits (Granite's logits_scaling),
    final_logit_softcap / attn_softcap are Gemma 2's tanh caps. attention_sinks: each layer's attention has a
    learned logit per query head that joins every row's softmax denominator and attends to nothing (gpt-oss's
    self_attn.sinks).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    layers: tuple[LayerSpec, ...]
    norm_eps: float = 1e-6
    norm_offset: float = 0.0
    norm_weight_in_float: bool = False
    norm_placement: str = "pre"
    qk_norm: str | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    activation: str = "silu"
    attention_scale: float | None = None      # None: head_dim ** -0.5
    embedding_scale: float | None = None
    residual_scale: float | None = None
    logit_scale: float | None = None
    final_logit_softcap: float | None = None
    attn_softcap: float | None = None
    tie_word_embeddings: bool = False
    fused_qkv: bool = False                   # the checkpoint holds qkv_proj / gate_up_proj (Phi-3)
    attention_sinks: bool = False             # gpt-oss

    @property
    def moe(self) -> MoeSpec | None:
        """The sparse layers' MoeSpec, None for a dense model."""
        return next((layer.moe for layer in self.layers if layer.moe is not None), None)

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5

    def cpp_misfits(self) -> list[str]:
        """Why the cpp backend's whole-stack operation (backends/cpp.decoder_stack: the fused C++ DecoderStack,
        the decoder layers one C++ call a step, the fast path) cannot run this spec; [] when it can: RMSNorm
        pre-norm rounded as LlamaRMSNorm, SiLU, optional q/k/v, o and MLP biases, one full-width RoPE of kind
        default / linear / llama3 on every layer, no window, cap, q/k norm or multiplier. A spec with misfits
        runs on the same C++ kernels op by op (forward.DecoderModel's walk), as does a tensor-parallel shard of
        any spec, so a misfit never refuses a backend or a degree."""
        rope = self.layers[0].rope
        checks = {
            "norm_offset (Gemma's 1 + weight)": self.norm_offset != 0.0,
            "a norm weighted in float32": self.norm_weight_in_float,
            f"norm_placement={self.norm_placement}": self.norm_placement != "pre",
            f"qk_norm={self.qk_norm}": self.qk_norm is not None,
            f"activation={self.activation}": self.activation != "silu",
            "a sliding window": any(layer.window is not None and layer.window < self.max_position_embeddings
                                    for layer in self.layers),
            "layers without RoPE": any(layer.rope is None for layer in self.layers),
            "per-layer RoPE": any(layer.rope is not rope for layer in self.layers),
            f"rope {rope.kind if rope else None}": rope is not None and (
                rope.kind not in ("default", "linear", "llama3") or rope.rotary_dim != self.head_dim
                or rope.attention_scaling != 1.0),
            "an attention scale other than head_dim ** -0.5": self.attention_scale is not None,
            "embedding / residual / logit multipliers": any(
                v is not None for v in (self.embedding_scale, self.residual_scale, self.logit_scale)),
            "soft-capping": self.final_logit_softcap is not None or self.attn_softcap is not None,
            "attention sinks": self.attention_sinks,
            "mixture-of-experts layers": self.moe is not None,
        }
        return [name for name, misfit in checks.items() if misfit]


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """(dim // 2,) float32: 1 / theta ** (2i / dim), as transformers' default RoPE computes it."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def build_rope(hf_config, params: dict, head_dim: int, max_position_embeddings: int,
               layer_type: str | None = None) -> RopeSpec:
    """The RopeSpec of one rope_parameters dict (transformers 5's standardized form: rope_type, rope_theta,
    partial_rotary_factor and the kind's own keys). Scaled kinds call transformers' ROPE_INIT_FUNCTIONS
    with hf_config (the config object transformers' own model would be built from), so the frequencies are
    its bits. The caller has checked rope_type against ROPE_TYPES."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = params.get("rope_type", params.get("type", "default"))
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if params.get("mrope_section"):
        return _mrope(params, rotary_dim, layer_type)
    if kind == "default":
        return RopeSpec(kind, rotary_dim, default_inv_freq(params["rope_theta"], rotary_dim), layer_type=layer_type)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu", layer_type=layer_type)
    inv_freq = inv_freq.float()
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    if kind == "longrope":
        long_inv, _ = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu", seq_len=original + 1, layer_type=layer_type)
        return RopeSpec(kind, rotary_dim, inv_freq, float(scaling), long_inv.float(), original, layer_type=layer_type)
    if kind == "dynamic":
        return RopeSpec(kind, rotary_dim, inv_freq, float(scaling), None, max_position_embeddings, hf_config,
                        layer_type=layer_type)
    return RopeSpec(kind, rotary_dim, inv_freq, float(scaling), layer_type=layer_type)


def _mrope(params: dict, rotary_dim: int, layer_type: str | None) -> RopeSpec:
    """Qwen2-VL's M-RoPE: default frequencies, split by mrope_section (transformers' Qwen2VLRotaryEmbedding
    maps rope_type "mrope" to "default"). Raises ConfigError when the sections do not cover rotary_dim // 2
    or the kind is a scaled one (transformers' M-RoPE models take only the default frequencies)."""
    section = tuple(int(n) for n in params["mrope_section"])
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "mrope") or sum(section) != rotary_dim // 2:
        raise ConfigError(f"config.json rope_parameters: mrope_section={list(section)} with rope_type={kind!r} is "
                          f"not supported (only the default rope_type, sections summing to {rotary_dim // 2})")
    return RopeSpec("default", rotary_dim, default_inv_freq(params["rope_theta"], rotary_dim), layer_type=layer_type,
                    mrope_section=section)


def mrope_cos_sin_rows(rope: RopeSpec, streams: list[tuple[torch.Tensor, torch.Tensor]]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE's cos, sin (T, rotary_dim) from the rows of each position stream's positions (streams: three
    (cos, sin) pairs, each (T, rotary_dim), as rope_cos_sin_rows or a RopeTable gives them): frequency j of
    section i is stream i % 3's, in both halves, as transformers' recomposition_frequencies picks them. Only
    copies: where the three streams hold the same positions the result is each stream's rows bit for bit."""
    half = rope.rotary_dim // 2
    bounds = [0]
    for n in rope.mrope_section:
        bounds.append(bounds[-1] + n)
    spans = [(i % 3, a, b) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    spans += [(s, a + half, b + half) for s, a, b in spans]

    def pick(k: int) -> torch.Tensor:
        return torch.cat([streams[s][k][:, a:b] for s, a, b in spans], dim=-1)

    return pick(0), pick(1)


def rope_cos_sin_rows(rope: RopeSpec, positions: torch.Tensor, seq_lens: torch.Tensor | None,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, rotary_dim) in `dtype` for positions (T,) int64, computed in float32 as transformers'
    rotary embeddings do (cat(freqs, freqs), times attention_scaling). seq_lens (T,): each row's sequence
    length this step, read only by the length-dependent kinds."""
    device = positions.device
    if rope.depends_on_length:
        lens = seq_lens.tolist()
        table = {n: rope.inv_freq_for(n).to(device) for n in set(lens)}
        inv = torch.stack([table[n] for n in lens]) if lens else rope.inv_freq.to(device)[None]
        freqs = positions.float()[:, None] * inv
    else:
        freqs = positions.float()[:, None] * rope.inv_freq.to(device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if rope.attention_scaling != 1.0:
        cos, sin = cos * rope.attention_scaling, sin * rope.attention_scaling
    return cos.to(dtype), sin.to(dtype)
